"""8-bit quantization hooks: PyTorch's quantization hooks as all-gather codecs.

Each rank quantizes its gradient to ``uint8`` with its own affine parameters
(a scale and a zero point, chosen from the gradient's range), the ranks
all-gather the quantized values together with those parameters, and every rank
dequantizes each rank's values and averages them. The numbers are those of
PyTorch's ``quantization_pertensor_hook`` and ``quantization_perchannel_hook``:
the parameters are computed as ``torch.ao.quantization``'s ``MinMaxObserver``
and ``PerChannelMinMaxObserver`` compute them by default (``quint8``, affine,
range 0..255), and quantization, dequantization and the average follow the
same arithmetic in the same order.

Two differences, neither of which changes a number:

* one all-gather per bucket, not two: the parameters travel in the same
  ``uint8`` payload as the values (see :func:`zerofn.hooks.gather.pack_bytes`),
  where PyTorch's hooks gather them first, in a collective of their own;
* the per-channel hook pads the gradient only up to a whole number of
  channels, where PyTorch's adds a whole channel of zeros when the length
  is already a multiple of ``bucket_size``.

Quantization is lossy: compose with :func:`zerofn.hooks.error_feedback.error_feedback`
to carry each rank's rounding error into its next iteration.
"""

from __future__ import annotations

import torch

from zerofn.hooks.gather import GatherCodec, gather_hook, pack_bytes, unpack_bytes
from zerofn.hooks.hook import CommHook

__all__ = [
    "QUANT_MAX",
    "QUANT_MIN",
    "channel_qparams",
    "dequantize",
    "per_channel_codec",
    "per_tensor_codec",
    "quantize",
    "quantize_per_channel",
    "quantize_per_tensor",
    "tensor_qparams",
    "to_channels",
]

QUANT_MIN = 0
"""Smallest quantized value (``quint8``)."""
QUANT_MAX = 255
"""Largest quantized value (``quint8``)."""

# The observers' lower bound on the scale, so a constant gradient still has one.
_EPS = torch.finfo(torch.float32).eps


def _affine_qparams(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``[scale, zero_point]`` (float32, stacked on dim 0) for values in ``[lo, hi]``."""
    # The range always includes 0, so that 0 is exactly representable.
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    scale = torch.clamp((hi - lo) / float(QUANT_MAX - QUANT_MIN), min=_EPS)
    zero_point = QUANT_MIN - torch.round(lo / scale).to(torch.int32)
    zero_point = torch.clamp(zero_point, QUANT_MIN, QUANT_MAX)
    return torch.stack([scale, zero_point.to(torch.float32)])


def tensor_qparams(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor affine parameters of ``x``: ``tensor([scale, zero_point])``, float32.

    As ``MinMaxObserver()`` computes them from ``x``'s minimum and maximum.
    """
    lo, hi = torch.aminmax(x.detach().to(torch.float32))
    return _affine_qparams(lo, hi)


def channel_qparams(channels: torch.Tensor) -> torch.Tensor:
    """Per-row affine parameters of a 2-D tensor: shape ``(2, rows)``, float32.

    Row 0 holds the scales, row 1 the zero points, as
    ``PerChannelMinMaxObserver()`` computes them (channel axis 0).
    """
    lo, hi = torch.aminmax(channels.detach().to(torch.float32), dim=1)
    return _affine_qparams(lo, hi)


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """``uint8`` codes of ``x``: ``clamp(round(x / scale) + zero_point, 0, 255)``.

    ``scale`` and ``zero_point`` broadcast against ``x`` (one per tensor or
    one per row).
    """
    codes = torch.round(x / scale) + zero_point
    return torch.clamp(codes, QUANT_MIN, QUANT_MAX).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """The float32 values ``codes`` stand for: ``scale * (codes - zero_point)``."""
    return scale * (codes.to(torch.float32) - zero_point)


def to_channels(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to whole channels, as ``(channels, bucket_size)``."""
    flat = x.reshape(-1)
    padding = -flat.numel() % bucket_size
    return torch.nn.functional.pad(flat, (0, padding)).view(-1, bucket_size)


def per_tensor_codec() -> GatherCodec:
    """Encode a gradient as its per-tensor parameters and ``uint8`` codes."""

    def encode(grad: torch.Tensor) -> torch.Tensor:
        qparams = tensor_qparams(grad)
        return pack_bytes([qparams, quantize(grad.reshape(-1), qparams[0], qparams[1])])

    def decode(payload: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        qparams, codes = unpack_bytes(payload, [(torch.float32, 2), (torch.uint8, grad.numel())])
        return dequantize(codes, qparams[0], qparams[1]).view(grad.shape)

    return GatherCodec(encode=encode, decode=decode)


def per_channel_codec(bucket_size: int = 512) -> GatherCodec:
    """Encode a gradient as channels of ``bucket_size`` elements, each with its
    own parameters and ``uint8`` codes.

    Raises:
        ValueError: if ``bucket_size`` is not a positive integer.
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive integer, got {bucket_size!r}")

    def encode(grad: torch.Tensor) -> torch.Tensor:
        channels = to_channels(grad, bucket_size)
        qparams = channel_qparams(channels)
        codes = quantize(channels, qparams[0].unsqueeze(1), qparams[1].unsqueeze(1))
        return pack_bytes([qparams, codes])

    def decode(payload: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        num_channels = -(-grad.numel() // bucket_size)
        qparams, codes = unpack_bytes(
            payload,
            [(torch.float32, 2 * num_channels), (torch.uint8, num_channels * bucket_size)],
        )
        qparams = qparams.view(2, num_channels, 1)
        values = dequantize(codes.view(num_channels, bucket_size), qparams[0], qparams[1])
        return values.reshape(-1)[: grad.numel()].view(grad.shape)

    return GatherCodec(encode=encode, decode=decode)


def quantize_per_tensor() -> CommHook[None, None]:
    """PyTorch's ``quantization_pertensor_hook`` as a hook: one scale per bucket."""
    return gather_hook(per_tensor_codec(), "quantize_per_tensor")


def quantize_per_channel(bucket_size: int = 512) -> CommHook[None, None]:
    """PyTorch's ``quantization_perchannel_hook`` as a hook: one scale per
    ``bucket_size`` consecutive elements of the bucket.

    Raises:
        ValueError: if ``bucket_size`` is not a positive integer.
    """
    return gather_hook(per_channel_codec(bucket_size), f"quantize_per_channel({bucket_size})")
