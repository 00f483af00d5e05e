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

With ``gather_during_forward=True`` the sends of the last bucket's order
travel behind the next forward instead: :func:`send_pieces` cuts every
shard into pieces of whole parameters, ordered by the forward's first use
(:func:`zerofn.zero.forward_gather.in_forward_order`), and
:func:`broadcast_in_forward_order` posts them all and writes each as it
arrives, so each module waits only for its own parameters.

Reduce plus broadcast move the bytes of one all-reduce, where all-reduce plus
a ZeRO exchange would move one and a half. Ownership is decided here, once;
whoever drives these programs (the adapter's hook, or the simulated world)
only follows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Broadcast, Collect, Post, Program, Reduce
from zerofn.overlap.ddp_buckets import BucketPlan, BucketShard
from zerofn.overlap.state import shard_element_range
from zerofn.zero.compressed.exchange import add_difference
from zerofn.zero.forward_gather import PIECE_NUMEL, ForwardGather, GatherPiece

__all__ = [
    "broadcast_differences_from_owners",
    "broadcast_from_owners",
    "broadcast_in_forward_order",
    "reduce_to_owners",
    "send_pieces",
    "shards_of_bucket",
    "write_flat",
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
            flat = _values(owned)
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
        exact = masters[shard.offset : shard.offset + shard.count] if shard.rank == rank else None
        payload = _difference_payload(quantizer, shard.numel, owned, exact, rank, bucket)
        # Received in place by the other ranks (handed over).
        yield Broadcast(payload, src=shard.rank, last=k == len(shards) - 1)
        decoded.append((shard, quantizer.decode(payload, shard.numel)))
    return decoded


def send_pieces(
    plan: BucketPlan,
    buckets: Sequence[int],
    indices: Mapping[int, Sequence[int]],
    piece_numel: int | None = PIECE_NUMEL,
) -> tuple[GatherPiece, ...]:
    """Every shard of ``buckets``, cut into pieces of whole parameters, in
    bucket, shard and parameter order.

    Args:
        plan: the fixed bucket plan.
        buckets: the buckets whose owners send.
        indices: per bucket, its parameters' global indices in bucket order.
        piece_numel: elements of one piece at most (a larger parameter
            travels alone); ``None``: whole shards, as a compressed send
            needs (its quantization blocks span the shard).

    Raises:
        ValueError: ``piece_numel`` below 1.
    """
    if piece_numel is not None and piece_numel < 1:
        raise ValueError(f"piece_numel must be at least 1, got {piece_numel}")
    pieces = []
    for bucket in buckets:
        sizes, names = plan.bucket_sizes[bucket], indices[bucket]
        for shard in shards_of_bucket(plan, bucket):
            start = shard_element_range(plan, shard)[0]
            run: list[int] = []
            numel = 0
            for position in range(shard.offset, shard.offset + shard.count):
                if run and piece_numel is not None and numel + sizes[position] > piece_numel:
                    pieces.append(GatherPiece(bucket, shard.rank, start, start + numel, tuple(run)))
                    start, run, numel = start + numel, [], 0
                run.append(names[position])
                numel += sizes[position]
            pieces.append(GatherPiece(bucket, shard.rank, start, start + numel, tuple(run)))
    return tuple(pieces)


def broadcast_in_forward_order(
    gather: ForwardGather,
    rank: int,
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor | None] | None = None,
    quantizer: BlockQuantizer | None = None,
) -> Program[None]:
    """Send every piece of ``gather`` from its owner, all posted at once,
    and write each into ``params`` as it arrives, in ``gather``'s order.

    Args:
        gather: the pieces (:func:`send_pieces`), in the order they travel.
        rank: this rank.
        params: every parameter, by global index; handed over: the other
            owners' pieces are written in place when collected (read on
            the owner when the program starts).
        masters: with ``quantizer``, per global parameter this rank's exact
            values (``None`` where it owns none).
        quantizer: send quantized differences of the masters, which every
            rank (the owner too) decodes and adds; ``None``: the values.

    Raises:
        ValueError: with ``quantizer``, this rank owns a piece it holds no
            masters for.
    """
    messages, owners = [], [[params[i] for i in piece.params] for piece in gather.pieces]
    for piece, owned in zip(gather.pieces, owners, strict=True):
        numel = piece.stop - piece.start
        if quantizer is None:
            flat = (
                _values(owned)
                if piece.owner == rank
                else torch.empty(numel, dtype=owned[0].dtype, device=owned[0].device)
            )
        else:
            exact = None if piece.owner != rank else [(masters or [])[i] for i in piece.params]
            flat = _difference_payload(quantizer, numel, owned, exact, rank, piece.buffer)
        messages.append(Broadcast(flat, src=piece.owner))
    for message in messages:
        yield Post(message)
    for piece, owned, message in zip(gather.pieces, owners, messages, strict=True):
        # Not marked last: the caller's thread collects every piece (a
        # forward's pre-hook), and writes it there.
        yield Collect(message)
        if quantizer is not None:
            write_flat(owned, quantizer.decode(message.tensor, piece.stop - piece.start), True)
        elif piece.owner != rank:
            write_flat(owned, message.tensor, False)


def write_flat(owned: Sequence[torch.Tensor], flat: torch.Tensor, differences: bool) -> None:
    """Write ``flat`` (``owned``'s elements, concatenated) into ``owned``:
    copied, or, as ``differences``, added
    (:func:`zerofn.zero.compressed.exchange.add_difference`)."""
    offset = 0
    with torch.no_grad():
        for p in owned:
            part = flat[offset : offset + p.numel()].view_as(p)
            if differences:
                add_difference(p, part)
            else:
                p.copy_(part)
            offset += p.numel()


def _values(owned: Sequence[torch.Tensor]) -> torch.Tensor:
    """The owner's message: its parameters' values, flat (a new tensor)."""
    return torch.cat([p.detach().reshape(-1) for p in owned])


def _difference_payload(
    quantizer: BlockQuantizer,
    numel: int,
    owned: Sequence[torch.Tensor],
    exact: Sequence[torch.Tensor | None] | None,
    rank: int,
    bucket: int,
) -> torch.Tensor:
    """A compressed message's payload: on the owner (``exact`` given) the
    quantized ``exact - owned``; elsewhere a buffer to receive it.

    Raises:
        ValueError: the owner holds no masters for a parameter it sends.
    """
    payload = torch.empty(
        quantizer.payload_nbytes(numel), dtype=torch.uint8, device=owned[0].device
    )
    if exact is not None:
        if any(m is None for m in exact):
            raise ValueError(f"rank {rank} owns a shard of bucket {bucket} without its masters")
        difference = torch.cat([m.detach().reshape(-1) for m in exact if m is not None])
        difference.sub_(_values(owned))
        quantizer.encode(difference, payload)
    return payload
