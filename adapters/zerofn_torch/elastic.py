"""Going on without a lost rank: the survivors agree on who is alive, form a
process group of their own in-process, take the lost ranks' shards from
their carriers (``ZeroRedundancyOptimizer(redundancy=2)``) and continue from a
step boundary, with no restart and no checkpoint read::

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                   redundancy=2, lr=1e-3)
    ddp = DistributedDataParallel(model)
    for step in range(steps):
        while True:
            try:
                train_step(ddp, zero, batch(step, rank, world_size))
                break
            except (CollectiveError, RuntimeError) as error:  # DDP raises RuntimeError
                survivors = recover(zero, error)
                ddp = DistributedDataParallel(model, process_group=survivors.group)
                rank, world_size = survivors.rank, survivors.world_size
                if survivors.finished_step:  # lost inside the step's exchange
                    break  # the step was finished from the carried copies

Which decisions are made where: the roll call is this module's (the job's
store, a deadline); who owns and carries what afterwards, what moves, and
the rebuilt rank are the core's (:func:`zerofn.zero.elastic.redundancy.plan_after_loss`,
:mod:`zerofn.zero.elastic.regroup`), the same functions the simulated world runs
(:func:`zerofn.testing.elastic.survivors_of`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

import attrs
import torch
import torch.distributed as dist

from zerofn.comm import answered_locally
from zerofn.diloco.outer import OuterStep
from zerofn.diloco.redundancy import (
    InconsistentSyncs,
    SyncPosition,
    SyncRecovery,
    regroup_program,
    sync_recovery,
)
from zerofn.diloco.schedule import fragment_synced_at
from zerofn.diloco.workers import after_loss
from zerofn.errors import CollectiveError
from zerofn.zero.elastic.liveness import seen_beats, silent_ranks
from zerofn.zero.elastic.recovery_point import (
    InconsistentPositions,
    Position,
    RecoveryPoint,
    recovery_point,
)
from zerofn.zero.elastic.redundancy import plan_after_loss
from zerofn_torch.diloco import DiLoCoOptimizer

# Growing back is its own module; its names stay importable from here, beside recover.
from zerofn_torch.growing import JOINERS, Admitted, Fingerprint, Joined, admit, fingerprint, join
from zerofn_torch.replicas import verify_replicas
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.driver import drive

# Starting the job through it lets a loss free a rank blocked in PyTorch's own collectives.
from zerofn_torch.runtime.group_sockets import init_process_group
from zerofn_torch.runtime.heartbeat import (
    abandon,
    beat_count,
    beat_key,
    raise_alarm,
    running_heartbeat,
)
from zerofn_torch.runtime.object_collectives import broadcast_object
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "JOINERS",
    "Admitted",
    "Fingerprint",
    "Joined",
    "Recovered",
    "RollCall",
    "admit",
    "fingerprint",
    "init_process_group",
    "join",
    "recover",
    "recover_diloco",
    "roll_call",
]

GENERATION = "zerofn/elastic/generation"
"""The job's newest world after a recovery (its generation), in its store: a
rank in an older world was left behind (paused past its peers' recovery) and
must fail alone."""

DEADLINE_S = 5.0
"""How long the roll call waits for a rank it never saw beat to say it is
alive (one that beats is waited for as long as a collective would wait for
it; one whose heartbeat stops is declared lost sooner)."""

SILENT_AFTER_S = 0.75
"""How long a rank's heartbeat may stand still before the roll call declares
it lost (it beats every tenth of a second)."""

LOST = "lost"
"""A rank's roll-call answer written by another rank that declared it lost."""


P = TypeVar("P", Position, SyncPosition)


@attrs.frozen
class RollCall(Generic[P]):
    """Who answered the roll call, and where each stood, as every survivor saw it.

    Attributes:
        alive: the group ranks that answered, in order.
        positions: where each of them stood (in ``alive``'s order): in the
            ZeRO step sequence, what :func:`~zerofn.zero.elastic.recovery_point.recovery_point`
            turns into the point every survivor goes on from; in DiLoCo's
            syncs, what :func:`~zerofn.diloco.redundancy.sync_recovery` does.
    """

    alive: tuple[int, ...]
    positions: tuple[P, ...]


@attrs.frozen
class Recovered:
    """What :func:`recover` made of the job.

    Attributes:
        group: the survivors' process group (the optimizer's from now on;
            build DDP on it).
        rank: this rank in ``group``.
        world_size: ranks in ``group``.
        lost: the ranks of the old group that are gone.
        finished_step: the step call that failed here is complete (do not
            redo it); ``False``: redo it on the survivors.
        point: the point every survivor went on from (the same on all of
            them, whichever call failed on which): a ZeRO optimizer's
            :class:`~zerofn.zero.elastic.recovery_point.RecoveryPoint`, or DiLoCo's
            :class:`~zerofn.diloco.redundancy.SyncRecovery`.
        inner_group: for DiLoCo workers of several ranks, this worker's new
            group (build its DDP on it); ``None`` otherwise.
    """

    group: Any
    rank: int
    world_size: int
    lost: tuple[int, ...]
    finished_step: bool
    point: RecoveryPoint | SyncRecovery
    inner_group: Any = None


def roll_call(
    store: Any,
    prefix: str,
    rank: int,
    world_size: int,
    position: P,
    deadline_s: float,
    *,
    generation: int = 0,
    silent_after_s: float = SILENT_AFTER_S,
    patience_s: float | None = None,
    together: Sequence[Sequence[int]] = (),
) -> RollCall[P]:
    """Every rank that can, says it is alive (and where it stands) under
    ``prefix`` in ``store``; a rank that has not is declared lost by any
    survivor once its heartbeat (``zerofn/beat/<generation>/<rank>``) has
    been silent for ``silent_after_s``; at ``deadline_s`` if it was never
    seen to beat; and at ``patience_s`` (``None``: ``deadline_s``) if it
    beats on and does not answer. A rank that beats is alive, busy in a long
    forward or inner step before it can hear the alarm: declaring it lost
    would cost its shard's redundancy, or the job. Each rank's
    answer is one key written once (compare-and-set: its position, or
    "lost"), so every survivor reads the same roll. It ends as soon as every
    rank has answered or been declared lost: within about ``silent_after_s``
    of the call for a dead rank that beat, rather than at the deadline.
    Ranks ``together`` (the ranks of one DiLoCo worker) are lost together:
    once one of them is, those that have not answered are not waited for.

    Raises:
        zerofn.errors.CollectiveError: this rank was left behind, declared
            lost before it answered (it was silent, or late): the others go
            on without it. Its text says "left behind", as when the others
            finished their recovery before this rank came back.
    """
    keys = [f"{prefix}/here/{r}" for r in range(world_size)]
    if store.compare_set(keys[rank], "", position.to_text()).decode() == LOST:
        raise CollectiveError(
            "the roll call",
            "going on without the lost ranks",
            prefix,
            f"this rank was left behind: rank {rank} was declared lost before it answered "
            f"(silent for {silent_after_s} s, or past the deadline), and the others go on "
            "without it; it ends here and touches nothing",
        )
    beats = [beat_key(generation, r) for r in range(world_size)]
    # Silence counts from what this rank's heartbeat already watched, if it
    # watched this world: a rank dead before the call is declared sooner.
    beating = running_heartbeat()
    view = None if beating is None else beating.view_of(generation)
    began = time.monotonic()
    end, patience_end = began + deadline_s, began + max(deadline_s, patience_s or deadline_s)
    while undecided := [r for r in range(world_size) if not store.check([keys[r]])]:
        now = time.monotonic()
        counts = [beat_count(store, k) for k in beats]
        view = seen_beats(view, counts, now, silent_after_s / 3)
        lost = set(silent_ranks(view, now, silent_after_s))
        if now >= end:
            lost.update(r for r, count in enumerate(counts) if count is None)
        if now >= patience_end:
            lost.update(range(world_size))
        lost.update(r for group in together if lost.intersection(group) for r in group)
        for r in set(undecided).intersection(lost):
            store.compare_set(keys[r], "", LOST)
        time.sleep(0.01)
    answers = [store.get(k).decode() for k in keys]
    alive = tuple(r for r in range(world_size) if answers[r] != LOST)
    return RollCall(alive, tuple(type(position).from_text(answers[r]) for r in alive))


def _timeout_s(group: Any) -> float:
    """``group``'s collective timeout in seconds (the new group keeps it)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # no gloo backend to ask: gloo's default
        return float(dist.default_pg_timeout.total_seconds())


def recover(
    zero: ZeroRedundancyOptimizer | DiLoCoOptimizer,
    error: BaseException,
    *,
    store: Any | None = None,
    deadline_s: float = DEADLINE_S,
) -> Recovered:
    """Go on without the ranks that are gone, after ``error`` (a failed
    collective: DDP's backward, the ZeRO step's exchange). Call it on every
    surviving rank, in the ``except`` of the failed step.

    The survivors agree on who is alive and where each stood in the step
    (:func:`roll_call`), and from that on one point to go on from
    (:func:`zerofn.zero.elastic.recovery_point.recovery_point`), whichever collective
    failed on which rank. They form a process group in-process
    (``new_group(..., use_local_synchronization=True)``), re-plan
    (:func:`zerofn.zero.elastic.redundancy.plan_after_loss`), and reach that point:
    a survivor that failed before its local step while another took it takes
    it from the other's averaged gradients; a step whose exchange did not
    complete is finished, the lost shards' updates coming from their carriers'
    copies. Then they send the copies that restore redundancy, rebuild the
    optimizer on the new group, and check that their parameters and shard
    copies agree (:func:`zerofn_torch.verify_replicas`). When every rank
    answered (a transient failure: a slow or paused rank came back in time)
    the same world goes on, on a new group, from the same agreed point.

    A :class:`~zerofn_torch.diloco.DiLoCoOptimizer` built with
    ``redundancy=2`` goes on the same way, by its syncs
    (:func:`recover_diloco`).

    Args:
        zero: the optimizer (built with ``redundancy=2``).
        error: what the failed step raised; raised again when every rank
            answered and it is no failed collective (a bug, not a loss).
        store: where the roll call is held (default: the default process
            group's store, which the launcher keeps).
        deadline_s: how long a rank never seen to beat has to answer the
            roll call (one whose heartbeat stands still is declared lost
            sooner; one that beats on is waited for up to the group's
            timeout, as its next collective would be).
            A survivor blocked in the failed collective is freed by the
            alarm: zerofn's waits end, and the connections of the world's
            group are shut (:mod:`zerofn_torch.runtime.group_sockets`; the
            default group's when the job was started by
            :func:`init_process_group`).

    Returns:
        The new group (with the old group's timeout), this rank's place in
        it, and whether the step call that failed here is complete.

    Raises:
        ValueError: ``zero`` keeps one copy of each shard (``redundancy=1``),
            or what :func:`~zerofn.zero.elastic.redundancy.plan_after_loss` refuses (a
            shard and its carrier both lost): restart from a checkpoint.
        BaseException: ``error`` itself, when every rank answered and it is
            no failed collective.
        zerofn.errors.CollectiveError: this rank was left behind (the job
            recovered without it: it must not touch the job's state); the
            survivors disagree on who is alive or stand at no common point;
            or a collective on the new group failed.
        zerofn.replicas.ReplicaMismatch: the survivors' parameters or shard
            copies differ.
    """
    if isinstance(zero, DiLoCoOptimizer):
        return recover_diloco(zero, error, store=store, deadline_s=deadline_s)
    old = zero.zero_rank
    if old.carried is None:
        raise ValueError(
            "recover needs ZeroRedundancyOptimizer(..., redundancy=2): with one copy of "
            "each shard a lost rank's optimizer state is gone; restart from a checkpoint"
        )
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    _, point, lost = _agree(
        zero, zero.position, lambda c: recovery_point(c.positions), error, store, deadline_s
    )
    regrouping = plan_after_loss(old.plan, lost)
    group = _group_of(zero.process_group, regrouping.survivors)
    params = [p for g in zero.param_groups for p in g["params"]]
    new_rank = regrouping.new_rank(zero.rank)
    zero.enter_world(group, new_rank, len(regrouping.survivors))
    if point.behind:
        assert point.source is not None
        grads = broadcast_object(
            zero.step_gradients if new_rank == point.source else None,
            point.source,
            group,
            "handing the averaged gradients to survivors that missed the local step",
        )
        if new_rank in point.behind:
            zero.take_missed_local_step(grads)
    # With the exchange behind the forward, the step had returned: the call
    # that failed (a forward, DDP's collectives) is no step to skip.
    finished = point.finished_step(zero.position) and not zero.exchange_behind_forward
    zero.regroup(group, regrouping, new_rank, finish_step=point.finish)
    if new_rank == 0:
        store.set(GENERATION, str(zero.generation))
    verify_replicas(params, group, optimizer=zero)
    return Recovered(group, new_rank, len(regrouping.survivors), lost, finished, point)


def recover_diloco(
    diloco: DiLoCoOptimizer,
    error: BaseException,
    *,
    store: Any | None = None,
    deadline_s: float = DEADLINE_S,
) -> Recovered:
    """Go on without the DiLoCo workers that are gone, after ``error``: call
    it on every surviving rank, in the ``except`` of the failed call
    (``step``, which raises at once on a rank between syncs once another
    raised the alarm; or a backward under DDP).

    The ranks of the whole job agree on who is alive and where each stood
    in the syncs (:func:`roll_call`). A worker with a lost rank is lost
    whole: its other ranks leave. The ranks of each surviving worker take
    the state of its furthest rank (:func:`~zerofn.diloco.workers.after_loss`)
    over the worker's new group, so every outer group decides the same
    (:func:`~zerofn.diloco.redundancy.sync_recovery`): finish the
    interrupted sync forward with a survivor's sum, or leave it to run
    again. Each outer group then cuts the outer state for its world from
    owners and carriers (:func:`~zerofn.diloco.redundancy.regroup_program`),
    merges the result of a sync it stepped, and checks the new copies. A
    survivor that was inside a sync nobody could finish runs it again on the
    survivors' group before it returns; the others run it when their inner
    steps get there.

    Returns:
        As :func:`recover`, with ``inner_group`` for workers of several
        ranks; ``finished_step``: the call that failed here is complete (its
        inner step taken and its sync done): do not redo it.

    Raises:
        ValueError: ``diloco`` keeps no copies (``redundancy=1``), or a
            worker and its carrier are both lost: restart from a checkpoint.
        BaseException: ``error`` itself, when every rank answered and it is
            no failed collective.
        zerofn.errors.CollectiveError: this rank was left behind, or its
            worker lost another rank (it ends here and touches nothing);
            the survivors' positions admit no common outer state; or a
            collective on the new groups failed.
        zerofn.replicas.ReplicaMismatch: a carried copy differs from its owner's.
    """
    own = diloco.position()
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    diloco.leave_group()
    workers, place = diloco.workers, diloco.place
    _, loss, _ = _agree(
        diloco, own, lambda c: after_loss(workers, c.alive, c.positions), error, store,
        deadline_s, (place, len(workers.ranks), workers.together()),
    )  # fmt: skip
    worker, local = workers.place(workers.ranks[place])
    if worker in loss.lost:
        _leave(worker, loss.lost, error)
    recovery = _decided(sync_recovery, loss.positions, diloco.generation, error)
    new_rank = loss.kept.index(worker)
    group = _group_of(diloco.process_group, loss.kept)
    inner = None
    if workers.ranks_per_worker > 1:
        inner = _group_of(dist.group.WORLD, loss.survivors.inner(new_rank), part_of=group)
    diloco.enter_world(group, loss.survivors)
    if inner is not None:
        source = loss.sources[new_rank]
        purpose = "DiLoCo: handing the furthest rank's state to its worker's other ranks"
        handed = broadcast_object(
            diloco.handed_state() if local == source else None, source, inner, purpose
        )
        if local != source:
            diloco.take_state(handed)
    position = loss.positions[new_rank]
    index = fragment_synced_at(diloco.config, recovery.sync)
    codec = diloco.config.compression
    program = regroup_program(
        recovery,
        position,
        diloco.plan,
        loss.kept,
        new_rank,
        lambda: diloco.finishing(index if index is not None else 0),
        lambda: diloco.held_state_dicts(recovery),
        None if codec is None else (codec, index),
    )
    purpose = "DiLoCo: regrouping the outer state without the lost ranks"
    regrouped = drive(
        answered_locally(program, OuterStep, diloco.answer_outer_step), group, purpose
    ).wait()
    diloco.regroup(group, new_rank, regrouped)
    if new_rank == 0:
        store.set(GENERATION, str(diloco.generation))
    diloco.resume(recovery, position, regrouped.results)
    diloco.verify_copies()
    if recovery.runs_again(position):
        diloco.run_again(position)
    # The failed call is done once the survivors stand past the step it was.
    finished = position.steps + int(position.taken) > own.steps
    return Recovered(group, new_rank, len(loss.kept), loss.lost, finished, recovery, inner)


def _leave(worker: int, lost: tuple[int, ...], error: BaseException) -> None:
    """End a live rank of a lost worker: it touches nothing more.

    Raises:
        zerofn.errors.CollectiveError: always, saying why.
    """
    raise CollectiveError(
        "the roll call",
        "going on without the lost ranks",
        f"DiLoCo worker {worker}",
        f"this rank was left behind: its worker lost another of its ranks (workers "
        f"{list(lost)} are gone), and a worker goes on whole or not at all; the others go on "
        "without it, and this rank ends here and touches nothing",
    ) from error


D = TypeVar("D")


def _agree(
    optimizer: ZeroRedundancyOptimizer | DiLoCoOptimizer,
    position: P,
    decide: Callable[[RollCall[P]], D],
    error: BaseException,
    store: Any,
    deadline_s: float,
    job: tuple[int, int, Sequence[Sequence[int]]] | None = None,
) -> tuple[RollCall[P], D, tuple[int, ...]]:
    """The survivors' agreement, the same for every optimizer that recovers:
    the failed world left, the alarm raised, the roll call held, and from
    what it gathered one decision (``decide``: the ZeRO step's
    :func:`~zerofn.zero.elastic.recovery_point.recovery_point` or DiLoCo's
    :func:`~zerofn.diloco.workers.after_loss`).

    Args:
        job: this rank's place in the roll call, the ranks called, and the
            places lost together (DiLoCo's workers); default: the
            optimizer's group, each rank alone.

    Returns:
        The roll call, the decision, and the places lost.

    Raises:
        zerofn.errors.CollectiveError: this rank was left behind, or the
            positions admit no decision (``decide`` refused them).
        BaseException: ``error`` itself, when every rank answered and it is
            no failed collective.
    """
    place, size, together = job if job is not None else (optimizer.rank, optimizer.world_size, ())
    # The failed world's group is never used again, and a collective of it
    # may stay pending (a wait the alarm ended, or a peer that gave up): its
    # destructor would wait for that, so it is kept for good.
    abandon(optimizer.process_group)
    _refuse_if_left_behind(store, optimizer.generation, error)
    # Every rank still waiting on a collective of this world ends its wait.
    raise_alarm(f"rank {place} of {size}: {type(error).__name__}")
    prefix = f"zerofn/elastic/{optimizer.generation}"
    call = roll_call(
        store, prefix, place, size, position, deadline_s, generation=optimizer.generation,
        patience_s=_timeout_s(optimizer.process_group), together=together,
    )  # fmt: skip
    decision = _decided(decide, call, optimizer.generation, error)
    lost = tuple(r for r in range(size) if r not in call.alive)
    if not lost and not _is_collective_failure(error):
        raise error  # every rank is here and no collective failed: not ours to mend
    return call, decision, lost


A = TypeVar("A")


def _decided(decide: Callable[[A], D], given: A, generation: int, error: BaseException) -> D:
    """``decide(given)``; a refusal of positions no run reaches raised as
    the failed recovery of the world of ``generation``.

    Raises:
        zerofn.errors.CollectiveError: ``decide`` refused the positions.
    """
    try:
        return decide(given)
    except (InconsistentPositions, InconsistentSyncs) as refused:
        raise CollectiveError(
            "the roll call",
            "going on without the lost ranks",
            f"zerofn/elastic/{generation}",
            str(refused),
        ) from error


def _group_of(group: Any, survivors: Sequence[int], part_of: Any | None = None) -> Any:
    """A process group of ``group``'s ranks ``survivors``, formed by them
    alone, with ``group``'s timeout; its connections are shut when the
    alarm of the world over it (or over ``part_of``) rings."""
    return group_sockets.opened(
        lambda: dist.new_group(
            [dist.get_global_rank(group, r) for r in survivors],
            timeout=timedelta(seconds=_timeout_s(group)),
            use_local_synchronization=True,
        ),
        part_of,
    )


_TRANSPORT_FAILURES = ("CollectiveError", "gloo/transport", "NCCL", "Timed out waiting")
"""What the text of a failed collective that DDP raises holds: a zerofn
communication hook's error, or the backend's own (gloo's transport, NCCL)."""


def _is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective: zerofn's own, or one that
    DDP raised as text (from a zerofn hook, or its own all-reduce's)."""
    text = str(error)
    return isinstance(error, CollectiveError) or any(s in text for s in _TRANSPORT_FAILURES)


def _refuse_if_left_behind(store: Any, generation: int, error: BaseException) -> None:
    """Refuse to recover a rank the job recovered without.

    Raises:
        zerofn.errors.CollectiveError: the job recovered into a newer world
            than this rank's.
    """
    current = int(store.get(GENERATION).decode()) if store.check([GENERATION]) else 0
    if current > generation:
        raise CollectiveError(
            "the roll call",
            "going on without the lost ranks",
            GENERATION,
            f"this rank was left behind: the job went on without it (it is in world "
            f"{current}, this rank in world {generation}); it ends here and touches nothing",
        ) from error
