"""Blockwise 2-bit quantization: four levels per block, one scale per block.

A vector is cut into blocks of ``block`` elements (the last one shorter).
Each block sends a scale ``s = max|block| / 3`` (``float32``) and, per
element, a 2-bit code ``q`` standing for the value ``(2q - 3) s``: one of
``-3s, -s, s, 3s``. These four levels are evenly spaced ``2s`` apart and
span the block's range, so every element comes back within one ``s``::

    |x - decode(encode(x))| <= max|block| / 3

Four levels without a zero (a *midrise* quantizer) halve the worst error
that three levels with one (-1, 0, 1 times ``max|block|``) would leave, for
the same two bits. Rounding is deterministic (round half to even), not
stochastic: every rank must decode identical bytes and runs must be
reproducible, and error feedback already carries what rounding drops to
the next sync, which is what stochastic rounding's unbiasedness buys.
An all-zero block has ``s = 0`` and decodes to zeros.

Payload::

    [ scales: float32 x blocks | codes: ceil(numel / 4) bytes | pad to 4 ]

At the default block of 256 elements that is ``2/8 + 4/256`` bytes per
element: 1/15 of ``float32``. (At 128 the scales would be 11% of the
payload and the sum 1/14.2, too close to 1/14 to keep once padding counts.)
"""

from __future__ import annotations

import attrs
import torch

from zerofn.bitpack import check_payload, check_values, pack_bits, unpack_bits

__all__ = ["TwoBitQuantizer", "midrise_codes", "midrise_values"]

_SCALE_BYTES = 4
LEVELS = 3
"""The largest level, in scales: levels are -3, -1, 1, 3 times the scale."""


def _check_block(_: object, __: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 4 or value % 4:
        raise ValueError(
            f"block must be an int >= 4 and a multiple of 4 (four 2-bit codes per byte), "
            f"got {value!r}; the default, 256, costs 1/15 of float32"
        )


def midrise_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes (``uint8``, 0..3) of values already divided by their
    scale (so within [-3, 3]): the nearest of the levels ``2q - 3``."""
    return scaled.add(LEVELS).div_(2).round_().clamp_(0, LEVELS).to(torch.uint8)


def midrise_values(codes: torch.Tensor) -> torch.Tensor:
    """The levels ``2q - 3`` (``float32``, in scales) codes stand for."""
    return codes.to(torch.float32).mul_(2).sub_(LEVELS)


@attrs.frozen
class TwoBitQuantizer:
    """2-bit block quantization (``compression="int2"``).

    Attributes:
        block: elements per scale; a multiple of 4, at least 4.
    """

    block: int = attrs.field(default=256, validator=_check_block)

    def blocks(self, numel: int) -> int:
        """How many blocks (scales) ``numel`` elements need."""
        return -(-numel // self.block)

    def payload_nbytes(self, numel: int) -> int:
        """The bytes of one payload for ``numel`` elements: scales, codes and
        padding to a multiple of 4."""
        raw = self.blocks(numel) * _SCALE_BYTES + -(-numel // 4)
        return -(-raw // _SCALE_BYTES) * _SCALE_BYTES

    def _parts(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_payload(payload, self.payload_nbytes(numel), numel)
        scale_bytes = self.blocks(numel) * _SCALE_BYTES
        scales = payload[:scale_bytes].view(torch.float32)
        return scales, payload[scale_bytes : scale_bytes + -(-numel // 4)]

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize ``values`` (1-D, floating point) into ``out`` (1-D
        ``uint8`` of :meth:`payload_nbytes` bytes, written in place).

        Raises:
            ValueError: ``out`` has the wrong dtype or length, or ``values``
                is not a 1-D floating-point tensor.
        """
        check_values(values)
        numel = values.numel()
        scales, codes = self._parts(out, numel)
        if numel == 0:
            return
        rows = torch.zeros(self.blocks(numel) * self.block, dtype=torch.float32, device=out.device)
        rows[:numel].copy_(values)
        rows = rows.view(-1, self.block)
        largest = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
        scales.copy_(largest.div_(LEVELS))
        inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        # Clamped: x * (1 / s) may land a rounding step beyond 3 at the largest element.
        pack_bits(midrise_codes(rows.mul_(inverse.unsqueeze(1))).view(-1)[:numel], 2, codes)

    def decode(
        self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``float32`` values a payload for ``numel`` elements carries
        (written into ``out`` when given, a new tensor otherwise).

        Raises:
            ValueError: the payload's dtype or length does not fit ``numel``.
        """
        scales, codes = self._parts(payload, numel)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        if numel == 0:
            return out
        out.copy_(midrise_values(unpack_bits(codes, numel, 2)))
        whole = (numel // self.block) * self.block
        if whole:
            out[:whole].view(-1, self.block).mul_(scales[: whole // self.block, None])
        if whole < numel:
            out[whole:].mul_(scales[-1])
        return out
