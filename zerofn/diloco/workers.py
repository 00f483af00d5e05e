"""Which ranks make up each DiLoCo worker, and what a lost rank leaves of them.

A worker may be several ranks that train one model under DDP over a group
inside it (its *inner group*); DiLoCo then runs one outer group per local
index: the ``l``-th rank of every worker (:class:`Workers`). Each outer
group syncs the whole model, so they all hold the same outer state.

A lost rank takes its whole worker with it: its inner group cannot go on,
so the worker's live ranks leave too (:func:`after_loss`).

The ranks of one worker (its *siblings*) hold equal replicas, but a loss
can catch them up to one inner step and one sync apart: the alarm stops one
before its step while another's outer group completes the sync. So each
surviving worker first takes the state of its furthest rank (the order of
:func:`progress`). Every outer group then sees the same positions, one per
surviving worker, and decides the same way
(:func:`zerofn.diloco.redundancy.sync_recovery`).

One rank per worker (every rank a worker) is the case of one outer group,
which is the whole job.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from zerofn.diloco.redundancy import SyncPosition

__all__ = ["WorkerLoss", "Workers", "after_loss", "progress"]


Grid = tuple[tuple[int, ...], ...]


def _as_grid(groups: Sequence[Sequence[int]]) -> Grid:
    return tuple(tuple(group) for group in groups)


def _grid(_: object, attribute: attrs.Attribute[Grid], value: Grid) -> None:
    if not value or not value[0]:
        raise ValueError(f"{attribute.name}: no ranks")
    sizes = {len(group) for group in value}
    if len(sizes) != 1:
        raise ValueError(
            f"the outer groups have different sizes {sorted(sizes)}: every worker needs one rank "
            "in each outer group (one per local index)"
        )
    ranks = [r for group in value for r in group]
    if len(set(ranks)) != len(ranks):
        raise ValueError(
            f"the outer groups {list(value)} share ranks: a rank belongs to one outer group"
        )


@attrs.frozen
class Workers:
    """The job's ranks, worker by worker.

    Attributes:
        outer: ``outer[l][k]``, the rank (in the job's default group) of
            worker ``k``'s ``l``-th rank: each row is one outer group, in
            its group order.
    """

    outer: Grid = attrs.field(converter=_as_grid, validator=_grid)

    @classmethod
    def from_outer_groups(cls, groups: Sequence[Sequence[int]]) -> Workers:
        """The workers of a job whose ranks each named their outer group
        (in its group order): the distinct groups, by their lowest rank.

        Raises:
            ValueError: groups of different sizes, or groups that share ranks.
        """
        distinct = sorted({tuple(g) for g in groups}, key=min)
        return cls(distinct)

    @property
    def count(self) -> int:
        """How many workers (the outer groups' size)."""
        return len(self.outer[0])

    @property
    def ranks_per_worker(self) -> int:
        """How many ranks each worker has (the number of outer groups)."""
        return len(self.outer)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, worker by worker: a rank's place here is its number
        in the job's roll call and heartbeats."""
        return tuple(group[k] for k in range(self.count) for group in self.outer)

    def place(self, rank: int) -> tuple[int, int]:
        """``(worker, local index)`` of ``rank``.

        Raises:
            ValueError: ``rank`` is no rank of these workers.
        """
        for local, group in enumerate(self.outer):
            if rank in group:
                return group.index(rank), local
        raise ValueError(f"rank {rank} is no rank of these workers ({self.ranks})")

    def inner(self, worker: int) -> tuple[int, ...]:
        """The ranks of ``worker``, by local index (its inner group)."""
        return tuple(group[worker] for group in self.outer)

    def together(self) -> tuple[tuple[int, ...], ...]:
        """For each worker, the places in :attr:`ranks` of its ranks: lost together."""
        size = self.ranks_per_worker
        return tuple(tuple(range(k * size, (k + 1) * size)) for k in range(self.count))

    def keeping(self, kept: Sequence[int]) -> Workers:
        """The workers ``kept`` (old indices, in order), renumbered from 0."""
        return Workers(tuple(tuple(group[k] for k in kept) for group in self.outer))


def progress(position: SyncPosition) -> tuple[int, int, bool, int]:
    """A key that orders a rank's positions as its step runs: the inner step
    taken, then the sync entered, then its sum held, then the step done."""
    return (
        position.steps + int(position.taken),
        position.sync,
        position.summed,
        position.steps,
    )


@attrs.frozen
class WorkerLoss:
    """What a loss leaves of the workers, as every survivor computes it.

    Attributes:
        lost: the workers gone (their index in the outer groups): each one
            with a rank that did not answer the roll call.
        kept: the workers that go on (old indices, in order).
        survivors: the workers that go on, renumbered from 0.
        sources: for each kept worker, the local index of its furthest rank,
            whose state its other ranks take.
        positions: for each kept worker, that rank's position.
    """

    lost: tuple[int, ...]
    kept: tuple[int, ...]
    survivors: Workers
    sources: tuple[int, ...]
    positions: tuple[SyncPosition, ...]


def after_loss(
    workers: Workers, alive: Sequence[int], positions: Sequence[SyncPosition]
) -> WorkerLoss:
    """What is left of ``workers`` when the ranks at places ``alive`` of
    :attr:`Workers.ranks` answered the roll call, at ``positions`` (in
    ``alive``'s order).

    Raises:
        ValueError: ``alive`` and ``positions`` differ in length, or fewer
            than 2 workers are left whole.
    """
    if len(alive) != len(positions):
        raise ValueError(f"{len(alive)} ranks answered but {len(positions)} positions were given")
    at = dict(zip(alive, positions, strict=True))
    groups = workers.together()
    kept = tuple(k for k, places in enumerate(groups) if all(p in at for p in places))
    lost = tuple(k for k in range(workers.count) if k not in kept)
    if len(kept) < 2:
        raise ValueError(
            f"only workers {list(kept)} are left whole: redundancy=2 needs 2 workers to go on"
        )
    sources, chosen = [], []
    for k in kept:
        mine = [at[p] for p in groups[k]]
        # The first of the furthest, so that every survivor picks the same one.
        local = max(range(len(mine)), key=lambda i: (progress(mine[i]), -i))
        sources.append(local)
        chosen.append(mine[local])
    return WorkerLoss(lost, kept, workers.keeping(kept), tuple(sources), tuple(chosen))
