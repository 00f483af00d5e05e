"""Part 1 of ``bench_elastic.py``, the cost per step of ``redundancy=2`` (its
docstring says how it is measured): the ranks that time ``redundancy=1``
against ``redundancy=2`` and the floor of what it adds (``_cost_rank``,
:func:`measure_costs`), what they returned (:class:`Cost`), and the tables and
lines the block quotes (:func:`cost_tables`, :func:`bound_line`,
:func:`verify_line`)."""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from bench_zero import update_alone
from elastic_setup import batch, iteration, make_model
from report import Spread, fmt_bytes, md_table, paired_ratios, round_sums, take_turns
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer, verify_replicas
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.footprint import plan_footprint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from train_elastic import CONFIGS, PLAIN, Config

ITERATION = {1: "iteration, redundancy=1", 2: "iteration, redundancy=2"}
STEP = {1: "optimizer step, redundancy=1", 2: "optimizer step, redundancy=2"}
ADAM = "Adam over the carried shard alone"
COPIES = "the carrier's copies alone"
PARTS = (ADAM, COPIES)
VERIFY = "verify_replicas"
VERIFY_EVERY = 100
"""``verify_replicas(..., every=VERIFY_EVERY)``: its cost is one check's
time over this many iterations."""


PLANNED_OPTIONS = ("master_dtype", "partition", "exchange_compression")
"""The optimizer options :func:`zerofn.footprint.plan_footprint` takes too."""


def copies_alone(shapes: Sequence[tuple[int, ...]], config: Config = PLAIN) -> Callable[[], None]:
    """What the carrier does besides its Adam step (``step_carried``): its
    tensors of ``shapes`` set to the parameters' values, and each parameter's
    gradient cloned for them; with masters (which it keeps from step to
    step), only each bf16 gradient upcast for them."""
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(config.dtype) for s in shapes]
    targets = [torch.empty(s) for s in shapes]

    def run() -> None:
        with torch.no_grad():
            for target, source, grad in zip(targets, sources, grads, strict=True):
                if not config.keeps_masters:
                    target.copy_(source)
                target.grad = grad.to(torch.float32, copy=True)
        for target in targets:
            target.grad = None

    return run


def _cost_rank(
    rank: int, world_size: int, quick: bool, rounds: int, warmup: int, config: Config
) -> Any:
    x = batch(rank, quick, config)
    models, zeros, iterations = {}, {}, {}
    for r in (1, 2):
        model = make_model(quick, config)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, redundancy=r, lr=1e-3, **dict(config.options)
        )
        ddp = DDP(model)
        ddp.register_comm_hook(None, allreduce_hook)  # the same all-reduce, visible to the count
        models[r], zeros[r], iterations[r] = model, zero, iteration(ddp, zero, x)
    carried = zeros[2].zero_rank.carried
    assert carried is not None
    shapes = [tuple(t.shape) for t in carried.tensors()]
    parts = {ADAM: update_alone(shapes), COPIES: copies_alone(shapes, config)}
    # Iterations only, so both copies take the same steps on the same data;
    # the check reads the parameters and changes nothing.
    iterations_s = take_turns(
        {
            ITERATION[1]: iterations[1],
            ITERATION[2]: iterations[2],
            VERIFY: lambda: verify_replicas(models[1]),
            **parts,
        },
        rounds,
        warmup,
    )
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(models[1].parameters(), models[2].parameters(), strict=True)
    )
    traffic = {}
    for r in (1, 2):
        with collective_traffic() as counted:
            iterations[r]()
        traffic[r] = {"calls": counted.total_calls, "sent": counted.sent_bytes(world_size)}
    steps_s = take_turns({STEP[1]: zeros[1].step, STEP[2]: zeros[2].step, **parts}, rounds, warmup)
    # The planner is asked what the optimizer was built with.
    asked = {k: v for k, v in config.options if k in PLANNED_OPTIONS}
    planned = {
        r: attrs.asdict(
            plan_footprint(
                models[r], world_size, redundancy=r, param_dtype=config.dtype, **asked
            ).ranks[rank]
        )
        for r in (1, 2)
    }
    return {
        "iterations": iterations_s,
        "steps": steps_s,
        "traffic": traffic,
        "memory": {r: zeros[r].memory_bytes() for r in (1, 2)},
        "planned": planned,
        "max_diff": diff,
        "numel": sum(p.numel() for p in models[1].parameters()),
        "tensors": len(list(models[1].parameters())),
        "carried_numel": sum(math.prod(s) for s in shapes),
    }


@attrs.frozen
class Cost:
    """One world size's and configuration's cost of ``redundancy=2``: what
    every rank returned (its rounds aligned with the others' by
    ``take_turns``' barriers)."""

    world_size: int
    results: Sequence[Mapping[str, Any]]
    config: str = "plain"

    def times(self, timed: str, redundancy: int) -> list[float]:
        """Rank 0's seconds per round of ``timed`` (``"iterations"`` or
        ``"steps"``) with ``redundancy``."""
        names = ITERATION if timed == "iterations" else STEP
        return list(self.results[0][timed][names[redundancy]])

    def verify_share(self) -> Spread:
        """Per round, ``verify_replicas``' time (the slowest rank's) over
        :data:`VERIFY_EVERY` iterations of ``redundancy=1`` (rank 0's): its
        cost per iteration when it runs every that many steps."""
        per_step = [VERIFY_EVERY * t for t in self.times("iterations", 1)]
        return paired_ratios(self.checks(), per_step)

    def checks(self) -> list[float]:
        """Per round, the slowest rank's seconds of one ``verify_replicas``."""
        per_rank = [r["iterations"][VERIFY] for r in self.results]
        return [max(v) for v in zip(*per_rank, strict=True)]

    def floor(self, timed: str, part: str | None = None) -> list[float]:
        """Per round, the heaviest carrier's floor (``part``: that part
        alone; default both): every rank waits for the slowest in the
        exchange, so the slowest rank's extra work is what a step pays."""
        names = (part,) if part else PARTS
        per_rank = [round_sums(*(r[timed][n] for n in names)) for r in self.results]
        return [max(values) for values in zip(*per_rank, strict=True)]


def bound_line(
    what: str,
    one: Sequence[float],
    two: Sequence[float],
    adam: Sequence[float],
    copies: Sequence[float],
) -> str:
    """Which bound ``two / one`` (seconds per round, aligned with the
    parts') sits near: the floor, the carrier's extra work (``adam``: the
    extra Adam step, ``copies``: the carrier's copies, both alone). Gives
    what ``redundancy=2`` adds per round against each, and the ratio against
    ``(one + floor) / one``, the ratio that adding the floor alone gives."""
    floor = round_sums(adam, copies)
    extra = statistics.median(b - a for a, b in zip(one, two, strict=True))
    measured = paired_ratios(two, one)
    bound = paired_ratios(round_sums(one, floor), one)
    if measured.q1 <= bound.median <= measured.q3:
        near = "at the floor's"
    elif measured.median > bound.median:
        near = "above the floor's (the step pays more than the carrier's own work)"
    else:
        near = "below the floor's (the parts cost more alone than inside the step)"
    return (
        f"{what}: redundancy=2 adds {extra * 1e3:+.1f} ms, "
        f"{extra / statistics.median(adam):.2f}x the extra Adam step alone and "
        f"{extra / statistics.median(floor):.2f}x the whole floor; its ratio "
        f"{measured.median:.2f} is {near} {bound.median:.2f}"
    )


def cost_tables(costs: Sequence[Cost]) -> tuple[str, str, list[str]]:
    """The time table, the bytes-and-memory table and the bound lines."""
    time_rows: list[list[object]] = []
    lines: list[str] = []
    for c in costs:
        for timed, label in (("iterations", "iteration"), ("steps", "optimizer step alone")):
            one, two = c.times(timed, 1), c.times(timed, 2)
            adam, copies, floor = c.floor(timed, ADAM), c.floor(timed, COPIES), c.floor(timed)
            time_rows.append(
                [
                    c.world_size,
                    c.config,
                    label,
                    Spread.of(one).scaled(1e3).fmt(1),
                    Spread.of(two).scaled(1e3).fmt(1),
                    paired_ratios(two, one).fmt(),
                    Spread.of(adam).scaled(1e3).fmt(1),
                    Spread.of(copies).scaled(1e3).fmt(1),
                    paired_ratios(round_sums(one, floor), one).fmt(),
                ]
            )
            what = f"{c.world_size} ranks, {c.config}, {label}"
            lines.append(bound_line(what, one, two, adam, copies))
    times = md_table(
        [
            "ranks",
            "configuration",
            "timed (rank 0)",
            "redundancy=1 (ms)",
            "redundancy=2 (ms)",
            "redundancy=2 / =1",
            "floor: Adam over the carried shard (ms)",
            "+ the carrier's copies (ms)",
            "(redundancy=1 + floor) / redundancy=1",
        ],
        time_rows,
    )
    memory_rows: list[list[object]] = []
    for c in costs:
        sent = c.results[0]["traffic"]
        carried = [res["memory"][2]["carried"] for res in c.results]
        planned = [res["planned"][2]["carried"] for res in c.results]
        memory_rows.append(
            [
                c.world_size,
                c.config,
                fmt_bytes(sent[1]["sent"]),
                fmt_bytes(sent[2]["sent"]),
                f"{sent[1]['calls']} / {sent[2]['calls']}",
                " / ".join(fmt_bytes(b) for b in carried),
                " / ".join(fmt_bytes(b) for b in planned),
                " / ".join(
                    f"{fmt_bytes(sum(res['memory'][1].values()))} → "
                    f"{fmt_bytes(sum(res['memory'][2].values()))}"
                    for res in c.results
                ),
            ]
        )
    memory = md_table(
        [
            "ranks",
            "configuration",
            "bytes sent / iteration / rank, redundancy=1",
            "redundancy=2",
            "collectives / iteration (=1 / =2)",
            "carried, measured (`memory_bytes`, rank 0 / 1 / ...)",
            "carried, planned (`plan_footprint`)",
            "each rank's bytes, redundancy=1 → 2",
        ],
        memory_rows,
    )
    return times, memory, lines


COSTED = tuple(
    c
    for c in CONFIGS.values()
    if not dict(c.options).get("overlap_with_ddp")
    # What the carried copy costs does not depend on when the exchange travels.
    and not dict(c.options).get("gather_during_forward")
)
"""The configurations whose step is timed apart from backward: with
``redundancy=2`` the overlapped one takes ``plain``'s whole step inside
backward (its cost is that row's, plus the all-reduce its ``redundancy=1``
twin replaces by reductions to the owners)."""


def measure_costs(quick: bool) -> tuple[list[Cost], int, int]:
    rounds, warmup = (5, 1) if quick else (20, 3)
    costs = []
    for world_size in (2,) if quick else (2, 3):
        for config in COSTED:
            results = run_local_world(_cost_rank, world_size, quick, rounds, warmup, config)
            costs.append(Cost(world_size, results, config.name))
    return costs, rounds, warmup


def verify_line(costs: Sequence[Cost]) -> str:
    """What checking the replicas costs: one ``verify_replicas`` over the
    model (timed in the same rounds as the iterations), and per iteration
    when it runs every :data:`VERIFY_EVERY` steps."""
    parts = []
    for c in costs:
        parts.append(
            f"{c.world_size} ranks, {c.config}: a check takes "
            f"{Spread.of(c.checks()).scaled(1e3).fmt(2)} ms, "
            f"{c.verify_share().scaled(100).fmt(2)} % of an iteration"
        )
    tensors = costs[0].results[0]["tensors"]
    return (
        f"**Checking the replicas.** `verify_replicas(ddp.module, every={VERIFY_EVERY}, "
        f"step=step)` hashes each of the model's {tensors} tensors and all-gathers 8 bytes a "
        f"tensor; timed in the same rounds as the iterations above (the slowest rank's): "
        + "; ".join(parts)
        + f" when it runs every {VERIFY_EVERY} steps (target: at most 1 %)."
    )
