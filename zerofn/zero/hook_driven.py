"""A ZeRO rank stepped by DDP's overlap hook (``overlap_with_ddp=True``):
attaching one, answering its step with given gradients, what compressed
sends read, and the checks that refuse to train, or to save, before a hook
made that possible. What the hook may do to the optimizer it drives is
:class:`zerofn.overlap.orders.OverlapBinding` (importable from here too),
and the order obeyed through it :func:`zerofn.overlap.orders.obey_order`.
Sharding by the owners DDP's buckets fix is
:func:`zerofn.zero.replan.sharded_by_owners`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from zerofn.overlap.orders import OverlapBinding, SendCompressed, StepGradients, step_with_gradients
from zerofn.zero.options import ZeroOptions
from zerofn.zero.params import plan_for
from zerofn.zero.rank import (
    OverlapMode,
    ZeroRank,
    build_rank,
    flat_params,
    synced_hyperparameters,
)

__all__ = [
    "OverlapBinding",
    "attach",
    "build_hook_driven_rank",
    "check_overlap_attached",
    "check_overlap_initialized",
    "check_stepped_here",
    "send_compressed",
    "step_rank_with_gradients",
]


def build_hook_driven_rank(groups: Sequence[dict[str, Any]], options: ZeroOptions) -> ZeroRank:
    """A new rank for ``overlap_with_ddp=True``, no hook attached yet: until
    DDP fixes its buckets every rank steps every parameter, so it owns them
    all (:func:`~zerofn.zero.replan.sharded_by_owners` keeps its share then).
    With ``redundancy=2`` the hook runs the whole step instead, so the rank
    is partitioned as the plain step's is, carried copy included.
    The optimizer and the simulated overlapped world build their ranks here."""
    owned: list[list[torch.Tensor]] = [[] for _ in range(options.world_size)]
    owned[options.rank] = flat_params(groups)
    plan = plan_for(groups, options.world_size, "greedy" if options.redundancy == 2 else owned)
    return build_rank(groups, options, plan, "unattached")


def attach(rank: ZeroRank) -> ZeroRank:
    """``rank`` driven by a hook.

    Raises:
        ValueError: the optimizer was not built with ``overlap_with_ddp=True``.
        RuntimeError: another hook drives it already.
    """
    if not rank.stepped_by_hook:
        raise ValueError(
            "the ZeroRedundancyOptimizer must be built with overlap_with_ddp=True to be "
            "stepped by this hook"
        )
    if rank.overlap != "unattached":
        raise RuntimeError("this ZeroRedundancyOptimizer is already driven by a DDP hook")
    return attrs.evolve(rank, overlap="attached")


def check_overlap_attached(overlap: OverlapMode) -> None:
    """Refuse to train with ``overlap_with_ddp=True`` and no hook: the hook
    is what steps the optimizer, so without one nothing would change.

    Raises:
        RuntimeError: no overlap hook was made for this optimizer.
    """
    if overlap == "unattached":
        raise RuntimeError(
            "this ZeroRedundancyOptimizer was built with overlap_with_ddp=True, so DDP's "
            "backward steps it through a communication hook, and no such hook was made "
            "for it: nothing would ever be updated. Register one before training, "
            "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero)) "
            "(or hook_with_zero_step_interleaved; both in zerofn_torch.hooks), and drop "
            "zero.step() from the loop; or build the optimizer with overlap_with_ddp=False"
        )


def check_overlap_initialized(rank: ZeroRank) -> None:
    """Refuse to read or load the state before DDP fixed its buckets.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``, before the bucket plan
            is fixed (every rank still holds every parameter's state).
    """
    if rank.stepped_by_hook and rank.overlap != "sharded" and not rank.steps_whole_in_hook:
        raise RuntimeError(
            "this ZeroRedundancyOptimizer (overlap_with_ddp=True) is not initialized yet: "
            "DDP fixes its buckets during the first iterations"
        )


def check_stepped_here(rank: ZeroRank, what: str) -> None:
    """Refuse ``what`` when DDP's hook steps the optimizer.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``.
    """
    if rank.stepped_by_hook:
        raise RuntimeError(
            f"{what} is not available with overlap_with_ddp=True: the DDP hook steps each "
            "bucket during backward, before the gradients of the whole model are known. "
            "Pass max_grad_norm= and loss_scaler= to hook_with_zero_step instead."
        )


def send_compressed(rank: ZeroRank, params: Sequence[torch.Tensor]) -> SendCompressed | None:
    """What the overlap hook's compressed sends read: the quantizer and
    this rank's masters by global parameter index (``None``: no
    compression)."""
    if rank.options.quantizer is None:
        return None
    assert rank.masters is not None
    master_of = {id(low): m for low, m in zip(rank.masters.low, rank.masters.master, strict=True)}
    return SendCompressed(rank.options.quantizer, [master_of.get(id(p)) for p in params])


def step_rank_with_gradients(
    rank: ZeroRank, groups: list[dict[str, Any]], request: StepGradients
) -> None:
    """Answer the overlapped step's :class:`~zerofn.overlap.orders.StepGradients`
    with the local optimizer (:func:`zerofn.overlap.orders.step_with_gradients`),
    its hyperparameters synced from the param groups first."""

    def step() -> None:
        with synced_hyperparameters(groups, rank):
            rank.optim.step()

    step_with_gradients(request, flat_params(groups), rank.local_tensors(), rank.masters, step)
