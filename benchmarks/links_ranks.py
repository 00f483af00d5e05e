"""What the shaped-link benchmark runs inside the network namespace: the
ranks of each measurement, and the child's entry (:func:`child_main`), which
writes their raw timings as JSON for the section to read."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import bench_compressed
import bench_diloco
import bench_hooks
import bench_overlap
import torch
import torch.distributed as dist
from links_setup import (
    BLOCKING,
    CODEC,
    DDP_NAME,
    DDP_STEPS,
    FRAGMENTS,
    MEASUREMENTS,
    QUIET,
    QUIET_STEPS,
    SIZES,
    STREAM_COMPRESSION,
    WORLD,
    ZERO_LABELS,
    blocking_name,
    covering_name,
    fragment_link_bytes,
    streaming_delay,
    streaming_name,
    streaming_sync_every,
)
from report import take_turns
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.averaging import DiLoCoOptimizer
from zerofn_torch.runtime.launch import run_local_world

from zerofn.blockquant import quantizer_for
from zerofn.diloco.compressed_sync import compressed_sync_program
from zerofn.diloco.fragments import Fragment, plan_fragments
from zerofn.diloco.sync import run_sync
from zerofn.testing.world import run_programs


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
