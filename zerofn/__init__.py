"""zerofn: data-parallel training algorithms as pure functions over frozen records.

Nothing in this package talks to ``torch.distributed``; the adapter package
``zerofn_torch`` binds these functions to process groups, DDP and ``torch.optim``.
"""

from zerofn.overlap.ddp_buckets import BucketPlan, BucketShard, assign_buckets
from zerofn.zero.planning.layout import BufferLayout, Segment, Slot, buffer_layouts
from zerofn.zero.planning.partition import (
    FlatPartition,
    Partition,
    PartitionMode,
    Piece,
    balanced_partition,
    flat_partition,
    greedy_partition,
    manual_partition,
    rank_loads,
)
from zerofn.zero.shard_state import consolidate, shard

__all__ = [
    "BucketPlan",
    "BucketShard",
    "BufferLayout",
    "FlatPartition",
    "Partition",
    "PartitionMode",
    "Piece",
    "Segment",
    "Slot",
    "assign_buckets",
    "balanced_partition",
    "buffer_layouts",
    "consolidate",
    "flat_partition",
    "greedy_partition",
    "manual_partition",
    "rank_loads",
    "shard",
]
