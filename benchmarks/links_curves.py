"""DiLoCo's compute utilization against the link's rate in the shaped-link
benchmark: the DiLoCo papers' model, beside what the run measured (a table
and a figure)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# The shaped-link testbed is a package of the repository, not of the library:
# it imports from the repository's root.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from links_setup import (
    BLOCKING,
    DDP_NAME,
    FRAGMENTS,
    QUIET,
    WORLD,
    _ms,
    blocking_name,
    per_step,
    rate_label,
    streaming_delay,
    streaming_sync_every,
)
from report import Curve, Panel, md_table, paired_ratios

from testbed import links

CURVE_RATES = ("100mbit", "300mbit", "1gbit", "3gbit", "10gbit")
"""The rates of the utilization figure (the full run measures DiLoCo at
each; the quick run draws the model only)."""


def model_sync_seconds(nbytes: float, world: int, bits_per_second: float) -> float:
    """The DiLoCo papers' sync time: a ring all-reduce of ``nbytes``,
    ``2 nbytes (W - 1) / W`` bytes each way at the rate (full duplex)."""
    return 2 * nbytes * (world - 1) / world * 8 / bits_per_second


def model_utilization(step: float, sync: float, every: int, hidden: float = 0.0) -> float:
    """Compute utilization (a step with no communication / time per inner
    step) of a sync taking ``sync`` seconds every ``every`` inner steps of
    ``step`` seconds, of which ``hidden`` overlap inner steps:
    ``t / (t + max(0, sync - hidden) / H)``; blocking syncs hide nothing."""
    return step / (step + max(0.0, sync - hidden) / every)


def _curve_names(raw: Mapping[str, Any]) -> dict[str, str]:
    """The figure's runs: label -> the run's name in ``raw``."""
    return {
        DDP_NAME: DDP_NAME,
        **{f"blocking, H={h}": blocking_name(h) for h in BLOCKING},
        f"streaming int8, P={FRAGMENTS}": raw["long"],
    }


def model_curves(raw: Mapping[str, Any], rates: Sequence[float]) -> dict[str, list[float]]:
    """The papers' model at ``rates`` (bit/s) for one measurement's model
    (``numel`` fp32 parameters; the int8 fragment's payload) and its inner
    step with no communication: blocking at H = 1, 10, 50; streaming with
    the delay that covers the link (:func:`streaming_delay`)."""
    t = raw["quiet_step"]
    full = 4 * raw["numel"]
    frag = raw["fragment_link_bytes"] / 2  # every owner's payload, once
    curves: dict[str, list[float]] = {}
    for h, label in ((1, DDP_NAME), *((h, f"blocking, H={h}") for h in BLOCKING)):
        curves[label] = [model_utilization(t, model_sync_seconds(full, WORLD, r), h) for r in rates]
    streaming = []
    for r in rates:
        delay = streaming_delay(raw["fragment_link_bytes"], r, t)
        stride = streaming_sync_every(delay, FRAGMENTS) // FRAGMENTS
        sync = model_sync_seconds(frag, WORLD, r)
        streaming.append(model_utilization(t, sync, stride, hidden=delay * t))
    curves[f"streaming int8, P={FRAGMENTS}"] = streaming
    return curves


def measured_utilization(raw: Mapping[str, Any], name: str) -> float:
    """No-communication step time / time per inner step of run ``name``:
    1 / the median of the per-round ratios."""
    steps = raw["steps"]
    quiet = per_step(raw["times"][QUIET], steps[QUIET])
    return 1 / paired_ratios(per_step(raw["times"][name], steps[name]), quiet).median


def utilization_part(
    reference: Mapping[str, Any], curve: Mapping[str, Mapping[str, Any]] | None
) -> tuple[str, Panel]:
    """The utilization table and panel: the model at :data:`CURVE_RATES`
    from ``reference`` (a DiLoCo measurement), beside what ``curve`` (rate
    -> DiLoCo measurement, ``None`` in the quick run) measured."""
    bits = [float(links.parse_rate(r)) for r in CURVE_RATES]
    model = model_curves(reference, bits)
    x = [b / 1e9 for b in bits]
    curves = [Curve(f"{label} (model)", x, ys) for label, ys in model.items()]
    header = ["run", *(rate_label(b) for b in bits)]
    rows = [[f"{label} (model)", *(f"{y:.2f}" for y in ys)] for label, ys in model.items()]
    if curve:
        measured_rates = [r for r in CURVE_RATES if r in curve]
        mx = [links.parse_rate(r) / 1e9 for r in measured_rates]
        for label in model:
            ys = []
            for r in measured_rates:
                raw = curve[r]
                name = _curve_names(raw)[label]
                ys.append(measured_utilization(raw, name) if name in raw["times"] else math.nan)
            curves.append(Curve(f"{label} (measured)", mx, ys))
            cells = dict(zip(measured_rates, ys, strict=True))
            rows.append(
                [
                    f"{label} (measured)",
                    *(f"{cells[r]:.2f}" if r in cells else "-" for r in CURVE_RATES),
                ]
            )
    t, numel = reference["quiet_step"], reference["numel"]
    measured = (
        "measured at each rate (fewer rounds at the rates other than 1 and 10 Gbit/s), "
        "beside the model the DiLoCo papers use"
        if curve
        else "not measured in the quick run, which draws the model the DiLoCo papers use alone"
    )
    body = (
        f"**DiLoCo's compute utilization against the rate** (a step with no communication / "
        f"time per inner step; MLP {numel / 1e6:.1f}M params, t = {_ms(t)}): "
        f"{measured}: sync time = 2 N bytes "
        "(W - 1) / W / rate (N = 4 bytes a parameter for the fp32 blocking syncs, the int8 "
        "fragment's payload for streaming), utilization = t / (t + sync / H) for blocking "
        "syncs, and t / (t + max(0, sync - delay t) / stride) for streaming at the delay "
        "that covers the link. The model assumes full duplex; the shaped loopback is half "
        "duplex, so both ranks' bytes wait in one queue.\n\n" + md_table(header, rows)
    )
    panel = Panel(
        "DiLoCo: compute utilization against link rate (2 ranks)",
        "link rate (Gbit/s)",
        "no-communication step / time per inner step",
        curves,
        log_x=True,
    )
    return body, panel
