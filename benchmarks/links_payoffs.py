"""Where each feature of the shaped-link benchmark starts to pay: the rate
below which the bytes it saves take as long on the link as its arithmetic,
from the parts of one rate's run (a table, and a block quoted on each
feature's page)."""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# The shaped-link testbed is a package of the repository, not of the library:
# it imports from the repository's root.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import attrs
import bench_compressed
import bench_hooks
from links_setup import (
    BLOCKING,
    DDP_NAME,
    FRAGMENTS,
    PYTORCH,
    TARGET_RATE,
    WORLD,
    ZERO_SETUPS,
    _mb,
    _ms,
    blocking_name,
    link_seconds,
    rate_label,
)
from report import md_table

from testbed import links

EVERY_RATE = math.inf
"""A pay-off rate meaning: at every rate where bytes cost anything."""

PAYS_AT = {
    "compressed": "pays-at-compressed",
    "powersgd": "pays-at-powersgd",
    "overlap": "pays-at-overlap",
    "diloco": "pays-at-diloco",
}
"""Each feature's generated block (quoted on its page) by measurement."""


def crossover_rate(nbytes: float, seconds: float) -> float:
    """The rate (bit/s) at which ``nbytes`` take ``seconds`` on the link:
    ``8 x nbytes / seconds``. Below it the bytes take longer than the
    seconds. ``EVERY_RATE`` where ``seconds <= 0`` (nothing to pay back:
    saving bytes pays wherever they cost anything); 0 where ``nbytes <= 0``
    (nothing saved: it never pays)."""
    if nbytes <= 0:
        return 0.0
    if seconds <= 0:
        return EVERY_RATE
    return nbytes * 8 / seconds


def compressed_pays_below(fp32_bytes: float, codec: float) -> float:
    """The rate below which a compressed exchange beats PyTorch's fp32 one.

    With the update and the codec beside the wire the compressed step costs
    ``max(8 B_c / R, u + c)`` and PyTorch's ``u + 8 B_32 / R``; ``B_c <
    B_32``, so the first is smaller exactly when ``c < 8 B_32 / R``:
    ``R* = 8 B_32 / c`` (its own bytes' link time and the update drop out).
    """
    return crossover_rate(fp32_bytes, codec)


def rate_phrase(bits_per_second: float) -> str:
    """``below 1.6 Gbit/s``, ``at every rate``, ``at no rate``."""
    if bits_per_second == EVERY_RATE:
        return "at every rate"
    if bits_per_second <= 0:
        return "at no rate"
    return f"below {rate_label(bits_per_second)}"


def _sig(bits_per_second: float) -> float:
    """``bits_per_second`` to 2 significant figures (a crossover is no
    more precise than the medians it comes from)."""
    if bits_per_second <= 0 or bits_per_second == EVERY_RATE:
        return bits_per_second
    return float(f"{bits_per_second:.2g}")


@attrs.frozen
class PayOff:
    """Where one feature starts to pay against what it replaces.

    Attributes:
        feature: what pays (``int8 exchange``).
        against: what it replaces.
        rate: bit/s below which it pays; ``EVERY_RATE`` or 0.
        how: the formula with this run's numbers.
    """

    feature: str
    against: str
    rate: float
    how: str

    def row(self) -> list[str]:
        return [self.feature, self.against, rate_phrase(_sig(self.rate)), self.how]


def compressed_payoffs(raw: Mapping[str, Any], bits_per_second: float) -> list[PayOff]:
    """The int8 and int4 exchange against PyTorch's ZeRO step, from one
    rate's ZeRO measurement: PyTorch's bytes on the link per step and each
    codec alone (one rank's, medians)."""
    times: Mapping[str, Sequence[float]] = raw["times"]
    fp32 = raw["on_link"][PYTORCH]
    out = []
    for label, (codec, _) in ZERO_SETUPS.items():
        if codec is None:
            continue
        work = statistics.median(times[bench_compressed.CODEC_ALONE[codec]])
        update = statistics.median(times[bench_compressed.UPDATE])
        mine = raw["on_link"][label]
        rate = compressed_pays_below(fp32, work)
        out.append(
            PayOff(
                f"{codec} exchange (ZeRO step)",
                "PyTorch's ZeroRedundancyOptimizer (fp32)",
                rate,
                f"step max(8 B_c / R, u + c) against u + 8 B_32 / R: pays while c < 8 B_32 / R, "
                f"R* = 8 x {_mb(fp32)} / {_ms(work)} (PyTorch's bytes on the link per step / "
                f"the {codec} codec alone; its own {_mb(mine)} hide behind the update and the "
                f"codec above {rate_label(_sig(crossover_rate(mine, update + work)))})",
            )
        )
    return out


def powersgd_payoff(raw: Mapping[str, Any], bits_per_second: float) -> PayOff:
    """zerofn's PowerSGD against DDP's all-reduce: its compression
    arithmetic (what its iteration spends beside its bytes' link time, less
    what DDP's spends beside its own) against the bytes it saves."""
    times: Mapping[str, Sequence[float]] = raw["times"]
    ours, theirs = raw["on_link"]["zerofn"], raw["on_link"][bench_hooks.BUILTIN]
    beside = statistics.median(times["zerofn"]) - link_seconds(ours, bits_per_second)
    ddp_beside = statistics.median(times[bench_hooks.BUILTIN]) - link_seconds(
        theirs, bits_per_second
    )
    arithmetic = beside - ddp_beside
    rate = crossover_rate(theirs - ours, arithmetic)
    return PayOff(
        f"PowerSGD rank {bench_hooks.RANK}",
        "DDP's all-reduce",
        rate,
        f"R* = 8 x (B_DDP - B_PowerSGD) / a = 8 x ({_mb(theirs)} - {_mb(ours)}) / "
        f"{_ms(arithmetic)}, a = what its iteration spends beside its bytes' link time "
        f"({_ms(beside)}) less what DDP's does ({_ms(ddp_beside)}), at "
        f"{rate_label(bits_per_second)}",
    )


def overlap_payoff(raw: Mapping[str, Any], bits_per_second: float) -> PayOff:
    """The overlapped DDP + ZeRO step against DDP + PyTorch's separate step:
    fewer bytes and no extra arithmetic."""
    mine, theirs = raw["on_link"]["overlapped"], raw["on_link"]["pytorch"]
    saved = theirs - mine
    rate = crossover_rate(saved, 0.0)
    if saved <= 0:
        how = (
            f"it puts {_mb(mine)} on the link per iteration against {_mb(theirs)}: no fewer "
            "bytes, so nothing to gain from a slower link"
        )
    else:
        how = (
            f"{_mb(mine)} on the link per iteration against {_mb(theirs)} "
            f"({mine / theirs:.2f} of the bytes) and no extra arithmetic: it saves "
            f"8 x {_mb(saved)} / R a step, {_ms(link_seconds(saved, bits_per_second))} at "
            f"{rate_label(bits_per_second)}"
        )
    return PayOff("overlapped DDP + ZeRO step", "DDP + PyTorch's separate ZeRO step", rate, how)


def diloco_payoffs(raw: Mapping[str, Any], bits_per_second: float) -> list[PayOff]:
    """DiLoCo against DDP, per inner step: blocking H (fewer bytes, no
    extra arithmetic) and streaming int8 (its sync's arithmetic per inner
    step against the bytes it saves; its sync hidden behind ``delay`` inner
    steps from ``8 B / (delay t)`` up)."""
    steps: Mapping[str, int] = raw["steps"]
    wire: Mapping[str, float] = raw["wire"]
    if DDP_NAME in wire:
        ddp = wire[DDP_NAME] / steps[DDP_NAME]
        source = f"DDP's {_mb(ddp)} per step"
    else:  # a blocking sync all-reduces what DDP's gradient all-reduce does
        h = BLOCKING[0]
        ddp = wire[blocking_name(h)]
        source = f"DDP's {_mb(ddp)} per step (one blocking sync's bytes)"
    out = []
    for h in BLOCKING:
        mine = wire[blocking_name(h)] / steps[blocking_name(h)]
        out.append(
            PayOff(
                f"DiLoCo blocking, H={h}",
                DDP_NAME,
                crossover_rate(ddp - mine, 0.0),
                f"{_mb(mine)} on the link per inner step against {source} and no extra arithmetic",
            )
        )
    long: str = raw["long"]
    t: float = raw["quiet_step"]
    mine = wire[long] / steps[long]
    stride = raw["sync_every"] // FRAGMENTS
    codec = statistics.median(raw["codec"]) / WORLD
    frag = raw["fragment_link_bytes"]
    hide_1 = crossover_rate(frag, t)
    out.append(
        PayOff(
            f"Streaming DiLoCo int8, P={FRAGMENTS}",
            DDP_NAME,
            crossover_rate(ddp - mine, codec / stride),
            f"R* = 8 x (B_DDP - B) / (a / stride) = 8 x ({_mb(ddp)} - {_mb(mine)}) / "
            f"({_ms(codec)} / {stride}), a its int8 sync's arithmetic; its sync "
            f"({frag:,} bytes on the link) hides behind delay d inner steps of {_ms(t)} "
            f"from R = 8 B / (d t) up: {rate_label(_sig(hide_1))} at delay 1, "
            f"{rate_label(_sig(crossover_rate(frag, raw['delays'][long] * t)))} at the "
            f"delay used here ({raw['delays'][long]})",
        )
    )
    return out


def payoffs(
    measured: Mapping[str, Mapping[str, Any]], bits_per_second: float
) -> dict[str, list[PayOff]]:
    """Every feature's pay-off from one rate's measurements (by measurement)."""
    makers: dict[str, Callable[[Mapping[str, Any], float], list[PayOff]]] = {
        "zero": compressed_payoffs,
        "powersgd": lambda raw, bits: [powersgd_payoff(raw, bits)],
        "overlap": lambda raw, bits: [overlap_payoff(raw, bits)],
        "diloco": diloco_payoffs,
    }
    return {
        ("compressed" if name == "zero" else name): make(measured[name], bits_per_second)
        for name, make in makers.items()
        if name in measured
    }


PAYOFF_HEADER = ["feature", "against", "starts to pay", "from this run's parts"]


def payoff_table(rows: Sequence[PayOff]) -> str:
    return md_table(PAYOFF_HEADER, [p.row() for p in rows])


def payoff_part(
    results: Mapping[str, Mapping[str, Any]],
) -> tuple[str, dict[str, str]]:
    """The section's pay-off table and each feature's block, from the run at
    :data:`TARGET_RATE` (else the first rate measured)."""
    rate = TARGET_RATE if TARGET_RATE in results else next(iter(results))
    bits = links.parse_rate(rate)
    found = payoffs(results[rate], bits)
    where = (
        f"from the parts measured at {rate_label(bits)} in this run: bytes on the link from "
        "the loopback's counter, the codec and arithmetic alone, medians"
    )
    body = (
        f"**Where each feature starts to pay**, {where}. A feature that saves bytes at "
        "the price of arithmetic pays below the "
        "rate R* at which the bytes it saves take as long on the link as the arithmetic "
        "takes, R* = 8 x bytes / seconds; one that saves bytes and adds no arithmetic pays "
        "at every rate where bytes cost anything.\n\n"
        + payoff_table([p for rows in found.values() for p in rows])
    )
    blocks = {
        PAYS_AT[name]: f"Computed {where}.\n\n{payoff_table(rows)}" for name, rows in found.items()
    }
    return body, blocks
