"""Which rank owns which parameters: ZeRO's partition of optimizer state.

Every function here is a pure function of parameter sizes (element counts,
grouped as the optimizer's param groups are) and the world size. Parameters are
named by their *global index*: their position when the param groups are read
in order, which is also the index PyTorch's optimizer ``state_dict`` uses.

Two record types come out:

* :class:`Partition` assigns whole tensors to ranks (PyTorch's behaviour, and
  ``balanced``).
* :class:`FlatPartition` cuts the concatenation of all parameters into
  ``world_size`` contiguous ranges, splitting tensors at the seams, so every
  rank holds within one element of ``total / world_size``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs
import torch

__all__ = [
    "FlatPartition",
    "Partition",
    "PartitionMode",
    "Piece",
    "balanced_partition",
    "flat_partition",
    "greedy_partition",
    "manual_partition",
    "rank_loads",
]

PartitionMode = Literal["greedy", "balanced", "flat"]

GroupSizes = tuple[tuple[int, ...], ...]
Assignment = tuple[tuple[tuple[int, ...], ...], ...]


def _freeze_group_sizes(group_sizes: Sequence[Sequence[int]]) -> GroupSizes:
    frozen = tuple(tuple(int(n) for n in group) for group in group_sizes)
    for g, group in enumerate(frozen):
        for i, n in enumerate(group):
            if n < 0:
                raise ValueError(f"param group {g}, parameter {i}: size {n} is negative")
    return frozen


def _assignment(ranks: Iterable[Iterable[Iterable[int]]]) -> Assignment:
    return tuple(tuple(tuple(group) for group in rank) for rank in ranks)


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def _group_offsets(group_sizes: GroupSizes) -> tuple[int, ...]:
    """Global index of the first parameter of each group, then the parameter count."""
    return tuple(itertools.accumulate((len(g) for g in group_sizes), initial=0))


@attrs.frozen
class Partition:
    """Whole-tensor assignment of parameters to ranks.

    Attributes:
        world_size: number of ranks.
        group_sizes: element count of every parameter, per param group.
        assignment: ``assignment[rank][group]`` is the tuple of global indices
            that ``rank`` updates from ``group``, in the order the rank's local
            optimizer sees them.
        owners: ``owners[i]`` is the rank owning global parameter ``i``, or
            ``-1`` for a parameter nobody updates (allowed only in a manual
            partition, for frozen parameters). Derived at construction.

    Raises:
        ValueError: at construction, if a parameter is assigned twice, an index
            is out of range, a parameter sits in the wrong group, or the shape
            of ``assignment`` does not match ``world_size`` and the groups.
    """

    world_size: int
    group_sizes: GroupSizes
    assignment: Assignment = attrs.field(converter=_assignment)
    owners: tuple[int, ...] = attrs.field(init=False)

    @owners.default
    def _derive_owners(self) -> tuple[int, ...]:
        _check_world_size(self.world_size)
        if len(self.assignment) != self.world_size:
            raise ValueError(
                f"assignment has {len(self.assignment)} ranks, "
                f"expected world_size={self.world_size}"
            )
        offsets = _group_offsets(self.group_sizes)
        owners = [-1] * offsets[-1]
        for rank, groups in enumerate(self.assignment):
            if len(groups) != len(self.group_sizes):
                raise ValueError(
                    f"rank {rank} lists {len(groups)} param groups, "
                    f"expected {len(self.group_sizes)}"
                )
            for g, indices in enumerate(groups):
                lo, hi = offsets[g], offsets[g + 1]
                for index in indices:
                    if not lo <= index < hi:
                        raise ValueError(
                            f"parameter {index} assigned to rank {rank} in group {g}, "
                            f"but group {g} holds global indices {lo}..{hi - 1}"
                        )
                    if owners[index] != -1:
                        raise ValueError(
                            f"parameter {index} is assigned to both rank {owners[index]} "
                            f"and rank {rank}; each parameter needs exactly one owner"
                        )
                    owners[index] = rank
        return tuple(owners)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Element count of every parameter, by global index."""
        return tuple(n for group in self.group_sizes for n in group)

    def params_of(self, rank: int) -> tuple[int, ...]:
        """Global indices owned by ``rank``, in its local optimizer's order."""
        return tuple(i for group in self.assignment[rank] for i in group)

    def loads(self) -> tuple[int, ...]:
        """Total elements owned by each rank."""
        sizes = self.sizes
        return tuple(sum(sizes[i] for i in self.params_of(r)) for r in range(self.world_size))

    def pieces_of(self, rank: int) -> tuple[Piece, ...]:
        """The rank's parameters as whole-tensor :class:`Piece` s, in local order."""
        sizes = self.sizes
        return tuple(Piece(i, 0, sizes[i]) for i in self.params_of(rank))

    def local_tensors(self, rank: int) -> tuple[tuple[Piece, ...], ...]:
        """What each tensor of ``rank``'s local state dict holds: one whole
        parameter each, in local order."""
        return tuple((piece,) for piece in self.pieces_of(rank))


@attrs.frozen
class Piece:
    """Elements ``[start, stop)`` of the flattened global parameter ``param``."""

    param: int
    start: int
    stop: int = attrs.field()

    @stop.validator
    def _check(self, _attribute: object, stop: int) -> None:
        if not 0 <= self.start <= stop:
            raise ValueError(f"piece of parameter {self.param}: need 0 <= start <= stop")

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.stop - self.start


@attrs.frozen
class FlatPartition:
    """Element-range assignment: rank ``r`` owns ``[bounds[r], bounds[r+1])`` of
    the concatenation of all parameters (global order).

    Attributes:
        world_size: number of ranks.
        group_sizes: element count of every parameter, per param group.
        bounds: ``world_size + 1`` non-decreasing element offsets, from 0 to
            the total element count.
    """

    world_size: int
    group_sizes: GroupSizes
    bounds: tuple[int, ...] = attrs.field()

    @bounds.validator
    def _check_bounds(self, _attribute: object, bounds: tuple[int, ...]) -> None:
        _check_world_size(self.world_size)
        total = sum(sum(g) for g in self.group_sizes)
        if len(bounds) != self.world_size + 1 or bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"bounds must run from 0 to {total} in {self.world_size + 1} steps")
        if any(a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError("bounds must be non-decreasing")

    @property
    def sizes(self) -> tuple[int, ...]:
        """Element count of every parameter, by global index."""
        return tuple(n for group in self.group_sizes for n in group)

    def loads(self) -> tuple[int, ...]:
        """Total elements owned by each rank."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))

    def pieces_of(self, rank: int) -> tuple[Piece, ...]:
        """The parts of parameters that ``rank`` owns, in global order."""
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        pieces = []
        start = 0
        for index, n in enumerate(self.sizes):
            stop = start + n
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                pieces.append(Piece(index, a - start, b - start))
            start = stop
        return tuple(pieces)

    def group_pieces_of(self, rank: int) -> tuple[tuple[Piece, ...], ...]:
        """:meth:`pieces_of` split by param group (a group may get no piece)."""
        offsets = _group_offsets(self.group_sizes)
        pieces = self.pieces_of(rank)
        return tuple(
            tuple(p for p in pieces if offsets[g] <= p.param < offsets[g + 1])
            for g in range(len(self.group_sizes))
        )

    def local_tensors(self, rank: int) -> tuple[tuple[Piece, ...], ...]:
        """What each tensor of ``rank``'s local state dict holds: one per param
        group, its pieces back to back (a group may hold none)."""
        return self.group_pieces_of(rank)


def greedy_partition(group_sizes: Sequence[Sequence[int]], world_size: int) -> Partition:
    """PyTorch's sorted-greedy partition, tie for tie.

    Group by group, parameters are taken largest first (equal sizes keep their
    order) and each goes to the rank with the smallest load so far (lowest rank
    on ties). Loads carry over from one group to the next.

    Args:
        group_sizes: element count of every parameter, per param group.
        world_size: number of ranks.

    Returns:
        The :class:`Partition`.

    Raises:
        ValueError: for a non-positive world size or a negative size.
    """
    frozen = _freeze_group_sizes(group_sizes)
    _check_world_size(world_size)
    offsets = _group_offsets(frozen)
    # A heap of (load, rank) pops the least-loaded rank, lowest rank on ties.
    heap = [(0, rank) for rank in range(world_size)]
    assignment: list[list[list[int]]] = [[[] for _ in frozen] for _ in range(world_size)]
    for g, group in enumerate(frozen):
        for local, size in zip(*_largest_first(group), strict=True):
            load, rank = heap[0]
            assignment[rank][g].append(offsets[g] + local)
            heapq.heapreplace(heap, (load + size, rank))
    return Partition(world_size, frozen, assignment)


def manual_partition(
    group_sizes: Sequence[Sequence[int]],
    world_size: int,
    params_per_rank: Sequence[Sequence[int]],
) -> Partition:
    """A partition given by hand, as PyTorch's ``params_per_rank``.

    Takes ``(group_sizes, world_size, ...)`` like every other partition
    function.

    Args:
        group_sizes: element count of every parameter; exactly one group.
        world_size: number of ranks.
        params_per_rank: for each rank, the global indices it updates. A
            parameter may be left out (a frozen one) but not listed twice.

    Returns:
        The :class:`Partition`, each rank keeping the order it was given.

    Raises:
        RuntimeError: if there is more than one param group (as PyTorch).
        ValueError: if ``params_per_rank`` does not have ``world_size`` entries,
            names an unknown parameter, or names one twice.
    """
    frozen = _freeze_group_sizes(group_sizes)
    _check_world_size(world_size)
    if len(frozen) != 1:
        raise RuntimeError(
            f"a manual params_per_rank supports a single param group, got {len(frozen)}; "
            "merge the groups or use an automatic partition"
        )
    if len(params_per_rank) != world_size:
        raise ValueError(
            f"params_per_rank has {len(params_per_rank)} entries; it needs one per rank "
            f"(world_size={world_size})"
        )
    num_params = len(frozen[0])
    for rank, indices in enumerate(params_per_rank):
        for index in indices:
            if not 0 <= index < num_params:
                raise ValueError(
                    f"params_per_rank[{rank}] names parameter {index}, which was not "
                    "passed to the optimizer"
                )
    return Partition(world_size, frozen, [[ix] for ix in params_per_rank])


def _largest_first(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """The indices of ``sizes`` largest first (equal sizes in index order,
    as ``sorted(..., reverse=True)`` keeps them), and the sizes in that order.

    Sorted by torch and handed back as two lists built in the order the
    greedy loops read them: a Python sort of indices by size leaves each
    loop reading ``sizes[i]`` at random places, and once a model's list
    outgrows the CPU caches (~100k parameters) those reads double the cost
    per parameter; this way 10x the parameters cost ~11x the time.
    """
    values = torch.tensor(sizes, dtype=torch.int64)
    order = torch.sort(values, descending=True, stable=True).indices
    indices: list[int] = order.tolist()
    ordered: list[int] = values[order].tolist()
    return indices, ordered


def _improve(sizes: Sequence[int], owners: Sequence[int], world_size: int) -> tuple[int, list[int]]:
    """Local search: move or swap one parameter off the heaviest rank while that
    strictly lowers the heaviest load. Never returns a worse assignment."""
    owners = list(owners)
    loads = [0] * world_size
    members: list[set[int]] = [set() for _ in range(world_size)]
    for i, r in enumerate(owners):
        loads[r] += sizes[i]
        members[r].add(i)
    # Each accepted move strictly lowers (max load, number of ranks at max),
    # so the loop ends; the cap keeps the worst case cheap on huge models.
    for _ in range(4 * world_size + 16):
        heavy = max(range(world_size), key=lambda r: loads[r])
        light = min(range(world_size), key=lambda r: loads[r])
        gap = loads[heavy] - loads[light]
        if gap <= 1:
            break
        # A move of size s from heavy to light helps when 0 < s < gap.
        movable = [i for i in members[heavy] if 0 < sizes[i] < gap]
        if movable:
            a = min(movable, key=lambda i: (abs(gap - 2 * sizes[i]), i))
            b = -1
        else:
            swap = _best_swap(sizes, members[heavy], members[light], gap)
            if swap is None:
                break
            a, b = swap
        owners[a] = light
        members[heavy].discard(a)
        members[light].add(a)
        delta = sizes[a]
        if b >= 0:
            owners[b] = heavy
            members[light].discard(b)
            members[heavy].add(b)
            delta -= sizes[b]
        loads[heavy] -= delta
        loads[light] += delta
    return max(loads), owners


def _best_swap(
    sizes: Sequence[int], on_heavy: Iterable[int], on_light: Iterable[int], gap: int
) -> tuple[int, int] | None:
    """The swap (a from heavy, b from light) with 0 < size(a) - size(b) < gap
    closest to gap / 2, searched by a two-pointer walk over sorted sizes."""
    heavy_sorted = sorted(on_heavy, key=lambda i: (sizes[i], i))
    light_sorted = sorted(on_light, key=lambda i: (sizes[i], i))
    best: tuple[int, int] | None = None
    best_score = gap
    j = 0
    for a in heavy_sorted:
        # Advance to the largest light size below sizes[a] - gap / 2.
        while j + 1 < len(light_sorted) and 2 * (sizes[a] - sizes[light_sorted[j + 1]]) >= gap:
            j += 1
        for k in (j, j + 1):
            if 0 <= k < len(light_sorted):
                b = light_sorted[k]
                delta = sizes[a] - sizes[b]
                if 0 < delta < gap and abs(gap - 2 * delta) < best_score:
                    best, best_score = (a, b), abs(gap - 2 * delta)
    return best


def balanced_partition(group_sizes: Sequence[Sequence[int]], world_size: int) -> Partition:
    """Whole-tensor partition whose heaviest rank is never heavier than greedy's.

    Starts from the better of PyTorch's per-group greedy and a greedy over all
    groups at once, then moves or swaps parameters off the heaviest rank while
    that lowers it. When nothing beats greedy, greedy's partition is returned
    as is; otherwise each rank lists its parameters in global order.

    Args:
        group_sizes: element count of every parameter, per param group.
        world_size: number of ranks.

    Returns:
        The :class:`Partition`; ``max(loads)`` <= greedy's.

    Raises:
        ValueError: for a non-positive world size or a negative size.
    """
    greedy = greedy_partition(group_sizes, world_size)
    sizes = greedy.sizes
    # Greedy over all groups at once is greedy over one group of every size.
    starts = (greedy.owners, greedy_partition([sizes], world_size).owners)
    heaviest, best = min((_improve(sizes, s, world_size) for s in starts), key=lambda c: c[0])
    if heaviest >= max(greedy.loads()):
        return greedy
    offsets = _group_offsets(greedy.group_sizes)
    assignment: list[list[list[int]]] = [
        [[] for _ in greedy.group_sizes] for _ in range(world_size)
    ]
    for g in range(len(greedy.group_sizes)):
        for index in range(offsets[g], offsets[g + 1]):
            assignment[best[index]][g].append(index)
    return Partition(world_size, greedy.group_sizes, assignment)


def flat_partition(group_sizes: Sequence[Sequence[int]], world_size: int) -> FlatPartition:
    """Cut the concatenated parameters into ``world_size`` near-equal ranges.

    Rank ``r`` owns elements ``[r * total // world_size, (r + 1) * total //
    world_size)``, so every rank holds ``floor`` or ``ceil`` of
    ``total / world_size``. Correct only for element-wise optimizers. Its
    arguments and errors are :func:`greedy_partition`'s.
    """
    frozen = _freeze_group_sizes(group_sizes)
    _check_world_size(world_size)
    total = sum(sum(g) for g in frozen)
    bounds = tuple(r * total // world_size for r in range(world_size + 1))
    return FlatPartition(world_size=world_size, group_sizes=frozen, bounds=bounds)


def rank_loads(partition: Partition | FlatPartition) -> tuple[int, ...]:
    """Total elements each rank owns: the optimizer-state footprint per rank."""
    return partition.loads()
