"""Which rank updates which part of each DDP gradient bucket.

When the ZeRO step overlaps DDP's backward, each DDP bucket (or a run of
parameters inside it) is owned by one rank, which steps those parameters as
soon as the bucket's gradients arrive. This module computes that assignment
from the buckets' parameter sizes alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["BucketPlan", "BucketShard", "assign_buckets"]


@attrs.frozen
class BucketShard:
    """Parameters ``[offset, offset + count)`` of DDP bucket ``bucket``, owned by ``rank``.

    Attributes:
        bucket: DDP bucket index.
        rank: owning rank.
        offset: index of the first parameter within the bucket.
        count: number of consecutive parameters.
        numel: their total element count.
    """

    bucket: int
    rank: int
    offset: int
    count: int
    numel: int


@attrs.frozen
class BucketPlan:
    """The assignment of every DDP bucket's parameters to ranks.

    Attributes:
        world_size: number of ranks.
        bucket_sizes: element count of each parameter, per bucket.
        shards: every :class:`BucketShard`, in the order they were assigned;
            together they cover every parameter of every bucket exactly once.
    """

    world_size: int
    bucket_sizes: tuple[tuple[int, ...], ...]
    shards: tuple[BucketShard, ...]

    def shards_of(self, rank: int) -> tuple[BucketShard, ...]:
        """The shards ``rank`` owns, in assignment order."""
        return tuple(s for s in self.shards if s.rank == rank)

    def ranks_of(self, bucket: int) -> tuple[int, ...]:
        """The ranks owning part of ``bucket``, in parameter order."""
        return tuple(
            s.rank for s in sorted(self.shards, key=lambda s: s.offset) if s.bucket == bucket
        )

    def local_offsets(self, rank: int) -> dict[int, int]:
        """For each bucket ``rank`` owns part of: the index, in the rank's
        parameter list (its shards' parameters concatenated), of that part's
        first parameter."""
        offsets: dict[int, int] = {}
        position = 0
        for shard in self.shards_of(rank):
            offsets[shard.bucket] = position
            position += shard.count
        return offsets

    def loads(self) -> tuple[int, ...]:
        """Elements owned by each rank."""
        loads = [0] * self.world_size
        for shard in self.shards:
            loads[shard.rank] += shard.numel
        return tuple(loads)


def _least_loaded(loads: Sequence[int], excluded: set[int]) -> int:
    candidates = [r for r in range(len(loads)) if r not in excluded]
    return min(candidates, key=lambda r: (loads[r], r))


def assign_buckets(
    bucket_sizes: Sequence[Sequence[int]], world_size: int, shard_buckets: bool = False
) -> BucketPlan:
    """Assign DDP buckets to ranks as PyTorch's overlap hooks do.

    Without ``shard_buckets``, bucket ``i`` belongs wholly to rank
    ``i % world_size``. With it, buckets are visited smallest first and cut
    into runs of consecutive parameters: a run closes before the parameter
    that would bring it to ``total / world_size`` elements, and goes to the
    least-loaded rank not already holding part of that bucket. Unlike
    PyTorch, a bucket is never cut into more runs than there are ranks (where
    PyTorch would fail, the last rank takes the rest of the bucket).

    Args:
        bucket_sizes: element count of every parameter, per DDP bucket.
        world_size: number of ranks.
        shard_buckets: whether a bucket may be split across ranks.

    Returns:
        The :class:`BucketPlan`.

    Raises:
        ValueError: for a non-positive world size, an empty bucket or a
            negative size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    sizes = tuple(tuple(int(n) for n in bucket) for bucket in bucket_sizes)
    for b, bucket in enumerate(sizes):
        if not bucket:
            raise ValueError(f"DDP bucket {b} holds no parameters")
        if any(n < 0 for n in bucket):
            raise ValueError(f"DDP bucket {b} has a negative parameter size")
    if not shard_buckets:
        shards = tuple(
            BucketShard(b, b % world_size, 0, len(bucket), sum(bucket))
            for b, bucket in enumerate(sizes)
        )
        return BucketPlan(world_size, sizes, shards)
    return BucketPlan(world_size, sizes, _cut_buckets(sizes, world_size))


def _cut_buckets(sizes: tuple[tuple[int, ...], ...], world_size: int) -> tuple[BucketShard, ...]:
    """The runs of :func:`assign_buckets` with ``shard_buckets``, smallest bucket first."""
    threshold = sum(sum(bucket) for bucket in sizes) / world_size
    loads = [0] * world_size
    out: list[BucketShard] = []
    for b in sorted(range(len(sizes)), key=lambda b: sum(sizes[b])):
        bucket = sizes[b]
        taken: set[int] = set()
        start = 0
        run = 0
        for i, n in enumerate(bucket):
            can_cut = i > start and len(taken) < world_size - 1
            if can_cut and run + n >= threshold:
                rank = _least_loaded(loads, taken)
                out.append(BucketShard(b, rank, start, i - start, run))
                taken.add(rank)
                loads[rank] += run
                start, run = i, 0
            run += n
        rank = _least_loaded(loads, taken)
        out.append(BucketShard(b, rank, start, len(bucket) - start, run))
        loads[rank] += run
    return tuple(out)
