"""Blockwise symmetric quantization: int8 or int4 codes, one scale per block.

A vector is cut into blocks of ``block`` elements (the last one shorter);
each block is sent as its scale (``float32``: the block's largest magnitude
over the largest code) and one signed code per element, ``round(x / scale)``.
Decoding multiplies back, so every element comes back within half a scale
of where it was:

    ``|x - decode(encode(x))| <= max|block| / (2 * qmax)``

with ``qmax = 127`` for int8 and ``7`` for int4 (codes ``-7..7``, stored with
an offset of 8, two per byte). One payload of bytes carries both, scales
first so that they stay aligned::

    [ scales: float32 x blocks | codes: numel (int8) or ceil(numel / 2) (int4) | pad to 4 ]

The compressed ZeRO exchange (:mod:`zerofn.zero.compressed.exchange`) and
DiLoCo's compressed sync both send these payloads. Decoding is a pure
function of the payload's bytes, so every rank that decodes the same payload
gets the same values, bit for bit.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

from zerofn.bitpack import check_payload, check_values

__all__ = ["BlockQuantizer", "quantizer_for"]

_SCALE_BYTES = 4


def _check_bits(_: object, __: object, value: object) -> None:
    if value not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {value!r}")


def _check_block(instance: BlockQuantizer, _: object, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ValueError(f"block must be an int >= 2, got {value!r}")
    if instance.bits == 4 and value % 2:
        raise ValueError(
            f"int4 packs two codes per byte, so its block must be even, got {value}; "
            "use an even block size"
        )


@attrs.frozen
class BlockQuantizer:
    """How a vector is quantized: code width and block length.

    Attributes:
        bits: 8 (codes -127..127) or 4 (codes -7..7, two per byte).
        block: elements per scale; even for int4. Longer blocks cost fewer
            scale bytes (4 per block) and a coarser step where magnitudes vary.
    """

    bits: Literal[8, 4] = attrs.field(validator=_check_bits)
    block: int = attrs.field(default=128, validator=_check_block)

    @property
    def qmax(self) -> int:
        """The largest code magnitude."""
        return 127 if self.bits == 8 else 7

    def blocks(self, numel: int) -> int:
        """How many blocks (scales) ``numel`` elements need."""
        return -(-numel // self.block)

    def code_nbytes(self, numel: int) -> int:
        """The bytes of ``numel`` elements' codes."""
        return numel if self.bits == 8 else -(-numel // 2)

    def payload_nbytes(self, numel: int) -> int:
        """The bytes of one payload for ``numel`` elements: scales, codes and
        padding to a multiple of 4 (so that payloads laid end to end keep
        their scales aligned)."""
        raw = self.blocks(numel) * _SCALE_BYTES + self.code_nbytes(numel)
        return -(-raw // _SCALE_BYTES) * _SCALE_BYTES

    def _parts(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_payload(payload, self.payload_nbytes(numel), numel)
        scale_bytes = self.blocks(numel) * _SCALE_BYTES
        scales = payload[:scale_bytes].view(torch.float32)
        codes = payload[scale_bytes : scale_bytes + self.code_nbytes(numel)]
        return scales, codes

    def padded_numel(self, numel: int) -> int:
        """``numel`` rounded up to whole blocks: the scratch :meth:`encode` needs."""
        return self.blocks(numel) * self.block

    def encode(
        self, values: torch.Tensor, out: torch.Tensor, work: torch.Tensor | None = None
    ) -> None:
        """Quantize ``values`` into ``out``.

        Args:
            values: a 1-D floating-point tensor (computed in ``float32``); it
                may be the start of ``work``.
            out: a 1-D ``uint8`` tensor of :meth:`payload_nbytes` bytes,
                written in place (its start 4-byte aligned).
            work: a 1-D ``float32`` scratch tensor of at least
                :meth:`padded_numel` elements, overwritten (``None``: a new
                one). Kept across calls, it spares fresh pages for every
                encode of a large shard.

        Raises:
            ValueError: ``out`` or ``work`` has the wrong dtype or length, or
                ``values`` is not a 1-D floating-point tensor.
        """
        check_values(values)
        numel = values.numel()
        scales, codes = self._parts(out, numel)
        if numel == 0:
            return
        buf = self._work(work, numel, values.device)
        if values.dtype != torch.float32 or values.data_ptr() != buf.data_ptr():
            buf[:numel].copy_(values)
        buf[numel:].zero_()
        rows = buf.view(-1, self.block)
        # Two read-only reductions instead of materializing |rows|.
        largest = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
        scales.copy_(largest.div_(self.qmax))
        # An all-zero block has scale 0: its codes are 0, not 0/0.
        inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        # |x| <= qmax * scale, so x / scale rounds into [-qmax, qmax] unclamped.
        rows.mul_(inverse.unsqueeze(1)).round_()
        if self.bits == 8:
            codes.view(torch.int8).copy_(buf[:numel])
            return
        # Codes -7..7 stored as 1..15; an odd count's last byte pads with 8 (0).
        paired = numel + numel % 2
        nibbles = buf[:paired].add_(8)
        if numel % 2:
            nibbles[numel] = 8
        low = nibbles[0::2].to(torch.uint8)
        high = nibbles[1::2].to(torch.uint8).mul_(16)
        torch.bitwise_or(low, high, out=codes)

    def _work(self, work: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        padded = self.padded_numel(numel)
        if work is None:
            return torch.empty(padded, dtype=torch.float32, device=device)
        if work.dtype != torch.float32 or work.dim() != 1 or work.numel() < padded:
            raise ValueError(
                f"work must be a 1-D float32 tensor of at least {padded} elements, got "
                f"{work.dtype} {tuple(work.shape)}"
            )
        return work[:padded]

    def decode(
        self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``float32`` values a payload carries.

        Args:
            payload: a payload from :meth:`encode` for ``numel`` elements.
            numel: how many elements it carries.
            out: a ``float32`` tensor of ``numel`` elements to write into
                (handed over), or ``None`` for a new one.

        Returns:
            The decoded values (``out`` when given).

        Raises:
            ValueError: the payload's dtype or length does not fit ``numel``.
        """
        scales, codes = self._parts(payload, numel)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        if numel == 0:
            return out
        if self.bits == 8:
            out.copy_(codes.view(torch.int8))
        else:
            out[0::2].copy_(codes[: (numel + 1) // 2] & 0x0F)
            out[1::2].copy_(codes[: numel // 2] >> 4)
            out.sub_(8)
        whole = (numel // self.block) * self.block
        if whole:
            out[:whole].view(-1, self.block).mul_(scales[: whole // self.block, None])
        if whole < numel:
            out[whole:].mul_(scales[-1])
        return out


def quantizer_for(name: str, block: int = 128) -> BlockQuantizer:
    """The quantizer a compression name stands for.

    Args:
        name: ``"int8"`` or ``"int4"``.
        block: elements per scale.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    known = {"int8": 8, "int4": 4}
    if name not in known:
        raise ValueError(f"unknown compression {name!r}; choose one of {sorted(known)} or None")
    return BlockQuantizer(known[name], block)  # type: ignore[arg-type]
