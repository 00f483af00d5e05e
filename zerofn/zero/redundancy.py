"""Every ZeRO shard kept on two ranks: who carries whose shard, the carried
copy a rank steps beside its own, and the plan after ranks are lost.

With ``redundancy=2`` rank ``r``'s shard (its optimizer state) lives on ``r``
and on its *carrier* ``(r + 1) % world_size``; so every rank carries exactly
one extra share, and never its own. The plain step already hands every rank
the whole averaged gradient (DDP's all-reduce), so the carrier steps its copy
from gradients it holds, with the owner's arithmetic on tensors of the
owner's shapes: the two copies stay bitwise equal and nothing extra is sent.
With master copies (``master_dtype``) the carried tensors are masters too,
kept from step to step as the owner keeps its own (a parameter's low
precision cannot restore them), and handed the same upcast, unscaled and
clipped gradients.

When ranks are lost, :func:`plan_after_loss` is the whole decision, a pure
function of the old plan and the lost ranks: each survivor keeps what it owned,
each lost shard goes to its carrier (which already holds its state), and the
new carriers (ring order among the survivors) get copies of what they do not
hold yet (:class:`Move`), the fewest the ring allows. When ranks join,
:func:`plan_after_join` gives them whole parameters from the heaviest ranks
and the copies that give them their shards and restore the ring.

Whole-tensor partitions (greedy, balanced, manual) only: a flat shard's
chunks are views of the owner's exchange buffer, which a carrier has no copy of.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from zerofn.zero.masters import Masters
from zerofn.zero.params import hyperparameters
from zerofn.zero.partition import FlatPartition, Partition
from zerofn.zero.plan import ShardPlan

__all__ = [
    "CarriedShard",
    "Move",
    "Regrouping",
    "carried_owner",
    "carried_shard",
    "carrier_of",
    "check_redundancy",
    "hand_carried_grads",
    "plan_after_join",
    "plan_after_loss",
    "reseed_carried",
    "step_carried",
]


def carrier_of(rank: int, world_size: int) -> int:
    """The rank that carries a copy of ``rank``'s shard: the next one, round.

    Raises:
        ValueError: a world of one rank (no other rank can carry anything).
    """
    if world_size < 2:
        raise ValueError(
            "redundancy=2 needs at least 2 ranks: a shard needs another rank to carry it"
        )
    return (rank + 1) % world_size


def carried_owner(rank: int, world_size: int) -> int:
    """The rank whose shard ``rank`` carries: the previous one, round."""
    if world_size < 2:
        raise ValueError(
            "redundancy=2 needs at least 2 ranks: a shard needs another rank to carry it"
        )
    return (rank - 1) % world_size


def check_redundancy(
    redundancy: int, world_size: int, partition: object, *, compressed: bool,
    overlap_with_ddp: bool,
) -> None:  # fmt: skip
    """Refuse a ``redundancy`` the optimizer cannot keep, before anything is built.

    Raises:
        ValueError: ``redundancy`` other than 1 or 2; 2 with one rank, with a
            flat partition, with a compressed exchange, or with
            ``overlap_with_ddp`` (the reduced gradients reach the owners
            only, so a carrier would need bytes sent to it too).
    """
    if redundancy not in (1, 2):
        raise ValueError(f"redundancy must be 1 (every shard on its owner) or 2, got {redundancy}")
    if redundancy == 1:
        return
    why = None
    if world_size < 2:
        why = "one rank has no other rank to carry its shard"
    elif partition == "flat":
        why = (
            "a flat shard's chunks are views of its owner's exchange buffer; "
            "use partition='greedy' or 'balanced'"
        )
    elif compressed:
        why = (
            "the compressed exchange sends differences, and a survivor that applied a lost "
            "owner's last one and a survivor that did not would go on from different replicas; "
            "use the exact exchange"
        )
    elif overlap_with_ddp:
        why = (
            "with overlap_with_ddp=True gradients are reduced to their owners only, so the "
            "carrier would need them sent too; use the plain step"
        )
    if why is not None:
        raise ValueError(f"redundancy=2 is not available here: {why}")


@attrs.frozen(eq=False)
class CarriedShard:
    """A copy of another rank's shard, stepped beside the owner's.

    Without master copies its tensors are the parameters' values, refreshed
    from the live parameters before each step (they are equal on every rank
    then). With them, its tensors are the owner's masters, kept here from
    step to step; ``masters`` pairs them with the parameters, for gradients
    going up and (when the owner is lost) values coming down.

    Attributes:
        owner: the rank whose shard this is.
        indices: the global indices of its parameters, in the owner's local order.
        optim: the carried optimizer, over one tensor per parameter; its
            state is the owner's, bit for bit.
        masters: the carried masters over the parameters (``None``: no masters).
    """

    owner: int
    indices: tuple[int, ...]
    optim: torch.optim.Optimizer
    masters: Masters | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The carried tensors, in the owner's local order."""
        return [t for g in self.optim.param_groups for t in g["params"]]


def carried_shard(
    plan: ShardPlan,
    rank: int,
    groups: Sequence[dict[str, Any]],
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    master_dtype: torch.dtype | None = None,
) -> CarriedShard:
    """The copy ``rank`` carries under ``plan``: the shard of
    :func:`carried_owner`, over fresh copies of its parameters (in
    ``master_dtype``, if given: the owner's masters as it makes them),
    grouped as the owner's local optimizer groups them (same options, same order)."""
    partition = _whole_tensor_partition(plan)
    owner = carried_owner(rank, partition.world_size)
    params = [p for g in groups for p in g["params"]]

    def copy(i: int) -> torch.Tensor:
        copied: torch.Tensor = params[i].detach().to(master_dtype or params[i].dtype, copy=True)
        return copied

    local_groups = [
        {**hyperparameters(g), "params": [copy(i) for i in indices]}
        for g, indices in zip(groups, partition.assignment[owner], strict=True)
    ]
    optim = optimizer_class(local_groups, **defaults)
    indices = partition.params_of(owner)
    masters = None
    if master_dtype is not None:
        copies = tuple(t for g in local_groups for t in g["params"])
        masters = Masters(tuple(params[i] for i in indices), copies, master_dtype)
    return CarriedShard(owner, indices, optim, masters)


def hand_carried_grads(
    carried: CarriedShard, params: Sequence[torch.Tensor], unscale: float = 1.0
) -> None:
    """Give the carried masters their parameters' gradients as the owner's
    masters get them (upcast, times ``unscale``; one that has a gradient
    keeps it). Without masters nothing is handed before the step."""
    if carried.masters is not None:
        carried.masters.hand_grads([params[i].grad for i in carried.indices], unscale)


def step_carried(carried: CarriedShard, params: Sequence[torch.Tensor]) -> None:
    """Step the carried copy as its owner steps its shard, with the same
    gradients: the parameters' (DDP's average, on every rank), or with
    masters the ones handed to them (:func:`hand_carried_grads`, clipped as
    the owner's were). Without masters its values are first set to the
    parameters' (equal on every rank before the step). A parameter without a
    gradient sits out, as it does on the owner."""
    if carried.masters is not None:
        hand_carried_grads(carried, params)
        carried.optim.step()
        carried.masters.drop_grads()
        return
    with torch.no_grad():
        for tensor, index in zip(carried.tensors(), carried.indices, strict=True):
            tensor.copy_(params[index])
            grad = params[index].grad
            tensor.grad = None if grad is None else grad.clone()
    carried.optim.step()
    for tensor in carried.tensors():
        tensor.grad = None


def reseed_carried(
    carried: CarriedShard, params: Sequence[torch.Tensor], *, keep_consistent: bool = False
) -> None:
    """Take the carried values from the parameters after a write from
    outside the step, as the owner re-derives its own (``keep_consistent``:
    see :meth:`~zerofn.zero.masters.Masters.reseed`)."""
    if carried.masters is not None:
        carried.masters.reseed(keep_consistent=keep_consistent)
        return
    with torch.no_grad():
        for tensor, index in zip(carried.tensors(), carried.indices, strict=True):
            tensor.copy_(params[index])


def _whole_tensor_partition(plan: ShardPlan) -> Partition:
    if isinstance(plan.partition, FlatPartition):
        raise ValueError("redundancy=2 needs a whole-tensor partition (greedy, balanced or manual)")
    return plan.partition


@attrs.frozen
class Move:
    """A copy of optimizer state one rank sends another when the world
    changes: the state of ``indices`` (global), from a rank that holds it to
    the rank that needs it (its new owner, a joiner, or its new carrier;
    ranks of the new world).

    Attributes:
        indices: the parameters whose optimizer state travels.
        source: the sending rank (new group).
        target: the receiving rank (new group).
    """

    indices: tuple[int, ...]
    source: int
    target: int


@attrs.frozen
class Regrouping:
    """A world that changes its ranks: who is who, the plan, and the copies
    to send.

    Attributes:
        old_ranks: per new rank, the old rank it was (``None``: a joiner);
            after a loss, the survivors in order.
        plan: the new world's plan (mode ``"manual"``): after a loss each
            survivor keeps what it owned and each lost shard goes to its
            carrier; after a join the joiners take parameters from the
            heaviest ranks.
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


def plan_after_loss(plan: ShardPlan, lost: Iterable[int]) -> Regrouping:
    """The plan, and the copies to send, after the ranks ``lost`` are gone.

    Args:
        plan: the plan every survivor trained under (``redundancy=2``).
        lost: the old ranks that are gone.

    Returns:
        The :class:`Regrouping`: survivors keep their shards, a lost rank's
        shard goes to its carrier, and each new owner's whole shard reaches
        its new carrier: a move for each part the carrier does not already
        hold (what it owned or carried before).

    Raises:
        ValueError: a lost rank's carrier is lost too (its state exists
            nowhere: restart from a checkpoint), fewer than two survivors
            (no redundancy to keep), or a rank outside the world. Nobody
            lost (a transient failure) gives the same world again: the same
            owners and carriers, no moves.
    """
    partition = _whole_tensor_partition(plan)
    world = partition.world_size
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
        missing = tuple(i for old in olds if old not in held for i in partition.params_of(old))
        if missing:
            moves.append(Move(missing, j, target))
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
        The :class:`Regrouping`: every running rank keeps its rank; each
        joiner takes whole parameters from the heaviest ranks while one fits
        under the new average load (each move lightens a donor and never
        makes it lighter than the joiner); then every shard goes to its
        carrier under the new ring, where the carrier does not hold it already.

    Raises:
        ValueError: fewer than one joiner.
    """
    partition = _whole_tensor_partition(plan)
    if joiners < 1:
        raise ValueError(f"plan_after_join needs at least one joiner, got {joiners}")
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
                Move(tuple(indices), source, target_rank)
                for source, indices in sorted(by_source.items())
            ]
    old_ranks: tuple[int | None, ...] = (*range(world), *([None] * joiners))
    return Regrouping(old_ranks, new_plan, tuple(moves))
