"""The exchange hidden behind the next forward: its pieces, their order, the waits.

The plain exchange (:func:`zerofn.zero.exchange.exchange_program`) brings
every rank's updated segment before ``step()`` returns, so the next forward
starts only once the last byte has arrived. With ``gather_during_forward``
the step posts one broadcast per *piece* (at most :data:`PIECE_NUMEL`
elements of one rank's segment) in the order the forward uses the
parameters, and returns; each module, as the forward reaches it, waits only
until the pieces holding its parameters have arrived, while the later pieces
are still on the wire. An iteration then costs about ``max(compute, bytes /
rate)`` instead of their sum.

Everything here is pure:

- :func:`gather_pieces` cuts every segment into pieces;
- :func:`first_uses` reads the forward's order from the parameters each
  module call used;
- :func:`in_forward_order` orders pieces by the first use of their
  parameters and says, for each parameter, how many pieces must have arrived
  before it holds its updated value (:class:`ForwardGather`);
  :func:`plan_forward_gather` does so for the exchange's pieces, and the
  overlapped step's sends (:func:`zerofn.overlap.step.send_pieces`) use it
  for theirs;
- :func:`forward_gather_program` posts every piece's broadcast and collects
  them in order, writing each into the parameters as it arrives
  (:meth:`zerofn.zero.shards.WholeTensorShards.unpack_range`).

A module that waits for ``ready[p]`` arrivals of each of its parameters
``p`` waits for every piece at most once: arrivals are counted in the order
they travel, and a later wait only counts further.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from zerofn.comm import Broadcast, Collect, Post, Program
from zerofn.zero.compressed.payloads import piece_count
from zerofn.zero.planning.layout import BufferLayout, Slot
from zerofn.zero.planning.plan import ShardPlan

__all__ = [
    "PIECE_NUMEL",
    "Arrivals",
    "ForwardGather",
    "GatherPiece",
    "UnpacksRanges",
    "check_gather_during_forward",
    "check_gather_with_hook",
    "compressed_arrivals",
    "first_uses",
    "forward_gather_program",
    "gather_pieces",
    "in_forward_order",
    "plan_forward_gather",
]

PIECE_NUMEL = 1 << 20
"""Elements of one piece at most (4 MiB of fp32): small enough that the first
modules wait for little, large enough that a broadcast's fixed cost is
small beside its bytes."""


def check_gather_during_forward(redundancy: int, overlap_with_ddp: bool) -> None:
    """Refuse ``gather_during_forward=True`` beside options it does not
    compose with, naming them.

    Raises:
        ValueError: with ``redundancy=2`` and ``overlap_with_ddp=True``
            together (the hook then takes the whole step inside backward,
            where a loss is recovered from inside the step).
    """
    if redundancy == 2 and overlap_with_ddp:
        raise ValueError(
            "gather_during_forward=True with redundancy=2 and overlap_with_ddp=True: the hook "
            "takes the whole step inside backward, where a loss is recovered from inside the "
            "step. Leave out one of the three options"
        )


def check_gather_with_hook(gathering: bool, interleaved: bool) -> None:
    """Refuse ``hook_with_zero_step_interleaved`` over an optimizer built
    with ``gather_during_forward=True``, naming both.

    Raises:
        ValueError: the interleaved hook sends each bucket's updates during
            backward, where the gather sends them behind the next forward.
    """
    if gathering and interleaved:
        raise ValueError(
            "hook_with_zero_step_interleaved over a ZeroRedundancyOptimizer built with "
            "gather_during_forward=True: the interleaved hook sends each bucket's updates during "
            "backward, the gather sends them behind the next forward. Use hook_with_zero_step "
            "(its sends then travel behind the forward), or gather_during_forward=False"
        )


@attrs.frozen
class GatherPiece:
    """Elements ``[start, stop)`` of buffer ``buffer``, inside rank ``owner``'s
    segment, and the parameters with an element in it.

    The buffers are the exchange's (one per layout); for the overlapped
    step's sends (:mod:`zerofn.overlap.step`) they are DDP's buckets, laid
    out as the bucket's flat gradient, and a piece holds whole parameters of
    one owner's shard."""

    buffer: int
    owner: int
    start: int
    stop: int
    params: tuple[int, ...]


@attrs.frozen
class Arrivals:
    """When each parameter holds its updated value, in a program that
    collects its pieces in a fixed order.

    Attributes:
        ready: ``ready[p]`` is how many pieces must have been collected
            before parameter ``p`` holds its updated value (0: it needs
            none, as a frozen parameter).
    """

    ready: tuple[int, ...]

    def waits(self, params: Sequence[int]) -> int:
        """How many pieces must have arrived before a module using ``params`` runs."""
        return max((self.ready[p] for p in params), default=0)


@attrs.frozen
class ForwardGather(Arrivals):
    """A gather in forward order: its :class:`Arrivals`, and the pieces, in
    the order they travel."""

    pieces: tuple[GatherPiece, ...]


def gather_pieces(
    layouts: Sequence[BufferLayout], piece_numel: int = PIECE_NUMEL
) -> tuple[GatherPiece, ...]:
    """Every rank's segment of every buffer, cut into pieces of at most
    ``piece_numel`` elements, in buffer, rank and offset order.

    Raises:
        ValueError: ``piece_numel`` below 1.
    """
    if piece_numel < 1:
        raise ValueError(f"piece_numel must be at least 1, got {piece_numel}")
    pieces = []
    for index, layout in enumerate(layouts):
        for segment in layout.segments:
            slots = layout.slots[segment.rank]
            stop = segment.offset + segment.length
            for start in range(segment.offset, stop, piece_numel):
                end = min(start + piece_numel, stop)
                inside = _params_within(slots, start, end)
                pieces.append(GatherPiece(index, segment.rank, start, end, inside))
    return tuple(pieces)


def _params_within(slots: Sequence[Slot], start: int, stop: int) -> tuple[int, ...]:
    """The parameters with an element in ``[start, stop)`` of a buffer,
    among one rank's ``slots``, each once, in slot order."""
    inside = (s.piece.param for s in slots if s.offset < stop and start < s.stop)
    return tuple(dict.fromkeys(inside))


def first_uses(calls: Sequence[Sequence[int]], num_params: int) -> tuple[int | None, ...]:
    """Each parameter's first use: the index of the first module call (in
    forward order) that used it, or ``None`` where none did.

    Args:
        calls: the parameters each module call used, in the order of the calls.
        num_params: how many parameters there are.

    Raises:
        ValueError: a call names a parameter outside ``range(num_params)``.
    """
    first: list[int | None] = [None] * num_params
    for position, used in enumerate(calls):
        for p in used:
            if not 0 <= p < num_params:
                raise ValueError(f"a module call used parameter {p} of {num_params}")
            if first[p] is None:
                first[p] = position
    return tuple(first)


def in_forward_order(
    pieces: Sequence[GatherPiece], first_use: Sequence[int | None]
) -> ForwardGather:
    """``pieces`` in the order the forward needs them, and each parameter's wait.

    A piece travels as early as its earliest-used parameter is used; pieces
    whose parameters the forward never used travel last; ties keep the
    given order. Every rank computes the same order from the same
    ``first_use``.

    Args:
        pieces: what travels, each naming the parameters it holds.
        first_use: :func:`first_uses` of every parameter (all ``None``: the
            parameters' own order).

    Raises:
        ValueError: a piece names a parameter outside ``range(len(first_use))``.
    """
    num_params = len(first_use)
    known = [u for u in first_use if u is not None]
    after_all = max(known, default=-1) + 1

    def when(p: int) -> tuple[int, int]:
        if not 0 <= p < num_params:
            raise ValueError(f"a piece holds parameter {p} of {num_params}")
        use = first_use[p]
        return (after_all, p) if use is None else (use, p)

    order = sorted(
        range(len(pieces)),
        key=lambda i: (min(map(when, pieces[i].params), default=(after_all + 1, 0)), i),
    )
    ordered = tuple(pieces[i] for i in order)
    ready = [0] * num_params
    for position, piece in enumerate(ordered):
        for p in piece.params:
            ready[p] = position + 1
    return ForwardGather(tuple(ready), ordered)


def plan_forward_gather(
    plan: ShardPlan, first_use: Sequence[int | None], piece_numel: int = PIECE_NUMEL
) -> ForwardGather:
    """The pieces of ``plan``'s exchange in forward order, and each
    parameter's wait (:func:`in_forward_order` of :func:`gather_pieces`).

    Args:
        plan: the shard plan (its buffer layouts).
        first_use: :func:`first_uses` of the parameters (all ``None``: the
            parameters' own order).
        piece_numel: elements of one piece at most.

    Raises:
        ValueError: ``first_use`` is not one entry per parameter, or a bad
            ``piece_numel``.
    """
    num_params = len(plan.keys)
    if len(first_use) != num_params:
        raise ValueError(f"first_use has {len(first_use)} entries for {num_params} parameters")
    return in_forward_order(gather_pieces(plan.layouts, piece_numel), first_use)


def compressed_arrivals(plan: ShardPlan, piece: int) -> Arrivals:
    """The waits of the compressed exchange behind the forward
    (:func:`zerofn.zero.compressed.exchange.compressed_exchange_program`), which
    collects, buffer by buffer, piece ``k`` of every rank's segment at once
    (elements ``[k * piece, (k + 1) * piece)`` of each): its pieces keep
    that order, since each one's codes span whole blocks of every segment.

    Raises:
        ValueError: ``piece`` below 1.
    """
    if piece < 1:
        raise ValueError(f"piece must be at least 1, got {piece}")
    ready = [0] * len(plan.keys)
    position = 0
    for layout in plan.layouts:
        for k in range(piece_count(piece, layout)):
            position += 1
            for segment in layout.segments:
                start = segment.offset + min(k * piece, segment.length)
                stop = segment.offset + min((k + 1) * piece, segment.length)
                for param in _params_within(layout.slots[segment.rank], start, stop):
                    ready[param] = position
    return Arrivals(tuple(ready))


class UnpacksRanges(Protocol):
    """What writes an arrived range of a buffer into the parameters (the
    shard mode's rule: :meth:`zerofn.zero.shards.WholeTensorShards.unpack_range`)."""

    def unpack_range(
        self, params: Sequence[torch.Tensor], buffer: int, start: int, stop: int
    ) -> None: ...


def forward_gather_program(
    gather: ForwardGather,
    buffers: Sequence[torch.Tensor],
    rank: int,
    shards: UnpacksRanges,
    params: Sequence[torch.Tensor],
) -> Program[None]:
    """Fill every rank's segment of every buffer, piece by piece in
    ``gather``'s order, writing each piece into ``params`` as it arrives.

    Every piece's broadcast is posted first (so all of them travel while the
    program waits), then they are collected in order. A driver that runs the
    program one collect at a time can let a module run once the pieces it
    waits for (:meth:`ForwardGather.waits`) have been collected.

    Args:
        gather: the pieces and their order.
        buffers: one buffer per layout, this rank's segment packed; handed
            over: the other segments are written in place.
        rank: this rank's index in the group.
        shards: writes an arrived range into the parameters.
        params: every parameter, in the optimizer's order; handed over.
    """
    broadcasts = [
        Broadcast(buffers[piece.buffer][piece.start : piece.stop], src=piece.owner)
        for piece in gather.pieces
    ]
    for request in broadcasts:
        yield Post(request)
    for piece, request in zip(gather.pieces, broadcasts, strict=True):
        yield Collect(request)
        shards.unpack_range(params, piece.buffer, piece.start, piece.stop)
