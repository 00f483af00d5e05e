"""Every ZeRO shard kept on two ranks, and the plan when the world changes.

With ``redundancy=2`` each rank's shard lives on it and on its carrier (the
next rank, round), which steps a copy beside its own shard
(:mod:`zerofn.zero.elastic.carried`). When ranks are lost, :func:`plan_after_loss`
is the whole decision, a pure function of the old plan and the lost ranks:
each survivor keeps what it owned, each lost shard goes to a survivor next to
it, and the new carriers (ring order among the survivors) get copies of what
they do not hold yet (:class:`Move`), the fewest the ring allows. When ranks
join, :func:`plan_after_join` gives them their shares and the copies that
give them their shards and restore the ring.

Under a whole-tensor partition (greedy, balanced, manual) a lost shard goes
to its carrier, which holds it. Under a flat one each rank owns one element
range, in rank order, so a lost range joins a neighbour's: its carrier's (the
next rank, whose range it precedes), except the last rank's, which joins its
predecessor's, the one neighbour it has; that predecessor is then sent the
range's state and its updated values by the carrier (rank 0). A join cuts
the flat space evenly again and moves what each range's new owner and
carrier lack.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from zerofn.zero.elastic.carried import (
    CarriedShard,
    carried_owner,
    carried_shard,
    carrier_of,
    reseed_carried,
    step_carried,
    write_carried_grads,
)
from zerofn.zero.planning.partition import FlatPartition, Partition, Piece, flat_partition
from zerofn.zero.planning.plan import ShardPlan

__all__ = [
    "CarriedShard",
    "Move",
    "Regrouping",
    "carried_owner",
    "carried_shard",
    "carrier_of",
    "check_redundancy",
    "plan_after_join",
    "plan_after_loss",
    "reseed_carried",
    "step_carried",
    "write_carried_grads",
]


def check_redundancy(redundancy: int, world_size: int) -> None:
    """Refuse a ``redundancy`` the optimizer cannot keep, before anything is built.

    Raises:
        ValueError: ``redundancy`` other than 1 or 2; 2 with one rank.
    """
    if redundancy not in (1, 2):
        raise ValueError(f"redundancy must be 1 (every shard on its owner) or 2, got {redundancy}")
    if redundancy == 2 and world_size < 2:
        raise ValueError(
            "redundancy=2 is not available here: one rank has no other rank to carry its shard"
        )


@attrs.frozen
class Move:
    """A copy of optimizer state one rank sends another when the world
    changes: the state of ``pieces``, from a rank that holds it to the rank
    that needs it (its new owner, a joiner, or its new carrier; ranks of the
    new world).

    Attributes:
        pieces: the parameters (whole, under a whole-tensor partition) or
            element ranges (flat) whose optimizer state travels.
        source: the sending rank (new group).
        target: the receiving rank (new group).
        values: the parameters' values for ``pieces`` travel too: the target
            becomes their owner without holding their last update (a lost
            last rank's range, under a flat partition).
    """

    pieces: tuple[Piece, ...]
    source: int
    target: int
    values: bool = False


@attrs.frozen
class Regrouping:
    """A world that changes its ranks: who is who, the plan, and the copies
    to send.

    Attributes:
        old_ranks: per new rank, the old rank it was (``None``: a joiner);
            after a loss, the survivors in order.
        plan: the new world's plan (mode ``"manual"``, or ``"flat"``): after
            a loss each survivor keeps what it owned and each lost shard goes
            to a survivor next to it; after a join the joiners take their
            shares.
        moves: the copies of optimizer state that restore redundancy (and,
            after a join, give the joiners their shards).
    """

    old_ranks: tuple[int | None, ...]
    plan: ShardPlan
    moves: tuple[Move, ...]

    @property
    def survivors(self) -> tuple[int, ...]:
        """The old ranks still there, in their new order."""
        return tuple(r for r in self.old_ranks if r is not None)

    def new_rank(self, old_rank: int) -> int:
        """``old_rank``'s rank in the new group.

        Raises:
            ValueError: ``old_rank`` was lost.
        """
        if old_rank not in self.old_ranks:
            raise ValueError(f"rank {old_rank} was lost; it has no rank in the new group")
        return self.old_ranks.index(old_rank)


def _whole_params(partition: Partition, indices: Iterable[int]) -> tuple[Piece, ...]:
    sizes = partition.sizes
    return tuple(Piece(i, 0, sizes[i]) for i in indices)


def _check_loss(world: int, lost: Iterable[int]) -> tuple[list[int], tuple[int, ...]]:
    """The lost ranks (sorted) and the survivors, or a refusal."""
    gone = sorted(set(lost))
    if any(not 0 <= r < world for r in gone):
        raise ValueError(f"lost ranks {gone} are not all ranks of a world of {world}")
    for r in gone:
        if carrier_of(r, world) in gone:
            raise ValueError(
                f"rank {r} and its carrier {carrier_of(r, world)} are both lost: no copy of "
                f"rank {r}'s shard is left; restart from a checkpoint"
            )
    survivors = tuple(r for r in range(world) if r not in gone)
    if len(survivors) < 2:
        raise ValueError(f"only rank {survivors} survives: redundancy=2 needs 2 ranks to go on")
    return gone, survivors


def plan_after_loss(plan: ShardPlan, lost: Iterable[int]) -> Regrouping:
    """The plan, and the copies to send, after the ranks ``lost`` are gone.

    Args:
        plan: the plan every survivor trained under (``redundancy=2``).
        lost: the old ranks that are gone.

    Returns:
        The :class:`Regrouping`: survivors keep their shards, a lost rank's
        shard goes to its carrier (under a flat partition the last rank's
        goes to its predecessor, with its values), and each new owner's
        whole shard reaches its new carrier: a move for each part the
        carrier does not already hold (what it owned or carried before).

    Raises:
        ValueError: a lost rank's carrier is lost too (its state exists
            nowhere: restart from a checkpoint), fewer than two survivors
            (no redundancy to keep), or a rank outside the world. Nobody
            lost (a transient failure) gives the same world again: the same
            owners and carriers, no moves.
    """
    if isinstance(plan.partition, FlatPartition):
        return _flat_after_loss(plan, plan.partition, lost)
    partition = plan.partition
    world = partition.world_size
    gone, survivors = _check_loss(world, lost)
    # Old shards each new rank owns: its own, and any lost one it carried.
    taken = [[old] + [r for r in gone if carrier_of(r, world) == old] for old in survivors]
    assignment = tuple(
        tuple(
            tuple(i for old in olds for i in partition.assignment[old][g])
            for g in range(len(partition.group_sizes))
        )
        for olds in taken
    )
    new_partition = Partition(len(survivors), partition.group_sizes, assignment)
    new_plan = ShardPlan("manual", new_partition, plan.keys, plan.trainable)
    moves = []
    for j, olds in enumerate(taken):
        target = carrier_of(j, len(survivors))
        held = {survivors[target], carried_owner(survivors[target], world)}
        missing = [i for old in olds if old not in held for i in partition.params_of(old)]
        if missing:
            moves.append(Move(_whole_params(partition, missing), j, target))
    return Regrouping(survivors, new_plan, tuple(moves))


def _give_joiner_params(
    assignment: list[list[list[int]]], sizes: Sequence[int], target: int, joiner: int
) -> None:
    """Move whole parameters from the heaviest ranks to ``joiner`` (in place)
    while one fits under ``target`` elements: the largest that fits, from
    the heaviest rank (the lowest of equals), so few move and the loads even out."""

    def load(rank: int) -> int:
        return sum(sizes[i] for group in assignment[rank] for i in group)

    while True:
        room = target - load(joiner)
        donors = sorted(range(joiner), key=lambda r: (-load(r), r))
        moved = False
        for donor in donors:
            fitting = [
                (sizes[i], -i, g, i)
                for g, group in enumerate(assignment[donor])
                for i in group
                if 0 < sizes[i] <= room and load(donor) - sizes[i] >= load(joiner) + sizes[i]
            ]
            if fitting:
                _, _, g, i = max(fitting)
                assignment[donor][g].remove(i)
                assignment[joiner][g].append(i)
                assignment[joiner][g].sort()
                moved = True
                break
        if not moved:
            return


def plan_after_join(plan: ShardPlan, joiners: int) -> Regrouping:
    """The plan, and the copies to send, once ``joiners`` new ranks join
    (as ranks ``world_size`` and up).

    Args:
        plan: the plan every running rank trains under (``redundancy=2``).
        joiners: how many ranks join.

    Returns:
        The :class:`Regrouping`: every running rank keeps its rank. Under a
        whole-tensor partition each joiner takes whole parameters from the
        heaviest ranks while one fits under the new average load (each move
        lightens a donor and never makes it lighter than the joiner); under
        a flat one the flat space is cut evenly again. Then every shard goes
        to its carrier under the new ring, where the carrier does not hold
        it already.

    Raises:
        ValueError: fewer than one joiner.
    """
    if joiners < 1:
        raise ValueError(f"plan_after_join needs at least one joiner, got {joiners}")
    old_ranks: tuple[int | None, ...] = (*range(plan.world_size), *([None] * joiners))
    if isinstance(plan.partition, FlatPartition):
        grown = flat_partition(plan.partition.group_sizes, plan.world_size + joiners)
        return _flat_regrouping(plan, plan.partition, old_ranks, grown.bounds, ())
    partition = plan.partition
    world = partition.world_size
    size = world + joiners
    empty: list[list[int]] = [[] for _ in partition.group_sizes]
    assignment = [[list(group) for group in ranks] for ranks in partition.assignment]
    assignment += [[list(g) for g in empty] for _ in range(joiners)]
    sizes = partition.sizes
    target = sum(sizes) // size
    for joiner in range(world, size):
        _give_joiner_params(assignment, sizes, target, joiner)
    frozen = tuple(tuple(tuple(g) for g in ranks) for ranks in assignment)
    new_plan = ShardPlan(
        "manual", Partition(size, partition.group_sizes, frozen), plan.keys, plan.trainable
    )
    held: list[set[int]] = [
        set(partition.params_of(r)) | set(partition.params_of(carried_owner(r, world)))
        for r in range(world)
    ] + [set() for _ in range(joiners)]
    moves = []
    for rank in range(size):
        owned = new_plan.partition.params_of(rank)  # type: ignore[union-attr]
        for target_rank in (rank, carrier_of(rank, size)):
            missing = [i for i in owned if i not in held[target_rank]]
            by_source: dict[int, list[int]] = {}
            for i in missing:  # from the old owner, who holds its state
                by_source.setdefault(partition.owners[i], []).append(i)
            moves += [
                Move(_whole_params(partition, indices), source, target_rank)
                for source, indices in sorted(by_source.items())
            ]
    return Regrouping(old_ranks, new_plan, tuple(moves))


# ----- flat partitions: element ranges ------------------------------------------------

Span = tuple[int, int]
"""Elements ``[lo, hi)`` of the flat space (all parameters, back to back)."""


def _flat_after_loss(plan: ShardPlan, partition: FlatPartition, lost: Iterable[int]) -> Regrouping:
    """:func:`plan_after_loss` under a flat partition: each lost range joins
    its carrier's (the next range), the last rank's its predecessor's."""
    world = partition.world_size
    gone, survivors = _check_loss(world, lost)
    # Dropping the bound between two ranges joins them.
    dropped = {r + 1 if r < world - 1 else r for r in gone}
    bounds = tuple(b for k, b in enumerate(partition.bounds) if k not in dropped)
    return _flat_regrouping(plan, partition, survivors, bounds, gone)


def _flat_regrouping(
    plan: ShardPlan,
    old: FlatPartition,
    old_ranks: Sequence[int | None],
    bounds: tuple[int, ...],
    gone: Sequence[int],
) -> Regrouping:
    """The regrouping to the flat plan of ``bounds`` (one range per new
    rank): each new rank is sent the state of what it now owns and carries
    and does not hold (its old range and the range it carried), from the
    old owner if it is there, else from that owner's carrier; a range whose
    owner changed to a rank that did not carry it travels with its values."""
    size, world = len(old_ranks), old.world_size
    new = FlatPartition(size, old.group_sizes, bounds)

    def span(part: FlatPartition, rank: int) -> Span:
        return part.bounds[rank], part.bounds[rank + 1]

    def held(old_rank: int | None) -> list[Span]:
        if old_rank is None:
            return []
        return [span(old, old_rank), span(old, carried_owner(old_rank, world))]

    def holder(old_owner: int) -> int:  # the new rank that sends old_owner's range
        source = old_owner if old_owner not in gone else carrier_of(old_owner, world)
        return list(old_ranks).index(source)

    moves = []
    for rank, was in enumerate(old_ranks):
        needs = [(span(new, rank), True), (span(new, carried_owner(rank, size)), False)]
        for needed, owns in needs:
            for lo, hi in _minus(needed, held(was)):
                for old_owner, a, b in _by_owner(old, lo, hi):
                    pieces = _pieces(old.sizes, a, b)
                    values = owns and old_owner in gone
                    moves.append(Move(pieces, holder(old_owner), rank, values))
    return Regrouping(
        tuple(old_ranks), ShardPlan("flat", new, plan.keys, plan.trainable), tuple(moves)
    )


def _minus(needed: Span, held: Sequence[Span]) -> list[Span]:
    """The parts of ``needed`` that no span of ``held`` covers, in order."""
    parts = [needed]
    for h_lo, h_hi in held:
        parts = [
            piece
            for lo, hi in parts
            for piece in ((lo, min(hi, h_lo)), (max(lo, h_hi), hi))
            if piece[0] < piece[1]
        ]
    return sorted(parts)


def _by_owner(partition: FlatPartition, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``[lo, hi)`` cut where the ranges of ``partition`` meet: (owner, lo, hi)."""
    out = []
    for rank in range(partition.world_size):
        a, b = max(lo, partition.bounds[rank]), min(hi, partition.bounds[rank + 1])
        if a < b:
            out.append((rank, a, b))
    return out


def _pieces(sizes: Sequence[int], lo: int, hi: int) -> tuple[Piece, ...]:
    """The pieces of parameters that elements ``[lo, hi)`` of the flat space are."""
    pieces, start = [], 0
    for index, n in enumerate(sizes):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            pieces.append(Piece(index, a - start, b - start))
        start += n
    return tuple(pieces)
