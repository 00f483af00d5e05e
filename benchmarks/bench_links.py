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
   reduce, the all-reduce and the broadcast alone; and, in a row, zerofn's
   separate step and its overlapped step each without and with
   ``gather_during_forward=True``.
3. **DDP + PowerSGD rank 4** (``bench_hooks``'s): zerofn's hook against DDP's
   built-in all-reduce and PyTorch's ``powerSGD_hook``. Should PyTorch's hook
   abort the ranks (it does on some models with gloo, see
   ``docs/powersgd.md``), the run is repeated without it and the table says so.
4. **DiLoCo** (``bench_diloco``'s model, inner AdamW): time per inner step
   against inner steps with no communication, blocking (H = 10, 50) and
   streaming with int8 (P = 2 fragments, H = 50 as the blocking run it is
   set beside, or more where the delay needs it) at a delay long enough for the link
   (:func:`links_setup.streaming_delay`, from the fragment's bytes, the rate and the
   fastest inner step measured at the start of the run) and at delay 1.

The targets: at 1 Gbit/s, ZeRO exact / PyTorch <= 1.0, int8 <= 0.30,
int4 <= 0.20, the overlapped iteration / PyTorch's <= 0.75, the separate
step with the gather behind the forward / without <= 1.0, the overlapped step
with its sends behind the forward / without <= 1.0, PowerSGD / DDP's
all-reduce <= 0.30; at every rate, streaming DiLoCo int8 with its delay <=
1.05 and at delay 1 <= 1.10 a step with no communication, and the
overlapped step with its sends behind the forward <= 1.15 its floor,
max(forward + backward + update alone, bytes / rate). A missed
target says why from parts of the same run: the link time of the bytes alone
(bytes x 8 / rate), the codec alone, the update alone.

These measurements shape the rate alone (a link between nodes in one
place); the loss-against-time figure below adds a WAN's delay. Where
namespaces cannot be made at all, the section says why and measures nothing.

From the parts of the run at 1 Gbit/s the section computes where each
feature starts to pay (:func:`links_payoffs.payoff_part`: a table, and a block quoted on
each feature's page): a feature that trades arithmetic for bytes pays below
the rate at which the bytes it saves take as long as its arithmetic,
``R* = 8 x bytes / seconds`` (the int8 and int4 exchange, their update and
codec beside the wire: ``8 x PyTorch's fp32 bytes / the codec alone``); one that only
saves bytes (the overlapped step, blocking DiLoCo) at every rate.

A figure: DiLoCo's compute utilization (a step with no communication / time
per inner step) against the rate (:data:`links_curves.CURVE_RATES`, 0.1 to 10 Gbit/s) for
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

This module makes the namespaces and the section; the rest of the benchmark
is in modules of one idea each: ``links_setup`` (the rates, the sizes, the
targets, a link's arithmetic), ``links_ranks`` (what runs inside the
namespace), ``links_parts`` (each measurement's table), ``links_why`` (why a
target was missed), ``links_payoffs`` (where each feature starts to pay) and
``links_curves`` (DiLoCo's utilization against the rate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# The shaped-link testbed is a package of the repository, not of the library:
# it imports from the repository's root.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import bench_loss_time
from links_curves import CURVE_RATES, utilization_part
from links_parts import PARTS
from links_payoffs import PAYS_AT, payoff_part
from links_setup import MEASUREMENTS, QUICK_RATES, RATES, TARGET_RATE, rate_label
from report import Headline, Panel, Section, Spread, standalone_main

from testbed import links

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------
# Outside: one namespace per rate, and the section
# ----------------------------------------------------------------------------

CHILD = "import sys, links_ranks; links_ranks.child_main(sys.argv[1:])"


def run_in_namespace(
    rate: str, quick: bool, measure: Sequence[str] = MEASUREMENTS, curve: bool = False
) -> dict[str, Any]:
    """Make ``shaped_loopback(rate)``, run the measurements inside it in a
    child Python, and return what it wrote (the namespace is removed;
    ``curve``: DiLoCo's utilization runs alone, see :func:`links_ranks._measure`)."""
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
