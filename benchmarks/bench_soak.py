"""Soak: DDP + PowerSGD + the overlapped ZeRO step for 2,000 steps, in one run.

Two gloo ranks on CPU train a ~0.3M-parameter MLP (several DDP buckets) on
their own random data (seeded by rank, so gradients differ and the averaging
matters), with zerofn's ``powerSGD_hook`` (rank 2, from iteration 10) wrapped
by ``hook_with_zero_step`` around a ``ZeroRedundancyOptimizer`` (Adam,
``overlap_with_ddp=True``). Twenty times in the run (every 100 steps; with
``--quick``, 200 steps, every 10) and once before it, each rank

* gathers every rank's parameters and checks they are bitwise equal (the
  owner of each shard steps it and broadcasts it: any drift is a bug);
* samples its resident set size (RSS) from ``/proc/self/statm``;
* records its mean training loss since the previous check.

Memory must stay flat: RSS growth from the first check after warm-up (a
quarter of the run) to the end, scaled to 1,000 steps, is the headline; the
``--quick`` run is too short to judge it and reports it without a target. Nothing is
timed against anything; the time per step is what this machine showed.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from report import Curve, Headline, Panel, Section, Spread, fmt_bytes, md_table, standalone_main
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import PowerSGDState, hook_with_zero_step, powerSGD_hook
from zerofn_torch.runtime.launch import run_local_world

IN, WIDTH, OUT, DEPTH = 64, 256, 16, 4
BATCH = 32
BUCKET_CAP_MB = 0.2  # under one hidden layer: DDP closes a bucket per layer
POWERSGD_RANK = 2
START_ITER = 10
CHECKS = 20
GROWTH_TARGET_MIB = 5.0  # per 1,000 steps
# RSS climbs for the first few hundred steps while the allocator settles (about
# 30 MiB here; a 6,000-step run then stayed flat), so the baseline waits.
WARMUP_FRACTION = 0.25


def make_model() -> torch.nn.Module:
    """``IN -> WIDTH (x DEPTH) -> OUT`` with ReLUs: ~0.3M parameters."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, WIDTH), torch.nn.ReLU()]
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, OUT))
    return torch.nn.Sequential(*layers)


def rss_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        # No /proc (macOS): the peak is the best there is; there it is in bytes.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def replicas_equal(params: Sequence[torch.Tensor]) -> tuple[bool, float]:
    """Gather every rank's parameters and compare them with rank 0's.

    Returns:
        Whether all ranks hold the same bits, and the largest absolute
        difference from rank 0's values.
    """
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    # Bits, not values: -0.0 == 0.0 and NaN != NaN would hide or invent drift.
    bits = [g.view(torch.uint8) for g in gathered]
    equal = all(torch.equal(bits[0], b) for b in bits[1:])
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    return equal, diff


def _setup() -> tuple[DDP, ZeroRedundancyOptimizer, PowerSGDState]:
    """DDP with PowerSGD, wrapped so that backward also takes the ZeRO step."""
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
    )
    state = PowerSGDState(
        process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=START_ITER
    )
    ddp.register_comm_hook(state, hook_with_zero_step(powerSGD_hook, ddp, zero))
    return ddp, zero, state


def _rank(rank: int, world: int, steps: int, every: int) -> dict[str, Any]:
    """Train ``steps`` steps, checking every ``every``: the fields of a
    :class:`RankTrace`, plus the model's size, buckets and compression rate."""
    ddp, zero, state = _setup()
    data = torch.Generator().manual_seed(1000 + rank)
    # The same teacher on every rank: a task the ranks share, seen through different data.
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234)) / IN**0.5
    trace: dict[str, Any] = {"steps": [], "rss": [], "equal": [], "diff": [], "loss": []}
    losses: list[float] = []

    def check(step: int) -> None:
        equal, diff = replicas_equal(list(ddp.parameters()))
        trace["steps"].append(step)
        trace["rss"].append(rss_bytes())
        trace["equal"].append(equal)
        trace["diff"].append(diff)
        trace["loss"].append(sum(losses) / len(losses) if losses else math.nan)
        losses.clear()

    check(0)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(BATCH, IN, generator=data)
        zero.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), torch.tanh(x @ teacher))
        loss.backward()  # the hook averages (PowerSGD) and steps ZeRO inside
        losses.append(loss.item())
        if step == 1:
            trace["first_loss"] = losses[0]
        if step % every == 0:
            check(step)
    trace["seconds"] = time.perf_counter() - started
    trace["numel"] = sum(p.numel() for p in ddp.parameters())
    trace["buckets"] = len(state.hook_state.buckets)
    trace["compression"] = state.compression_stats()[0]
    return trace


@attrs.frozen
class RankTrace:
    """One rank's samples, one per check (the first before training).

    Attributes:
        steps: the step each check followed (0: before training).
        rss: resident set size at each check, bytes.
        equal: whether all ranks' parameters were bitwise equal at each check.
        diff: largest absolute parameter difference from rank 0 at each check.
        loss: mean training loss since the previous check (NaN at step 0).
        first_loss: the loss of the first step.
        seconds: wall time of the training loop, checks included.
    """

    steps: tuple[int, ...] = attrs.field(converter=tuple)
    rss: tuple[int, ...] = attrs.field(converter=tuple)
    equal: tuple[bool, ...] = attrs.field(converter=tuple)
    diff: tuple[float, ...] = attrs.field(converter=tuple)
    loss: tuple[float, ...] = attrs.field(converter=tuple)
    first_loss: float
    seconds: float

    @classmethod
    def of(cls, result: dict[str, Any]) -> RankTrace:
        """From what a rank returned (a plain dict crosses processes safely)."""
        names = [field.name for field in attrs.fields(cls)]
        return cls(**{name: result[name] for name in names})


@attrs.frozen
class Growth:
    """RSS after warm-up: its ends, and its trend over every check between.

    Attributes:
        start_step, start: the first check at or after warm-up, and its RSS (bytes).
        end_step, end: the last check, and its RSS (bytes).
        trend: least-squares slope of RSS over those checks, MiB per 1,000 steps.
    """

    start_step: int
    start: int
    end_step: int
    end: int
    trend: float

    @property
    def mib(self) -> float:
        """End minus start, MiB."""
        return (self.end - self.start) / 2**20

    @property
    def mib_per_1000(self) -> float:
        """End minus start, MiB per 1,000 steps."""
        return self.mib * 1000 / (self.end_step - self.start_step)


def rss_growth(steps: Sequence[int], rss: Sequence[int], warmup: int) -> Growth:
    """RSS growth from the first check at step ``>= warmup`` to the last check.

    The allocator moves RSS up and down by a few MiB from check to check, so
    the trend fits every check after warm-up rather than trusting two of them.

    Raises:
        ValueError: if fewer than two checks come at or after ``warmup``.
    """
    after = [i for i, step in enumerate(steps) if step >= warmup]
    if len(after) < 2:
        raise ValueError(f"need two checks at or after step {warmup}, got {len(after)}")
    fit = statistics.linear_regression([steps[i] for i in after], [rss[i] for i in after])
    first, last = after[0], after[-1]
    return Growth(steps[first], rss[first], steps[last], rss[last], fit.slope * 1000 / 2**20)


def first_unequal_step(traces: Sequence[RankTrace]) -> int | None:
    """The first check's step at which some rank saw unequal replicas, if any."""
    steps = [s for t in traces for s, eq in zip(t.steps, t.equal, strict=True) if not eq]
    return min(steps) if steps else None


def _rank_table(traces: Sequence[RankTrace], warmup: int) -> str:
    first, steps = rss_growth(traces[0].steps, traces[0].rss, warmup), traces[0].steps
    rows = []
    for rank, t in enumerate(traces):
        g = rss_growth(t.steps, t.rss, warmup)
        rows.append(
            [
                rank,
                fmt_bytes(g.start),
                fmt_bytes(g.end),
                f"{g.mib:+.2f}",
                f"{g.mib_per_1000:+.2f}",
                f"{g.trend:+.2f}",
                f"{t.first_loss:.4f}",
                f"{t.loss[-1]:.4f}",
            ]
        )
    header = [
        "rank",
        f"RSS at step {first.start_step}",
        f"RSS at step {first.end_step}",
        "growth (MiB)",
        "growth per 1,000 steps (MiB)",
        "trend per 1,000 steps (MiB, fitted)",
        "loss, step 1",
        f"loss, mean of steps {steps[-2] + 1}-{steps[-1]}",
    ]
    return md_table(header, rows)


def _headlines(
    traces: Sequence[RankTrace], warmup: int, model: str, target: float | None
) -> list[Headline]:
    equal = first_unequal_step(traces) is None
    worst = max(rss_growth(t.steps, t.rss, warmup).trend for t in traces)
    return [
        Headline(
            model,
            "replicas bitwise equal at every check",
            Spread.exact(1.0 if equal else 0.0),
            "== 1",
            equal,
        ),
        Headline(
            model,
            "RSS growth after warm-up, MiB per 1,000 steps (fitted trend, worst rank)",
            Spread.exact(worst),
            "" if target is None else f"<= {target:g}",
            None if target is None else worst <= target,
        ),
    ]


def _equality_line(traces: Sequence[RankTrace]) -> str:
    checks = len(traces[0].steps)
    unequal = first_unequal_step(traces)
    if unequal is None:
        return f"Replicas bitwise equal at all {checks} checks (steps 0-{traces[0].steps[-1]})."
    diff = max(max(t.diff) for t in traces)
    bad = sum(not all(eqs) for eqs in zip(*(t.equal for t in traces), strict=True))
    return (
        f"**Replicas NOT bitwise equal** at {bad} of {checks} checks, first at step "
        f"{unequal}; largest parameter difference {diff:.3g}."
    )


def _method_text(traces: Sequence[RankTrace], warmup: int, setup: str, judged: bool) -> str:
    steps, seconds = traces[0].steps[-1], traces[0].seconds
    text = (
        f"{setup}. {steps:,} steps in {seconds:.1f} s on rank 0, "
        f"{seconds / steps * 1e3:.1f} ms per step (checks included). "
        f"{len(traces[0].steps)} checks, one before training and then every "
        f"{traces[0].steps[1]} steps. RSS growth is counted from the first check at "
        f"or after step {warmup} to the last; the headline is its trend, the least-squares "
        "slope over every check in between, since RSS moves by a few MiB from check to "
        "check as the allocator takes and returns pages."
    )
    if not judged:
        text += (
            " This run is too short for RSS to have settled: its growth is shown without a target."
        )
    return text


def soak_section(
    traces: Sequence[RankTrace],
    warmup: int,
    setup: str,
    growth_target: float | None = GROWTH_TARGET_MIB,
) -> Section:
    """The soak's section from every rank's trace.

    Args:
        traces: one per rank, in rank order, all with the same checks.
        warmup: steps before the RSS baseline (its first check at or after).
        setup: model and training set-up, for the headlines and the text.
        growth_target: most RSS growth allowed, MiB per 1,000 steps; ``None``
            for a run too short to judge it.
    """
    model = f"soak ({setup}, {traces[0].steps[-1]:,} steps)"
    panel = Panel(
        "Soak: resident memory per rank",
        "step",
        "RSS (MiB)",
        [
            Curve(f"rank {rank}", t.steps, [r / 2**20 for r in t.rss])
            for rank, t in enumerate(traces)
        ],
    )
    body = "\n\n".join(
        [
            _method_text(traces, warmup, setup, judged=growth_target is not None),
            _equality_line(traces),
            _rank_table(traces, warmup),
        ]
    )
    return Section(
        "Soak: DDP + PowerSGD + overlapped ZeRO (2 gloo ranks, CPU)",
        body,
        _headlines(traces, warmup, model, growth_target),
        [panel],
    )


def bench_soak(quick: bool) -> Section:
    """Train 2,000 steps (``quick``: 200) on 2 ranks and report the checks."""
    steps = 200 if quick else 2000
    results = run_local_world(_rank, 2, steps, steps // CHECKS)
    r0 = results[0]
    setup = (
        f"Adam, MLP {r0['numel'] / 1e6:.2f}M params in {r0['buckets']} buckets, PowerSGD rank "
        f"{POWERSGD_RANK} from iteration {START_ITER} (compression {r0['compression']:.0f}x), "
        "2 gloo ranks"
    )
    traces = [RankTrace.of(r) for r in results]
    warmup = int(steps * WARMUP_FRACTION)
    return soak_section(traces, warmup, setup, None if quick else GROWTH_TARGET_MIB)


BENCHES: dict[str, Callable[[bool], Section]] = {"soak": bench_soak}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
