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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from zerofn.comm import AllGather, Program
from zerofn.hooks.hook import BucketInfo, CommHook

__all__ = ["GatherCodec", "gather_hook", "pack_bytes", "unpack_bytes"]


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

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: None, b: None
    ) -> tuple[None, Program[tuple[torch.Tensor, None]]]:
        def program() -> Program[tuple[torch.Tensor, None]]:
            payloads = yield AllGather(codec.encode(grad), last=True)
            return _average(codec, payloads, grad), None

        return None, program()

    return CommHook(init=lambda: None, start=start, name=name)


def _average(
    codec: GatherCodec, payloads: Sequence[torch.Tensor], grad: torch.Tensor
) -> torch.Tensor:
    contributions = [codec.decode(p, grad) for p in payloads]
    total = torch.zeros_like(contributions[0])
    for contribution in contributions:
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
    out = []
    offset = 0
    for (dtype, _), size in zip(layout, sizes, strict=True):
        # A copy starts at offset 0, so viewing it as a wider dtype is always aligned.
        out.append(payload[offset : offset + size].clone().view(dtype))
        offset += size
    return out
