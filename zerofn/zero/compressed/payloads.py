"""Where the pieces of a compressed exchange's payloads lie, and their bytes.

Each rank's segment of a buffer travels as its quantized difference, cut into
pieces of whole blocks (:data:`PIECE_ELEMENTS`); each rank's payload lies in
one byte buffer per layout, the ranks' payloads end to end. These functions
say where each piece starts and ends, in elements and in bytes, and what the
buffers and scratch cost: the exchange (:mod:`zerofn.zero.compressed.exchange`),
its finish after a loss and the planner read them.
"""

from __future__ import annotations

import math

from zerofn.blockquant import BlockQuantizer
from zerofn.zero.planning.layout import BufferLayout
from zerofn.zero.planning.plan import ShardPlan

__all__ = [
    "PIECE_ELEMENTS",
    "compressed_buffer_bytes",
    "difference_numel",
    "exchange_bytes",
    "payload_offsets",
    "piece_bounds",
    "piece_count",
    "piece_numel",
    "work_numel",
]


PIECE_ELEMENTS = 1 << 20
"""Elements per piece of a segment (rounded up to whole blocks): about 1 MB
of int8 codes, few enough pieces that their latencies stay small against a
20M-parameter shard's bytes, enough that the codec overlaps the wire."""


def piece_count(piece: int, layout: BufferLayout) -> int:
    """The pieces every rank's segment of ``layout`` travels in (at least
    one): the longest segment's; a shorter segment's later pieces are empty."""
    longest = max((s.length for s in layout.segments), default=0)
    return max(1, -(-longest // piece))


def piece_bounds(
    quantizer: BlockQuantizer, piece: int, length: int, k: int
) -> tuple[int, int, int, int]:
    """Piece ``k`` (of ``piece`` elements, whole blocks) of a segment of
    ``length`` elements: its first element and element count, and where its
    payload starts in the segment's part and how many bytes it has. Pieces
    other than the last hold whole blocks, so their payloads laid end to end
    fill exactly ``payload_nbytes(length)``."""
    start = min(k * piece, length)
    numel = min(piece, length - start)
    return start, numel, quantizer.payload_nbytes(start), quantizer.payload_nbytes(numel)


def payload_offsets(quantizer: BlockQuantizer, layout: BufferLayout) -> tuple[int, ...]:
    """Where each rank's payload starts in ``layout``'s payload buffer (and,
    last, where the buffer ends)."""
    offsets = [0]
    for segment in layout.segments:
        offsets.append(offsets[-1] + quantizer.payload_nbytes(segment.length))
    return tuple(offsets)


def exchange_bytes(quantizer: BlockQuantizer, plan: ShardPlan) -> int:
    """The bytes one compressed exchange moves into every rank: every rank's
    payload (codes, scales and padding), summed over the buffers."""
    return sum(payload_offsets(quantizer, layout)[-1] for layout in plan.layouts)


def difference_numel(quantizer: BlockQuantizer, plan: ShardPlan) -> int:
    """Scratch elements for the longest segment's difference (whole blocks)."""
    lengths = [s.length for layout in plan.layouts for s in layout.segments]
    return quantizer.padded_numel(max(lengths, default=0))


def piece_numel(quantizer: BlockQuantizer, piece_elements: int) -> int:
    """The elements of one piece: ``piece_elements`` rounded up to whole
    blocks whose codes fill whole 4-byte words, so that no piece but the
    last pads its payload and the pieces' payloads laid end to end are the
    segment's (:func:`piece_bounds`).

    Raises:
        ValueError: ``piece_elements`` below 1.
    """
    if piece_elements < 1:
        raise ValueError(f"piece_elements must be positive, got {piece_elements}")
    unit = math.lcm(quantizer.block, 32 // quantizer.bits)  # codes per 4 bytes
    return -(-piece_elements // unit) * unit


def work_numel(quantizer: BlockQuantizer, plan: ShardPlan, piece: int) -> int:
    """Scratch elements: the longest segment's difference, then one piece
    decoded beside it."""
    longest = difference_numel(quantizer, plan)
    return longest + min(longest, piece)


def compressed_buffer_bytes(
    quantizer: BlockQuantizer, plan: ShardPlan, piece_elements: int = PIECE_ELEMENTS
) -> int:
    """The bytes a rank keeps for the compressed exchange: the payload
    buffers (every rank's codes and scales) and one ``float32`` scratch as
    long as the longest segment (the difference) plus one piece (each piece
    decoded, while the difference's later pieces are still to encode)."""
    piece = piece_numel(quantizer, piece_elements)
    return exchange_bytes(quantizer, plan) + 4 * work_numel(quantizer, plan, piece)
