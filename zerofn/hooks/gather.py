"""Lossy hooks whose ranks exchange encoded gradients by all-gather.

An encoding such as 8-bit quantization or top-k sparsification cannot be summed
by an all-reduce: each rank's payload only means something with that rank's own
scale or indices. Such a hook is a :class:`GatherCodec` (``encode`` a gradient
into a flat byte payload, ``decode`` a payload back into a gradient) run by
:func:`gather_hook`: every rank all-gathers the payloads, decodes each one and
averages them in rank order. Every rank decodes the same bytes in the same
order, so every rank computes the same result.

:func:`pack_bytes` and :func:`unpack_bytes` put tensors of different dtypes
(quantized values and their float scales, values and integer indices) into
one ``uint8`` payload, so a hook needs one collective, not one per dtype.

Some encodings draw random numbers (random-k picks random positions). A codec
holds no state, so it cannot advance a generator of its own: one that seeded
itself the same way on every call would draw the same numbers every
iteration, and one that used the process's global generator would draw
different numbers on each rank, and for the error feedback's replay. Such a
codec is a :class:`SharedRandomCodec`: its ``draw`` step gets a generator
seeded from a :class:`SharedStream`, ``(seed, iteration, bucket index)``,
which every rank knows alike: the seed from the hook's configuration, the
iteration from the hook's global state (:class:`StreamState`, advanced once
per iteration), the bucket index from the bucket. :func:`shared_random_hook`
runs it: one draw per bucket and iteration, the same on every rank, and the
same again when the bucket is replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import attrs
import numpy as np
import torch

from zerofn.comm import AllGather, Program
from zerofn.hooks.hook import BucketInfo, CommHook, stateless

__all__ = [
    "GatherCodec",
    "SharedRandomCodec",
    "SharedStream",
    "StreamState",
    "gather_hook",
    "next_iteration",
    "pack_bytes",
    "shared_random_hook",
    "unpack_bytes",
]

D = TypeVar("D")


@attrs.frozen
class GatherCodec:
    """A lossy encoding exchanged by all-gather.

    Attributes:
        encode: ``grad -> payload``: a 1-D ``uint8`` tensor whose length
            depends only on the gradient's shape and dtype (all-gather needs
            the same length on every rank).
        decode: ``(payload, grad) -> contribution``: what a payload stands
            for, shaped like ``grad``; ``grad`` (this rank's gradient) only
            tells the length and dtype, never the values.
    """

    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gather_hook(codec: GatherCodec, name: str) -> CommHook[None, None]:
    """A stateless hook: all-gather the encoded gradients, decode and average.

    The decoded contributions are summed in rank order, starting from zeros,
    and the sum divided by the world size; the result has the gradient's dtype.
    One collective per bucket.
    """
    return stateless(name, lambda grad, bucket: _gather_program(codec, grad))


def _gather_program(codec: GatherCodec, grad: torch.Tensor) -> Program[tuple[torch.Tensor, None]]:
    payloads = yield AllGather(codec.encode(grad), last=True)
    return _average(codec, payloads, grad), None


# ----- codecs that draw from the iteration's shared random stream ------------------


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative int, got {value!r}")


@attrs.frozen
class SharedStream:
    """Where one bucket's random draws come from in one iteration.

    Every rank builds the same record for the same bucket of the same
    iteration, so every rank draws the same numbers; another iteration or
    another bucket draws others.

    Attributes:
        seed: the hook's seed (its configuration).
        iteration: completed iterations (the hook's :class:`StreamState`).
        bucket: the bucket's index.

    Raises:
        ValueError: if any of them is not a non-negative int.
    """

    seed: int = attrs.field(validator=_non_negative_int)
    iteration: int = attrs.field(validator=_non_negative_int)
    bucket: int = attrs.field(validator=_non_negative_int)

    def generator(self) -> torch.Generator:
        """A new CPU generator seeded from the three numbers.

        numpy's ``SeedSequence`` mixes them, so nearby iterations and
        buckets get unrelated streams. The generator lives on the CPU so
        that ranks on different devices still agree.
        """
        mixed = np.random.SeedSequence([self.seed, self.iteration, self.bucket])
        return torch.Generator().manual_seed(int(mixed.generate_state(1, np.uint64)[0]))


@attrs.frozen
class StreamState:
    """The global state of a :func:`shared_random_hook`.

    Attributes:
        iteration: completed iterations; :func:`next_iteration` advances it
            after an iteration's last bucket, on every rank alike.

    Raises:
        ValueError: if ``iteration`` is not a non-negative int.
    """

    iteration: int = attrs.field(default=0, validator=_non_negative_int)


def next_iteration(state: StreamState) -> StreamState:
    """The state after one more completed iteration."""
    return StreamState(state.iteration + 1)


@attrs.frozen
class SharedRandomCodec(Generic[D]):
    """A lossy encoding, exchanged by all-gather, that depends on a random
    draw every rank makes alike (random positions, random projections).

    Attributes:
        draw: ``(numel, device, generator) -> drawn``: the bucket's draw,
            from its length and device alone (never from values, which
            differ between ranks), with ``generator`` seeded from the
            bucket's :class:`SharedStream`.
        encode: ``(grad, drawn) -> payload``: as :attr:`GatherCodec.encode`.
        decode: ``(payload, grad, drawn) -> contribution``: as
            :attr:`GatherCodec.decode`; ``drawn`` is this rank's draw, which
            equals the sending rank's.
    """

    draw: Callable[[int, torch.device, torch.Generator], D]
    encode: Callable[[torch.Tensor, D], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor, D], torch.Tensor]

    def bind(self, stream: SharedStream, grad: torch.Tensor) -> GatherCodec:
        """The plain codec for one bucket of one iteration: draws once, from
        ``stream``, for a gradient shaped like ``grad`` (its values unread)."""
        drawn = self.draw(grad.numel(), grad.device, stream.generator())

        def encode(x: torch.Tensor) -> torch.Tensor:
            return self.encode(x, drawn)

        def decode(payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return self.decode(payload, like, drawn)

        return GatherCodec(encode=encode, decode=decode)


def shared_random_hook(
    codec: SharedRandomCodec[D], seed: int, name: str
) -> CommHook[StreamState, None]:
    """:func:`gather_hook` for a codec that draws: each bucket's draw comes
    from ``SharedStream(seed, iteration, bucket index)``.

    The iteration is the hook's global state (:class:`StreamState`), which
    ``end_iteration`` advances, so the draws change every iteration, agree
    on every rank, and repeat exactly when a bucket is run again from the
    same state (error feedback's replay, a resumed run).

    Raises:
        ValueError: if ``seed`` is not a non-negative int.
    """
    SharedStream(seed, 0, 0)  # check the seed now, not at the first bucket

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: StreamState, b: None
    ) -> tuple[StreamState, Program[tuple[torch.Tensor, None]]]:
        bound = codec.bind(SharedStream(seed, g.iteration, bucket.index), grad)
        return g, _gather_program(bound, grad)

    return CommHook(init=StreamState, start=start, end_iteration=next_iteration, name=name)


def _average(
    codec: GatherCodec, payloads: Sequence[torch.Tensor], grad: torch.Tensor
) -> torch.Tensor:
    contributions = [codec.decode(p, grad) for p in payloads]
    total = torch.zeros_like(contributions[0])
    for contribution in contributions:  # in place: no new tensor per rank
        total += contribution
    return (total / len(payloads)).to(grad.dtype)


def pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors``, flattened and concatenated into one ``uint8`` tensor."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(
    payload: torch.Tensor, layout: Sequence[tuple[torch.dtype, int]]
) -> list[torch.Tensor]:
    """Undo :func:`pack_bytes`: one 1-D tensor per ``(dtype, numel)`` in ``layout``.

    Raises:
        ValueError: if ``payload`` is not exactly as long as ``layout`` says.
    """
    sizes = [numel * dtype.itemsize for dtype, numel in layout]
    if sum(sizes) != payload.numel():
        raise ValueError(
            f"payload holds {payload.numel()} bytes, layout {layout} needs {sum(sizes)}"
        )
    # A copy starts at offset 0, so viewing it as a wider dtype is always aligned.
    return [
        part.clone().view(dtype)
        for (dtype, _), part in zip(layout, torch.split(payload, sizes), strict=True)
    ]
