"""Flat buffers that carry updated parameter shards between ranks.

After each rank steps its shard, every rank needs every shard. The shards of
one device and dtype are laid out in one flat buffer, rank after rank, so that
the exchange is one contiguous segment per rank (one coalesced collective per
buffer) instead of one message per parameter. With
``parameters_as_bucket_view`` the parameters themselves become views into
that buffer and the exchange writes them in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from zerofn.zero.planning.partition import Piece

__all__ = ["BufferLayout", "Segment", "Slot", "buffer_layouts"]


@attrs.frozen
class Segment:
    """Elements ``[offset, offset + length)`` of a buffer, written by ``rank``."""

    rank: int
    offset: int
    length: int


@attrs.frozen
class Slot:
    """Where a :class:`Piece` of a parameter lives in a buffer."""

    piece: Piece
    offset: int

    @property
    def stop(self) -> int:
        """One past the slot's last buffer element."""
        return self.offset + self.piece.numel


@attrs.frozen
class BufferLayout:
    """One flat exchange buffer: all ranks' pieces for one device and dtype.

    Attributes:
        key: the device/dtype this buffer holds (as given by the caller).
        numel: buffer length; the segments tile ``[0, numel)`` in rank order.
        segments: one :class:`Segment` per rank.
        slots: ``slots[rank]`` is where each of the rank's pieces lives, in the
            rank's local order and contiguous inside its segment.
    """

    key: str
    numel: int
    segments: tuple[Segment, ...]
    slots: tuple[tuple[Slot, ...], ...]

    def span_of(self, param: int) -> tuple[int, int] | None:
        """``(offset, numel)`` of ``param`` if all its pieces sit back to back
        in start order (so the whole parameter can be a view); else ``None``."""
        pieces = sorted(
            (s for rank_slots in self.slots for s in rank_slots if s.piece.param == param),
            key=lambda s: s.piece.start,
        )
        if not pieces or pieces[0].piece.start != 0:
            return None
        for before, after in itertools.pairwise(pieces):
            if before.stop != after.offset or before.piece.stop != after.piece.start:
                return None
        return pieces[0].offset, pieces[-1].piece.stop


def buffer_layouts(
    pieces_per_rank: Sequence[Sequence[Piece]],
    keys: Sequence[str],
    trainable: Sequence[bool],
) -> tuple[BufferLayout, ...]:
    """Lay out every rank's trainable pieces in one buffer per key.

    Args:
        pieces_per_rank: each rank's pieces, in its local order.
        keys: device/dtype key of every global parameter.
        trainable: whether each global parameter is trained; frozen ones are
            never updated, so they are left out of the exchange.

    Returns:
        One :class:`BufferLayout` per key that has a trainable piece, ordered
        by each key's first appearance among the parameters.

    Raises:
        ValueError: if ``keys`` and ``trainable`` differ in length or a piece
            names a parameter beyond them.
    """
    if len(keys) != len(trainable):
        raise ValueError(f"keys has {len(keys)} entries but trainable has {len(trainable)}")
    layouts = []
    for key in dict.fromkeys(keys):  # each key once, in order of first appearance
        segments: list[Segment] = []
        slots: list[tuple[Slot, ...]] = []
        offset = 0
        for rank, pieces in enumerate(pieces_per_rank):
            start = offset
            rank_slots = []
            for piece in pieces:
                if not 0 <= piece.param < len(keys):
                    raise ValueError(f"piece names parameter {piece.param}, beyond {len(keys)}")
                if keys[piece.param] == key and trainable[piece.param]:
                    rank_slots.append(Slot(piece, offset))
                    offset += piece.numel
            segments.append(Segment(rank, start, offset - start))
            slots.append(tuple(rank_slots))
        if any(slots):
            layouts.append(
                BufferLayout(key=key, numel=offset, segments=tuple(segments), slots=tuple(slots))
            )
    return tuple(layouts)
