"""A ZeRO rank stepped by DDP's overlap hook (``overlap_with_ddp=True``):
what the hook may do to the optimizer it drives (:class:`OverlapBinding`),
attaching one, answering its step with given gradients, what compressed
sends read, one order obeyed through the binding (:func:`obey_through`,
the adapter's hook and the simulated overlapped world alike), and the checks
that refuse to train, or to save, before a hook made that possible.
Sharding by the owners DDP's buckets fix is
:func:`zerofn.zero.replan.sharded_by_owners`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.comm import Program, answered_locally
from zerofn.overlap.hook import OverlapConfig, OverlapHookState, StepOrder
from zerofn.overlap.orders import (
    Handed,
    OrderObeyed,
    SendCompressed,
    StepChecks,
    StepGradients,
    obey_order,
    step_with_gradients,
)
from zerofn.zero.arguments import plan_for
from zerofn.zero.forward_gather import ForwardGather
from zerofn.zero.options import ZeroOptions
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
    "obey_through",
    "send_compressed",
    "step_rank_with_gradients",
]


@attrs.frozen
class OverlapBinding:
    """What the overlap hook may do to the optimizer it drives
    (``zerofn_torch.ZeroRedundancyOptimizer.bind_overlap_hook``).

    Attributes:
        step: answer a :class:`~zerofn.overlap.orders.StepGradients`: step the
            local optimizer with its gradients; the parameters not named sit out.
        adopt_owners: keep only this rank's parameters (global indices per
            rank) and their state from now on.
        compressed: what compressed sends read (``None``: no compression).
        step_whole: take the optimizer's whole step (its exchange included)
            with these averaged gradients, by global parameter index
            (``None`` with no whole step: ``redundancy=1``).
        forward_order: the forward's first use of each parameter when the
            owners' sends are to travel behind the next forward
            (``gather_during_forward=True``; agreed across ranks, a
            collective the first time), else ``None``.
        behind_forward: hand over those sends' pieces and the program that
            runs them, for the next forward (and every reader of
            parameters) to finish.
    """

    step: Callable[[StepGradients], None]
    adopt_owners: Callable[[Sequence[Sequence[int]]], None]
    compressed: Callable[[], SendCompressed | None]
    step_whole: Callable[[Mapping[int, torch.Tensor]], None] | None = None
    forward_order: Callable[[], Sequence[int | None] | None] = lambda: None
    behind_forward: Callable[[ForwardGather, Program[None]], None] | None = None


def obey_through(
    binding: OverlapBinding,
    state: OverlapHookState[Any],
    config: OverlapConfig,
    order: StepOrder,
    handed: Handed,
    params: Sequence[torch.Tensor],
    checks: StepChecks,
) -> Program[OrderObeyed]:
    """The core's :func:`~zerofn.overlap.orders.obey_order` for ``order``,
    obeyed by the rank ``binding`` drives: its step answered by
    ``binding.step``, its sends compressed and ordered as the binding says;
    when the program ends, the sends behind the next forward handed over and
    the rank's share kept once the plan is fixed. The sends it returns are
    the caller's to run (in the order given, on every rank alike)."""
    # Asked only when owners send: the first time it is a collective.
    first_use = None if order.everywhere else binding.forward_order()
    program = obey_order(
        state, config, order, handed, params, checks, binding.compressed(), first_use
    )
    done = yield from answered_locally(program, StepGradients, binding.step)
    if done.behind_forward is not None:
        assert binding.behind_forward is not None
        binding.behind_forward(*done.behind_forward)
    if done.reshard is not None:
        binding.adopt_owners(done.reshard)
    return done


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
