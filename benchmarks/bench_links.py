"""On shaped links: the features that save bytes, where a byte costs time.

Everything zerofn adds to communication saves bytes, and between two
processes on one machine a byte costs almost nothing. Here the two gloo ranks
run inside a network namespace whose loopback is shaped to a rate
(:func:`zerofn_torch.links.shaped_loopback`: a ``tbf`` on ``lo``), 1 Gbit/s
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
   streaming with int8 (P = 2 fragments) at a delay long enough for the link
   (:func:`streaming_delay`, from the fragment's bytes, the rate and the
   inner step measured at the start of the run) and at delay 1.

The targets: at 1 Gbit/s, ZeRO exact / PyTorch <= 1.0, int8 <= 0.30,
int4 <= 0.20, the overlapped iteration / PyTorch's <= 0.75, PowerSGD /
DDP's all-reduce <= 0.30; at every rate, streaming DiLoCo int8 with its
delay <= 1.05 and at delay 1 <= 1.10 a step with no communication. A missed
target says why from parts of the same run: the link time of the bytes alone
(bytes x 8 / rate), the codec alone, the update alone.

No delay: this needs ``netem``, which some kernels lack
(``unavailable_reason(delay=True)`` says so); only rates are measured. Where
namespaces cannot be made at all, the section says why and measures nothing.

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

import attrs
import bench_compressed
import bench_diloco
import bench_hooks
import bench_overlap
import torch
import torch.distributed as dist
from report import (
    Headline,
    Section,
    Spread,
    floor_verdict,
    md_table,
    paired_ratios,
    round_sums,
    standalone_main,
    take_turns,
)
from zerofn_torch import links
from zerofn_torch.averaging import DiLoCoOptimizer
from zerofn_torch.launch import run_local_world

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
    """

    zero: tuple[int, int]
    overlap: tuple[int, int, int]
    powersgd: tuple[int, int, int]
    diloco: tuple[int, int, int, int]


SIZES = {
    False: Sizes(
        zero=(10, 2), overlap=(1024, 4, 10), powersgd=(1024, 4, 12), diloco=(768, 4, 8, 1)
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
QUIET_STEPS = 10
BLOCKING = (10, 50)
FRAGMENTS = 2
STREAM_COMPRESSION = "int8"
MIN_SYNC_EVERY = 10
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
    same rounds), in turn and with the codec beside the wire."""
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
    beside = update + max(work, link)
    return (
        f"{bytes_clause}, the {codec} codec alone {_ms(work)} and the update alone "
        f"{_ms(update)}, against PyTorch's {_ms(pt)} step: done in turn they allow "
        f"{serial / pt:.2f}, with the codec beside the wire {beside / pt:.2f}; the {codec} step "
        f"takes {_ms(step)}, {step / serial:.2f}x the parts in turn"
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
    return (
        f"a fragment's int8 sync puts {raw['fragment_link_bytes']:,} bytes on the link, "
        f"{_ms(link)} at {rate_label(bits_per_second)}, under {delay} inner step"
        f"{'s' if delay > 1 else ''} of {_ms(quiet)} ({_ms(exposed)} left to wait, "
        f"{_ms(exposed / stride)} per inner step); its arithmetic alone (encode, decode, the "
        f"replica's update) takes {_ms(codec)} a sync on the rank's one core, "
        f"{_ms(codec / stride)} per inner step ({codec / stride / quiet:.2f} of a step); the "
        f"run took {_ms(mine - quiet)} per inner step more than without communication, "
        f"{_ms(beyond)} beyond the wait and the arithmetic"
    )


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
) -> dict[str, Any]:
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    quiet_model = bench_diloco.make_model(width, depth)
    quiet = bench_diloco.window(quiet_model, bench_diloco.adamw(quiet_model), batch, QUIET_STEPS)
    quiet()
    samples = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        quiet()
        samples.append((time.perf_counter() - start) / QUIET_STEPS)
    # Both ranks must build the same configuration: the slower rank's step.
    step = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    sizes = [p.numel() for p in quiet_model.parameters()]
    link_bytes = fragment_link_bytes(sizes, FRAGMENTS, STREAM_COMPRESSION)
    delay = streaming_delay(link_bytes, bits_per_second, step.item())
    h = streaming_sync_every(delay, FRAGMENTS)

    configs: dict[str, dict[str, Any]] = {blocking_name(b): {"sync_every": b} for b in BLOCKING}
    # Where delay 1 already covers the link, that run serves both targets.
    long = covering_name(delay)
    short = long if delay == 1 else streaming_name(1)
    delays = {long: delay, short: 1}
    for name, d in delays.items():
        configs[name] = {
            "sync_every": h,
            "fragments": FRAGMENTS,
            "delay": d,
            "compression": STREAM_COMPRESSION,
        }
    runs: dict[str, Callable[[], None]] = {QUIET: quiet}
    steps = {QUIET: QUIET_STEPS}
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


def _measure(name: str, quick: bool, bits_per_second: float) -> dict[str, Any]:
    """One measurement on 2 ranks (in this process's namespace): rank 0's
    record, with what the other ranks add where it is needed."""
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
        return dict(run_local_world(_diloco_rank, WORLD, *sizes.diloco, bits_per_second)[0])
    raise ValueError(f"unknown measurement {name!r}; choose from {MEASUREMENTS}")


def child_main(argv: Sequence[str]) -> None:
    """Inside the namespace: ``argv`` is the spec (JSON) and the output path."""
    spec = json.loads(argv[0])
    results: dict[str, Any] = {}
    for name in spec["measure"]:
        started = time.perf_counter()
        print(f"[{spec['rate']}] {name} ...", file=sys.stderr, flush=True)
        results[name] = _measure(name, spec["quick"], spec["bits"])
        results[name]["seconds"] = time.perf_counter() - started
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(results, f)


# ----------------------------------------------------------------------------
# Outside: one namespace per rate, and the tables
# ----------------------------------------------------------------------------

CHILD = "import sys, bench_links; bench_links.child_main(sys.argv[1:])"


def run_in_namespace(
    rate: str, quick: bool, measure: Sequence[str] = MEASUREMENTS
) -> dict[str, Any]:
    """Make ``shaped_loopback(rate)``, run the measurements inside it in a
    child Python, and return what it wrote (the namespace is removed)."""
    spec = {
        "rate": rate,
        "bits": links.parse_rate(rate),
        "quick": quick,
        "measure": list(measure),
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
            "no communication (the slower rank's median of 3 windows):",
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


def _intro(rates: Sequence[str], netem: str | None) -> str:
    no_delay = (
        f"No delay is emulated: {netem}. Only rates are measured here; a WAN's round trip "
        "(100 Mbit/s + 20 ms, say) waits for a kernel with netem."
        if netem is not None
        else "No delay is emulated in this section: only rates are measured."
    )
    return (
        f"The two ranks run inside a network namespace whose loopback is shaped to "
        f"{' and '.join(rate_label(links.parse_rate(r)) for r in rates)} "
        "(`zerofn_torch.links.shaped_loopback`, a `tbf` on `lo`, see [links](links.md)). One "
        "`tbf` on the one loopback shapes both directions together: the link is half duplex, "
        "the two ranks share one rate, and the link time of a step's bytes is what both "
        "ranks send, x 8 / the rate. zerofn and PyTorch take turns in the same run; ratios "
        "are medians of per-round ratios [q1, q3]. The targets for the ZeRO step, "
        f"DDP + ZeRO and PowerSGD hold at {rate_label(links.parse_rate(TARGET_RATE))}; "
        f"DiLoCo's at every rate (its delay is computed for the rate). {no_delay}"
    )


def unavailable_section(reason: str, rates: Sequence[str]) -> Section:
    """The section where shaped links cannot be made: the reason, no numbers."""
    what = ", ".join(rate_label(links.parse_rate(r)) for r in rates)
    body = (
        f"**Not measured**: shaped links cannot be made here, so the ZeRO step, DDP + ZeRO, "
        f"PowerSGD and DiLoCo were not run at {what}. `zerofn_torch.links.unavailable_reason()` "
        f"says: {reason}"
    )
    headline = Headline(
        f"links ({what})",
        f"not measured: {reason}".replace("|", "/"),
        Spread.unmeasured(),
    )
    return Section(TITLE, body, (headline,))


def section_from(
    results: Mapping[str, Mapping[str, Any]],
    seconds: Mapping[str, float],
    netem: str | None = None,
) -> Section:
    """The section from every rate's child output (``rate -> measurement ->
    raw``), each rate's wall time, and why links cannot be delayed here
    (``unavailable_reason(delay=True)``; ``None``: they can)."""
    rates = list(results)
    blocks = [_intro(rates, netem)]
    headlines: list[Headline] = []
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
    return Section(TITLE, "\n\n".join(blocks), headlines)


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
    return section_from(results, seconds, links.unavailable_reason(delay=True))


BENCHES: dict[str, Callable[[bool], Section]] = {"links": bench_links}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
