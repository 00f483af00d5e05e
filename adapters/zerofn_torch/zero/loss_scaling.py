"""Dynamic loss scaling for fp16 parameters with fp32 master shards.

``torch.amp.GradScaler`` refuses fp16 gradients (it would unscale them in
fp16, where small values flush to zero) and decides on inf/nan from the
gradients it sees on one rank. :class:`LossScaler` keeps its interface
(``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, state dicts)
for a :class:`~zerofn_torch.ZeroRedundancyOptimizer` built with
``master_dtype``: gradients are unscaled into the fp32 masters, and the ranks
agree with one all-reduce whether any shard held inf or nan, so every rank
steps or skips together. The schedule is
:func:`zerofn.zero.mixed_precision.loss_scale.update_loss_scale`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofn.zero.mixed_precision.loss_scale import (
    LossScaleConfig,
    LossScaleState,
    init_loss_scale,
    update_loss_scale,
)
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["LossScaler"]


class LossScaler:
    """Scale the loss up, unscale the gradients into the masters, skip steps
    whose gradients overflowed, and adapt the scale.

    Used like ``torch.amp.GradScaler``::

        scaler.scale(loss).backward()
        scaler.unscale_(opt)            # optional: before clipping
        opt.clip_grad_norm_(1.0)        # optional
        scaler.step(opt)                # skipped on every rank on inf/nan
        scaler.update()

    Differences from ``GradScaler``: it accepts fp16 gradients; the skip
    decision is collective (one all-reduce); clipping goes through the
    optimizer's :meth:`~zerofn_torch.zero.optimizer.ZeroRedundancyOptimizer.clip_grad_norm_`
    (the masters' gradients, not ``.grad``, hold the unscaled values); and
    :meth:`update` takes no explicit new scale tensor, only a float.

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` good steps.
        backoff_factor: the scale's factor after a step with inf or nan.
        growth_interval: good steps in a row before the scale grows (see
            :class:`zerofn.zero.mixed_precision.loss_scale.LossScaleConfig`).
        enabled: ``False`` makes every method a pass-through.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.config = LossScaleConfig(init_scale, growth_factor, backoff_factor, growth_interval)
        self.state: LossScaleState = init_loss_scale(self.config)
        self.enabled = enabled
        # This iteration's verdict per optimizer (id -> found inf/nan), until update().
        self._found: dict[int, bool] = {}

    def get_scale(self) -> float:
        """The current scale (``1.0`` when disabled)."""
        return self.state.scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self.enabled

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs`` multiplied by the current scale."""
        return outputs * self.state.scale if self.enabled else outputs

    def unscale_(self, optimizer: ZeroRedundancyOptimizer) -> None:
        """Unscale ``optimizer``'s gradients for this step (into its masters)
        and learn, with every rank, whether any overflowed.

        Raises:
            RuntimeError: called twice for one optimizer before :meth:`update`.
        """
        if not self.enabled:
            return
        if id(optimizer) in self._found:
            raise RuntimeError("unscale_() was already called on this optimizer since update()")
        self._found[id(optimizer)] = optimizer.unscale_gradients_(1.0 / self.state.scale)

    def record(self, optimizer: ZeroRedundancyOptimizer, found_nonfinite: bool) -> None:
        """Note that ``optimizer``'s step for this iteration was taken, or
        skipped for inf/nan, elsewhere: the overlapped step calls this from
        inside backward (``hook_with_zero_step(..., loss_scaler=...)``)."""
        self._found[id(optimizer)] = found_nonfinite

    def step(self, optimizer: ZeroRedundancyOptimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless some rank's gradients held inf or nan.

        Returns:
            The optimizer's return value, or ``None`` for a skipped step.
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._found:
            self.unscale_(optimizer)
        if self._found[id(optimizer)]:
            optimizer.discard_step()
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Adapt the scale to this iteration (back off if any step was
        skipped, grow after ``growth_interval`` good ones), or set it."""
        if not self.enabled:
            return
        if new_scale is not None:
            self.state = LossScaleState(float(new_scale))
        else:
            found = any(self._found.values())
            self.state = update_loss_scale(self.config, self.state, found)
        self._found = {}

    def state_dict(self) -> dict[str, Any]:
        """The schedule and where it stands, with ``GradScaler``'s keys
        (``weights_only``-loadable; either class loads the other's)."""
        return {
            "scale": self.state.scale,
            "_growth_tracker": self.state.growth_tracker,
            "growth_factor": self.config.growth_factor,
            "backoff_factor": self.config.backoff_factor,
            "growth_interval": self.config.growth_interval,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            KeyError: a key is missing.
        """
        self.config = LossScaleConfig(
            state_dict["scale"],
            state_dict["growth_factor"],
            state_dict["backoff_factor"],
            state_dict["growth_interval"],
        )
        self.state = LossScaleState(float(state_dict["scale"]), int(state_dict["_growth_tracker"]))
        self._found = {}
