"""DiLoCo's hyperparameters: one frozen record, checked when it is built.

:class:`DiLoCoConfig` holds what the user chose and never changes during
training; what does change (the inner step count, the sync in flight) lives
in :mod:`zerofn.diloco.state`. Every invariant the schedule relies on is
checked here, with an error that says what to pass instead.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from zerofn.blockquant import BlockQuantizer, quantizer_for
from zerofn.topk import TopK
from zerofn.twobit import TwoBitQuantizer

__all__ = ["Codec", "Compression", "DiLoCoConfig", "codec_for"]


@runtime_checkable
class Codec(Protocol):
    """What a compressed sync needs of a codec: payload sizes known from the
    element count alone (so no rank asks another how much it sends), and a
    decode that is a pure function of the payload's bytes (so every rank
    that decodes the same payload gets the same values, bit for bit)."""

    def payload_nbytes(self, numel: int) -> int:
        """The bytes of one payload for ``numel`` elements."""
        ...

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Encode ``values`` (1-D, ``float32``) into ``out`` (``uint8``)."""
        ...

    def decode(
        self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``float32`` values ``payload`` carries."""
        ...


CODECS = (BlockQuantizer, TwoBitQuantizer, TopK)
"""The codec types a configuration takes as they are."""

Compression = str | BlockQuantizer | TwoBitQuantizer | TopK | None
"""How pseudo-gradients travel: ``None`` (fp32), ``"int8"``, ``"int4"``,
``"int2"``, a :class:`~zerofn.topk.TopK` (top-k per chunk), or a
:class:`~zerofn.blockquant.BlockQuantizer` or
:class:`~zerofn.twobit.TwoBitQuantizer` (another block length)."""

NAMES = ("int8", "int4", "int2")
"""The codecs a name stands for: int8 and int4 block quantization (blocks of
128), 2-bit block quantization (blocks of 256)."""


def _int_at_least(name: str, low: int) -> Any:
    def check(_: object, __: object, value: object) -> None:
        # bool is an int subclass, but True as a count is surely a mistake.
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")

    return check


def _mixing(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"mixing must be a number in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            f"mixing is the weight of the local values when a sync's result is applied; "
            f"it must lie in [0, 1], got {value}"
        )
    return float(value)


def codec_for(value: Compression) -> BlockQuantizer | TwoBitQuantizer | TopK | None:
    """The codec ``compression`` stands for (``None``: fp32 syncs).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither ``None``, a name nor a codec.
    """
    if value is None or isinstance(value, CODECS):
        return value
    if isinstance(value, str):
        if value == "int2":
            return TwoBitQuantizer()
        if value not in NAMES:
            raise ValueError(
                f"unknown compression {value!r}; choose one of {', '.join(NAMES)}, "
                "zerofn.topk.TopK(density=0.02, bits=2) or None"
            )
        return quantizer_for(value)
    raise TypeError(
        f"compression must be None, 'int8', 'int4', 'int2', a zerofn.topk.TopK (e.g. "
        "TopK(density=0.02, bits=2)), a zerofn.blockquant.BlockQuantizer or a "
        f"zerofn.twobit.TwoBitQuantizer, got {value!r}"
    )


@attrs.frozen
class DiLoCoConfig:
    """What DiLoCo does, fixed for a run.

    Every ``sync_every`` inner steps each fragment of the parameters is
    synced once: the workers' mean is formed, the outer optimizer steps the
    anchor with the pseudo-gradient ``anchor - mean``, and the result is
    merged into the parameters ``delay`` inner steps after the sync began.

    Attributes:
        sync_every: inner steps between two syncs of the same fragment (the
            paper's H); at least 1.
        fragments: how many contiguous fragments the flat parameter vector is
            cut into (Streaming DiLoCo's P); they sync in turn, one every
            ``sync_every // fragments`` steps. Must divide ``sync_every``.
        delay: inner steps between a sync's start and the step its result is
            applied at (Streaming DiLoCo's tau), overlapped with those steps;
            below ``sync_every // fragments``, so at most one sync is in flight.
        mixing: the weight of the local values when a result is applied:
            ``params = mixing * local + (1 - mixing) * global``. 0 replaces
            the parameters by the global values (DiLoCo); Streaming DiLoCo
            keeps part of the progress made during the delay (0.5 there).
        compression: the codec pseudo-gradients and anchor updates travel
            with (``"int8"``/``"int4"``/``"int2"`` convert; a
            :class:`~zerofn.topk.TopK` sends the top entries of each chunk),
            or ``None`` for fp32.

    Raises:
        TypeError: a count that is not an int, or an unknown kind of compression.
        ValueError: ``sync_every < 1``, ``fragments < 1``, ``fragments`` not
            dividing ``sync_every``, ``delay < 0`` or
            ``delay >= sync_every // fragments``, ``mixing`` outside [0, 1],
            or an unknown compression name.
    """

    sync_every: int = attrs.field(validator=_int_at_least("sync_every", 1))
    fragments: int = attrs.field(default=1, validator=_int_at_least("fragments", 1))
    delay: int = attrs.field(default=0, validator=_int_at_least("delay", 0))
    mixing: float = attrs.field(default=0.0, converter=_mixing)
    compression: BlockQuantizer | TwoBitQuantizer | TopK | None = attrs.field(
        default=None, converter=codec_for
    )

    def __attrs_post_init__(self) -> None:
        # Checked together, once each count has passed its own validator.
        if self.sync_every % self.fragments:
            divisors = [d for d in range(1, self.sync_every + 1) if self.sync_every % d == 0]
            raise ValueError(
                f"fragments={self.fragments} does not divide sync_every={self.sync_every}, so "
                f"the fragments could not sync evenly staggered; use one of {divisors}"
            )
        if self.delay >= self.stride:
            raise ValueError(
                f"delay={self.delay} must be below sync_every // fragments = {self.stride}: a "
                "fragment's result must be applied before the next fragment's sync starts; "
                f"use delay <= {self.stride - 1}, fewer fragments, or a larger sync_every"
            )

    @property
    def stride(self) -> int:
        """Inner steps between two consecutive syncs (of different fragments)."""
        return self.sync_every // self.fragments
