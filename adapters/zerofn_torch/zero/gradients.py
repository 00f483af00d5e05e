"""The gradients a ZeRO step reads, clipped by the whole model's norm and
unscaled for a loss scaler. Each rank reads only what it owns
(:func:`zerofn.zero.rank.owned_grads`); the global answers are the core's
programs (:func:`~zerofn.zero.mixed_precision.precision.clip_program`,
:func:`~zerofn.zero.mixed_precision.precision.nonfinite_program`, the same the overlapped
step's hook asks), one all-reduce of one number each, which this module drives."""

from __future__ import annotations

import math
from typing import Any

import torch

from zerofn.zero.hook_driven import check_stepped_here
from zerofn.zero.mixed_precision.precision import clip_program, nonfinite_program
from zerofn.zero.rank import (
    ZeroRank,
    drop_master_grads,
    master_grads,
    owned_grads,
    write_local_grads,
)
from zerofn_torch.runtime.driver import drive
from zerofn_torch.zero.shell_state import ShellState

__all__ = ["GradientChecks", "clip_grad_norm", "unscale_gradients"]


class GradientChecks(ShellState):
    """The optimizer's part that reads the step's gradients over the whole
    model: clipping by the global norm, unscaling for a loss scaler, and
    skipping a step (see :class:`~zerofn_torch.zero.shell_state.ShellState`)."""

    _join_config: Any  # torch's Joinable's

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients by their norm over the whole model, as
        ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model (the
        same norm and factor up to the order of additions and where they
        are rounded: last bits in float32, up to 2 bf16 ulps on bf16
        gradients without masters; see ``docs/mixed_precision.md``).

        Collective (one all-reduce of one number): call on every rank, after
        backward and before :meth:`step`. Scales the gradients in place, or
        with ``master_dtype`` the masters' float32 ones (``.grad`` kept).

        Args:
            max_norm: the largest norm allowed.
            norm_type: the norm's order (``float("inf")`` for the largest element).
            error_if_nonfinite: raise if the norm is inf or nan.

        Returns:
            The norm before clipping: a float32 scalar, equal on every rank.

        Raises:
            ValueError: ``max_norm`` negative, ``norm_type`` not positive.
            RuntimeError: with ``overlap_with_ddp=True``; inside ``Join``
                (a joined rank's shard would be left out of the norm); a
                non-finite norm with ``error_if_nonfinite``.
            zerofn.errors.CollectiveError: the all-reduce failed.
        """
        self._refuse_inside_join("clip_grad_norm_", "global norm")
        return clip_grad_norm(
            self._zero, self._all_params, self.process_group,
            max_norm, norm_type, error_if_nonfinite,
        )  # fmt: skip

    def unscale_gradients_(self, factor: float) -> bool:
        """Multiply the gradients the step reads by ``factor`` (a loss
        scaler's ``1 / scale``), and tell whether any rank's hold inf or nan.

        With ``master_dtype`` the product lands in the float32 masters (fp16
        gradients would underflow); without, gradients are scaled in place.
        Collective: one all-reduce of one flag; call before
        :meth:`clip_grad_norm_`, once per step.

        Returns:
            ``True`` on every rank if any rank found inf or nan: then skip
            the step everywhere with :meth:`discard_step`.

        Raises:
            RuntimeError: with ``overlap_with_ddp=True``; inside ``Join``; or
                if the gradients were already read for this step (clipped or
                unscaled).
            zerofn.errors.CollectiveError: the all-reduce failed.
        """
        self._refuse_inside_join("unscale_gradients_ (a loss scaler's unscale_)", "inf/nan check")
        return unscale_gradients(self._zero, self._all_params, self.process_group, factor)

    def _refuse_inside_join(self, what: str, question: str) -> None:
        """Refuse a collective over every rank's shard inside ``Join``.

        Raises:
            RuntimeError: in a join context.
        """
        if self._join_config.enable:
            raise RuntimeError(
                f"{what} inside Join: its {question} is one all-reduce over every rank's "
                "shard, and a rank that ran out of inputs neither takes part nor holds "
                "gradients for its shard, so the answer would leave that shard out. Give "
                "every rank the same number of steps, or leave the clipping or loss scaling "
                "out of the Join context"
            )

    def discard_step(self) -> None:
        """Skip this step: forget the gradients loaded for it (into the
        masters). Every rank must skip alike; :meth:`unscale_gradients_`
        tells them all the same."""
        drop_master_grads(self._zero)


def clip_grad_norm(
    rank: ZeroRank,
    params: list[torch.Tensor],
    group: Any,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Clip the step's gradients by the whole model's norm: the body of
    :meth:`zerofn_torch.zero.optimizer.ZeroRedundancyOptimizer.clip_grad_norm_`,
    which says what it returns and raises."""
    check_stepped_here(rank, "clip_grad_norm_")
    grads = owned_grads(rank, params)
    program = clip_program(grads, max_norm, float(norm_type), rank.options.device)
    total, coefficient = drive(program, group, "clip_grad_norm_'s global norm").wait()
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    if coefficient != 1.0:
        grads = (
            master_grads(rank)
            if rank.masters is not None
            else [p.grad for p in params if p.grad is not None]
        )
        for grad in grads:
            grad.mul_(coefficient)
    return torch.tensor(total, dtype=torch.float32)


def unscale_gradients(
    rank: ZeroRank, params: list[torch.Tensor], group: Any, factor: float
) -> bool:
    """Multiply the step's gradients by ``factor`` and agree on inf/nan (see
    :meth:`zerofn_torch.zero.optimizer.ZeroRedundancyOptimizer.unscale_gradients_`).

    Returns:
        ``True`` on every rank if any rank found inf or nan.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``, or if the gradients
            were already read for this step (clipped or unscaled).
        zerofn.errors.CollectiveError: the all-reduce failed.
    """
    check_stepped_here(rank, "loss scaling")
    if rank.masters is not None:
        if rank.masters.grads():
            raise RuntimeError(
                "the gradients were already unscaled or clipped for this step: unscale "
                "once per step, before clip_grad_norm_"
            )
        write_local_grads(rank, params, unscale=factor)
        grads = rank.masters.grads()  # the carried masters' are the same numbers
    else:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
        grads = owned_grads(rank, params)
    program = nonfinite_program(grads, rank.options.device)
    result: bool = drive(program, group, "loss scaling's inf/nan check").wait()
    return result
