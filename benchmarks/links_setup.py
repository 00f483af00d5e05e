"""The shaped-link benchmark's set-up: what every other part of it imports.

The rates, what each rate runs (:class:`Sizes`), the set-ups and their
targets, the names of DiLoCo's runs, and a link's arithmetic: the time bytes
take on it, the bytes a fragment's sync puts on it, the delay that covers
them, and a ZeRO step's time beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import bench_compressed

from zerofn.blockquant import quantizer_for
from zerofn.diloco.fragments import plan_fragments

RATES = ("1gbit", "10gbit")
QUICK_RATES = ("1gbit",)
TARGET_RATE = "1gbit"
"""The rate the ZeRO, overlap and PowerSGD targets hold at."""

WORLD = 2

# ----------------------------------------------------------------------------
# What each rate runs (the child reads the same table)
# ----------------------------------------------------------------------------


@attrs.frozen
class Sizes:
    """Models and rounds of one run.

    Attributes:
        zero: ``(rounds, warmup)`` of the ZeRO step (its model is
            ``bench_zero.model_shapes(quick)``).
        overlap: ``(width, depth, rounds)`` of the DDP + ZeRO MLP.
        powersgd: ``(width, depth, rounds)`` of the PowerSGD MLP.
        diloco: ``(width, depth, rounds, warmup)`` of the DiLoCo MLP.
        curve: ``(rounds, warmup)`` of DiLoCo at the figure's rates other
            than :data:`RATES` (the same MLP, the figure's runs alone).
    """

    zero: tuple[int, int]
    overlap: tuple[int, int, int]
    powersgd: tuple[int, int, int]
    diloco: tuple[int, int, int, int]
    curve: tuple[int, int] = (3, 1)


SIZES = {
    False: Sizes(
        zero=(10, 2), overlap=(1024, 4, 10), powersgd=(1024, 4, 12), diloco=(768, 4, 24, 1)
    ),
    True: Sizes(zero=(2, 1), overlap=(256, 2, 2), powersgd=(256, 2, 2), diloco=(256, 2, 2, 1)),
}
MEASUREMENTS = ("zero", "overlap", "powersgd", "diloco")

# ZeRO: bench_compressed's set-ups (labels of its IMPLS) and their targets.
PYTORCH = bench_compressed.PYTORCH_DEFAULT
ZERO_SETUPS: dict[str, tuple[str | None, float]] = {
    # label: (codec, target at TARGET_RATE, zerofn / PyTorch)
    "zerofn exact": (None, 1.0),
    "zerofn int8": ("int8", 0.30),
    "zerofn int4": ("int4", 0.20),
}
ZERO_LABELS = (PYTORCH, *ZERO_SETUPS)
OVERLAP_TARGET = 0.75
POWERSGD_TARGET = 0.30

# DiLoCo: the runs, by name.
QUIET = "no communication"
QUIET_STEPS = 50
BLOCKING = (10, 50)
FRAGMENTS = 2
STREAM_COMPRESSION = "int8"
MIN_SYNC_EVERY = max(BLOCKING)
"""Streaming runs sync at least this seldom: the longer blocking run's ``H``,
so each streaming figure has a blocking twin that moves the same bytes per
inner step (the streaming papers sync every 100 inner steps)."""
LONG_TARGET = 1.05
DELAY_1_TARGET = 1.10
CODEC = "int8 sync arithmetic alone (both ranks, simulated)"
DDP_NAME = "DDP (H = 1)"
"""DiLoCo's reference run: DDP's built-in all-reduce every inner step."""
DDP_STEPS = 2


def blocking_name(h: int) -> str:
    return f"blocking, H={h}"


def streaming_name(delay: int) -> str:
    return f"streaming int8, P={FRAGMENTS}, delay {delay}"


def covering_name(delay: int) -> str:
    """The streaming run whose delay covers the link."""
    return f"{streaming_name(delay)} (covers the link)"


# ----------------------------------------------------------------------------
# A link's arithmetic: the link, the delay, a step beside the wire
# ----------------------------------------------------------------------------


def rate_label(bits_per_second: float) -> str:
    """``1 Gbit/s``, ``100 Mbit/s``."""
    if bits_per_second >= 1e9:
        return f"{bits_per_second / 1e9:g} Gbit/s"
    return f"{bits_per_second / 1e6:g} Mbit/s"


def link_seconds(nbytes: float, bits_per_second: float) -> float:
    """The time ``nbytes`` take on the link: ``nbytes * 8 / rate`` (headers
    not counted). On the shaped loopback both ranks' bytes pass one queue, so
    ``nbytes`` is what all ranks send together."""
    return nbytes * 8 / bits_per_second


def fragment_link_bytes(sizes: Sequence[int], fragments: int, compression: str) -> int:
    """The bytes the largest fragment's compressed DiLoCo sync puts on a
    half-duplex link between 2 ranks: each rank's codes of the other owner's
    slice (the all-to-all) and each owner's codes of its new anchor slice
    (broadcast to the other), twice every owner's payload in all
    (:func:`zerofn.diloco.compressed_sync.compressed_sync_bytes` counts
    what a rank hands to the collectives, not what crosses)."""
    quantizer = quantizer_for(compression)
    plan = plan_fragments(list(sizes), fragments, WORLD)
    return max(2 * sum(quantizer.payload_nbytes(n) for n in f.lengths) for f in plan.fragments)


def streaming_delay(link_bytes: float, bits_per_second: float, step_seconds: float) -> int:
    """The delay (inner steps) that covers one sync's link time:
    ``ceil(link_bytes * 8 / rate / step_seconds)``, at least 1."""
    if step_seconds <= 0:
        raise ValueError(f"an inner step must take time, got {step_seconds} s")
    return max(1, math.ceil(link_seconds(link_bytes, bits_per_second) / step_seconds))


def streaming_sync_every(delay: int, fragments: int, at_least: int = MIN_SYNC_EVERY) -> int:
    """The smallest ``H >= at_least``, a multiple of ``fragments``, whose
    stride ``H / fragments`` exceeds ``delay`` (DiLoCo requires it)."""
    stride = max(-(-at_least // fragments), delay + 1)
    return stride * fragments


def delay_formula(
    link_bytes: float, bits_per_second: float, step_seconds: float, fragments: int = FRAGMENTS
) -> str:
    """The page's line computing the delay, with this run's numbers."""
    delay = streaming_delay(link_bytes, bits_per_second, step_seconds)
    h = streaming_sync_every(delay, fragments)
    rate, link, step = (
        rate_label(bits_per_second),
        link_seconds(link_bytes, bits_per_second),
        step_seconds,
    )
    return (
        f"delay = ceil(B x 8 / R / t) = ceil({link_bytes:,.0f} x 8 / {rate} / "
        f"{step * 1e3:.2f} ms) = ceil({link * 1e3:.2f} ms / {step * 1e3:.2f} ms) = {delay}, "
        f"so H = {h} (P = {fragments}, stride {h // fragments} > delay)"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.2f} ms"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def compressed_step_model(
    update: float, codec: float, nbytes: float, bits_per_second: float
) -> float:
    """A compressed ZeRO step with the update and the codec beside the wire:
    ``max(link time of its bytes, update + codec)``."""
    return max(link_seconds(nbytes, bits_per_second), update + codec)


def pytorch_step_model(update: float, nbytes: float, bits_per_second: float) -> float:
    """PyTorch's ZeRO step: the update, then its fp32 bytes on the link."""
    return update + link_seconds(nbytes, bits_per_second)


def per_step(times: Sequence[float], steps: int) -> list[float]:
    return [t / steps for t in times]
