"""One ZeRO rank, built once: the rank's whole state (:class:`ZeroRank`:
plan, shards, masters, compressed exchange, local optimizer, who steps it,
under the options :mod:`zerofn.zero.options` resolved), with the functions
that build it, write a step's gradients for it and answer the step program's
local step.

``zerofn_torch.ZeroRedundancyOptimizer`` and the simulated world
(:mod:`zerofn.testing.zero`) build their ranks with the same
:func:`~zerofn.zero.options.resolve_options` and :func:`build_rank`, and
answer the step program's :class:`~zerofn.zero.step.LocalStep` with the same
:func:`answer_local_step`: what a property test of the simulated world checks
is what training runs.

Two layers, and this module is where they meet. The planning layer is frozen
data and pure functions: the options (:class:`~zerofn.zero.options.ZeroOptions`),
the plan (:class:`~zerofn.zero.planning.plan.ShardPlan`, partitions, layouts), the
moves and codecs; equal inputs give equal records. A :class:`ZeroRank` is
not of that layer: it is the rank's *stateful part*, the handles to live
torch state (the local optimizer, master copies, exchange buffers, a carried
copy) bundled with the plan they were built for. Its fields are never
reassigned (a change of plan, masters, optimizer or overlap mode builds a
new one, which the functions here return), but what they refer to changes in
place every step, as training needs: it compares by identity, and the
functions that take it say which of its tensors they write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import attrs
import torch
from torch.optim import Optimizer

from zerofn.zero.compressed.exchange import (
    CompressedExchange,
    compressed_exchange,
)
from zerofn.zero.elastic.carried import (
    CarriedShard,
    carried_shard,
    step_carried,
    write_carried_grads,
)
from zerofn.zero.mixed_precision.masters import Masters, make_masters
from zerofn.zero.optimizers import steps_in_parts
from zerofn.zero.options import ZeroOptions
from zerofn.zero.params import hyperparameters
from zerofn.zero.planning.plan import ShardPlan, with_trainable
from zerofn.zero.shards import Shards, shards_for
from zerofn.zero.step import Compressed, LocalStep, finish_masters

__all__ = [
    "OverlapMode",
    "ZeroRank",
    "answer_local_step",
    "build_rank",
    "copy_hyperparameters",
    "drop_master_grads",
    "extend_local_optimizer",
    "flat_params",
    "master_grads",
    "memory_bytes",
    "owned_grads",
    "rank_for_plan",
    "synced_hyperparameters",
    "with_current_trainable",
    "write_local_grads",
]

OverlapMode = Literal["off", "unattached", "attached", "sharded"]
"""Who steps a rank's optimizer: ``"off"``, its own step; with
``overlap_with_ddp=True``, no hook yet (``"unattached"``), a DDP hook with
every rank stepping every parameter (``"attached"``), or a hook after DDP
fixed its buckets, each rank keeping its own (``"sharded"``). With
``redundancy=2`` as well the hook runs the rank's whole step after the last
bucket (:attr:`ZeroRank.steps_whole_in_hook`): ``"attached"`` for good."""


def flat_params(groups: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``groups``, in the optimizer's (global index) order."""
    return [p for g in groups for p in g["params"]]


@attrs.frozen(eq=False)
class ZeroRank:
    """One rank's ZeRO state, consistent as a whole: the stateful part of a
    rank (live handles, written in place by steps and loads), not a value.

    Attributes:
        options: what the constructor fixed.
        plan: who owns what and how shards travel.
        shards: how this rank holds and steps its shard under ``plan``.
        masters: this rank's master copies (``None`` without ``master_dtype``).
        exchange: the compressed exchange's buffers (``None``: exact, or sent
            by the overlap hook).
        overlap: who steps the optimizer.
        optim: the local optimizer over this rank's shard (the masters, the
            owned parameters, or a flat shard's chunks).
        carried: the copy of another rank's shard this rank steps too
            (``redundancy=2``), or ``None``.
    """

    options: ZeroOptions
    plan: ShardPlan
    shards: Shards
    masters: Masters | None
    exchange: CompressedExchange | None
    overlap: OverlapMode
    optim: Optimizer
    carried: CarriedShard | None = None

    @property
    def stepped_by_hook(self) -> bool:
        """DDP's hook steps the optimizer (``overlap_with_ddp=True``)."""
        return self.overlap != "off"

    @property
    def steps_whole_in_hook(self) -> bool:
        """DDP's hook runs this rank's whole step (its partition, carried
        copy and exchange) once every bucket is averaged: ``overlap_with_ddp``
        with ``redundancy=2``, whose carriers need every averaged gradient."""
        return _whole_in_hook(self.overlap, self.options)

    @property
    def compressed(self) -> Compressed | None:
        """What the step program's compressed exchange needs (``None``: exact).
        With a carried copy the local step is taken whole before the exchange,
        never in parts: a loss inside the exchange then finds every survivor's
        step whole (:mod:`zerofn.zero.compressed.finish` finishes it)."""
        if self.exchange is None:
            return None
        assert self.masters is not None  # a compressed exchange always keeps masters
        in_parts = steps_in_parts(self.optim) and self.carried is None
        return Compressed(self.exchange, self.masters.master, in_parts)

    def local_tensors(self) -> list[torch.Tensor]:
        """What the local optimizer steps, in its order."""
        return [t for g in self.optim.param_groups for t in g["params"]]


def _whole_in_hook(overlap: OverlapMode, options: ZeroOptions) -> bool:
    return overlap != "off" and options.redundancy == 2


def rank_for_plan(
    groups: Sequence[dict[str, Any]],
    options: ZeroOptions,
    plan: ShardPlan,
    overlap: OverlapMode,
    *,
    rebuilt: bool,
    kept: ZeroRank | None = None,
) -> ZeroRank:
    """A rank placed by ``plan``: this rank's shards and, with compression,
    the payload buffers (built here; with ``options.bucket_view`` the
    parameters become views of the new exchange buffers). The local
    optimizer, its masters and the carried copy are ``kept``'s if given,
    else new ones over the new shard (and, with ``redundancy=2``, the
    carried one).

    Args:
        groups: the param groups, in the optimizer's order.
        options: what the constructor fixed.
        plan: who owns what.
        overlap: who steps the optimizer.
        rebuilt: exchange buffers existed before (see
            :func:`zerofn.zero.shards.build_buffers`).
        kept: the rank whose local optimizer, masters and carried copy to
            keep (``None``: build them).
    """
    params = flat_params(groups)
    hook = overlap != "off" and not _whole_in_hook(overlap, options)
    # The overlap hook sends its own payloads, bucket by bucket.
    exchange = (
        None
        if options.quantizer is None or hook
        else compressed_exchange(options.quantizer, plan, options.device, options.piece_elements)
    )
    shards = shards_for(
        plan,
        options.rank,
        params,
        bucket_view=options.bucket_view,
        stepped_by_hook=hook,
        step_dtype=options.master_dtype or params[0].dtype,
        options=options.defaults,
        rebuilt=rebuilt,
    )
    masters, optim, carried = (
        (kept.masters, kept.optim, kept.carried) if kept is not None else (None, None, None)
    )
    if optim is None:
        local = shards.local_groups(groups, params)
        if options.master_dtype is not None:
            local, masters = make_masters(local, options.master_dtype)
        optim = options.optimizer_class(local, **options.defaults)
        if options.redundancy == 2:
            carried = carried_shard(
                plan, options.rank, groups, options.optimizer_class, options.defaults,
                options.master_dtype,
            )  # fmt: skip
    return ZeroRank(options, plan, shards, masters, exchange, overlap, optim, carried)


def build_rank(
    groups: Sequence[dict[str, Any]],
    options: ZeroOptions,
    plan: ShardPlan,
    overlap: OverlapMode = "off",
) -> ZeroRank:
    """A new rank: its shards, exchange buffers, masters and a fresh local
    optimizer over its shard of ``groups`` under ``plan`` (the constructor's,
    and each simulated rank's)."""
    return rank_for_plan(groups, options, plan, overlap, rebuilt=False)


def extend_local_optimizer(rank: ZeroRank, groups: Sequence[dict[str, Any]]) -> ZeroRank:
    """Add this rank's share of ``groups``' last group to its local optimizer
    (the other groups' shards are unchanged).

    Returns:
        ``rank`` with masters for the new group's share added.
    """
    new_local = rank.shards.local_groups(groups, flat_params(groups))[-1]
    masters = rank.masters
    if masters is not None:
        (new_local,), added = make_masters([new_local], masters.dtype)
        masters = masters.extended(added)
    rank.optim.add_param_group(new_local)
    return attrs.evolve(rank, masters=masters)


def with_current_trainable(rank: ZeroRank, groups: Sequence[dict[str, Any]]) -> ZeroRank:
    """``rank``, re-placed (exchange buffers included) if the parameters
    requiring grad changed since its plan was made; its optimizer kept.

    Raises:
        ValueError: a manual plan would leave a newly trainable parameter to
            no rank; a flat plan cannot follow the change; then nothing changed.
    """
    trainable = tuple(p.requires_grad for p in flat_params(groups))
    if trainable == rank.plan.trainable:
        return rank
    plan = with_trainable(rank.plan, trainable)  # may refuse: then nothing changed
    return rank_for_plan(groups, rank.options, plan, rank.overlap, rebuilt=True, kept=rank)


def copy_hyperparameters(
    source: Sequence[Mapping[str, Any]], target: Sequence[dict[str, Any]]
) -> None:
    """Copy each group's options (all but ``params``) from ``source`` into ``target``.

    The one way options move between ``param_groups`` and the local
    optimizer's groups: a scheduler's edits of ``param_groups`` reach the
    local optimizer, and what the local optimizer sets comes back.

    Raises:
        ValueError: the two differ in their number of groups.
    """
    for s, d in zip(source, target, strict=True):
        d.update(hyperparameters(s))


@contextmanager
def synced_hyperparameters(groups: Sequence[dict[str, Any]], rank: ZeroRank) -> Iterator[None]:
    """``groups``' options reach the rank's local optimizer (and its carried
    copy's) on entry; the local optimizer's come back when the block ends
    without an error (as after ``torch.optim``'s step)."""
    copy_hyperparameters(groups, rank.optim.param_groups)
    if rank.carried is not None:
        copy_hyperparameters(groups, rank.carried.optim.param_groups)
    yield
    copy_hyperparameters(rank.optim.param_groups, groups)


def write_local_grads(rank: ZeroRank, params: Sequence[torch.Tensor], unscale: float = 1.0) -> None:
    """Write this step's gradients where the local optimizer reads them: the masters (the
    carried copy's too) get them upcast (times ``unscale``; a master that
    has one keeps it, so writing twice in a step is writing once), a flat
    shard's chunks get views of the parameters' gradients; owned whole
    parameters hold their own."""
    if rank.masters is not None:
        rank.masters.write_grads(rank.shards.local_grads(params, rank.masters.low), unscale)
        if rank.carried is not None:
            write_carried_grads(rank.carried, params, unscale)
    else:
        rank.shards.write_grads(params, rank.local_tensors())


def master_grads(rank: ZeroRank) -> list[torch.Tensor]:
    """The gradients handed to this rank's masters and its carried masters
    for this step (what clipping scales; empty without masters)."""
    if rank.masters is None:
        return []
    carried = rank.carried.masters if rank.carried is not None else None
    return rank.masters.grads() + (carried.grads() if carried is not None else [])


def drop_master_grads(rank: ZeroRank) -> None:
    """Forget the gradients handed to the masters (and the carried ones)
    for a step that is skipped."""
    for masters in (rank.masters, rank.carried.masters if rank.carried is not None else None):
        if masters is not None:
            masters.drop_grads()


def owned_grads(rank: ZeroRank, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients this rank's step reads, for the elements it owns, in
    the parameters' global order (a norm over them adds as PyTorch's does):
    the masters' (handed over now if not yet), or views into the
    parameters' ``.grad``."""
    if rank.masters is not None:
        write_local_grads(rank, params)
        sources = rank.shards.local_sources(params)
        placed_grads = [
            (source, master.grad)
            for source, master in zip(sources, rank.masters.master, strict=True)
            if source is not None and master.grad is not None
        ]
        return [grad for _, grad in sorted(placed_grads, key=lambda pair: pair[0][:2])]
    pieces = rank.plan.partition.pieces_of(rank.options.rank)
    return [
        grad.reshape(-1)[p.start : p.stop]
        for p in sorted(pieces, key=lambda p: (p.param, p.start))
        if (grad := params[p.param].grad) is not None and p.numel
    ]


def answer_local_step(
    rank: ZeroRank, params: Sequence[torch.Tensor], run: Callable[[Optimizer], Any]
) -> Callable[[LocalStep], Any]:
    """The answer to the step program's :class:`~zerofn.zero.step.LocalStep`:
    write this step's gradients for the local optimizer, ``run(optim)`` (its
    ``step``, with whatever closure or options the caller has) over the
    tensors the request names, the others' gradients hidden; after the
    step's last request, step the carried copy as its owner does
    (``redundancy=2``) and finish the masters (cast back, or left to the
    compressed exchange).

    Returns:
        The answer, returning what ``run`` returned (the loss, with a
        closure; ``None`` for a request naming no tensor).
    """

    def answer(request: LocalStep) -> Any:
        if request.tensors is None and rank.exchange is not None:
            rank.exchange.begin_step()  # taken whole: its exchange has not begun
        write_local_grads(rank, params)
        loss = None
        if request.tensors is None:
            loss = run(rank.optim)
        elif request.tensors:
            with _stepping_only(rank.local_tensors(), request.tensors):
                loss = run(rank.optim)
        if request.last:
            if rank.carried is not None:
                step_carried(rank.carried, params)
            finish_masters(rank.masters, compressed=rank.exchange is not None)
        return loss

    return answer


@contextmanager
def _stepping_only(tensors: Sequence[torch.Tensor], chosen: Sequence[int]) -> Iterator[None]:
    """The gradients of ``tensors`` other than ``chosen`` (indices) hidden
    (``None``, so the optimizer skips them), and put back afterwards."""
    keep = set(chosen)
    hidden = {i: t.grad for i, t in enumerate(tensors) if i not in keep}
    for i in hidden:
        tensors[i].grad = None
    try:
        yield
    finally:
        for i, grad in hidden.items():
            tensors[i].grad = grad


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_bytes(rank: ZeroRank, params: Sequence[torch.Tensor]) -> dict[str, int]:
    """This rank's bytes by kind, read from the live tensors: what
    :func:`zerofn.footprint.plan_footprint` predicts.

    Returns:
        ``parameters``, ``gradients``, ``master_weights``,
        ``optimizer_state``, ``exchange_buffers`` (buffer bytes no
        parameter lives in, plus the compressed exchange's payloads) and
        ``carried`` (the carried copy's values and optimizer state,
        ``redundancy=2``; else 0). With
        ``overlap_with_ddp`` no exchange buffer is held between iterations,
        exact or compressed (the hook's messages live during backward only),
        so ``exchange_buffers`` is 0.
    """
    aliased = 0
    for buffer in rank.shards.buffers:
        lo = buffer.data_ptr()
        hi = lo + buffer.numel() * buffer.element_size()
        aliased += sum(_nbytes(p) for p in params if lo <= p.data_ptr() < hi)
    return {
        "parameters": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "master_weights": rank.masters.nbytes() if rank.masters is not None else 0,
        "optimizer_state": _state_bytes(rank.optim),
        "exchange_buffers": sum(_nbytes(b) for b in rank.shards.buffers)
        - aliased
        + (rank.exchange.nbytes() if rank.exchange is not None else 0),
        "carried": 0
        if rank.carried is None
        else _state_bytes(rank.carried.optim) + sum(_nbytes(t) for t in rank.carried.tensors()),
    }


def _state_bytes(optim: Optimizer) -> int:
    return sum(
        _nbytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
