"""The compressed ZeRO exchange: quantized shard differences, identical replicas.

The exact exchange sends every rank's updated shard (4 bytes per parameter
in fp32). The compressed one sends, per rank, its shard's *difference*
``master - replica``, block-quantized (:mod:`zerofn.blockquant`: int8 or
int4 codes and one ``float32`` scale per block):

* The owner of a shard keeps its exact values, the *master* (the copies the
  local optimizer steps, :mod:`zerofn.zero.mixed_precision.masters`); the parameters every
  rank holds, the owner's included, are the *replica*.
* After the local step the owner encodes ``master - replica`` for its segment
  into its part of one byte buffer; :class:`~zerofn.comm.GatherSegments`
  requests bring every rank's part to every rank.
* Every rank decodes every part and adds it to its replica of that segment
  with the same arithmetic (:func:`add_difference`). Decoding is a function of
  the bytes alone, so the replicas stay bitwise identical on every rank.
* The update and the codec run beside the wire: each segment travels in
  pieces of :data:`PIECE_ELEMENTS` (a payload of its own each), two pieces
  in flight; while pieces ``k`` and ``k + 1`` are on the wire the program
  steps (with ``in_parts``: the local tensors that piece ``k + 2`` is the
  first to carry, :func:`update_parts`) and encodes piece ``k + 2``, and it
  decodes piece ``k`` once it has arrived (posted and collected requests,
  :class:`~zerofn.comm.Post`). On a link slower than the update and the
  codec a step costs about the wire time of its bytes, not the wire time
  plus theirs.

Error feedback needs no state of its own: what one step's codes leave out,
``master - replica`` still holds, so the next difference carries it. After a
step, ``|master - replica|`` is at most half the quantization step of the
difference just sent (plus the rounding of the replica's dtype); it does
not accumulate over steps.

The functions here write only into the tensors handed to them, as their
signatures say.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Collect, GatherSegments, Post
from zerofn.zero.compressed.payloads import (
    PIECE_ELEMENTS,
    compressed_buffer_bytes,
    difference_numel,
    exchange_bytes,
    payload_offsets,
    piece_bounds,
    piece_count,
    piece_numel,
    work_numel,
)
from zerofn.zero.exchange import ExchangeCollective, pack, slot_view
from zerofn.zero.local_step import LocalStep, StepProgram
from zerofn.zero.planning.chunks import ChunkSource
from zerofn.zero.planning.plan import ShardPlan
from zerofn.zero.shards import Shards

__all__ = [
    "PIECE_ELEMENTS",
    "CompressedExchange",
    "LocalSpan",
    "add_difference",
    "apply_piece",
    "block_scales",
    "compressed_buffer_bytes",
    "compressed_exchange",
    "compressed_exchange_program",
    "encode_unsent",
    "exchange_bytes",
    "local_spans",
    "update_parts",
]


@attrs.frozen
class LocalSpan:
    """Where one local tensor sits in this rank's segment of a buffer.

    Attributes:
        layout: the buffer's index in the plan's layouts.
        offset: the tensor's first element, counted from the segment's start.
        numel: its element count.
    """

    layout: int
    offset: int
    numel: int


@attrs.define(eq=False)
class CompressedExchange:
    """The byte buffers a compressed exchange sends, one per buffer layout.

    Mutable: the exchange writes the payloads in place, and counts the
    pieces it has applied.

    Attributes:
        quantizer: how differences are coded.
        payloads: per layout, every rank's payload laid end to end.
        offsets: per layout, where each rank's payload starts (and, last,
            where the buffer ends).
        piece: elements per piece a segment travels in (whole blocks).
        work: ``float32`` scratch for the longest segment and one piece,
            reused by every encode and decode (fresh pages for each would
            cost more than the arithmetic on a large shard).
        applied: per layout, how many pieces of the step in progress this
            rank has added to its replica (each piece covers every rank's
            segment): where an exchange a lost rank cut short stopped here
            (:mod:`zerofn.zero.compressed.finish` goes on from it).
    """

    quantizer: BlockQuantizer
    payloads: list[torch.Tensor]
    offsets: tuple[tuple[int, ...], ...]
    work: torch.Tensor
    piece: int
    applied: list[int] = attrs.field(factory=list)

    def begin_step(self) -> None:
        """A new step: none of its pieces applied yet."""
        self.applied[:] = [0] * len(self.payloads)

    def parts(self, index: int) -> tuple[torch.Tensor, ...]:
        """Each rank's payload in buffer ``index``, as views, in rank order."""
        bounds = self.offsets[index]
        payload = self.payloads[index]
        return tuple(payload[a:b] for a, b in itertools.pairwise(bounds))

    def nbytes(self) -> int:
        """The payload buffers' and the scratch's bytes."""
        return sum(p.numel() for p in self.payloads) + 4 * self.work.numel()


def compressed_exchange(
    quantizer: BlockQuantizer,
    plan: ShardPlan,
    device: torch.device,
    piece_elements: int = PIECE_ELEMENTS,
) -> CompressedExchange:
    """Payload buffers and scratch for ``plan``'s layouts (zeroed), each
    segment to travel in pieces of ``piece_elements`` (rounded up as
    :func:`~zerofn.zero.compressed.payloads.piece_numel` says)."""
    piece = piece_numel(quantizer, piece_elements)
    offsets = tuple(payload_offsets(quantizer, layout) for layout in plan.layouts)
    payloads = [torch.zeros(o[-1], dtype=torch.uint8, device=device) for o in offsets]
    work = torch.zeros(work_numel(quantizer, plan, piece), dtype=torch.float32, device=device)
    return CompressedExchange(quantizer, payloads, offsets, work, piece, [0] * len(payloads))


def block_scales(exchange: CompressedExchange, index: int, rank: int, length: int) -> torch.Tensor:
    """The scale of every block of rank ``rank``'s segment (``length``
    elements) of buffer ``index``, in order, read piece by piece from its
    payload.

    Returns:
        ``float32`` scales, one per block.
    """
    quantizer, part = exchange.quantizer, exchange.parts(index)[rank]
    scales = []
    for k in range(max(1, -(-length // exchange.piece))):
        _, numel, at, _ = piece_bounds(quantizer, exchange.piece, length, k)
        scales.append(part[at : at + 4 * quantizer.blocks(numel)].view(torch.float32))
    return torch.cat(scales)


def local_spans(
    plan: ShardPlan, rank: int, sources: Sequence[ChunkSource | None]
) -> list[LocalSpan | None]:
    """Where each local tensor sits in this rank's segments.

    Args:
        plan: the shard plan.
        rank: this rank.
        sources: each local tensor's ``(parameter, first element, count)``
            (:meth:`~zerofn.zero.shards.WholeTensorShards.local_sources`).

    Returns:
        One :class:`LocalSpan` per local tensor; ``None`` for one no buffer
        carries (a frozen parameter, or an empty group's placeholder).

    Raises:
        ValueError: a tensor straddles two slots (the plan and the local
            tensors disagree).
    """
    where: dict[int, list[tuple[int, int, int, int]]] = {}
    for index, layout in enumerate(plan.layouts):
        base = layout.segments[rank].offset
        for slot in layout.slots[rank]:
            piece = slot.piece
            where.setdefault(piece.param, []).append(
                (index, piece.start, piece.stop, slot.offset - base)
            )
    spans: list[LocalSpan | None] = []
    for source in sources:
        if source is None:
            spans.append(None)
            continue
        param, start, numel = source
        found = None
        for index, lo, hi, offset in where.get(param, ()):
            if lo <= start < hi or (numel == 0 and lo == start):
                if start + numel > hi:
                    raise ValueError(
                        f"local tensor of parameter {param} [{start}, {start + numel}) "
                        f"straddles the slot [{lo}, {hi})"
                    )
                found = LocalSpan(index, offset + start - lo, numel)
                break
        spans.append(found)
    return spans


def add_difference(replica: torch.Tensor, difference: torch.Tensor) -> None:
    """Add a decoded difference (``float32``) to a replica, in place, the
    same way on every rank: in ``float32`` or wider, then rounded once to the
    replica's dtype. For a narrower replica ``difference`` is overwritten
    (it holds the sum before the rounding)."""
    with torch.no_grad():
        if torch.finfo(replica.dtype).bits >= 32:
            replica.add_(difference)
        else:
            replica.copy_(difference.add_(replica))


def compressed_exchange_program(
    shards: Shards,
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    exchange: CompressedExchange,
    collective: ExchangeCollective,
    in_parts: bool = False,
) -> StepProgram[None]:
    """Send this rank's shard as its quantized difference; apply everyone's.

    Args:
        shards: how this rank holds its shard; its own segments of the
            buffers hold the replica of its shard (packed for the step).
        params: every parameter (the replica), in the optimizer's order;
            handed over: every segment's decoded difference is added to them.
        masters: the exact values of this rank's local tensors, in the local
            optimizer's order (``shards.local_sources``).
        exchange: the payload buffers (handed over).
        collective: how the payloads move.
        in_parts: the masters are not stepped yet: the program asks for
            their local step a part at a time (:class:`LocalStep` requests
            naming tensors, the last one ``last``), each part just before
            the first piece that carries it is encoded (see
            :func:`update_parts`). Else they were stepped before.

    Returns:
        A program making, per buffer, one posted request per piece (the
        codec of the neighbouring pieces runs while each travels); when it
        returns, every rank's replica has every segment's difference added.

    Raises:
        ValueError: masters that do not match the local tensors.
    """
    layouts = shards.plan.layouts
    sources = shards.local_sources(params)
    if len(sources) != len(masters):
        raise ValueError(f"{len(masters)} masters for {len(sources)} local tensors")
    spans = local_spans(shards.plan, shards.rank, sources)
    update = update_parts(shards.plan, spans, exchange.piece) if in_parts else {}
    exchange.begin_step()
    for index in range(len(layouts)):
        difference = _difference(shards, index, masters, spans, exchange)
        yield from _send_pieces(
            shards,
            index,
            params,
            difference,
            exchange,
            collective,
            index == len(layouts) - 1,
            update,
        )
    if in_parts:
        # The tensors no buffer carries are in no part: they are stepped last.
        unsent = tuple(t for t, span in enumerate(spans) if span is None)
        yield LocalStep(shards.rank, unsent, last=True)


def update_parts(
    plan: ShardPlan, spans: Sequence[LocalSpan | None], piece: int
) -> dict[tuple[int, int], tuple[int, ...]]:
    """When each local tensor is stepped, for an update in parts: just before
    the first piece that carries any of it is encoded.

    Args:
        plan: the shard plan.
        spans: where each local tensor sits in this rank's segments
            (:func:`local_spans`).
        piece: elements per piece.

    Returns:
        ``(buffer index, piece index) -> local tensor indices`` to step before
        that piece is encoded, in the local optimizer's order. Tensors no
        buffer carries (``None`` spans) are in no part: the program steps them
        with its last request.
    """
    parts: dict[tuple[int, int], list[int]] = {}
    for tensor, span in enumerate(spans):
        if span is None:
            continue
        count = piece_count(piece, plan.layouts[span.layout])
        # An empty tensor at a segment's end starts past its last piece.
        first = min(span.offset // piece, count - 1)
        parts.setdefault((span.layout, first), []).append(tensor)
    return {key: tuple(tensors) for key, tensors in sorted(parts.items())}


@attrs.frozen(eq=False)
class _Difference:
    """``master - replica`` over this rank's segment of one buffer, taken a
    piece at a time (:meth:`take`), so the first piece's codes leave before
    the rest of the segment is read.

    Attributes:
        values: where the difference is taken (the exchange's scratch, for
            float32 masters), one element per element of the segment.
        masters: the parts of this rank's masters in the segment, with
            where each starts in it.
        replica: the segment of the buffer (the replica of the shard).
    """

    values: torch.Tensor
    masters: tuple[tuple[int, torch.Tensor], ...]
    replica: torch.Tensor

    def take(self, start: int, numel: int) -> torch.Tensor:
        """The difference over ``[start, start + numel)`` of the segment, written."""
        stop = start + numel
        piece = self.values[start:stop]
        for offset, master in self.masters:
            lo, hi = max(start, offset), min(stop, offset + master.numel())
            if lo < hi:
                piece[lo - start : hi - start] = master[lo - offset : hi - offset]
        return piece.sub_(self.replica[start:stop])


def _difference(
    shards: Shards,
    index: int,
    masters: Sequence[torch.Tensor],
    spans: Sequence[LocalSpan | None],
    exchange: CompressedExchange,
    owner: int | None = None,
) -> _Difference:
    """Where ``master - replica`` over ``owner``'s segment (this rank's by
    default) of buffer ``index`` will be taken, checked to be covered by the
    masters."""
    owner = shards.rank if owner is None else owner
    layout, buffer = shards.plan.layouts[index], shards.buffers[index]
    own = layout.segments[owner]
    # A rank that owns nothing has no masters and sends an empty payload.
    wide = masters[0].dtype if masters else torch.float32
    if wide == torch.float32:
        values = exchange.work[: own.length]
    else:  # wider masters: the difference is taken at their width
        values = torch.empty(own.length, dtype=wide, device=buffer.device)
    parts = tuple(
        (span.offset, master.detach().view(-1))
        for master, span in zip(masters, spans, strict=True)
        if span is not None and span.layout == index
    )
    covered = sum(part.numel() for _, part in parts)
    if covered != own.length:
        raise ValueError(
            f"the masters cover {covered} of the {own.length} elements of rank "
            f"{owner}'s segment of the {layout.key} buffer"
        )
    return _Difference(values, parts, buffer[own.offset : own.offset + own.length])


def _send_pieces(
    shards: Shards,
    index: int,
    params: Sequence[torch.Tensor],
    difference: _Difference,
    exchange: CompressedExchange,
    collective: ExchangeCollective,
    last: bool,
    update: dict[tuple[int, int], tuple[int, ...]],
) -> StepProgram[None]:
    """Buffer ``index``'s exchange, piece by piece: step (``update``) and
    encode piece ``k + 2`` while pieces ``k`` and ``k + 1`` travel, decode
    piece ``k`` once it has arrived."""
    quantizer = exchange.quantizer
    layout = shards.plan.layouts[index]
    parts = exchange.parts(index)
    count = piece_count(exchange.piece, layout)

    def payload(rank: int, k: int) -> torch.Tensor:
        _, _, at, nbytes = piece_bounds(quantizer, exchange.piece, layout.segments[rank].length, k)
        return parts[rank][at : at + nbytes]

    def step_and_encode(k: int) -> StepProgram[None]:
        if (index, k) in update:
            yield LocalStep(shards.rank, update[index, k], last=False)
        start, numel, _, _ = piece_bounds(
            quantizer, exchange.piece, layout.segments[shards.rank].length, k
        )
        if numel:
            work = exchange.work[start : start + quantizer.padded_numel(numel)]
            quantizer.encode(difference.take(start, numel), payload(shards.rank, k), work)

    requests = [
        GatherSegments(tuple(payload(r, k) for r in range(len(parts))), shards.rank, collective)
        for k in range(count)
    ]
    # Two pieces in flight: the next one is queued behind the one on the
    # wire, so the link does not idle between them.
    for k in range(min(2, count)):
        yield from step_and_encode(k)
        yield Post(requests[k])
    for k in range(count):
        yield Collect(requests[k], last=last and k + 1 == count)
        if k + 2 < count:
            yield from step_and_encode(k + 2)
            yield Post(requests[k + 2])
        apply_piece(shards, index, params, exchange, k)


def apply_piece(
    shards: Shards, index: int, params: Sequence[torch.Tensor], exchange: CompressedExchange, k: int
) -> None:
    """Decode piece ``k`` of every rank's payload in buffer ``index`` and add
    it to this rank's replica (the parameters, written in place); count it
    applied."""
    quantizer, layout = exchange.quantizer, shards.plan.layouts[index]
    parts = exchange.parts(index)
    # Beside the difference (whose later pieces may be still to encode).
    scratch = exchange.work[difference_numel(quantizer, shards.plan) :]
    for segment in layout.segments:
        start, numel, at, nbytes = piece_bounds(quantizer, exchange.piece, segment.length, k)
        if numel:
            payload = parts[segment.rank][at : at + nbytes]
            decoded = quantizer.decode(payload, numel, scratch[:numel])
            _apply(shards, index, params, segment.offset + start, decoded)
    exchange.applied[index] = k + 1


def encode_unsent(
    shards: Shards,
    index: int,
    owner: int,
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    sources: Sequence[ChunkSource | None],
    exchange: CompressedExchange,
) -> None:
    """Encode, into ``owner``'s payload in buffer ``index``, the pieces of its
    segment this rank has not applied, from ``masters`` (``owner``'s, or a
    carried copy of them; ``sources`` says what each holds) minus this rank's
    replica (``params``), which those pieces have not moved: the bytes
    ``owner`` sends for them (encoding is a function of those values alone).
    The pieces this rank applied are in the payload already, as they arrived."""
    quantizer, layout = exchange.quantizer, shards.plan.layouts[index]
    if not shards.bucket_view:  # the buffer holds the replica only where packed
        pack(shards.buffers[index], layout.slots[owner], params)
    spans = local_spans(shards.plan, owner, sources)
    difference = _difference(shards, index, masters, spans, exchange, owner)
    part, length = exchange.parts(index)[owner], layout.segments[owner].length
    for k in range(exchange.applied[index], piece_count(exchange.piece, layout)):
        start, numel, at, nbytes = piece_bounds(quantizer, exchange.piece, length, k)
        if numel:
            work = exchange.work[start : start + quantizer.padded_numel(numel)]
            quantizer.encode(difference.take(start, numel), part[at : at + nbytes], work)


def _apply(
    shards: Shards, index: int, params: Sequence[torch.Tensor], at: int, decoded: torch.Tensor
) -> None:
    """Add ``decoded``, the difference of buffer ``index``'s elements from
    ``at`` on, to the replica those elements hold."""
    buffer = shards.buffers[index]
    stop = at + decoded.numel()
    if shards.bucket_view:
        # The parameters are views of the buffer: one add covers them.
        add_difference(buffer[at:stop], decoded)
        return
    layout = shards.plan.layouts[index]
    for segment in layout.segments:
        if segment.offset + segment.length <= at or segment.offset >= stop:
            continue
        for slot in layout.slots[segment.rank]:
            lo, hi = max(slot.offset, at), min(slot.stop, stop)
            if lo < hi:
                view = slot_view(params[slot.piece.param], slot)
                add_difference(
                    view[lo - slot.offset : hi - slot.offset], decoded[lo - at : hi - at]
                )
