"""Top-k sparsification per chunk: the k largest magnitudes of every chunk,
their offsets in it and their values in 2 or 8 bits.

A vector is cut into chunks of ``chunk`` elements (the last one shorter).
Of a chunk of ``m`` elements exactly ``k(m) = min(m, ceil(density * m))``
are kept: the largest in magnitude, ties broken by the lowest offset first,
so the choice is a pure function of the values. Everything else decodes to
zero. Because ``k`` is fixed by the chunk's length, a payload's size is
known from the element count alone, before any value is seen: ranks that
exchange these payloads agree on their sizes without asking each other.

A kept element travels as its offset in the chunk (``ceil(log2(chunk))``
bits, packed end to end: 11 bits at the default chunk of 2048) and its
value. With ``bits=2`` the value is a sign bit and a level bit: the kept
magnitudes of a chunk lie in ``[low, high]`` (its smallest and largest kept
magnitude, two ``float32`` per chunk), and the two levels sit a quarter of
that range in from either end, so every kept value comes back within
``(high - low) / 4``. (Levels spread over ``[-high, high]``, as
:mod:`zerofn.twobit`'s, would spend half of them on magnitudes below the
cut, where nothing is kept, and inflate the smallest kept values up to a
third of the largest; error feedback then pushes them back sync after sync.)
With ``bits=8`` the value is an int8 code with one scale per chunk,
``s = high / 127``: within ``s / 2``. Rounding is deterministic, so every
rank decodes identical bytes. Payload::

    [ scales: float32 x (2 or 1) x chunks | value codes | offsets | pad to 4 ]

At density 0.02, 2 bits and chunks of 2048 that is
``(41 x (2 + 11) / 8 + 8) / 2048`` = 0.0364 bytes per element: 1/110 of
``float32``. Offsets within chunks are what make it: ``int32`` indices
would cost 0.02 x 4 = 0.08 bytes per element alone (1/50).
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch

from zerofn.bitpack import check_payload, check_values, pack_bits, packed_nbytes, unpack_bits

__all__ = ["TopK"]

_SCALE_BYTES = 4


def _density(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"density is the fraction of each chunk sent, a number in (0, 1], "
            f"got {type(value).__name__}"
        )
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(
            f"density is the fraction of each chunk sent; it must lie in (0, 1], got {value}; "
            "e.g. 0.02 sends 2% of the elements"
        )
    return float(value)


def _check_bits(_: object, __: object, value: object) -> None:
    if value not in (2, 8) or isinstance(value, bool):
        raise ValueError(f"bits are the kept values' code width: 2 or 8, got {value!r}")


def _check_chunk(_: object, __: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"chunk must be an int >= 2 (elements per chunk; offsets take ceil(log2(chunk)) "
            f"bits), got {value!r}; the default is 2048"
        )


@attrs.frozen
class TopK:
    """Top-k per chunk (``compression=TopK(density=0.02, bits=2)``).

    Attributes:
        density: the fraction of each chunk kept, in (0, 1].
        bits: the kept values' code width: 2 or 8.
        chunk: elements per chunk (each with one scale); at least 2.
    """

    density: float = attrs.field(default=0.02, converter=_density)
    bits: Literal[2, 8] = attrs.field(default=2, validator=_check_bits)
    chunk: int = attrs.field(default=2048, validator=_check_chunk)

    @property
    def index_bits(self) -> int:
        """Bits per offset: enough for ``chunk - 1``."""
        return max(1, (self.chunk - 1).bit_length())

    def k_of(self, length: int) -> int:
        """Elements kept of a chunk of ``length`` elements: ``ceil(density *
        length)`` (at least one of a non-empty chunk), at most ``length``."""
        if length == 0:
            return 0
        # Rounded first, so that 0.07 * 100 = 7.000000000000001 keeps 7, not 8.
        return min(length, max(1, math.ceil(round(self.density * length, 9))))

    def _lengths(self, numel: int) -> tuple[int, int, int]:
        """Full chunks, the last partial chunk's length (0: none), elements kept."""
        full, tail = divmod(numel, self.chunk)
        return full, tail, full * self.k_of(self.chunk) + self.k_of(tail)

    def kept(self, numel: int) -> int:
        """Elements a payload for ``numel`` elements carries."""
        return self._lengths(numel)[2]

    def _value_nbytes(self, kept: int) -> int:
        return kept if self.bits == 8 else packed_nbytes(kept, 2)

    def payload_nbytes(self, numel: int) -> int:
        """The bytes of one payload for ``numel`` elements: scales, value
        codes, offsets and padding to a multiple of 4; a function of
        ``numel`` alone."""
        full, tail, kept = self._lengths(numel)
        chunks = full + (tail > 0)
        raw = (
            chunks * self.scales_per_chunk * _SCALE_BYTES
            + self._value_nbytes(kept)
            + packed_nbytes(kept, self.index_bits)
        )
        return -(-raw // _SCALE_BYTES) * _SCALE_BYTES

    def _parts(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, ...]:
        check_payload(payload, self.payload_nbytes(numel), numel)
        full, tail, kept = self._lengths(numel)
        a = (full + (tail > 0)) * self.scales_per_chunk * _SCALE_BYTES
        b = a + self._value_nbytes(kept)
        c = b + packed_nbytes(kept, self.index_bits)
        return payload[:a].view(torch.float32), payload[a:b], payload[b:c]

    def _rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The chunks as 2-D views: the full ones as one matrix, the tail as one row."""
        full, tail, _ = self._lengths(values.numel())
        rows = []
        if full:
            rows.append(values[: full * self.chunk].view(full, self.chunk))
        if tail:
            rows.append(values[full * self.chunk :].view(1, tail))
        return rows

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """The offsets kept in each chunk of ``values`` (1-D): ``k(m)`` per
        chunk of ``m`` elements, ascending within a chunk, chunk after chunk
        (``int64``, 1-D)."""
        parts = [self._select(rows).reshape(-1) for rows in self._rows(values)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _select(self, rows: torch.Tensor) -> torch.Tensor:
        k = self.k_of(rows.shape[1])
        magnitude = rows.abs()
        # The k-th largest magnitude of each row; above it everything is kept, at
        # it the lowest offsets first (torch.topk breaks ties in no set order).
        cut = torch.topk(magnitude, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        above = magnitude > cut
        at = magnitude == cut
        wanted = k - above.sum(dim=1, keepdim=True)
        crowded = (at.sum(dim=1, keepdim=True) > wanted).view(-1)
        if bool(crowded.any()):  # more ties at the cut than places: the first ones
            tied = crowded.nonzero().view(-1)
            at[tied] &= at[tied].cumsum(dim=1) <= wanted[tied]
        chosen = above | at
        # Row-major nonzero: each row's offsets ascending, k per row.
        return chosen.nonzero()[:, 1].view(rows.shape[0], k)

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Keep ``values``' (1-D, floating point) top ``k`` of every chunk
        in ``out`` (1-D ``uint8`` of :meth:`payload_nbytes` bytes, written
        in place).

        Raises:
            ValueError: ``out`` has the wrong dtype or length, or ``values``
                is not a 1-D floating-point tensor.
        """
        check_values(values)
        numel = values.numel()
        scales, codes, offsets = self._parts(out, numel)
        if numel == 0:
            return
        kept_offsets, kept_scales, kept_codes = [], [], []
        for rows in self._rows(values.to(torch.float32)):
            chosen = self._select(rows)
            kept_offsets.append(chosen.reshape(-1))
            chunk_scales, chunk_codes = self._quantize(rows.gather(1, chosen))
            kept_scales.append(chunk_scales.reshape(-1))
            kept_codes.append(chunk_codes.reshape(-1))
        scales.copy_(torch.cat(kept_scales))
        if self.bits == 8:
            codes.view(torch.int8).copy_(torch.cat(kept_codes))
        else:
            pack_bits(torch.cat(kept_codes), 2, codes)
        pack_bits(torch.cat(kept_offsets), self.index_bits, offsets)

    @property
    def scales_per_chunk(self) -> int:
        """``float32`` scales per chunk: one for int8 codes, two for 2-bit ones."""
        return 1 if self.bits == 8 else 2

    def _quantize(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's scales and its kept values' codes."""
        magnitude = kept.abs()
        if self.bits == 8:
            scale = magnitude.amax(dim=1, keepdim=True) / 127
            inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
            return scale, kept.mul(inverse).round_().clamp_(-127, 127)
        # Kept magnitudes lie in [low, high]: a sign bit and a bit for the lower
        # or upper level, (high - low) / 4 in from either end, waste no level
        # on magnitudes below the cut, where nothing was kept.
        low = magnitude.amin(dim=1, keepdim=True)
        high = magnitude.amax(dim=1, keepdim=True)
        upper = (magnitude >= (low + high) / 2).to(torch.uint8)
        return torch.cat([low, high], dim=1), (kept < 0).to(torch.uint8) | (upper << 1)

    def _levels(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The values of ``codes`` (one row per chunk) under each row's ``scales``."""
        if self.bits == 8:
            return codes.to(torch.float32).mul_(scales)
        low, high = scales[:, :1], scales[:, 1:]
        step = ((codes >> 1) & 1).to(torch.float32).mul_(2).add_(1).div_(4)
        magnitude = low + (high - low) * step
        return torch.where((codes & 1).bool(), -magnitude, magnitude)

    def decode(
        self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``float32`` values a payload for ``numel`` elements carries:
        the kept ones, zeros elsewhere (written into ``out`` when given, a
        new tensor otherwise).

        Raises:
            ValueError: the payload's dtype or length does not fit ``numel``.
        """
        scales, codes, offsets = self._parts(payload, numel)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        out.zero_()
        if numel == 0:
            return out
        full, tail, kept = self._lengths(numel)
        if self.bits == 8:
            all_codes = codes.view(torch.int8)
        else:
            all_codes = unpack_bits(codes, kept, 2).to(torch.uint8)
        where = unpack_bits(offsets, kept, self.index_bits)
        per = self.scales_per_chunk
        chunk_scales = scales.view(-1, per)
        k = self.k_of(self.chunk)
        if full:
            rows = out[: full * self.chunk].view(full, self.chunk)
            vals = self._levels(chunk_scales[:full], all_codes[: full * k].view(full, k))
            rows.scatter_(1, where[: full * k].view(full, k), vals)
        if tail:
            vals = self._levels(chunk_scales[full:], all_codes[full * k :].view(1, -1))
            out[full * self.chunk :][where[full * k :]] = vals.view(-1)
        return out
