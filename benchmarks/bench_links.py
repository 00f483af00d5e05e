"""On shaped links: the features that save bytes, where a byte costs time.

Everything zerofn adds to communication saves bytes, and between two
processes on one machine a byte costs almost nothing. Here the two gloo ranks
run inside a network namespace whose loopback is shaped to a rate
(:func:`testbed.links.shaped_loopback`: a ``tbf`` on ``lo``), 1 Gbit/s
and 10 Gbit/s. One ``tbf`` on the one loopback shapes both directions
together: the link is half duplex, the two ranks share one rate, and the
bytes both ranks send all pass the same queue. The ranks must live in the
namespace, so this process (outside it) starts a child Python inside it
(``ip netns exec``, with ``GLOO_SOCKET_IFNAME=lo``), which runs the other
benchmarks' per-rank functions through ``run_local_world`` and writes their
raw timings as JSON; this process reads them and makes the tables. At each
rate, zerofn and PyTorch take turns in the same run (``report.take_turns``;
ratios are medians of per-round ratios, with their quartiles):

1. **ZeRO step** (``bench_compressed``'s per-rank function, Adam,
   ``bench_zero``'s ~20.7M parameters in 60 tensors): zerofn exact, int8 and
   int4 against PyTorch's ``ZeroRedundancyOptimizer`` at its default, beside
   the parts alone in the same rounds (the update; each exchange's bytes
   broadcast from their owners; each codec).
2. **DDP + ZeRO** (``bench_overlap``'s): the step overlapped with backward
   against DDP's built-in all-reduce + PyTorch's separate ZeRO step, beside
   the parts alone; the bytes each collective put on the link are read from
   the loopback's counter (``/proc/net/dev`` inside the namespace) for the
   reduce, the all-reduce and the broadcast alone.
3. **DDP + PowerSGD rank 4** (``bench_hooks``'s): zerofn's hook against DDP's
   built-in all-reduce and PyTorch's ``powerSGD_hook``. Should PyTorch's hook
   abort the ranks (it does on some models with gloo, see
   ``docs/powersgd.md``), the run is repeated without it and the table says so.
4. **DiLoCo** (``bench_diloco``'s model, inner AdamW): time per inner step
   against inner steps with no communication, blocking (H = 10, 50) and
   streaming with int8 (P = 2 fragments, H = 50 as the blocking run it is
   set beside, or more where the delay needs it) at a delay long enough for the link
   (:func:`streaming_delay`, from the fragment's bytes, the rate and the
   fastest inner step measured at the start of the run) and at delay 1.

The targets: at 1 Gbit/s, ZeRO exact / PyTorch <= 1.0, int8 <= 0.30,
int4 <= 0.20, the overlapped iteration / PyTorch's <= 0.75, PowerSGD /
DDP's all-reduce <= 0.30; at every rate, streaming DiLoCo int8 with its
delay <= 1.05 and at delay 1 <= 1.10 a step with no communication. A missed
target says why from parts of the same run: the link time of the bytes alone
(bytes x 8 / rate), the codec alone, the update alone.

These measurements shape the rate alone (a link between nodes in one
place); the loss-against-time figure below adds a WAN's delay. Where
namespaces cannot be made at all, the section says why and measures nothing.

From the parts of the run at 1 Gbit/s the section computes where each
feature starts to pay (:func:`payoff_part`: a table, and a block quoted on
each feature's page): a feature that trades arithmetic for bytes pays below
the rate at which the bytes it saves take as long as its arithmetic,
``R* = 8 x bytes / seconds`` (the int8 and int4 exchange, their update and
codec beside the wire: ``8 x PyTorch's fp32 bytes / the codec alone``); one that only
saves bytes (the overlapped step, blocking DiLoCo) at every rate.

A figure: DiLoCo's compute utilization (a step with no communication / time
per inner step) against the rate (:data:`CURVE_RATES`, 0.1 to 10 Gbit/s) for
H = 1 (DDP), 10, 50 and streaming, beside the DiLoCo papers' model (sync time
= 2 N bytes (W - 1) / W / rate; utilization t / (t + sync / H) for blocking
syncs). The full run measures DiLoCo alone at the rates other than 1 and 10
Gbit/s, with fewer rounds; the quick run draws the model only. A second
figure (:mod:`bench_loss_time`): the demo's model trained by DDP, ZeRO, ZeRO +
PowerSGD and DiLoCo on two nodes joined by 100 Mbit/s with 20 ms each way
(the testbed's delay line), held-out loss against training time.

Run ``python benchmarks/bench_links.py`` for this section alone (as root;
``--quick``: one short case at 1 Gbit/s with tiny models, for CI);
``make bench`` runs it first through ``run_all.py``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# The shaped-link testbed is a package of the repository, not of the library:
# it imports from the repository's root.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import attrs
import bench_compressed
import bench_diloco
import bench_hooks
import bench_loss_time
import bench_overlap
import torch
import torch.distributed as dist
from report import (
    Curve,
    Headline,
    Panel,
    Section,
    Spread,
    floor_verdict,
    md_table,
    paired_ratios,
    round_sums,
    standalone_main,
    take_turns,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.averaging import DiLoCoOptimizer
from zerofn_torch.runtime.launch import run_local_world

from testbed import links
from zerofn.blockquant import quantizer_for
from zerofn.diloco.compressed_sync import compressed_sync_program
from zerofn.diloco.fragments import Fragment, plan_fragments
from zerofn.diloco.sync import run_sync
from zerofn.testing.world import run_programs

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

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


def blocking_name(h: int) -> str:
    return f"blocking, H={h}"


def streaming_name(delay: int) -> str:
    return f"streaming int8, P={FRAGMENTS}, delay {delay}"


def covering_name(delay: int) -> str:
    """The streaming run whose delay covers the link."""
    return f"{streaming_name(delay)} (covers the link)"


# ----------------------------------------------------------------------------
# Pure parts: the link, the delay, the why lines
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


def zero_why(
    label: str, times: Mapping[str, Sequence[float]], link_bytes: float, bits_per_second: float
) -> str:
    """Why a ZeRO set-up missed its target against PyTorch's step: its
    bytes' link time, its codec alone and the update alone (medians of the
    same rounds), in turn and with the update and the codec beside the wire."""
    codec, _ = ZERO_SETUPS[label]
    pt = statistics.median(times[PYTORCH])
    step = statistics.median(times[label])
    update = statistics.median(times[bench_compressed.UPDATE])
    link = link_seconds(link_bytes, bits_per_second)
    alone = statistics.median(times[bench_compressed.BYTES_ALONE[codec or "exact"]])
    bytes_clause = (
        f"its bytes take {_ms(link)} on the link alone ({_mb(link_bytes)} x 8 / "
        f"{rate_label(bits_per_second)}, both ranks' through the one half-duplex queue; "
        f"broadcast alone {_ms(alone)})"
    )
    if codec is None:
        floor = round_sums(
            times[bench_compressed.UPDATE], times[bench_compressed.BYTES_ALONE["exact"]]
        )
        verdict = floor_verdict((label, "PyTorch"), times[label], floor, times[PYTORCH])
        return (
            f"{bytes_clause}, the same bytes as PyTorch's, and the update alone {_ms(update)}: "
            f"{verdict}"
        )
    work = statistics.median(times[bench_compressed.CODEC_ALONE[codec]])
    serial = update + work + link
    beside = compressed_step_model(update, work, link_bytes, bits_per_second)
    return (
        f"{bytes_clause}, the {codec} codec alone {_ms(work)} and the update alone "
        f"{_ms(update)}, against PyTorch's {_ms(pt)} step: done in turn they allow "
        f"{serial / pt:.2f}, with the update and the codec beside the wire {beside / pt:.2f}; "
        f"the {codec} step takes {_ms(step)}, {step / serial:.2f}x the parts in turn"
    )


def link_factors(link: Mapping[str, float], payload: float) -> dict[str, float]:
    """Bytes on the link per payload byte of gloo's own collectives, from the
    loopback's counter around each part alone (``payload`` bytes each)."""
    kinds = {
        "reduce": bench_overlap.REDUCE,
        "all-reduce": bench_overlap.ALL_REDUCE,
        "broadcast": bench_overlap.BROADCAST,
    }
    return {kind: link[part] / payload for kind, part in kinds.items()}


def overlap_why(
    times: Mapping[str, list[float]],
    on_link: Mapping[str, float],
    factors: Mapping[str, float],
    bits_per_second: float,
) -> str:
    """Why the overlapped iteration missed its target against PyTorch's: the
    link time of each one's bytes (the loopback's counter over one
    iteration), then each part alone and the floors
    (``bench_overlap.missed_time_line``)."""
    mine, theirs = on_link["overlapped"], on_link["pytorch"]
    rate = rate_label(bits_per_second)
    head = (
        f"the overlapped iteration puts {_mb(mine)} on the link "
        f"({_ms(link_seconds(mine, bits_per_second))} at {rate}) against PyTorch's "
        f"{_mb(theirs)} ({_ms(link_seconds(theirs, bits_per_second))}), {mine / theirs:.2f} of "
        f"its bytes (gloo's own reduce puts {factors['reduce']:.2f}x its payload on the link, "
        f"its all-reduce {factors['all-reduce']:.2f}x, a broadcast {factors['broadcast']:.2f}x)"
    )
    body = bench_overlap.missed_time_line(dict(times), "pytorch", "the PyTorch iteration")
    return f"{head}; {body}"


def powersgd_why(
    times: Mapping[str, Sequence[float]],
    zerofn_link: float,
    ddp_link: float,
    bits_per_second: float,
) -> str:
    """Why zerofn's PowerSGD iteration missed its target against DDP's
    all-reduce: each one's bytes on the link, and what zerofn's iteration
    spends beside its bytes."""
    ours = statistics.median(times["zerofn"])
    ddp = statistics.median(times[bench_hooks.BUILTIN])
    mine = link_seconds(zerofn_link, bits_per_second)
    theirs = link_seconds(ddp_link, bits_per_second)
    return (
        f"DDP's all-reduce puts {_mb(ddp_link)} on the link ({_ms(theirs)} at "
        f"{rate_label(bits_per_second)}) and PowerSGD {_mb(zerofn_link)} ({_ms(mine)}); "
        f"zerofn's iteration takes {_ms(ours)}, of which {_ms(max(ours - mine, 0.0))} beside "
        f"its bytes (forward, backward, the compression), {(ours - mine) / ddp:.2f} of DDP's "
        f"{_ms(ddp)} iteration"
    )


def per_step(times: Sequence[float], steps: int) -> list[float]:
    return [t / steps for t in times]


def diloco_why(
    name: str,
    raw: Mapping[str, Any],
    bits_per_second: float,
) -> str:
    """Why a streaming run missed its target: the sync's link time against
    the inner steps it overlaps, and its arithmetic per inner step."""
    steps: Mapping[str, int] = raw["steps"]
    times: Mapping[str, Sequence[float]] = raw["times"]
    delay: int = raw["delays"][name]
    quiet = statistics.median(per_step(times[QUIET], steps[QUIET]))
    mine = statistics.median(per_step(times[name], steps[name]))
    link = link_seconds(raw["fragment_link_bytes"], bits_per_second)
    stride = raw["sync_every"] // FRAGMENTS
    codec = statistics.median(raw["codec"]) / WORLD
    exposed = max(0.0, link - delay * quiet)
    beyond = mine - quiet - (exposed + codec) / stride
    blocking = blocking_name(raw["sync_every"])
    same_h = ""
    if blocking in times:  # the same syncs, each waited for whole: what hiding them saves
        waited = statistics.median(per_step(times[blocking], steps[blocking])) - quiet
        same_h = (
            f"; blocking DiLoCo with the same H = {raw['sync_every']}, which hides nothing, "
            f"took {_ms(waited)} more"
        )
    return (
        f"a fragment's int8 sync puts {raw['fragment_link_bytes']:,} bytes on the link, "
        f"{_ms(link)} at {rate_label(bits_per_second)}, "
        f"{'more than' if exposed > 0 else 'within'} the {delay} inner step"
        f"{'s' if delay > 1 else ''} of {_ms(quiet)} it may take ({_ms(exposed)} left to wait, "
        f"{_ms(exposed / stride)} per inner step); its arithmetic alone (encode, decode, the "
        f"replica's update) takes {_ms(codec)} a sync on the rank's one core, "
        f"{_ms(codec / stride)} per inner step ({codec / stride / quiet:.2f} of a step); the "
        f"run took {_ms(mine - quiet)} per inner step more than without communication, "
        f"{_ms(beyond)} beyond the wait and the arithmetic{same_h}"
    )


# ----------------------------------------------------------------------------
# Pure parts: where each feature starts to pay
# ----------------------------------------------------------------------------

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


def compressed_step_model(
    update: float, codec: float, nbytes: float, bits_per_second: float
) -> float:
    """A compressed ZeRO step with the update and the codec beside the wire:
    ``max(link time of its bytes, update + codec)``."""
    return max(link_seconds(nbytes, bits_per_second), update + codec)


def pytorch_step_model(update: float, nbytes: float, bits_per_second: float) -> float:
    """PyTorch's ZeRO step: the update, then its fp32 bytes on the link."""
    return update + link_seconds(nbytes, bits_per_second)


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


DDP_NAME = "DDP (H = 1)"
"""DiLoCo's reference run: DDP's built-in all-reduce every inner step."""
DDP_STEPS = 2


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


# ----------------------------------------------------------------------------
# Pure parts: DiLoCo's compute utilization against the rate
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# Inside the namespace: the ranks
# ----------------------------------------------------------------------------


def lo_tx_bytes() -> int:
    """Bytes the loopback of this process's network namespace has sent."""
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    raise RuntimeError("/proc/net/dev lists no lo")


def on_link(fn: Callable[[], object]) -> int:
    """The bytes the loopback (the shaped link) carried while ``fn`` ran on
    every rank (between two barriers; a barrier's few bytes included)."""
    dist.barrier()
    before = lo_tx_bytes()
    fn()
    dist.barrier()
    return lo_tx_bytes() - before


def _zero_rank(rank: int, world: int, quick: bool, rounds: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = bench_compressed._step_rank(
        rank, world, quick, rounds, warmup, ZERO_LABELS, False, on_link
    )
    floors = bench_compressed._floors(out["numel"], world)
    out["link_parts"] = {
        name: on_link(floors[name]) for name in bench_compressed.BYTES_ALONE.values()
    }
    return out


def _overlap_rank(rank: int, world: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
    out = bench_overlap._rank(rank, world, width, depth, rounds, on_link)
    batch = torch.randn(32, width)
    parts = bench_overlap._parts(bench_overlap.make_model(width, depth), batch, rank, world)
    names = (bench_overlap.REDUCE, bench_overlap.ALL_REDUCE, bench_overlap.BROADCAST)
    out["link_parts"] = {name: on_link(parts[name]) for name in names}
    return out


def _powersgd_rank(
    rank: int, world: int, width: int, depth: int, rounds: int, timed: Sequence[str]
) -> dict[str, Any]:
    return bench_hooks._rank(rank, world, width, depth, rounds, timed, on_link)


def _sync_arithmetic(fragment: Fragment, compression: str) -> Callable[[], None]:
    """Both ranks' compressed syncs of ``fragment`` driven in one process by
    the simulated world (collectives answered by copies, the outer step by
    its anchor): the arithmetic of a sync, twice, and no link."""
    quantizer = quantizer_for(compression)
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(fragment.numel, generator=gen) for _ in range(WORLD)]
    replicas = [torch.zeros(fragment.numel) for _ in range(WORLD)]
    residuals = [torch.zeros(fragment.numel) for _ in range(WORLD)]
    masters = [torch.zeros(n) for n in fragment.lengths]

    def run() -> None:
        programs = [
            run_sync(
                compressed_sync_program(
                    fragment, r, values[r], replicas[r], residuals[r], masters[r], quantizer
                ),
                lambda request, r=r: masters[r],
            )
            for r in range(WORLD)
        ]
        run_programs(programs, purpose="the sync's arithmetic alone")

    return run


def _diloco_rank(
    rank: int,
    world: int,
    width: int,
    depth: int,
    rounds: int,
    warmup: int,
    bits_per_second: float,
    curve_only: bool = False,
) -> dict[str, Any]:
    """DiLoCo's runs on this rank (``curve_only``: the figure's alone, no
    separate delay-1 run)."""
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    quiet_model = bench_diloco.make_model(width, depth)
    quiet = bench_diloco.window(quiet_model, bench_diloco.adamw(quiet_model), batch, QUIET_STEPS)
    ddp_model = DDP(bench_diloco.make_model(width, depth))
    ddp_opt = bench_diloco.adamw(ddp_model)
    # DDP rebuilds its buckets after its first window; and the inner steps
    # run ~1.5x slower until the process has made its larger allocations,
    # which this window does (the delay below must come from the steady step).
    bench_diloco.window(ddp_model, ddp_opt, batch, 1)()
    quiet()
    samples = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        quiet()
        samples.append((time.perf_counter() - start) / QUIET_STEPS)
    # Both ranks must build the same configuration. The fastest step of
    # either rank gives the longest delay: one that still covers the link
    # when the timed windows run faster than these samples.
    step = torch.tensor([min(samples)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    sizes = [p.numel() for p in quiet_model.parameters()]
    link_bytes = fragment_link_bytes(sizes, FRAGMENTS, STREAM_COMPRESSION)
    delay = streaming_delay(link_bytes, bits_per_second, step.item())
    h = streaming_sync_every(delay, FRAGMENTS)

    configs: dict[str, dict[str, Any]] = {blocking_name(b): {"sync_every": b} for b in BLOCKING}
    # Where delay 1 already covers the link, that run serves both targets.
    long = covering_name(delay)
    short = long if delay == 1 or curve_only else streaming_name(1)
    delays = {long: delay, short: 1} if short != long else {long: delay}
    for name, d in delays.items():
        configs[name] = {
            "sync_every": h,
            "fragments": FRAGMENTS,
            "delay": d,
            "compression": STREAM_COMPRESSION,
        }
    runs: dict[str, Callable[[], None]] = {
        QUIET: quiet,
        DDP_NAME: bench_diloco.window(ddp_model, ddp_opt, batch, DDP_STEPS),
    }
    steps = {QUIET: QUIET_STEPS, DDP_NAME: DDP_STEPS}
    optimizers = []
    for name, config in configs.items():
        model = bench_diloco.make_model(width, depth)
        opt = DiLoCoOptimizer(bench_diloco.adamw(model), **config)
        # Start each window `delay` steps after a sync, so that every sync a
        # window starts is applied inside it and none is in flight between turns.
        bench_diloco.window(model, opt, batch, config.get("delay", 0))()
        runs[name] = bench_diloco.window(model, opt, batch, config["sync_every"])
        steps[name] = config["sync_every"]
        optimizers.append(opt)
    plan = plan_fragments(sizes, FRAGMENTS, world)
    largest = max(plan.fragments, key=lambda f: f.numel)
    timed: dict[str, Callable[[], object]] = {
        **runs,
        CODEC: _sync_arithmetic(largest, STREAM_COMPRESSION),
    }
    times = take_turns(timed, rounds, warmup)
    wire = {name: on_link(fn) for name, fn in runs.items()}  # one more window each
    for opt in optimizers:
        opt.drain()
    return {
        "times": {name: t for name, t in times.items() if name != CODEC},
        "codec": times[CODEC],
        "steps": steps,
        "wire": wire,
        "quiet_step": step.item(),
        "fragment_link_bytes": link_bytes,
        "delays": delays,
        "long": long,
        "delay_1": short,
        "sync_every": h,
        "numel": sum(sizes),
    }


def _measure(
    name: str, quick: bool, bits_per_second: float, curve_only: bool = False
) -> dict[str, Any]:
    """One measurement on 2 ranks (in this process's namespace): rank 0's
    record, with what the other ranks add where it is needed (``curve_only``:
    DiLoCo's runs for the utilization figure alone, fewer rounds)."""
    sizes = SIZES[quick]
    if name == "zero":
        ranks = run_local_world(_zero_rank, WORLD, quick, *sizes.zero)
        out = ranks[0]
        # The bytes both ranks send share the link.
        out["payload"] = {
            label: sum(r["traffic"][label]["sent"] for r in ranks) for label in ZERO_LABELS
        }
        out["equal"] = all(r["digests"] == out["digests"] for r in ranks)
        return dict(out)
    if name == "overlap":
        return dict(run_local_world(_overlap_rank, WORLD, *sizes.overlap)[0])
    if name == "powersgd":
        timed = ("zerofn", "pytorch", bench_hooks.BUILTIN)
        try:
            out = run_local_world(_powersgd_rank, WORLD, *sizes.powersgd, timed)[0]
            out["aborted"] = None
        except Exception as error:  # PyTorch's hook can abort a rank (SIGABRT)
            said = str(error).strip().splitlines()
            alone = ("zerofn", bench_hooks.BUILTIN)
            out = run_local_world(_powersgd_rank, WORLD, *sizes.powersgd, alone)[0]
            out["aborted"] = said[0] if said else type(error).__name__
        return dict(out)
    if name == "diloco":
        width, depth, rounds, warmup = sizes.diloco
        if curve_only:
            rounds, warmup = sizes.curve
        args = (width, depth, rounds, warmup, bits_per_second, curve_only)
        return dict(run_local_world(_diloco_rank, WORLD, *args)[0])
    raise ValueError(f"unknown measurement {name!r}; choose from {MEASUREMENTS}")


def child_main(argv: Sequence[str]) -> None:
    """Inside the namespace: ``argv`` is the spec (JSON) and the output path."""
    spec = json.loads(argv[0])
    results: dict[str, Any] = {}
    for name in spec["measure"]:
        started = time.perf_counter()
        print(f"[{spec['rate']}] {name} ...", file=sys.stderr, flush=True)
        results[name] = _measure(name, spec["quick"], spec["bits"], spec.get("curve", False))
        results[name]["seconds"] = time.perf_counter() - started
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(results, f)


# ----------------------------------------------------------------------------
# Outside: one namespace per rate, and the tables
# ----------------------------------------------------------------------------

CHILD = "import sys, bench_links; bench_links.child_main(sys.argv[1:])"


def run_in_namespace(
    rate: str, quick: bool, measure: Sequence[str] = MEASUREMENTS, curve: bool = False
) -> dict[str, Any]:
    """Make ``shaped_loopback(rate)``, run the measurements inside it in a
    child Python, and return what it wrote (the namespace is removed;
    ``curve``: DiLoCo's utilization runs alone, see :func:`_measure`)."""
    spec = {
        "rate": rate,
        "bits": links.parse_rate(rate),
        "quick": quick,
        "measure": list(measure),
        "curve": curve,
    }
    with tempfile.TemporaryDirectory() as tmp, links.shaped_loopback(rate) as node:
        out = os.path.join(tmp, "timings.json")
        env = node.env(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (BENCH_DIR, os.environ.get("PYTHONPATH", "")) if p
        )
        done = subprocess.run(
            node.command([sys.executable, "-c", CHILD, json.dumps(spec), out]),
            env=env,
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=300 if quick else 2400,
            check=False,
        )
        if done.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RuntimeError(
                f"the link benchmark at {rate} failed inside its namespace "
                f"(exit {done.returncode}):\n{tail}"
            )
        with open(out, encoding="utf-8") as f:
            results: dict[str, Any] = json.load(f)
    return results


def _headline(
    benchmark: str,
    measure: str,
    value: Spread,
    target: float | None,
    why: Callable[[], str],
    short: str,
) -> Headline:
    if target is None:
        return Headline(benchmark, measure, value, short=short)
    met = value.median <= target
    return Headline(benchmark, measure, value, f"<= {target}", met, short, "" if met else why())


@attrs.frozen
class Part:
    """One measurement's share of a rate's subsection."""

    body: str
    headlines: tuple[Headline, ...] = attrs.field(converter=tuple)


def zero_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    pt = times[PYTORCH]
    held = rate == TARGET_RATE
    model = f"Adam, {raw['numel'] / 1e6:.1f}M params in {raw['tensors']} tensors"
    bench = f"link {rate_label(bits)}: ZeRO step ({model}, 2 gloo ranks)"
    rows, headlines = [], []
    for label in ZERO_LABELS:
        on = raw["on_link"][label]
        ratio = paired_ratios(times[label], pt)
        target = ZERO_SETUPS[label][1] if label in ZERO_SETUPS else None
        rows.append(
            [
                label,
                Spread.of(times[label]).scaled(1e3).fmt(1),
                ratio.fmt() if label != PYTORCH else "1.00",
                f"{raw['payload'][label] / 1e6:.1f}",
                f"{on / 1e6:.1f}",
                f"{link_seconds(on, bits) * 1e3:.1f}",
                f"<= {target}" if held and target is not None else "-",
            ]
        )
        if label == PYTORCH:
            continue
        headlines.append(
            _headline(
                bench,
                f"step time: {label} / PyTorch",
                ratio,
                target if held else None,
                lambda label=label, on=on: zero_why(label, times, on, bits),
                f"link {rate_label(bits)} ZeRO",
            )
        )
    steps = md_table(
        [
            "set-up",
            "step (ms)",
            "/ PyTorch",
            "payload sent / step (MB, both ranks)",
            "MB on the link / step",
            "their link time (ms)",
            "target",
        ],
        rows,
    )
    part_names = (
        bench_compressed.UPDATE,
        *bench_compressed.BYTES_ALONE.values(),
        *bench_compressed.CODEC_ALONE.values(),
    )
    link = raw["link_parts"]
    part_rows = [
        [
            name,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], pt).fmt(),
            f"{link[name] / 1e6:.1f}" if name in link else "-",
        ]
        for name in part_names
    ]
    parts = md_table(["part alone (rank 0)", "ms", "/ PyTorch step", "MB on the link"], part_rows)
    missed = [f"- {h.measure}: {h.why}." for h in headlines if h.met is False]
    body = "\n\n".join(
        [
            f"**ZeRO step** ({model}; {len(pt)} timed rounds): the payload is what both ranks "
            "hand to the collectives to send (each rank's segment, broadcast from its owner); "
            "MB on the link is the loopback's counter over one more step (payload, TCP/IP "
            "headers, acknowledgements), and its link time those bytes x 8 / the rate. The "
            "parts are one rank's share, timed in the same rounds: the update; each "
            "exchange's payloads broadcast alone; each codec alone (difference, encode, decode, "
            "add). Replicas bitwise equal across the ranks: "
            f"{'yes' if raw['equal'] else '**no**'}.",
            steps,
            parts,
            *(["Missed:", "\n".join(missed)] if missed else []),
        ]
    )
    return Part(body, headlines)


def overlap_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    grad_bytes = raw["grad_bytes"]
    factors = link_factors(raw["link_parts"], grad_bytes)
    on_link: dict[str, int] = raw["on_link"]
    held = rate == TARGET_RATE
    model = f"Adam, MLP {grad_bytes / 4e6:.1f}M params"
    bench = f"link {rate_label(bits)}: DDP + ZeRO ({model}, 2 gloo ranks)"
    rows = [
        [
            name,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], times["pytorch"]).fmt(),
            ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(raw["kinds"][name].items())),
            f"{on_link[name] / 1e6:.1f}",
            f"{link_seconds(on_link[name], bits) * 1e3:.1f}",
        ]
        for name in bench_overlap.SETUPS
    ]
    ratio = paired_ratios(times["overlapped"], times["pytorch"])
    headline = _headline(
        bench,
        "iteration time: overlapped / PyTorch's DDP + separate ZeRO step",
        ratio,
        OVERLAP_TARGET if held else None,
        lambda: overlap_why(times, on_link, factors, bits),
        f"link {rate_label(bits)} overlap",
    )
    table = md_table(
        [
            "iteration",
            "ms",
            "/ pytorch",
            "payload by collective (MB, rank 0)",
            "MB on the link",
            "its link time (ms)",
        ],
        rows,
    )
    parts = md_table(
        ["part alone (rank 0)", "ms", "/ pytorch", "MB on the link"],
        [
            [
                name,
                Spread.of(times[name]).scaled(1e3).fmt(1),
                paired_ratios(times[name], times["pytorch"]).fmt(),
                f"{raw['link_parts'][name] / 1e6:.1f}" if name in raw["link_parts"] else "-",
            ]
            for name in bench_overlap.PARTS
        ],
    )
    factor_line = ", ".join(f"{k} {v:.2f}x" for k, v in factors.items())
    body = "\n\n".join(
        [
            f"**DDP + ZeRO** ({model}; {len(times['pytorch'])} timed rounds): 'overlapped' is "
            "zerofn's step inside backward (gradients sent to their owners, shards broadcast "
            "back), 'separate' DDP + zerofn's step after backward, 'pytorch' DDP's built-in "
            "all-reduce + PyTorch's `ZeroRedundancyOptimizer.step()`. MB on the link: the "
            "loopback's counter over one more iteration of each (PyTorch's payload is counted "
            "on a twin with PyTorch's Python all-reduce hook). The parts use gloo's own "
            "collectives, each on all the gradients' bytes "
            f"({grad_bytes / 1e6:.1f} MB): on the link they put {factor_line} of that.",
            table,
            parts,
            *([f"Missed: {headline.why}."] if headline.met is False else []),
        ]
    )
    return Part(body, (headline,))


def powersgd_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    on_link: dict[str, int] = raw["on_link"]
    ddp = times[bench_hooks.BUILTIN]
    numel = raw["numel"]
    held = rate == TARGET_RATE
    model = f"MLP {numel / 1e6:.1f}M params, rank {bench_hooks.RANK}"
    bench = f"link {rate_label(bits)}: DDP + PowerSGD ({model}, 2 gloo ranks)"
    ratio = paired_ratios(times["zerofn"], ddp)
    ours, theirs = on_link["zerofn"], on_link[bench_hooks.BUILTIN]
    headlines = [
        _headline(
            bench,
            "iteration time: zerofn PowerSGD / DDP all-reduce",
            ratio,
            POWERSGD_TARGET if held else None,
            lambda: powersgd_why(times, ours, theirs, bits),
            f"link {rate_label(bits)} PowerSGD",
        )
    ]
    aborted = raw.get("aborted")
    if not aborted:
        headlines.append(
            Headline(
                bench,
                "iteration time: zerofn PowerSGD / PyTorch's powerSGD_hook",
                paired_ratios(times["zerofn"], times["pytorch"]),
                short=f"link {rate_label(bits)} PowerSGD",
            )
        )

    def row(label: str, name: str) -> list[object]:
        if name not in times:
            return [label, "PyTorch's hook aborted", "-", "-", "-"]
        return [
            label,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], ddp).fmt() if name != bench_hooks.BUILTIN else "1.00",
            f"{on_link[name] / 1e6:.2f}",
            f"{link_seconds(on_link[name], bits) * 1e3:.1f}",
        ]

    table = md_table(
        ["iteration", "ms", "/ DDP all-reduce", "MB on the link", "its link time (ms)"],
        [
            row("DDP's built-in all-reduce", bench_hooks.BUILTIN),
            row("zerofn powerSGD_hook", "zerofn"),
            row("PyTorch's powerSGD_hook", "pytorch"),
        ],
    )
    notes = [
        f"**DDP + PowerSGD** ({model}; {len(ddp)} timed rounds): zerofn's `powerSGD_hook`, "
        "DDP's built-in all-reduce (no hook) and PyTorch's `powerSGD_hook` (one process group "
        "and state per bucket, as in the PowerSGD section) taking turns. MB on the link: the "
        "loopback's counter over one more iteration of each.",
        table,
    ]
    if aborted:
        notes.append(
            f"PyTorch's hook aborted: the run with it died ({aborted}); the rows above are "
            "from the same run repeated without it."
        )
    if headlines[0].met is False:
        notes.append(f"Missed: {headlines[0].why}.")
    return Part("\n\n".join(notes), headlines)


def diloco_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    steps: dict[str, int] = raw["steps"]
    quiet = per_step(times[QUIET], steps[QUIET])
    model = f"MLP {raw['numel'] / 1e6:.1f}M params, AdamW inner"
    bench = f"link {rate_label(bits)}: DiLoCo ({model}, 2 gloo ranks)"
    long, short = raw["long"], raw["delay_1"]
    held: dict[str, list[tuple[str, float]]] = {}
    held.setdefault(long, []).append((long, LONG_TARGET))
    held.setdefault(short, []).append((streaming_name(1), DELAY_1_TARGET))
    rows, headlines = [], []
    for name, sample in times.items():
        ratio = paired_ratios(per_step(sample, steps[name]), quiet)
        wire = raw["wire"][name] / steps[name]
        targets = held.get(name, [])
        rows.append(
            [
                name,
                steps[name],
                Spread.of(per_step(sample, steps[name])).scaled(1e3).fmt(1),
                ratio.fmt() if name != QUIET else "1.00",
                f"{wire / 1e6:.2f}",
                f"{link_seconds(wire, bits) * 1e3:.1f}",
                "; ".join(f"<= {t}" for _, t in targets) or "-",
            ]
        )
        if name == QUIET:
            continue
        judged: list[tuple[str, float | None]] = [*targets] or [(name, None)]
        for shown, target in judged:
            headlines.append(
                _headline(
                    bench,
                    f"time per inner step: {shown} / no communication",
                    ratio,
                    target,
                    lambda name=name: diloco_why(name, raw, bits),
                    f"link {rate_label(bits)} DiLoCo",
                )
            )
    table = md_table(
        [
            "run",
            "window (inner steps)",
            "ms per inner step",
            "/ no communication",
            "MB on the link per inner step",
            "its link time (ms)",
            "target",
        ],
        rows,
    )
    formula = delay_formula(raw["fragment_link_bytes"], bits, raw["quiet_step"])
    codec = Spread.of([t / WORLD for t in raw["codec"]]).scaled(1e3).fmt(2)
    missed = [f"- {h.measure}: {h.why}." for h in headlines if h.met is False]
    same = (
        [f"Delay 1 already covers the link here: the run '{long}' is held to both targets."]
        if long == short
        else []
    )
    body = "\n\n".join(
        [
            f"**DiLoCo** ({model}; {len(quiet)} timed rounds): windows of inner steps (forward, "
            "backward, step) taking turns; each window holds whole syncs (a streaming window "
            "starts `delay` steps after a sync, so every sync it starts is applied inside it). "
            f"Blocking: one fragment, delay 0. Streaming: P = {FRAGMENTS} fragments, int8, at "
            "a delay long enough for the link and at delay 1. That delay is computed before "
            "the timed rounds from B, the bytes one fragment's int8 sync puts on the link "
            "(2 x the payload of every owner's slice, codes and block scales: the codes to "
            "the owner, the new anchor's codes back), the rate R and t, the inner step with "
            "no communication (the fastest of 5 windows on either rank, so that the delay still "
            "covers the link when the timed windows run faster):",
            f"`{formula}`",
            *same,
            table,
            f"The int8 sync's arithmetic alone (one rank's share of both ranks' syncs run "
            f"in the simulated world): {codec} ms per sync. MB on the link: the loopback's "
            "counter over one more window of each run.",
            *(["Missed:", "\n".join(missed)] if missed else []),
        ]
    )
    return Part(body, headlines)


PARTS: dict[str, Callable[[Mapping[str, Any], str, float], Part]] = {
    "zero": zero_part,
    "overlap": overlap_part,
    "powersgd": powersgd_part,
    "diloco": diloco_part,
}

TITLE = "On shaped links (2 gloo ranks in a network namespace, CPU)"


def _intro(rates: Sequence[str], no_delay: str | None) -> str:
    wan = (
        f"The loss-against-time figure adds a WAN's delay, which cannot be made here "
        f"(`unavailable_reason(delay=True)` says: {no_delay}), so it was not run."
        if no_delay is not None
        else "The loss-against-time figure adds a WAN's delay: two nodes, each direction "
        "held by the testbed's delay line."
    )
    return (
        f"The two ranks run inside a network namespace whose loopback is shaped to "
        f"{' and '.join(rate_label(links.parse_rate(r)) for r in rates)} "
        "(`testbed.links.shaped_loopback`, a `tbf` on `lo`, see [links](links.md)), "
        "with no added delay (nodes in one place). One "
        "`tbf` on the one loopback shapes both directions together: the link is half duplex, "
        "the two ranks share one rate, and the link time of a step's bytes is what both "
        "ranks send, x 8 / the rate. zerofn and PyTorch take turns in the same run; ratios "
        "are medians of per-round ratios [q1, q3]. The targets for the ZeRO step, "
        f"DDP + ZeRO and PowerSGD hold at {rate_label(links.parse_rate(TARGET_RATE))}; "
        f"DiLoCo's at every rate (its delay is computed for the rate). {wan}"
    )


def unavailable_section(reason: str, rates: Sequence[str]) -> Section:
    """The section where shaped links cannot be made: the reason, no numbers."""
    what = ", ".join(rate_label(links.parse_rate(r)) for r in rates)
    body = (
        f"**Not measured**: shaped links cannot be made here, so the ZeRO step, DDP + ZeRO, "
        f"PowerSGD and DiLoCo were not run at {what}. "
        "`testbed.links.unavailable_reason()` "
        f"says: {reason}"
    )
    headline = Headline(
        f"links ({what})",
        f"not measured: {reason}".replace("|", "/"),
        Spread.unmeasured(),
    )
    quoted = {
        block: f"_Not measured: shaped links cannot be made here ({reason})._"
        for block in PAYS_AT.values()
    }
    return Section(TITLE, body, (headline,), blocks=quoted)


def section_from(
    results: Mapping[str, Mapping[str, Any]],
    seconds: Mapping[str, float],
    curve: Mapping[str, Mapping[str, Any]] | None = None,
    loss_time: Mapping[str, Any] | None = None,
    no_delay: str | None = None,
) -> Section:
    """The section from every rate's child output (``rate -> measurement ->
    raw``), each rate's wall time (the figure's extra rates' too), DiLoCo's
    measurement at each of the figure's rates (``curve``; ``None``: the model
    alone), the demo's runs across :data:`bench_loss_time.RATE` and
    :data:`bench_loss_time.DELAY` (``loss_time``; ``None``: not run), and why
    links cannot be delayed here (``unavailable_reason(delay=True)``;
    ``None``: they can)."""
    rates = list(results)
    blocks = [_intro(rates, no_delay)]
    headlines: list[Headline] = []
    panels: list[Panel] = []
    pays, quoted = payoff_part(results)
    blocks.append(pays)
    reference = next((m["diloco"] for m in results.values() if "diloco" in m), None)
    if reference is not None:
        body, panel = utilization_part(reference, curve)
        extra = [r for r in (curve or {}) if r not in results and r in seconds]
        if extra:
            took = ", ".join(f"{rate_label(links.parse_rate(r))} {seconds[r]:.0f} s" for r in extra)
            body += f"\n\nDiLoCo alone at the figure's other rates took {took}."
        blocks.append(body)
        panels.append(panel)
    if loss_time is not None:
        link = (
            f"{rate_label(links.parse_rate(loss_time['rate']))} "
            f"+ {links.parse_delay(loss_time['delay']) / 1000:g} ms"
        )
        body, panel = bench_loss_time.loss_time_part(loss_time, link)
        blocks.append(body)
        panels.append(panel)
        codecs, codec_headlines = bench_loss_time.codec_part(loss_time, link)
        if codecs:
            blocks.append(codecs)
            headlines += codec_headlines
    for rate, measured in results.items():
        bits = links.parse_rate(rate)
        blocks.append(
            f"### {rate_label(bits)} (shaped loopback; this rate took {seconds[rate]:.0f} s)"
        )
        for name, make in PARTS.items():
            if name in measured:
                part = make(measured[name], rate, bits)
                blocks.append(part.body)
                headlines += part.headlines
    return Section(TITLE, "\n\n".join(blocks), headlines, panels, blocks=quoted)


def bench_links(quick: bool) -> Section:
    """The section: every measurement at each rate (``quick``: 1 Gbit/s,
    tiny models, 2 rounds)."""
    rates = QUICK_RATES if quick else RATES
    reason = links.unavailable_reason()
    if reason is not None:
        return unavailable_section(reason, rates)
    results, seconds = {}, {}
    for rate in rates:
        started = time.perf_counter()
        results[rate] = run_in_namespace(rate, quick)
        seconds[rate] = time.perf_counter() - started
    curve = None
    if not quick:  # the utilization figure's rates: DiLoCo alone where not measured yet
        curve = {}
        for rate in CURVE_RATES:
            if rate in results:
                curve[rate] = results[rate]["diloco"]
                continue
            started = time.perf_counter()
            curve[rate] = run_in_namespace(rate, quick, ("diloco",), curve=True)["diloco"]
            seconds[rate] = time.perf_counter() - started
    no_delay = links.unavailable_reason(delay=True)
    loss_time = bench_loss_time.run_across_link(quick) if no_delay is None else None
    return section_from(results, seconds, curve, loss_time, no_delay)


BENCHES: dict[str, Callable[[bool], Section]] = {"links": bench_links}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
