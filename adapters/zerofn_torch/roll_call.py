"""The survivors' roll call and what they agree from it, for every
optimizer that goes on without lost ranks (:func:`zerofn_torch.elastic.recover`):
who is alive and where each stood (:func:`roll_call`, held in the job's
store), one decision from that, and the process groups the survivors form
by themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

import attrs
import torch
import torch.distributed as dist

from zerofn.diloco.redundancy import InconsistentSyncs, SyncPosition, SyncRecovery
from zerofn.errors import CollectiveError
from zerofn.zero.elastic.liveness import seen_beats, silent_ranks
from zerofn.zero.elastic.recovery_point import InconsistentPositions, Position, RecoveryPoint
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.heartbeat import (
    abandon,
    beat_count,
    beat_key,
    raise_alarm,
    running_heartbeat,
)

__all__ = [
    "DEADLINE_S",
    "GENERATION",
    "LOST",
    "SILENT_AFTER_S",
    "Recovered",
    "Recovering",
    "RollCall",
    "agree",
    "group_of",
    "roll_call",
    "timeout_s",
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
    """What :func:`~zerofn_torch.elastic.recover` made of the job.

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


def timeout_s(group: Any) -> float:
    """``group``'s collective timeout in seconds (the new group keeps it)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # no gloo backend to ask: gloo's default
        return float(dist.default_pg_timeout.total_seconds())


class Recovering(Protocol):
    """What the agreement reads of an optimizer that recovers (a
    ``ZeroRedundancyOptimizer`` or ``DiLoCoOptimizer`` with ``redundancy=2``)."""

    @property
    def process_group(self) -> Any: ...

    @property
    def generation(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


D = TypeVar("D")


def agree(
    optimizer: Recovering,
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
    refuse_if_left_behind(store, optimizer.generation, error)
    # Every rank still waiting on a collective of this world ends its wait.
    raise_alarm(f"rank {place} of {size}: {type(error).__name__}")
    prefix = f"zerofn/elastic/{optimizer.generation}"
    call = roll_call(
        store, prefix, place, size, position, deadline_s, generation=optimizer.generation,
        patience_s=timeout_s(optimizer.process_group), together=together,
    )  # fmt: skip
    decision = decided(decide, call, optimizer.generation, error)
    lost = tuple(r for r in range(size) if r not in call.alive)
    if not lost and not is_collective_failure(error):
        raise error  # every rank is here and no collective failed: not ours to mend
    return call, decision, lost


A = TypeVar("A")


def decided(decide: Callable[[A], D], given: A, generation: int, error: BaseException) -> D:
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


def group_of(group: Any, survivors: Sequence[int], part_of: Any | None = None) -> Any:
    """A process group of ``group``'s ranks ``survivors``, formed by them
    alone, with ``group``'s timeout; its connections are shut when the
    alarm of the world over it (or over ``part_of``) rings."""
    return group_sockets.opened(
        lambda: dist.new_group(
            [dist.get_global_rank(group, r) for r in survivors],
            timeout=timedelta(seconds=timeout_s(group)),
            use_local_synchronization=True,
        ),
        part_of,
    )


_TRANSPORT_FAILURES = ("CollectiveError", "gloo/transport", "NCCL", "Timed out waiting")
"""What the text of a failed collective that DDP raises holds: a zerofn
communication hook's error, or the backend's own (gloo's transport, NCCL)."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective: zerofn's own, or one that
    DDP raised as text (from a zerofn hook, or its own all-reduce's)."""
    text = str(error)
    return isinstance(error, CollectiveError) or any(s in text for s in _TRANSPORT_FAILURES)


def refuse_if_left_behind(store: Any, generation: int, error: BaseException) -> None:
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
