"""The compressed ZeRO exchange: quantized shard differences, identical replicas.

The exact exchange sends every rank's updated shard (4 bytes per parameter
in fp32). The compressed one sends, per rank, its shard's *difference*
``master - replica``, block-quantized (:mod:`zerofn.blockquant`: int8 or
int4 codes and one ``float32`` scale per block):

* The owner of a shard keeps its exact values, the *master* (the copies the
  local optimizer steps, :mod:`zerofn.zero.masters`); the parameters every
  rank holds, the owner's included, are the *replica*.
* After the local step the owner encodes ``master - replica`` for its segment
  into its part of one byte buffer; one :class:`~zerofn.comm.GatherSegments`
  brings every rank's part to every rank.
* Every rank decodes every part and adds it to its replica of that segment
  with the same arithmetic (:func:`add_difference`). Decoding is a function of
  the bytes alone, so the replicas stay bitwise identical on every rank.

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

from zerofn.blockquant import BlockQuantizer, quantizer_for
from zerofn.comm import GatherSegments, Program
from zerofn.zero.chunks import ChunkSource
from zerofn.zero.exchange import ExchangeVia, slot_view
from zerofn.zero.layout import BufferLayout
from zerofn.zero.plan import ShardPlan
from zerofn.zero.precision import resolve_master_dtype
from zerofn.zero.shards import Shards

__all__ = [
    "CompressedExchange",
    "LocalSpan",
    "add_difference",
    "compressed_buffer_bytes",
    "compressed_exchange",
    "compressed_exchange_program",
    "compression_master_dtype",
    "exchange_bytes",
    "local_spans",
    "resolve_compression",
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


def resolve_compression(
    compression: str | BlockQuantizer | None, dtype: torch.dtype
) -> BlockQuantizer | None:
    """The quantizer ``exchange_compression`` asks for, checked against the
    parameters' dtype.

    Args:
        compression: ``None`` (the exact exchange), ``"int8"``, ``"int4"``, or
            a :class:`~zerofn.blockquant.BlockQuantizer` (another block size).
        dtype: the parameters' dtype.

    Raises:
        ValueError: an unknown name, or parameters that are not floating point.
        TypeError: something other than a name or a quantizer.
    """
    if compression is None:
        return None
    if isinstance(compression, str):
        quantizer = quantizer_for(compression)
    elif isinstance(compression, BlockQuantizer):
        quantizer = compression
    else:
        raise TypeError(
            "exchange_compression must be None, 'int8', 'int4' or a "
            f"zerofn.blockquant.BlockQuantizer, got {compression!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"exchange_compression quantizes differences of floating-point parameters; "
            f"these are {dtype}: leave exchange_compression=None"
        )
    return quantizer


def compression_master_dtype(
    param_dtype: torch.dtype, master_dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype of the exact copies a compressed exchange keeps: the
    ``master_dtype`` asked for, else ``float32`` (or the parameters' own
    dtype when wider).

    Raises:
        TypeError, ValueError: as :func:`zerofn.zero.precision.resolve_master_dtype`.
    """
    asked = resolve_master_dtype(param_dtype, master_dtype)
    if asked is not None:
        return asked
    if master_dtype is not None:
        return master_dtype
    return torch.float32 if torch.finfo(param_dtype).bits < 32 else param_dtype


def _payload_offsets(quantizer: BlockQuantizer, layout: BufferLayout) -> tuple[int, ...]:
    offsets = [0]
    for segment in layout.segments:
        offsets.append(offsets[-1] + quantizer.payload_nbytes(segment.length))
    return tuple(offsets)


def exchange_bytes(quantizer: BlockQuantizer, plan: ShardPlan) -> int:
    """The bytes one compressed exchange moves into every rank: every rank's
    payload (codes, scales and padding), summed over the buffers."""
    return sum(_payload_offsets(quantizer, layout)[-1] for layout in plan.layouts)


def _work_numel(quantizer: BlockQuantizer, plan: ShardPlan) -> int:
    lengths = [s.length for layout in plan.layouts for s in layout.segments]
    return quantizer.padded_numel(max(lengths, default=0))


def compressed_buffer_bytes(quantizer: BlockQuantizer, plan: ShardPlan) -> int:
    """The bytes a rank keeps for the compressed exchange: the payload
    buffers (every rank's codes and scales) and one ``float32`` scratch as
    long as the longest segment (the difference, then each decoded part)."""
    return exchange_bytes(quantizer, plan) + 4 * _work_numel(quantizer, plan)


@attrs.define(eq=False)
class CompressedExchange:
    """The byte buffers a compressed exchange sends, one per buffer layout.

    Mutable: the exchange writes the payloads in place.

    Attributes:
        quantizer: how differences are coded.
        payloads: per layout, every rank's payload laid end to end.
        offsets: per layout, where each rank's payload starts (and, last,
            where the buffer ends).
        work: ``float32`` scratch for the longest segment, reused by every
            encode and decode (fresh pages for each would cost more than the
            arithmetic on a large shard).
    """

    quantizer: BlockQuantizer
    payloads: list[torch.Tensor]
    offsets: tuple[tuple[int, ...], ...]
    work: torch.Tensor

    def parts(self, index: int) -> tuple[torch.Tensor, ...]:
        """Each rank's payload in buffer ``index``, as views, in rank order."""
        bounds = self.offsets[index]
        payload = self.payloads[index]
        return tuple(payload[a:b] for a, b in itertools.pairwise(bounds))

    def nbytes(self) -> int:
        """The payload buffers' and the scratch's bytes."""
        return sum(p.numel() for p in self.payloads) + 4 * self.work.numel()


def compressed_exchange(
    quantizer: BlockQuantizer, plan: ShardPlan, device: torch.device
) -> CompressedExchange:
    """Payload buffers and scratch for ``plan``'s layouts (zeroed)."""
    offsets = tuple(_payload_offsets(quantizer, layout) for layout in plan.layouts)
    payloads = [torch.zeros(o[-1], dtype=torch.uint8, device=device) for o in offsets]
    work = torch.zeros(_work_numel(quantizer, plan), dtype=torch.float32, device=device)
    return CompressedExchange(quantizer, payloads, offsets, work)


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
    via: ExchangeVia,
) -> Program[None]:
    """Send this rank's shard as its quantized difference; apply everyone's.

    Args:
        shards: how this rank holds its shard; its own segments of the
            buffers hold the replica of its shard (packed for the step).
        params: every parameter (the replica), in the optimizer's order;
            handed over: every segment's decoded difference is added to them.
        masters: the exact values of this rank's local tensors, in the local
            optimizer's order (``shards.local_sources``).
        exchange: the payload buffers (handed over).
        via: how the payloads move.

    Returns:
        A program making one request per buffer; when it returns, every
        rank's replica has every segment's difference added.

    Raises:
        ValueError: masters that do not match the local tensors.
    """
    layouts = shards.plan.layouts
    rank = shards.rank
    sources = shards.local_sources(params)
    if len(sources) != len(masters):
        raise ValueError(f"{len(masters)} masters for {len(sources)} local tensors")
    spans = local_spans(shards.plan, rank, sources)
    quantizer = exchange.quantizer
    for index, (layout, buffer) in enumerate(zip(layouts, shards.buffers, strict=True)):
        own = layout.segments[rank]
        # A rank that owns nothing has no masters and sends an empty payload.
        wide = masters[0].dtype if masters else torch.float32
        if wide == torch.float32:
            difference = exchange.work[: own.length]
        else:  # wider masters: the difference is taken at their width
            difference = torch.empty(own.length, dtype=wide, device=buffer.device)
        covered = 0
        for master, span in zip(masters, spans, strict=True):
            if span is not None and span.layout == index:
                difference[span.offset : span.offset + span.numel] = master.detach().view(-1)
                covered += span.numel
        if covered != own.length:
            raise ValueError(
                f"the masters cover {covered} of the {own.length} elements of rank {rank}'s "
                f"segment of the {layout.key} buffer"
            )
        difference.sub_(buffer[own.offset : own.offset + own.length])
        parts = exchange.parts(index)
        quantizer.encode(difference, parts[rank], exchange.work)
        yield GatherSegments(parts, rank, via, last=index == len(layouts) - 1)
        for segment, part in zip(layout.segments, parts, strict=True):
            decoded = quantizer.decode(part, segment.length, exchange.work[: segment.length])
            if shards.bucket_view:
                # The parameters are views of the buffer: one add covers them.
                add_difference(buffer[segment.offset : segment.offset + segment.length], decoded)
                continue
            for slot in layout.slots[segment.rank]:
                lo = slot.offset - segment.offset
                add_difference(
                    slot_view(params[slot.piece.param], slot), decoded[lo : lo + slot.piece.numel]
                )
