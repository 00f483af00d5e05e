"""The post-local SGD communication hook: PyTorch's names, zerofn's schedule.

For the first ``start_localSGD_iter`` iterations the hook averages gradients
over the whole process group, as plain DDP does; afterwards only within each
rank's subgroup (or not at all), and a model averager (see
:mod:`zerofn_torch.averaging`) averages the parameters globally now and then::

    from zerofn_torch.hooks.post_local_sgd import PostLocalSGDState, post_localSGD_hook

    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=100)
    ddp.register_comm_hook(state, post_localSGD_hook)

Which group a bucket is averaged in is the pure
:func:`zerofn.averaging.take_bucket`; the averaging itself is the core's
``zerofn.hooks.hook.allreduce_mean`` program, run on that group by
``zerofn_torch.runtime.driver.drive``. The counter lives in a
:class:`zerofn.averaging.LocalSGDState` and checkpoints as a plain dict.

Its hook's annotations stay real objects, with no postponed evaluation:
DDP reads them when the hook is registered.
"""

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from zerofn.averaging import (
    GradientSync,
    LocalSGDState,
    PostLocalSGDSchedule,
    local_sgd_state_from_dict,
    take_bucket,
)
from zerofn.hooks.hook import allreduce_mean
from zerofn_torch.runtime.hook_cells import run_stateless

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """The post-local SGD hook's groups, schedule and iteration counter.

    A drop-in for PyTorch's ``PostLocalSGDState``, with a checkpoint:
    :meth:`state_dict` holds the counter only, as plain integers, so it loads
    with ``torch.load(weights_only=True)`` (process groups cannot be saved;
    a resumed run builds its own).

    Args:
        process_group: the group for global averaging (``None``: the world).
        subgroup: the group for local averaging; ``None`` makes the
            intra-machine subgroups with ``dist.new_subgroups()`` at the
            switch, which needs CUDA to know the machine's size: on CPU pass
            a subgroup.
        start_localSGD_iter: iterations that average gradients globally.
        post_local_gradient_allreduce: whether to average gradients within
            the subgroup after the switch (else each rank keeps its own).

    Raises:
        ValueError: ``start_localSGD_iter < 0``.
        TypeError: ``start_localSGD_iter`` is not an int.
    """

    def __init__(
        self,
        process_group: Any,
        subgroup: Any,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        self._schedule = PostLocalSGDSchedule(start_localSGD_iter, post_local_gradient_allreduce)
        self._progress = LocalSGDState()
        self.process_group = process_group
        self.subgroup = subgroup
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)

    @property
    def start_localSGD_iter(self) -> int:
        """Iterations that average gradients globally."""
        return self._schedule.start_localSGD_iter

    @property
    def post_local_gradient_allreduce(self) -> bool:
        """Whether gradients are averaged within the subgroup after the switch."""
        return self._schedule.post_local_gradient_allreduce

    @property
    def iter(self) -> int:
        """Completed iterations, counted up to ``start_localSGD_iter``."""
        return self._progress.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self._progress = LocalSGDState(value)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration if ``bucket`` is its last one, during the global
        phase (PyTorch's name for the counter's transition)."""
        self.take(bucket)

    def take(self, bucket: GradBucket) -> GradientSync:
        """Advance the counter past ``bucket``; where to average the bucket."""
        before = self._progress
        self._progress, sync = take_bucket(self._schedule, before, bucket.is_last())
        if before.iter < self.start_localSGD_iter == self._progress.iter:  # switched
            logger.info("Start to apply local SGD after %s iterations.", self._progress.iter)
        return sync

    def state_dict(self) -> dict[str, int]:
        """The counter, ``{"iter": int}`` (safe for ``torch.load(weights_only=True)``)."""
        return self._progress.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the counter saved by :meth:`state_dict`.

        Raises:
            ValueError: no ``"iter"``, or a negative one; then nothing changes.
            TypeError: the counter is not an int.
        """
        self._progress = local_sgd_state_from_dict(state_dict)

    def group_for(self, sync: GradientSync) -> Any:
        """The process group that ``sync`` names; makes the default subgroups
        on first use (a collective, reached by every rank at the same bucket)."""
        if sync == "global":
            return self.process_group if self.process_group is not None else dist.group.WORLD
        if self.subgroup is None:
            self.subgroup, _ = dist.new_subgroups()  # type: ignore[no-untyped-call]
        return self.subgroup


def post_localSGD_hook(
    state: PostLocalSGDState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket globally during warm-up, then within the subgroup.

    Run it with a model averager that averages parameters after the optimizer
    step, with ``warmup_steps`` equal to ``start_localSGD_iter``.

    Args:
        state: the groups, schedule and counter.
        bucket: DDP's gradient bucket.

    Returns:
        A future of the averaged flat gradient (the local one, unchanged,
        after the switch when ``post_local_gradient_allreduce`` is off).
    """
    sync = state.take(bucket)
    if sync == "none":
        kept: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        kept.set_result(bucket.buffer())
        return kept
    averaging = attrs.evolve(allreduce_mean(), name="post_localSGD")
    return run_stateless(averaging, state.group_for(sync), bucket)
