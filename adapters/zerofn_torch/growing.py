"""Growing back: a replacement (or one more rank) joins a running job
(``ZeroRedundancyOptimizer(redundancy=2)``), with no restart and no
checkpoint read. The running ranks call :func:`admit` at step boundaries;
the joiner calls :func:`join` with the job's store, model and optimizer::

    # on every running rank, while the world is short
    grown = admit(zero, store, extra={"step": step})
    if grown is not None:
        ddp = DistributedDataParallel(model)  # the new default group

    # in the replacement
    joined = join(store, model, torch.optim.AdamW, redundancy=2, lr=1e-3)
    zero, first_step = joined.optimizer, joined.extra["step"]

Who is let in is this module's (the joiners' announcements in the store,
checked against the job's :class:`Fingerprint`); the grown plan, the moves and
the rebuilt ranks are the core's (:func:`zerofn.zero.elastic.redundancy.plan_after_join`,
:func:`zerofn.zero.elastic.regroup.regroup_program`), the same the simulated world
runs (:func:`zerofn.testing.elastic.grown_by`). Losing a rank is
:mod:`zerofn_torch.elastic`'s, which also exports these names.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Broadcast, Program
from zerofn.zero.elastic.redundancy import Regrouping, plan_after_join
from zerofn.zero.mixed_precision.precision import resolve_master_dtype
from zerofn.zero.options import compression_master_dtype, resolve_compression
from zerofn.zero.planning.partition import FlatPartition
from zerofn_torch.checkpoint.background import settle_in_flight
from zerofn_torch.replicas import verify_replicas
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.futures import settle
from zerofn_torch.runtime.object_collectives import broadcast_object
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["JOINERS", "Admitted", "Fingerprint", "Joined", "admit", "fingerprint", "join"]

JOINERS = "zerofn/elastic/joiners"
"""Where joiners announce themselves in the job's store."""


@attrs.frozen
class Fingerprint:
    """What a joiner must share with the running job to join it.

    Attributes:
        optimizer: the local optimizer's class, by qualified name.
        defaults: its keyword arguments, as text.
        redundancy: copies of each shard.
        shapes: every parameter's shape and dtype, in order.
        master_dtype: the masters' dtype, as text (``"None"``: no masters).
        flat: the optimizer's partition is flat (element ranges), not whole
            parameters.
        compression: the exchange's codec, as text (``"None"``: exact).
        gather_during_forward: the exchange travels behind the next forward.
    """

    optimizer: str
    defaults: str
    redundancy: int
    shapes: tuple[tuple[tuple[int, ...], str], ...]
    master_dtype: str = "None"
    flat: bool = False
    compression: str = "None"
    gather_during_forward: bool = False

    def refusal(self, joiner: Fingerprint) -> str | None:
        """Why ``joiner`` cannot join a job of this fingerprint (``None``: it can)."""
        for field in attrs.fields(Fingerprint):
            mine, theirs = getattr(self, field.name), getattr(joiner, field.name)
            if mine != theirs:
                return (
                    f"the joiner's {field.name} differs from the running job's: "
                    f"{theirs!r} against {mine!r}; start it with the job's model and optimizer"
                )
        return None


def fingerprint(
    params: Sequence[torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    redundancy: int,
    master_dtype: torch.dtype | None = None,
    flat: bool = False,
    compression: BlockQuantizer | None = None,
    gather_during_forward: bool = False,
) -> Fingerprint:
    """The :class:`Fingerprint` of a model's parameters and optimizer options."""
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    shapes = tuple((tuple(p.shape), str(p.dtype)) for p in params)
    return Fingerprint(
        name, repr(sorted(defaults.items())), redundancy, shapes, str(master_dtype), flat,
        repr(compression), gather_during_forward,
    )  # fmt: skip


def _fingerprint_of(zero: ZeroRedundancyOptimizer) -> Fingerprint:
    options = zero.zero_rank.options
    params = [p for g in zero.param_groups for p in g["params"]]
    return fingerprint(
        params, options.optimizer_class, options.defaults, options.redundancy,
        options.master_dtype, isinstance(zero.shard_plan.partition, FlatPartition),
        options.quantizer, options.gather_during_forward,
    )  # fmt: skip


@attrs.frozen
class Admitted:
    """What :func:`admit` made of the job: the grown world.

    Attributes:
        group: the new world's process group (the default group: build DDP on it).
        rank: this rank in it (unchanged for a running rank).
        world_size: ranks in it.
        joined: how many ranks joined.
    """

    group: Any
    rank: int
    world_size: int
    joined: int


@attrs.frozen
class Joined:
    """What :func:`join` made of a joiner.

    Attributes:
        optimizer: its ``ZeroRedundancyOptimizer``, holding its shards.
        rank: its rank in the job.
        world_size: ranks in the job.
        extra: what the running ranks passed to :func:`admit` (the step,
            a scheduler's state, ...).
    """

    optimizer: ZeroRedundancyOptimizer
    rank: int
    world_size: int
    extra: Any


def _pending(store: Any) -> tuple[int, ...]:
    """The joiners' tickets not answered yet (rank 0 reads them)."""
    count = store.add(f"{JOINERS}/count", 0)
    handled = store.add(f"{JOINERS}/handled", 0)
    return tuple(range(handled + 1, count + 1))


def _answer(store: Any, ticket: int, answer: Mapping[str, Any]) -> None:
    store.set(f"{JOINERS}/{ticket}/answer", pickle.dumps(dict(answer)))


def _decide(store: Any, job: Fingerprint) -> tuple[int, ...]:
    """Rank 0: the pending joiners it admits; the others are refused now."""
    pending = _pending(store)
    admitted = []
    for ticket in pending:
        theirs: Fingerprint = pickle.loads(store.get(f"{JOINERS}/{ticket}/fingerprint"))
        why = job.refusal(theirs)
        if why is None:
            admitted.append(ticket)
        else:
            _answer(store, ticket, {"refused": why})
    store.add(f"{JOINERS}/handled", len(pending))
    return tuple(admitted)


def _new_world(store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """This process's default group, now the new world's (every member, the
    joiners included, starts it under the same ``prefix``), its connections
    shut when that world's alarm rings."""
    group_sockets.opened(
        lambda: dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    )
    return dist.group.WORLD


def _broadcast_params(params: Sequence[torch.Tensor]) -> Program[None]:
    """Rank 0's parameters into every rank's (a joiner's come from here)."""
    for i, p in enumerate(params):
        yield Broadcast(p.data, 0, last=i == len(params) - 1)


def _grow(
    zero: ZeroRedundancyOptimizer,
    group: Any,
    regrouping: Regrouping,
    generation: int,
    extra: Any,
) -> Any:
    """Every member of the new world, running rank or joiner: the plan and
    ``extra`` from rank 0, its parameters, the moves, the optimizer rebuilt."""
    rank = dist.get_rank(group)
    shared = broadcast_object((regrouping, generation, extra), 0, group, "growing the world")
    regrouping, generation, extra = shared
    params = [p for g in zero.param_groups for p in g["params"]]
    with torch.no_grad():
        drive(_broadcast_params(params), group, "the joiners' parameters").wait()
    zero.enter_world(group, rank, dist.get_world_size(group), generation)
    zero.regroup(group, regrouping, rank, finish_step=False)
    verify_replicas(params, group)
    return extra


def admit(
    zero: ZeroRedundancyOptimizer,
    store: Any,
    *,
    extra: Any = None,
    timeout_s: float = 120.0,
) -> Admitted | None:
    """At a step boundary, on every running rank: let in the ranks waiting
    to join (:func:`join`), if any, growing the world.

    Rank 0 reads the joiners' announcements in ``store`` and checks each
    against the job (:class:`Fingerprint`): a joiner with another model or
    optimizer is refused, with the reason, and the job goes on untouched.
    The ranks agree on the admitted ones with one broadcast of a few bytes
    (the cost of a call that finds nobody). Then every running rank and
    every joiner starts a new default process group, rank 0 sends the
    joiners the plan (:func:`~zerofn.zero.elastic.redundancy.plan_after_join`),
    ``extra`` and the parameters, the moves give the joiners their shards and
    carried copies, and every optimizer is rebuilt; last, every rank checks
    that the parameters agree (:func:`zerofn_torch.verify_replicas`). A
    background save in flight is finished first.

    Args:
        zero: the running optimizer (``redundancy=2``).
        store: the job's store, the one the joiners announce themselves in.
        extra: what the joiners need besides the model and optimizer (the
            step, a scheduler's ``state_dict()``, ...): picklable, rank 0's.
        timeout_s: the new group's collective timeout.

    Returns:
        The grown world (build DDP on its group, re-register hooks), or
        ``None`` when nobody joined.

    Raises:
        zerofn.errors.CollectiveError: a collective of the growth failed.
    """
    zero.wait()  # an exchange behind the forward, in the world about to go
    group = zero.process_group
    decided = _decide(store, _fingerprint_of(zero)) if zero.rank == 0 else None
    tickets: tuple[int, ...] = broadcast_object(decided, 0, group, "who joins")
    if not tickets:
        return None
    world, generation = zero.world_size, zero.generation + 1
    prefix = f"zerofn/world/{generation}"
    size = world + len(tickets)
    if zero.rank == 0:
        for i, ticket in enumerate(tickets):
            _answer(store, ticket, {"prefix": prefix, "rank": world + i, "world_size": size})
    settle_in_flight(group)
    rank = zero.rank
    settle()  # no callback of ours may be running when the world's groups go
    dist.destroy_process_group()
    new_group = _new_world(store, prefix, rank, size, timeout_s)
    extra = _grow(
        zero, new_group, plan_after_join(zero.shard_plan, len(tickets)), generation, extra
    )
    return Admitted(new_group, rank, size, len(tickets))


def join(
    store: Any,
    model: torch.nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    *,
    redundancy: int = 2,
    master_dtype: torch.dtype | None = None,
    partition: str = "greedy",
    exchange_compression: str | BlockQuantizer | None = None,
    overlap_with_ddp: bool = False,
    gather_during_forward: bool = False,
    timeout_s: float = 120.0,
    **defaults: Any,
) -> Joined:
    """Join a running job as a new rank (a replacement, or one more): announce
    this process in the job's ``store``, wait for the running ranks' next
    :func:`admit`, then take part in the growth: this process's default group
    is the job's, ``model`` holds the job's parameters, and the returned
    optimizer its share of the optimizer state.

    Args:
        store: the job's store (the one the running ranks pass to :func:`admit`).
        model: the job's model (its values are replaced by the job's).
        optimizer_class: the job's local optimizer class.
        redundancy: the job's redundancy.
        master_dtype: the job's master copies' dtype (``None``: none).
        partition: ``"flat"`` for a job whose partition is flat; else any
            whole-tensor one (the joiner's share comes from the job's plan).
        exchange_compression: the job's compressed exchange (``None``: exact).
        overlap_with_ddp: the job steps inside DDP's backward (register
            ``hook_with_zero_step`` on the DDP built on the new group, as
            the running ranks do).
        gather_during_forward: the job's exchange travels behind the next
            forward.
        timeout_s: how long to wait to be admitted, and the group's timeout.
        **defaults: the job's optimizer options.

    Returns:
        The optimizer, this rank, the world size, and the running ranks' ``extra``.

    Raises:
        ValueError: the running job refused this process (another model or
            optimizer), saying why.
        TimeoutError: nobody admitted it within ``timeout_s``.
    """
    params = list(model.parameters())
    dtype = params[0].dtype
    codec = resolve_compression(exchange_compression, dtype)
    # The masters the optimizer keeps (a compressed exchange keeps its own).
    masters = (
        resolve_master_dtype(dtype, master_dtype)
        if codec is None
        else compression_master_dtype(dtype, master_dtype)
    )
    mine = fingerprint(
        params, optimizer_class, defaults, redundancy, masters, partition == "flat", codec,
        gather_during_forward,
    )  # fmt: skip
    # Before announcing: the options are checked while the job is untouched,
    # and the optimizer's lazy imports are paid before the running ranks wait.
    optimizer_class([torch.zeros(1, dtype=master_dtype or params[0].dtype)], **defaults)
    ticket = store.add(f"{JOINERS}/count", 1)
    store.set(f"{JOINERS}/{ticket}/fingerprint", pickle.dumps(mine))
    key = f"{JOINERS}/{ticket}/answer"
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as e:  # the store's own timeout error
        raise TimeoutError(f"no running rank admitted this joiner within {timeout_s} s") from e
    answer = pickle.loads(store.get(key))
    if "refused" in answer:
        raise ValueError(f"the running job refused this joiner: {answer['refused']}")
    group = _new_world(store, answer["prefix"], answer["rank"], answer["world_size"], timeout_s)
    zero = ZeroRedundancyOptimizer(
        params, optimizer_class, redundancy=redundancy, master_dtype=master_dtype,
        partition=partition, exchange_compression=exchange_compression,
        overlap_with_ddp=overlap_with_ddp, gather_during_forward=gather_during_forward,
        **defaults,
    )  # fmt: skip
    extra = _grow(zero, group, None, 0, None)  # type: ignore[arg-type]
    return Joined(zero, answer["rank"], answer["world_size"], extra)
