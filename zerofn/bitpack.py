"""Unsigned integers of a few bits each, packed end to end into bytes.

The 2-bit codes of :mod:`zerofn.twobit` and the chunk offsets of
:mod:`zerofn.topk` travel in as few bits as they need. Values are laid out
least significant bit first: value ``i`` occupies bits ``i * bits`` to
``(i + 1) * bits - 1`` of the stream, bit ``j`` of the stream being bit
``j % 8`` of byte ``j // 8``; the last byte is padded with zero bits.
Packing and unpacking are pure functions of the values and the bytes, so
every rank that unpacks the same bytes gets the same integers. Beside them,
the checks every block codec's inputs pass (:mod:`zerofn.blockquant`,
:mod:`zerofn.twobit`, :mod:`zerofn.topk`).
"""

from __future__ import annotations

import torch

__all__ = ["check_payload", "check_values", "pack_bits", "packed_nbytes", "unpack_bits"]


def check_values(values: torch.Tensor) -> None:
    """Refuse what a codec cannot encode.

    Raises:
        ValueError: ``values`` is not a 1-D floating-point tensor.
    """
    if values.dim() != 1 or not values.is_floating_point():
        raise ValueError(
            f"values must be a 1-D float tensor, got {values.dtype} {tuple(values.shape)}"
        )


def check_payload(payload: torch.Tensor, nbytes: int, numel: int) -> None:
    """Refuse a payload that cannot hold ``numel`` elements' codes.

    Raises:
        ValueError: ``payload`` is not a 1-D ``uint8`` tensor of ``nbytes`` bytes.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(
            f"a payload is a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}"
        )
    if payload.numel() != nbytes:
        raise ValueError(
            f"{numel} elements need a payload of {nbytes} bytes, got {payload.numel()}"
        )


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
        raise ValueError(f"bits must be an int in [1, 32], got {bits!r}")


def packed_nbytes(count: int, bits: int) -> int:
    """The bytes ``count`` values of ``bits`` bits each take, packed."""
    _check_bits(bits)
    return -(-count * bits // 8)


def pack_bits(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack ``values`` into ``out``.

    Args:
        values: a 1-D integer tensor, every value in ``[0, 2**bits)`` (not
            checked: higher bits are dropped).
        bits: bits per value, 1 to 32.
        out: a 1-D ``uint8`` tensor of :func:`packed_nbytes` bytes, written
            in place.

    Raises:
        ValueError: ``out`` has the wrong dtype or length, or ``bits`` is
            out of range.
    """
    count = values.numel()
    nbytes = packed_nbytes(count, bits)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes:
        raise ValueError(
            f"{count} values of {bits} bits pack into a 1-D uint8 tensor of {nbytes} bytes, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if count == 0:
        return
    device = values.device
    if 8 % bits == 0:
        # Whole values per byte: shift each into its place, no bit planes needed.
        per = 8 // bits
        lanes = torch.zeros(nbytes * per, dtype=torch.uint8, device=device)
        lanes[:count].copy_(values.to(torch.uint8) & ((1 << bits) - 1))
        lanes = lanes.view(nbytes, per)
        out.copy_(lanes[:, 0])
        for lane in range(1, per):
            out.bitwise_or_(lanes[:, lane] << (bits * lane))
        return
    shifts = torch.arange(bits, device=device)
    planes = torch.zeros(nbytes * 8, dtype=torch.uint8, device=device)
    planes[: count * bits].copy_(((values.to(torch.int64).unsqueeze(1) >> shifts) & 1).view(-1))
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int64, device=device)
    out.copy_((planes.view(nbytes, 8).to(torch.int64) * weights).sum(1))


def unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` values :func:`pack_bits` packed into ``packed``, as ``int64``.

    Raises:
        ValueError: ``packed`` is not a 1-D ``uint8`` tensor of
            :func:`packed_nbytes` bytes.
    """
    nbytes = packed_nbytes(count, bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != nbytes:
        raise ValueError(
            f"{count} values of {bits} bits unpack from a 1-D uint8 tensor of {nbytes} bytes, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    device = packed.device
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        lanes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return lanes.view(-1)[:count].to(torch.int64)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    planes = ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[: count * bits]
    weights = torch.tensor([1 << j for j in range(bits)], dtype=torch.int64, device=device)
    return (planes.view(count, bits).to(torch.int64) * weights).sum(1)
