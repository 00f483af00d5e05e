"""Collectives as data: what a communication program asks the world to do.

A communication hook in zerofn is a *program*: a generator that yields
:data:`Request` records and receives each request's result. The core never
communicates; whoever drives the program fulfils the requests: the adapter
with ``torch.distributed`` collectives, :mod:`zerofn.testing.world` with a pure
reduction over simulated ranks. So one program serves real training and
property tests alike, and every rank issues the same requests in the same
order by construction.

A request yielded plainly is waited for before the program goes on. To
compute while bytes travel (encode the next piece of a message while this
one is on the wire), a program yields :class:`Post` around the request,
works, and later yields :class:`Collect` for its response.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, TypeAlias, TypeVar

import attrs
import torch

__all__ = [
    "AllGather",
    "AllGatherObjects",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "BroadcastObject",
    "Collect",
    "CollectiveKind",
    "GatherObjects",
    "GatherSegments",
    "ObjectRequest",
    "Post",
    "Program",
    "ProgramStep",
    "Reduce",
    "Reduction",
    "Request",
    "Response",
    "answered_locally",
    "describe",
    "kind_of",
    "recording_requests",
    "request_bytes",
    "split_like",
    "tensors_of",
]

Reduction: TypeAlias = Literal["sum", "avg", "max"]


def _tensors(value: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class AllReduce:
    """Reduce ``tensors`` element-wise across ranks.

    Attributes:
        tensors: this rank's contributions; every rank sends the same shapes
            and dtypes in the same order. They are handed over: the driver may
            reduce them in place, or pack them into one message (they travel
            together: one round trip).
        op: ``"sum"``, ``"avg"`` or ``"max"``.
        last: the program's final request: the driver may hand the result to
            the program later (asynchronously) instead of waiting for it.

    The response is the reduced tensors, in order.
    """

    tensors: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    op: Reduction = "sum"
    last: bool = False


@attrs.frozen(eq=False)
class AllGather:
    """Collect ``tensor`` from every rank.

    Attributes:
        tensor: this rank's contribution; same shape and dtype on every rank.
        last: as for :class:`AllReduce`.

    The response is one tensor per rank, in rank order.
    """

    tensor: torch.Tensor
    last: bool = False


@attrs.frozen(eq=False)
class Broadcast:
    """Send rank ``src``'s ``tensor`` to every rank.

    Attributes:
        tensor: on ``src``, the payload; elsewhere a buffer of the same shape
            and dtype, handed over: the driver writes the payload into it.
        src: the sending rank's index in the group.
        last: as for :class:`AllReduce`.

    The response is ``(tensor,)`` holding ``src``'s payload.
    """

    tensor: torch.Tensor
    src: int
    last: bool = False


@attrs.frozen(eq=False)
class Reduce:
    """Sum ``tensor`` (this rank's contribution, handed over: reduced in
    place) across ranks onto rank ``dst`` (an index in the group) alone;
    ``last`` as for :class:`AllReduce`.

    The response is ``(tensor,)``: the sum on ``dst``; on other ranks its
    contents are unspecified (the program must not read them).
    """

    tensor: torch.Tensor
    dst: int
    last: bool = False


@attrs.frozen(eq=False)
class GatherSegments:
    """Fill each rank's segment of a buffer from that rank.

    Attributes:
        segments: one tensor per rank (its own filled, the others buffers to
            receive into), all handed over; segments may differ in size.
        rank: this rank's index in the group.
        collective: how the bytes move: ``"all_gather"`` (one collective; what NCCL
            does best) or ``"broadcasts"`` (one broadcast per non-empty
            segment from its owner; measured faster on gloo). Either way each
            rank receives exactly the other ranks' segments.
        last: as for :class:`AllReduce`.

    The response is the segments, every one filled.
    """

    segments: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    rank: int
    collective: Literal["all_gather", "broadcasts"] = "broadcasts"
    last: bool = False


@attrs.frozen(eq=False)
class AllToAll:
    """Send each rank its own part, and receive each rank's part for this one.

    Unlike :class:`GatherSegments`, a part travels to one rank only: what
    only its owner needs (quantized codes, which cannot be summed on the
    way) costs one rank's share, not every rank's.

    Attributes:
        sends: one tensor per rank, what this rank sends it; sizes may
            differ, the dtype is one. Its own entry is copied to
            ``receives[rank]``.
        receives: one tensor per rank, handed over: filled with what that
            rank sends this one (as many elements as it sends).
        rank: this rank's index in the group.
        last: as for :class:`AllReduce`.

    The response is ``receives``, every one filled.

    Raises:
        ValueError: ``sends`` and ``receives`` of different lengths, more
            than one dtype among them, or ``rank`` outside them.
    """

    sends: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    receives: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    rank: int
    last: bool = False

    def __attrs_post_init__(self) -> None:
        if len(self.sends) != len(self.receives) or not 0 <= self.rank < len(self.sends):
            raise ValueError(
                f"all_to_all needs one send and one receive per rank and this rank among them: "
                f"got {len(self.sends)} sends, {len(self.receives)} receives, rank {self.rank}"
            )
        dtypes = {t.dtype for t in (*self.sends, *self.receives)}
        if len(dtypes) > 1:
            raise ValueError(f"all_to_all moves one dtype; got {sorted(map(str, dtypes))}")


Request: TypeAlias = AllReduce | AllGather | Broadcast | Reduce | GatherSegments | AllToAll
"""Any collective of tensors a program may ask for."""


@attrs.frozen(eq=False)
class AllGatherObjects:
    """Every rank's picklable ``value``, in rank order, on every rank (the
    response is ``(values,)``: copies, as pickling makes them).

    Attributes:
        value: this rank's value.
        last: as for :class:`AllReduce`.
    """

    value: Any
    last: bool = False


@attrs.frozen(eq=False)
class GatherObjects:
    """Every rank's picklable ``value``, in rank order, on rank ``dst`` (the
    response there is ``(values,)``; elsewhere ``(None,)``).

    Attributes:
        value: this rank's value.
        dst: the rank that receives them.
        last: as for :class:`AllReduce`.
    """

    value: Any
    dst: int
    last: bool = False


@attrs.frozen(eq=False)
class BroadcastObject:
    """Rank ``src``'s picklable ``value`` on every rank (the response is
    ``(value,)``).

    Attributes:
        value: this rank's value (read on ``src`` only).
        src: the rank whose value every rank receives.
        last: as for :class:`AllReduce`.
    """

    value: Any
    src: int
    last: bool = False


ObjectRequest: TypeAlias = AllGatherObjects | GatherObjects | BroadcastObject
"""Collectives of picklable values: bookkeeping that is no tensor (optimizer
states by index, verdicts, plans). Drivers run them to completion before the
program goes on; they are never posted."""


@attrs.frozen(eq=False)
class Post:
    """Start ``request`` and go on at once: the program computes while it
    travels and takes its response with a later :class:`Collect`. Every
    posted request must be collected before the program returns.

    Attributes:
        request: the collective to start (its ``last`` is ignored; a
            :class:`Collect` says which is last).

    The response is ``()``.
    """

    request: Request


@attrs.frozen(eq=False)
class Collect:
    """Wait for a request posted earlier.

    Attributes:
        request: the request, as it was posted.
        last: as for :class:`AllReduce`.

    The response is the posted request's.
    """

    request: Request
    last: bool = False


ProgramStep: TypeAlias = Request | ObjectRequest | Post | Collect
"""What a program may yield: a request (waited for at once), a collective of
objects, or a request posted and later collected."""


CollectiveKind: TypeAlias = Literal[
    "all_reduce", "all_gather", "broadcast", "reduce", "exchange", "all_to_all"
]


def kind_of(request: Request) -> CollectiveKind:
    """The collective ``request`` asks for, by name."""
    kinds: dict[type, CollectiveKind] = {
        AllReduce: "all_reduce",
        AllGather: "all_gather",
        Broadcast: "broadcast",
        Reduce: "reduce",
        GatherSegments: "exchange",
        AllToAll: "all_to_all",
    }
    return kinds[type(request)]


def tensors_of(request: Request) -> tuple[torch.Tensor, ...]:
    """The tensors ``request`` hands over on this rank (for :class:`AllToAll`,
    what it sends)."""
    if isinstance(request, AllReduce | GatherSegments):
        return request.tensors if isinstance(request, AllReduce) else request.segments
    if isinstance(request, AllToAll):
        return request.sends
    return (request.tensor,)


def request_bytes(request: Request) -> int:
    """The bytes of this rank's tensors in ``request`` (for
    :class:`GatherSegments`, the whole buffer: every rank's segment; for
    :class:`AllToAll`, what leaves the rank: its own part is not sent)."""
    tensors = tensors_of(request)
    if isinstance(request, AllToAll):
        tensors = tuple(t for r, t in enumerate(tensors) if r != request.rank)
    return sum(t.numel() * t.element_size() for t in tensors)


def _size(request: Request) -> str:
    count = request_bytes(request)
    if count < 1024:
        return f"{count} B"
    if count < 1024**2:
        return f"{count / 1024:.1f} KiB"
    return f"{count / 1024**2:.1f} MiB"


def split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat``, in order, shaped like each of ``like`` (``flat``
    holds their elements end to end, as a request's packed message does)."""
    out = []
    offset = 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return tuple(out)


def describe(request: Request | ObjectRequest) -> str:
    """A short account of ``request`` for messages: the collective, its
    payload and size, e.g. ``"all_reduce (sum) of 2 tensors, 8.0 KiB"``."""
    if isinstance(request, AllGatherObjects):
        return "all_gather_object"
    if isinstance(request, GatherObjects):
        return f"gather_object to rank {request.dst}"
    if isinstance(request, BroadcastObject):
        return f"broadcast_object_list from rank {request.src}"
    if isinstance(request, AllReduce):
        n = len(request.tensors)
        return f"all_reduce ({request.op}) of {n} tensor{'s' * (n != 1)}, {_size(request)}"
    if isinstance(request, AllGather):
        return f"all_gather of {_size(request)} per rank"
    if isinstance(request, Broadcast):
        return f"broadcast from rank {request.src} of {_size(request)}"
    if isinstance(request, Reduce):
        return f"reduce to rank {request.dst} of {_size(request)}"
    if isinstance(request, AllToAll):
        return f"all_to_all among {len(request.sends)} ranks, {_size(request)} sent"
    collective = request.collective.replace("_", "-")
    return f"exchange of {len(request.segments)} segments by {collective}, {_size(request)} in all"


Response: TypeAlias = tuple[Any, ...]
"""What a program receives back for a request: tensors, or for a collective
of objects the one value it answers."""

R = TypeVar("R")
Program: TypeAlias = Generator[ProgramStep, Response, R]
"""A communication program: yields requests (plain, or posted and
collected), receives responses, returns ``R``."""


def recording_requests(program: Program[R], see: Callable[[Request], object]) -> Program[R]:
    """``program`` unchanged, calling ``see`` on each collective of tensors
    it makes (to count or record them; a posted one when it is posted),
    before the request goes out. Collectives of objects are bookkeeping: not seen."""
    try:
        request = next(program)
        while True:
            if not isinstance(request, Collect | ObjectRequest):
                see(request.request if isinstance(request, Post) else request)
            request = program.send((yield request))
    except StopIteration as stop:
        result: R = stop.value
        return result


Q = TypeVar("Q")


def answered_locally(
    program: Generator[ProgramStep | Q, Any, R], kind: type[Q], answer: Callable[[Q], Any]
) -> Program[R]:
    """``program`` with its local requests of type ``kind`` answered here by
    ``answer`` (a step of the caller's own, such as the local optimizer's),
    and only its collectives passed on to whoever drives it.

    So one program can say "now step your shard" between its collectives,
    and the adapter's driver and the simulated world run it unchanged, each
    answering with its own optimizer.
    """
    try:
        request = next(program)
        while True:
            if isinstance(request, kind):
                request = program.send(answer(request))
            else:
                request = program.send((yield request))  # type: ignore[misc]
    except StopIteration as stop:
        result: R = stop.value
        return result
