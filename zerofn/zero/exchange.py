"""The ZeRO exchange: shards in and out of flat buffers, and the program that
sends every rank's updated segment to every rank.

A :class:`~zerofn.zero.planning.layout.BufferLayout` says where each piece of each
parameter lives in a device/dtype's flat buffer; each rank's pieces form one
contiguous *segment*. After the local optimizer step, every rank packs its
updated pieces into its segment, :func:`exchange_program` asks for one
:class:`~zerofn.comm.GatherSegments` per buffer, and every rank unpacks the
other ranks' segments into its parameters. How the bytes move
(one all-gather, or one broadcast per rank) is a parameter of the program,
not a branch in whoever drives it.

The functions here write only into the buffers and tensors handed to them,
as their signatures say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch

from zerofn.comm import GatherSegments, Program
from zerofn.zero.planning.layout import BufferLayout, Slot
from zerofn.zero.planning.partition import FlatPartition

__all__ = [
    "ExchangeCollective",
    "exchange_program",
    "group_slots",
    "pack",
    "segment_views",
    "slot_view",
    "unpack",
]

ExchangeCollective: TypeAlias = Literal["all_gather", "broadcasts"]
"""How an exchange moves its bytes (see :class:`~zerofn.comm.GatherSegments`)."""


def slot_view(tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The elements of ``tensor`` (a parameter, or its gradient) that ``slot``
    covers, as a flat view."""
    return tensor.detach().view(-1)[slot.piece.start : slot.piece.stop]


def pack(buffer: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.Tensor]) -> None:
    """Copy the covered elements of ``params`` into ``buffer`` (written in place)."""
    for slot in slots:
        buffer[slot.offset : slot.stop].copy_(slot_view(params[slot.piece.param], slot))


def unpack(
    buffer: torch.Tensor,
    slots: Sequence[Slot],
    params: Sequence[torch.Tensor],
    start: int = 0,
    stop: int | None = None,
) -> None:
    """Copy ``buffer``'s elements back into ``params`` (written in place):
    those of ``slots`` inside elements ``[start, stop)`` of the buffer (all
    of them by default)."""
    stop = buffer.numel() if stop is None else stop
    with torch.no_grad():
        for slot in slots:
            lo, hi = max(slot.offset, start), min(slot.stop, stop)
            if lo >= hi:
                continue
            begin = slot.piece.start + lo - slot.offset
            flat = params[slot.piece.param].detach().view(-1)
            flat[begin : begin + hi - lo].copy_(buffer[lo:hi])


def segment_views(layout: BufferLayout, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each rank's segment of ``buffer``, as views, in rank order."""
    return tuple(buffer[s.offset : s.offset + s.length] for s in layout.segments)


def exchange_program(
    layouts: Sequence[BufferLayout],
    buffers: Sequence[torch.Tensor],
    rank: int,
    collective: ExchangeCollective = "broadcasts",
) -> Program[None]:
    """Fill every rank's segment of every buffer from that rank.

    Args:
        layouts: the plan's buffer layouts (one per device/dtype).
        buffers: one buffer per layout, this rank's segment packed; handed
            over: the other segments are written in place.
        rank: this rank's index in the group.
        collective: ``"all_gather"`` (one collective per buffer; NCCL) or
            ``"broadcasts"`` (one broadcast per non-empty segment; gloo).

    Returns:
        A program making one request per buffer (the last marked ``last``);
        when it returns, every buffer holds every rank's segment.

    Raises:
        ValueError: if the counts of layouts and buffers differ, or a buffer
            is not as long as its layout.
    """
    if len(layouts) != len(buffers):
        raise ValueError(f"{len(layouts)} layouts but {len(buffers)} buffers")
    for layout, buffer in zip(layouts, buffers, strict=True):
        if buffer.numel() != layout.numel:
            raise ValueError(
                f"the {layout.key} buffer has {buffer.numel()} elements; its layout needs "
                f"{layout.numel}"
            )
    for index, (layout, buffer) in enumerate(zip(layouts, buffers, strict=True)):
        last = index == len(layouts) - 1
        # The driver fills the other ranks' segments in place (handed over).
        yield GatherSegments(segment_views(layout, buffer), rank, collective, last=last)


def group_slots(
    layout: BufferLayout, partition: FlatPartition, rank: int
) -> tuple[tuple[Slot, ...], ...]:
    """Under a flat partition: ``rank``'s slots in the (single) buffer, per
    param group. Each group's slots are contiguous, so a local optimizer can
    step one view of the buffer per group."""
    groups = map(set, partition.group_pieces_of(rank))
    return tuple(tuple(s for s in layout.slots[rank] if s.piece in wanted) for wanted in groups)
