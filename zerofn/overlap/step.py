"""The overlapped ZeRO step's communication, as programs over a fixed bucket plan.

Once the overlap's :class:`~zerofn.overlap.ddp_buckets.BucketPlan` is fixed (see
:mod:`zerofn.overlap`), each DDP bucket is split into shards, each owned by
one rank. Per bucket:

1. :func:`reduce_to_owners` averages the bucket's gradients onto each shard's
   owner (one :class:`~zerofn.comm.Reduce` per shard) instead of all-reducing
   them: an owner needs its shard's average, nobody else needs it;
2. the hook steps the gradients of the shards this rank owns
   (:func:`zerofn.overlap.hook.gradients_to_step`);
3. after the owners' local step, :func:`broadcast_from_owners` sends each
   shard's updated parameters from its owner to every rank (one
   :class:`~zerofn.comm.Broadcast` per shard), or, with a compressed
   exchange, :func:`broadcast_differences_from_owners` sends each shard's
   block-quantized difference from the replica, which every rank, the owner
   included, adds (see :mod:`zerofn.zero.compressed.exchange`).

Reduce plus broadcast move the bytes of one all-reduce, where all-reduce plus
a ZeRO exchange would move one and a half. Ownership is decided here, once;
whoever drives these programs (the adapter's hook, or the simulated world)
only follows it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Broadcast, Program, Reduce
from zerofn.overlap.ddp_buckets import BucketPlan, BucketShard
from zerofn.overlap.state import shard_element_range

__all__ = [
    "broadcast_differences_from_owners",
    "broadcast_from_owners",
    "reduce_to_owners",
    "shards_of_bucket",
]


def shards_of_bucket(plan: BucketPlan, bucket: int) -> tuple[BucketShard, ...]:
    """The shards of DDP bucket ``bucket``, in parameter order."""
    return tuple(sorted((s for s in plan.shards if s.bucket == bucket), key=lambda s: s.offset))


def reduce_to_owners(
    plan: BucketPlan, bucket: int, grad: torch.Tensor, world_size: int
) -> Program[torch.Tensor]:
    """Average bucket ``bucket``'s flat gradient onto the owner of each shard.

    Args:
        plan: the fixed bucket plan.
        bucket: the DDP bucket's index.
        grad: this rank's flat bucket gradient; handed over: divided by
            ``world_size`` and reduced in place.
        world_size: number of ranks.

    Returns:
        A program returning ``grad``: on each shard's owner, that shard's
        elements are the average over ranks; other elements are unspecified.
    """
    grad.div_(world_size)
    shards = shards_of_bucket(plan, bucket)
    for k, shard in enumerate(shards):
        start, stop = shard_element_range(plan, shard)
        part = grad[start:stop]
        # Reduced in place onto the owner (handed over).
        yield Reduce(part, dst=shard.rank, last=k == len(shards) - 1)
    return grad


def broadcast_from_owners(
    plan: BucketPlan, rank: int, bucket: int, params: Sequence[torch.Tensor]
) -> Program[list[tuple[BucketShard, torch.Tensor]]]:
    """Send every shard of bucket ``bucket`` from its owner to every rank.

    Args:
        plan: the fixed bucket plan.
        rank: this rank.
        bucket: the DDP bucket's index.
        params: the bucket's parameters, in bucket order (read, not written:
            the owner's updated values are copied into the message).

    Returns:
        A program returning what this rank must write into its parameters:
        for every shard another rank owns, the shard and its parameters'
        updated values as one flat tensor.
    """
    shards = shards_of_bucket(plan, bucket)
    received = []
    for k, shard in enumerate(shards):
        owned = params[shard.offset : shard.offset + shard.count]
        if shard.rank == rank:
            flat = torch.cat([p.detach().reshape(-1) for p in owned])
        else:
            flat = torch.empty(shard.numel, dtype=owned[0].dtype, device=owned[0].device)
        # Received in place by the other ranks (handed over).
        yield Broadcast(flat, src=shard.rank, last=k == len(shards) - 1)
        if shard.rank != rank:
            received.append((shard, flat))
    return received


def broadcast_differences_from_owners(
    plan: BucketPlan,
    rank: int,
    bucket: int,
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor | None],
    quantizer: BlockQuantizer,
) -> Program[list[tuple[BucketShard, torch.Tensor]]]:
    """Send every shard of bucket ``bucket`` as its owner's quantized
    ``master - replica``.

    Args:
        plan: the fixed bucket plan.
        rank: this rank.
        bucket: the DDP bucket's index.
        params: the bucket's parameters (the replica), in bucket order (read,
            not written: :func:`zerofn.overlap.orders.write_updates` adds the
            differences at the iteration's end).
        masters: the exact values of the bucket's parameters this rank owns,
            in bucket order (``None`` where another rank owns it).
        quantizer: how differences are coded.

    Returns:
        A program returning, for every shard of the bucket (this rank's too),
        the shard and its decoded difference as one flat ``float32`` tensor.

    Raises:
        ValueError: this rank owns a shard it holds no masters for.
    """
    shards = shards_of_bucket(plan, bucket)
    decoded = []
    for k, shard in enumerate(shards):
        owned = params[shard.offset : shard.offset + shard.count]
        payload = torch.empty(
            quantizer.payload_nbytes(shard.numel), dtype=torch.uint8, device=owned[0].device
        )
        if shard.rank == rank:
            exact = masters[shard.offset : shard.offset + shard.count]
            if any(m is None for m in exact):
                raise ValueError(f"rank {rank} owns a shard of bucket {bucket} without its masters")
            difference = torch.cat([m.detach().reshape(-1) for m in exact if m is not None])
            difference.sub_(torch.cat([p.detach().reshape(-1) for p in owned]))
            quantizer.encode(difference, payload)
        # Received in place by the other ranks (handed over).
        yield Broadcast(payload, src=shard.rank, last=k == len(shards) - 1)
        decoded.append((shard, quantizer.decode(payload, shard.numel)))
    return decoded
