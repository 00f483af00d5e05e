"""What ``redundancy=2`` costs per step, and what losing a rank costs with it.

1. **The cost per step** (2 and 3 gloo ranks on CPU, one thread each; an MLP of
   ~4M parameters, in each configuration of ``train_elastic.CONFIGS`` stepped
   after backward, :data:`COSTED`;
   DDP + ``zerofn_torch.ZeroRedundancyOptimizer(Adam)``). One
   process group holds two copies of the model, one trained with
   ``redundancy=1`` and one with ``redundancy=2``; their iterations (forward,
   backward with DDP's all-reduce, the ZeRO step) take turns round by round
   with the floor of what ``redundancy=2`` adds: a plain ``torch.optim.Adam``
   step over fresh tensors of the carried shard's shapes (the extra local step,
   1/W of the parameters). Separate rounds time the optimizer step alone
   (``zero.step()`` over the gradients the last iteration left), with the same
   floor. The two copies take the same iterations on the same data, so they
   must end with the same parameters (checked). Bytes per iteration are counted
   for both (``collective_traffic``; DDP runs zerofn's all-reduce hook so that
   its all-reduce is counted too) and must be equal; memory from
   ``memory_bytes()`` (its ``carried`` key) against ``plan_footprint(...,
   redundancy=2)``. In the same rounds, ``verify_replicas`` over the model: its
   cost when it runs every :data:`VERIFY_EVERY` steps is one check over that
   many iterations.
2. **A loss** (3 gloo ranks, the same model, ``redundancy=2``): rank 2 exits at
   step :data:`LOST_AT`, before its step or inside the step's exchange (right
   after its local step): ``examples/train_elastic.py``'s two modes, with a
   roll-call deadline of :data:`DEADLINE_S` s. The dying rank writes the time
   in the store first; the survivors time from then: until their collective
   failed, the roll call (a dead rank never answers: it ends once the rank's
   heartbeat has been silent long enough), the rest of ``recover`` (the
   survivors' group, the moves, the rebuilt optimizer, and after a loss inside
   the exchange the exchange again), DDP's rebuild, and the step redone, up to
   their next completed step; the state bytes moved to restore redundancy (the
   outboxes of ``outgoing_states``) against the model's optimizer state; steps
   lost (the steps done before the loss that the state the survivors go on from
   lacks, by Adam's step count in it). Beside it, the restart path's figures,
   read from the kill-and-restart soak's block on ``docs/resilience.md``
   (``bench_soak_restart.py``; ``make bench`` runs it first).
3. **A join** (2 gloo ranks and a new process, the same model,
   ``redundancy=2``): after the job's first step rank 0 starts a fresh
   interpreter (``python -c``) that calls ``zerofn_torch.elastic.join``;
   the running ranks call ``admit`` at every step boundary until it is in,
   then the 3 ranks take :data:`AFTER_JOIN` steps; :data:`JOINS` times.
   Times on one machine's wall clock, from outside the library's calls:
   the joiner's start until it calls ``join``, its wait until rank 0's
   ``admit`` that lets it in began (where in a step it announced itself:
   reported beside the running ranks' step), the growth until ``join``
   returned, DDP's rebuild, its first step; the running ranks' pause (that
   ``admit``, and the ``admit`` calls that found nobody). Bytes sent to the
   joiner: the parameters (its broadcasts inside ``join``,
   ``collective_traffic``) and the optimizer state (the tensors addressed
   to it in the outboxes of ``outgoing_states``, which ``_grow`` calls by
   name; they travel pickled, by ``all_gather_object``, which
   ``collective_traffic`` does not see), against the model's parameters
   and the state the grown plan gives it; the three ranks' parameters
   must end equal.

Its block (``bench:elastic``) is quoted on ``docs/resilience.md``
(``generated_blocks.QUOTED``; full runs of ``make bench`` only). Run
``python benchmarks/bench_elastic.py [--quick]`` for this section alone.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import zerofn_torch.elastic as elastic
from bench_soak_restart import BEGIN as SOAK_BEGIN
from bench_soak_restart import END as SOAK_END
from bench_soak_restart import FULL as SOAK
from bench_soak_restart import PAGE as RESILIENCE_PAGE
from bench_zero import update_alone
from report import (
    Headline,
    Section,
    Spread,
    fmt_bytes,
    md_table,
    paired_ratios,
    round_sums,
    standalone_main,
    take_turns,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer, verify_replicas
from zerofn_torch.elastic import SILENT_AFTER_S, admit, join, recover
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.errors import CollectiveError
from zerofn.footprint import OPTIMIZERS, plan_footprint
from zerofn.zero import regroup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from train_elastic import CONFIGS, PLAIN, Config

DEADLINE_S = 1.0
"""The roll call's deadline: realistic for a small job on one machine (the
default is 5 s)."""

LOST, LOST_AT = 2, 3
"""Rank 2 of 3 is lost at step 3 (0-based: three steps done on 3 ranks)."""

STEPS = 6
BATCH = 32
MODES = ((False, "before its step"), (True, "inside the exchange"))
ITERATION = {1: "iteration, redundancy=1", 2: "iteration, redundancy=2"}
STEP = {1: "optimizer step, redundancy=1", 2: "optimizer step, redundancy=2"}
ADAM = "Adam over the carried shard alone"
COPIES = "the carrier's copies alone"
PARTS = (ADAM, COPIES)
VERIFY = "verify_replicas"
VERIFY_EVERY = 100
"""``verify_replicas(..., every=VERIFY_EVERY)``: its cost is one check's
time over this many iterations."""
AFTER_DETECTION_S = 1.0
"""The target for a loss: at most this long from its detection (the failed
collective, then the roll call that proves who is gone) to the next step."""
GROUP_TIMEOUT_S = 30.0
"""The process group's timeout in the loss runs: long, so that the figures
show the roll call's short deadline; a loss that gloo held to this timeout
is reported beside them (``examples/train_elastic.py`` keeps the deadline
above a short timeout instead, as docs/resilience.md advises)."""


def model_size(quick: bool) -> tuple[int, int]:
    """Width and depth of the MLP: ~4.2M parameters (``quick``: ~0.2M)."""
    return (256, 3) if quick else (1024, 4)


def make_model(quick: bool, config: Config = PLAIN) -> torch.nn.Module:
    torch.manual_seed(0)
    width, depth = model_size(quick)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(config.dtype)


def batch(seed: int, quick: bool, config: Config = PLAIN) -> torch.Tensor:
    width, _ = model_size(quick)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(seed))
    return x.to(config.dtype)


def iteration(ddp: DDP, zero: ZeroRedundancyOptimizer, x: torch.Tensor) -> Callable[[], None]:
    """One training iteration: forward, backward (DDP's all-reduce), ZeRO step."""

    def run() -> None:
        zero.zero_grad()
        ddp(x).square().mean().backward()
        zero.step()

    return run


# ----- 1. the cost per step ------------------------------------------------------------


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


COSTED = tuple(c for c in CONFIGS.values() if not dict(c.options).get("overlap_with_ddp"))
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


# ----- 2. a loss -------------------------------------------------------------------------


def _die(store: Any) -> None:
    store.set("bench/died", repr(time.time()))
    os._exit(0)


def _die_after_local_step(zero: ZeroRedundancyOptimizer, store: Any) -> None:
    """This rank exits right after its next local step, inside the step (as
    ``examples/train_elastic.py`` does): the others' exchange then fails."""
    local = zero.optim
    step = local.step

    def step_then_die(*args: Any, **kwargs: Any) -> Any:
        step(*args, **kwargs)
        _die(store)

    local.step = step_then_die  # type: ignore[method-assign]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _watch_outboxes(seen: Callable[[Any], None]) -> None:
    """Hand ``seen`` every outbox this process sends in the moves (the
    core's ``regroup_program`` calls ``outgoing_states`` by name, in this
    process's copy of ``zerofn.zero.regroup``)."""
    outgoing = regroup.outgoing_states

    def watched(*args: Any, **kwargs: Any) -> Any:
        outbox = outgoing(*args, **kwargs)
        seen(outbox)
        return outbox

    setattr(regroup, "outgoing_states", watched)  # noqa: B010


def _instrument(spent: dict[str, float]) -> None:
    """Time ``recover``'s roll call (called by name, in this process's copy
    of ``zerofn_torch.elastic``) and count the state it sends."""
    roll_call = elastic.roll_call

    def timed_roll_call(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return roll_call(*args, **kwargs)
        finally:
            spent["roll_call_s"] += time.perf_counter() - began

    def counted(outbox: Any) -> None:
        spent["moved_bytes"] += _tensor_bytes(outbox)

    setattr(elastic, "roll_call", timed_roll_call)  # noqa: B010
    _watch_outboxes(counted)


def _loss_rank(
    rank: int, world_size: int, quick: bool, in_exchange: bool, deadline_s: float
) -> dict[str, Any]:
    spent = {"roll_call_s": 0.0, "moved_bytes": 0.0}
    _instrument(spent)
    model = make_model(quick)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=1e-3)
    ddp = DDP(model)
    store = dist.distributed_c10d._get_default_store()
    state_bytes = 0
    step_s: list[tuple[int, float]] = []  # (world size, seconds) of each step done whole
    loss: dict[str, Any] = {}
    for step in range(STEPS):
        if rank == LOST and step == LOST_AT:
            if not in_exchange:
                _die(store)
            _die_after_local_step(zero, store)
        began = time.perf_counter()
        try:
            iteration(ddp, zero, batch(step * 16 + zero.rank, quick))()
            step_s.append((zero.world_size, time.perf_counter() - began))
        except (CollectiveError, RuntimeError) as error:  # DDP raises RuntimeError
            failed_at = time.time()
            t0 = time.perf_counter()
            survivors = recover(zero, error, deadline_s=deadline_s)
            t1 = time.perf_counter()
            applied = min(int(s["step"]) for s in zero.optim.state.values())
            if not spent["roll_call_s"] or not spent["moved_bytes"]:
                raise RuntimeError(
                    "recover no longer calls zerofn_torch.elastic.roll_call and "
                    "zerofn.zero.regroup.outgoing_states by name: bench_elastic._instrument "
                    "timed nothing"
                ) from error
            ddp = DDP(model, process_group=survivors.group)
            t2 = time.perf_counter()
            if not survivors.finished_step:
                iteration(ddp, zero, batch(step * 16 + zero.rank, quick))()
            done_at, t3 = time.time(), time.perf_counter()
            died_at = float(store.get("bench/died").decode())
            loss = {
                "step": step,
                "done_before": len(step_s),  # steps done whole before the loss
                "applied": applied,  # Adam steps in the state the survivors go on from
                "finished_step": survivors.finished_step,
                "lost": survivors.lost,
                "detect_s": failed_at - died_at,
                "roll_call_s": spent["roll_call_s"],
                "recover_rest_s": t1 - t0 - spent["roll_call_s"],
                "ddp_s": t2 - t1,
                "redo_s": t3 - t2,
                "total_s": done_at - died_at,
                "moved_bytes": spent["moved_bytes"],
                "error": f"{type(error).__name__}: {str(error)[:300]}",
            }
        if step == 0:
            total = torch.tensor([float(zero.memory_bytes()["optimizer_state"])])
            dist.all_reduce(total)
            state_bytes = int(total.item())
    return {
        "loss": loss,
        "state_bytes": state_bytes,
        "step_s": step_s,
        "world_size": zero.world_size,
        "steps": STEPS,
    }


@attrs.frozen
class Loss:
    """One loss, as the survivors saw it (new rank 0's times; bytes moved
    summed over the survivors)."""

    in_exchange: bool
    detect_s: float
    roll_call_s: float
    recover_rest_s: float
    ddp_s: float
    redo_s: float
    total_s: float
    moved_bytes: float
    state_bytes: int
    steps_lost: int
    step_before_s: float  # a step on 3 ranks before the loss (median)
    step_after_s: float  # a step on 2 ranks after it (median)

    @property
    def after_detection_s(self) -> float:
        """Seconds from the loss's detection (the failed collective, then
        the roll call) to the next completed step."""
        return self.total_s - self.detect_s - self.roll_call_s

    @classmethod
    def of(cls, in_exchange: bool, results: Sequence[Mapping[str, Any] | None]) -> Loss:
        """From what the ranks of one world returned (``None``: the lost one).

        Raises:
            RuntimeError: a survivor did not see exactly one loss or did not
                finish on 2 ranks.
        """
        survivors = [r for r in results if r is not None]
        if len(survivors) != 2 or any(
            not r["loss"] or r["world_size"] != 2 or r["loss"]["lost"] != (LOST,) for r in survivors
        ):
            raise RuntimeError(f"the survivors did not go on as expected: {results}")
        first = survivors[0]
        lost = first["loss"]
        before = [s for w, s in first["step_s"] if w == 3]
        after = [s for w, s in first["step_s"] if w == 2]
        return cls(
            in_exchange=in_exchange,
            detect_s=lost["detect_s"],
            roll_call_s=lost["roll_call_s"],
            recover_rest_s=lost["recover_rest_s"],
            ddp_s=lost["ddp_s"],
            redo_s=lost["redo_s"],
            total_s=lost["total_s"],
            moved_bytes=sum(r["loss"]["moved_bytes"] for r in survivors),
            state_bytes=first["state_bytes"],
            # Steps done before the loss (and the one finished from the carried
            # copies) that the state the survivors go on from lacks.
            steps_lost=lost["done_before"] + lost["finished_step"] - lost["applied"],
            step_before_s=statistics.median(before),
            step_after_s=statistics.median(after),
        )


def measure_losses(quick: bool, repeats: int) -> list[Loss]:
    """``repeats`` losses in each mode, the modes taking turns."""
    losses = []
    for _ in range(repeats):
        for in_exchange, _label in MODES:
            results = run_local_world(
                _loss_rank,
                3,
                quick,
                in_exchange,
                DEADLINE_S,
                timeout_s=GROUP_TIMEOUT_S,
                may_exit=[LOST],
            )
            losses.append(Loss.of(in_exchange, results))
    return losses


def span(values: Sequence[float], digits: int) -> str:
    """``median (min to max)``, or the value alone when there is one."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f} to {max(values):.{digits}f})"
    )


def loss_table(losses: Sequence[Loss]) -> str:
    rows = [
        [
            dict(MODES)[x.in_exchange],
            f"{x.detect_s:.2f}",
            f"{x.roll_call_s:.2f}",
            f"{x.recover_rest_s:.2f}",
            f"{x.ddp_s:.2f}",
            f"{x.redo_s:.2f}" if not x.in_exchange else "- (finished in `recover`)",
            f"{x.total_s:.2f}",
            f"{fmt_bytes(x.moved_bytes)} ({x.moved_bytes / x.state_bytes:.2f})",
            x.steps_lost,
        ]
        for x in losses
    ]
    return md_table(
        [
            "rank 2 lost",
            "to the survivors' error (s)",
            f"roll call, deadline {DEADLINE_S:g} s (s)",
            "rest of `recover`: group, moves, rebuild (s)",
            "DDP rebuilt (s)",
            "step redone (s)",
            "loss → next completed step (s)",
            "state moved (/ all optimizer state)",
            "steps lost",
        ],
        rows,
    )


SOAK_SUMMARY = re.compile(
    r"Steps lost per kill: (?P<lost>[^.]+)\. "
    r"Restart, from the kill to training again: (?P<restart>.+?) s\."
)


def restart_figures(page: str) -> tuple[str, str] | None:
    """The restart path's figures from the kill-and-restart soak's block on
    ``page`` (``bench_soak_restart.py`` writes it): seconds from a kill to
    training again and steps lost per kill, as it quotes them (``median (min
    to max)``); ``None`` when the page has no such block."""
    if page.count(SOAK_BEGIN) != 1 or page.count(SOAK_END) != 1:
        return None
    block = page.split(SOAK_BEGIN)[1].split(SOAK_END)[0]
    found = SOAK_SUMMARY.search(" ".join(block.split()))
    return None if found is None else (found["restart"], found["lost"])


def loss_summary(losses: Sequence[Loss], restart: tuple[str, str] | None) -> str:
    """The closing lines: the loss's seconds and their parts, bytes moved,
    steps lost, and the restart path beside them."""
    rest = [x.total_s - x.roll_call_s for x in losses]
    after = [x.after_detection_s for x in losses]
    line = (
        f"From a loss to the survivors' next completed step: "
        f"{span([x.total_s for x in losses], 2)} s, of which the roll call "
        f"{span([x.roll_call_s for x in losses], 2)} s (a dead rank never answers: it is "
        f"declared lost once its heartbeat has been silent for {SILENT_AFTER_S:g} s, counted "
        f"from the last beat seen) and everything else {span(rest, 2)} s (the failed collective "
        f"{span([x.detect_s for x in losses], 2)} s, the rest of `recover` "
        f"{span([x.recover_rest_s for x in losses], 2)} s, DDP's rebuild "
        f"{span([x.ddp_s for x in losses], 2)} s). Once the loss is detected (the failed "
        f"collective, then the roll call that proves who is gone) the survivors complete "
        f"their next step in {span(after, 2)} s (target: at most {AFTER_DETECTION_S:g} s). "
        f"State moved to restore redundancy: "
        f"{fmt_bytes(statistics.median(x.moved_bytes for x in losses))}, "
        f"{statistics.median(x.moved_bytes / x.state_bytes for x in losses):.2f} of the "
        f"model's optimizer state ({fmt_bytes(losses[0].state_bytes)}). Steps lost (steps "
        f"done that the state the survivors go on from lacks, by its Adam step count): "
        f"{span([float(x.steps_lost) for x in losses], 0)}. For scale, a step takes "
        f"{statistics.median(x.step_before_s for x in losses) * 1e3:.0f} ms on 3 ranks and "
        f"{statistics.median(x.step_after_s for x in losses) * 1e3:.0f} ms on the 2 survivors."
    )
    stalled = [x for x in losses if x.detect_s >= 0.9 * GROUP_TIMEOUT_S]
    if stalled:
        line += (
            f" In {len(stalled)} of {len(losses)} losses the survivors' collective failed only "
            f"at the group's {GROUP_TIMEOUT_S:g} s timeout ("
            + ", ".join(f"{x.detect_s:.1f} s, {dict(MODES)[x.in_exchange]}" for x in stalled)
            + "): gloo did not report the dead peer at once, and the timeout, not the roll "
            "call, set the time to go on."
        )
    if restart is None:
        return (
            f"{line} The restart path (torchrun starting every worker again from the newest "
            "whole checkpoint) pays the new processes' start and trains again the steps since "
            "that checkpoint; its soak block was not found to quote."
        )
    seconds, lost = restart
    return (
        f"{line} The restart path, from the kill-and-restart soak above (torchrun, 2 ranks, "
        f"a background save every {SOAK.save_every} steps): {seconds} s from a kill to "
        f"training again and {lost} steps lost per kill."
    )


# ----- 3. a join -------------------------------------------------------------------------

JOINS = 3
"""Joins measured in a full run (``--quick``: one)."""

AFTER_JOIN = 3
"""Steps the 3 ranks take once the joiner is in, its first step among them."""

JOIN_TIMEOUT_S = 60.0
"""The longest the running ranks wait for the joiner to announce itself, and
``join``'s own timeout."""

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

STATE = OPTIMIZERS["adam"]


def _record_outboxes(outboxes: list[Any]) -> None:
    """Keep every outbox this process sends in the moves (``admit`` and
    ``join`` run them in ``_grow``): what each rank sends to which."""
    _watch_outboxes(outboxes.append)


def _grown_outbox(outboxes: Sequence[Any]) -> dict[str, Any]:
    """The one outbox of the growth, sized (after the timed part): tensor
    bytes per target rank and parameter, and its pickled size (what
    ``all_gather_object`` sends).

    Raises:
        RuntimeError: the moves did not run once.
    """
    if len(outboxes) != 1:
        raise RuntimeError(
            f"the growth made {len(outboxes)} outboxes, not one: does _grow still call "
            "zerofn.zero.regroup.outgoing_states by name? bench_elastic._record_outboxes "
            "counted nothing"
        )
    (out,) = outboxes
    return {
        "to": {t: _bytes_by_param(states) for t, states in out.items()},
        "pickled": len(pickle.dumps(out)),
    }


def _bytes_by_param(states: Mapping[Any, Any]) -> dict[int, int]:
    """Tensor bytes of an outbox's states (by piece), summed per parameter."""
    out: dict[int, int] = {}
    for piece, state in states.items():
        out[piece.param] = out.get(piece.param, 0) + _tensor_bytes(state)
    return out


def planned_state_bytes(sizes: Sequence[int], indices: Sequence[int]) -> int:
    """Adam's state bytes (float32) for the parameters ``indices`` of a model
    whose parameters have ``sizes`` elements: what the plan puts there."""
    return sum(STATE.elementwise_states * sizes[i] * 4 + STATE.scalar_bytes for i in indices)


def _joiner_command(job_store: str, out: str, quick: bool) -> list[str]:
    """A fresh interpreter that imports this module (torch, zerofn_torch) and joins."""
    code = (
        f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import bench_elastic; "
        f"bench_elastic.joiner_main({job_store!r}, {out!r}, {quick!r})"
    )
    return [sys.executable, "-c", code]


def joiner_main(job_store: str, out: str, quick: bool) -> None:
    """The replacement process: join the running job, take :data:`AFTER_JOIN`
    steps with it, save its times and what it holds to ``out``."""
    torch.set_num_threads(1)
    outboxes: list[Any] = []
    _record_outboxes(outboxes)
    store = dist.FileStore(job_store, -1)
    model = make_model(quick)
    called = time.time()
    with collective_traffic() as counted:
        joined = join(
            store, model, torch.optim.Adam, redundancy=2, timeout_s=JOIN_TIMEOUT_S, lr=1e-3
        )
    joined_at = time.time()
    zero, first = joined.optimizer, joined.extra["step"]
    carried = zero.zero_rank.carried
    assert carried is not None
    held = {
        "owned": zero.zero_rank.plan.partition.params_of(joined.rank),  # type: ignore[union-attr]
        "carried": tuple(carried.indices),
        "shard_state": zero.memory_bytes()["optimizer_state"],
        "carried_state": _tensor_bytes(list(carried.optim.state.values())),
    }
    ddp = DDP(model)
    ddp_at = time.time()
    iteration(ddp, zero, batch(first * 16 + joined.rank, quick))()
    first_at = time.time()
    for step in range(first + 1, first + AFTER_JOIN):
        iteration(ddp, zero, batch(step * 16 + joined.rank, quick))()
    result = {
        "rank": joined.rank,
        "world_size": joined.world_size,
        "called": called,
        "joined": joined_at,
        "ddp": ddp_at,
        "first": first_at,
        "broadcasts": counted.calls,
        "broadcast_bytes": counted.payload_bytes,
        "outbox": _grown_outbox(outboxes),
        "held": held,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    torch.save(result, out)
    # Leave without tearing anything down: freeing DDP's reducer drops the
    # last reference to the gloo group, whose destructor joins gloo's thread
    # holding the GIL while that thread may still run a future's Python
    # callback (zerofn's driver), which waits for the GIL: a deadlock at exit,
    # about one join in ten here.
    os._exit(0)


def _running_rank(rank: int, world_size: int, quick: bool, tmp: str) -> dict[str, Any]:
    """One of the 2 running ranks: a step, then (rank 0) the joiner's process
    started; ``admit`` at every step boundary until it is in, then
    :data:`AFTER_JOIN` steps on 3 ranks."""
    outboxes: list[Any] = []
    _record_outboxes(outboxes)
    job_store, out = os.path.join(tmp, "job"), os.path.join(tmp, "joiner.pt")
    store = dist.FileStore(job_store, -1)
    model = make_model(quick)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=1e-3)
    ddp = DDP(model)
    iteration(ddp, zero, batch(rank, quick))()  # the job runs before the joiner starts
    joiner, started = None, time.time()
    if rank == 0:
        joiner = subprocess.Popen(_joiner_command(job_store, out, quick))
    try:
        step_s: list[float] = []  # steps on 2 ranks while the joiner starts
        empty_s: list[float] = []  # the admits that found nobody
        step = 1
        while True:
            if joiner is not None and joiner.poll() is not None:
                raise RuntimeError(f"the joiner exited with {joiner.returncode} before joining")
            if time.time() - started > JOIN_TIMEOUT_S:
                raise RuntimeError(f"the joiner did not join within {JOIN_TIMEOUT_S:g} s")
            admit_began = time.time()
            grown = admit(zero, store, extra={"step": step})
            admit_s = time.time() - admit_began
            if grown is not None:
                break
            empty_s.append(admit_s)
            began = time.perf_counter()
            iteration(ddp, zero, batch(step * 16 + rank, quick))()
            step_s.append(time.perf_counter() - began)
            step += 1
        began = time.perf_counter()
        ddp = DDP(model)  # the new default group
        ddp_s = time.perf_counter() - began
        after_s = []
        for s in range(step, step + AFTER_JOIN):
            began = time.perf_counter()
            iteration(ddp, zero, batch(s * 16 + rank, quick))()
            after_s.append(time.perf_counter() - began)
        result = {
            "started": started,
            "admit_began": admit_began,
            "admit_s": admit_s,
            "ddp_s": ddp_s,
            "step_s": step_s,
            "empty_admit_s": empty_s,
            "after_s": after_s,
            "joined": grown.joined,
            "world_size": zero.world_size,
            "outbox": _grown_outbox(outboxes),
            "params": [p.detach().clone() for p in model.parameters()],
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "sizes": [p.numel() for p in model.parameters()],
        }
        if joiner is not None:
            if joiner.wait(timeout=JOIN_TIMEOUT_S) != 0:
                raise RuntimeError(f"the joiner exited with {joiner.returncode}")
            result["joiner"] = torch.load(out, weights_only=False)
        return result
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


@attrs.frozen
class Join:
    """One join, seen by the joiner and the running rank 0 (one machine's wall
    clock): seconds from the joiner's start, the running ranks' pause, and
    the bytes sent to the joiner."""

    start_s: float  # the joiner's process start, imports and model, until `join` is called
    wait_s: float  # from then until rank 0's `admit` that lets it in began
    grow_s: float  # from that `admit`'s start until `join` returned
    ddp_s: float  # the joiner's DDP built
    first_step_s: float  # its first step
    total_s: float  # the joiner's start to its first completed step
    admit_s: float  # rank 0's `admit` that let it in: the running ranks' pause
    running_ddp_s: float  # rank 0's DDP rebuilt
    empty_admit_s: tuple[float, ...]  # rank 0's `admit`s that found nobody
    step_before_s: float  # a step on the 2 running ranks (median): the boundary
    step_after_s: float  # a step on 3 ranks after the join (median, rank 0)
    param_bytes: int  # the model's parameters
    broadcasts: int  # the joiner's broadcasts inside `join` (`collective_traffic`)
    broadcast_bytes: int  # their payload
    shard_bytes: int  # state sent to the joiner for its shard (tensors in the outboxes)
    carried_bytes: int  # ... for its carried copy
    moved_bytes: int  # all the state the growth moved, to every rank
    gathered_bytes: int  # what the all-gather of the pickled outboxes brings the joiner
    shard_held: int  # its shard's state after `join` (`memory_bytes`)
    carried_held: int  # its carried copy's state after `join`
    shard_planned: int  # its shard's state, by the grown plan
    carried_planned: int  # its carried copy's state, by the grown plan
    max_diff: float  # the 3 ranks' parameters after the steps on 3 ranks

    @classmethod
    def of(cls, results: Sequence[Mapping[str, Any]]) -> Join:
        """From what the 2 running ranks returned (rank 0's holds the joiner's).

        Raises:
            RuntimeError: the world did not grow to 3 with one joiner as rank
                2, or state reached the joiner for parameters it neither
                owns nor carries.
        """
        r0 = results[0]
        joiner = r0.get("joiner")
        if (
            joiner is None
            or joiner["rank"] != 2
            or any(r["world_size"] != 3 or r["joined"] != 1 for r in results)
            or joiner["world_size"] != 3
        ):
            raise RuntimeError(f"the world did not grow as expected: {results}")
        to_joiner: dict[int, int] = {}
        for r in results:
            to_joiner.update(r["outbox"]["to"].get(joiner["rank"], {}))
        held = joiner["held"]
        owned, carried = set(held["owned"]), set(held["carried"])
        if not set(to_joiner) <= owned | carried:
            raise RuntimeError(
                f"state for parameters {sorted(set(to_joiner) - owned - carried)} reached the "
                "joiner, which neither owns nor carries them"
            )
        outboxes = [r["outbox"] for r in (*results, joiner)]
        sizes = r0["sizes"]
        return cls(
            start_s=joiner["called"] - r0["started"],
            wait_s=r0["admit_began"] - joiner["called"],
            grow_s=joiner["joined"] - r0["admit_began"],
            ddp_s=joiner["ddp"] - joiner["joined"],
            first_step_s=joiner["first"] - joiner["ddp"],
            total_s=joiner["first"] - r0["started"],
            admit_s=r0["admit_s"],
            running_ddp_s=r0["ddp_s"],
            empty_admit_s=tuple(r0["empty_admit_s"]),
            step_before_s=statistics.median(r0["step_s"]),
            step_after_s=statistics.median(r0["after_s"]),
            param_bytes=r0["param_bytes"],
            broadcasts=joiner["broadcasts"].get("broadcast", 0),
            broadcast_bytes=joiner["broadcast_bytes"].get("broadcast", 0),
            shard_bytes=sum(b for i, b in to_joiner.items() if i in owned),
            carried_bytes=sum(b for i, b in to_joiner.items() if i in carried),
            moved_bytes=sum(b for o in outboxes for s in o["to"].values() for b in s.values()),
            gathered_bytes=(len(outboxes) - 1) * max(o["pickled"] for o in outboxes),
            shard_held=held["shard_state"],
            carried_held=held["carried_state"],
            shard_planned=planned_state_bytes(sizes, held["owned"]),
            carried_planned=planned_state_bytes(sizes, held["carried"]),
            max_diff=max(
                (p - q).abs().max().item()
                for r in (results[1], joiner)
                for p, q in zip(r0["params"], r["params"], strict=True)
            ),
        )


def measure_joins(quick: bool, repeats: int) -> list[Join]:
    """``repeats`` joins, each of a fresh process to a fresh 2-rank job."""
    joins = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results = run_local_world(_running_rank, 2, quick, tmp, timeout_s=GROUP_TIMEOUT_S)
        joins.append(Join.of(results))
    return joins


def join_table(joins: Sequence[Join]) -> str:
    rows = [
        [
            f"{j.start_s:.2f}",
            f"{j.wait_s:.2f}",
            f"{j.grow_s:.2f}",
            f"{j.ddp_s:.2f}",
            f"{j.first_step_s:.2f}",
            f"{j.total_s:.2f}",
            f"{j.admit_s:.2f}",
            f"{j.running_ddp_s:.2f}",
            f"{j.step_before_s * 1e3:.0f}",
        ]
        for j in joins
    ]
    return md_table(
        [
            "joiner: start, imports, model → `join` (s)",
            "waiting to be admitted (s)",
            "growth: group, plan, parameters, moves, rebuild (s)",
            "DDP rebuilt (s)",
            "first step (s)",
            "start → first completed step (s)",
            "running ranks' pause: the `admit` that lets it in (s)",
            "their DDP rebuilt (s)",
            "their boundary: a step on 2 ranks as the joiner starts (ms)",
        ],
        rows,
    )


def _of(part: int, whole: int) -> str:
    return f"{fmt_bytes(part)} ({part / whole:.2f})"


def join_bytes_table(joins: Sequence[Join]) -> str:
    """What reached the joiner (the first join's: every join's are checked equal)."""
    j = joins[0]
    addressed = j.shard_bytes + j.carried_bytes
    return md_table(
        ["sent to the joiner", "bytes", "counted as", "against"],
        [
            [
                "parameters (broadcast from rank 0)",
                fmt_bytes(j.broadcast_bytes),
                f"`collective_traffic` on the joiner inside `join`: {j.broadcasts} broadcasts, "
                "their payload",
                f"the model's parameters, {_of(j.broadcast_bytes, j.param_bytes)}",
            ],
            [
                "optimizer state for its shard",
                fmt_bytes(j.shard_bytes),
                "the tensors addressed to it in the running ranks' outboxes (`outgoing_states`)",
                f"its shard's state by the grown plan, {_of(j.shard_bytes, j.shard_planned)}; "
                f"held after `join` (`memory_bytes`): {fmt_bytes(j.shard_held)}",
            ],
            [
                "optimizer state for its carried copy",
                fmt_bytes(j.carried_bytes),
                "the same",
                f"its carried copy's state by the grown plan, "
                f"{_of(j.carried_bytes, j.carried_planned)}; held after `join`: "
                f"{fmt_bytes(j.carried_held)}",
            ],
            [
                "all the outboxes, as the all-gather brings them",
                fmt_bytes(j.gathered_bytes),
                "pickled outboxes (`pickle.dumps`, as `all_gather_object` sends them), "
                "padded to the largest, from each of the 2 others",
                f"the state addressed to it, {_of(j.gathered_bytes, addressed)}",
            ],
        ],
    )


def join_summary(joins: Sequence[Join]) -> str:
    """The closing lines: the join's seconds and their parts, the running
    ranks' pause, an ``admit`` that finds nobody, the bytes."""
    empty = [s for j in joins for s in j.empty_admit_s]
    j = joins[0]
    same = all(
        (k.broadcast_bytes, k.shard_bytes, k.carried_bytes, k.moved_bytes)
        == (j.broadcast_bytes, j.shard_bytes, j.carried_bytes, j.moved_bytes)
        for k in joins
    )
    exact = all(
        k.broadcast_bytes == k.param_bytes
        and k.shard_bytes == k.shard_planned == k.shard_held
        and k.carried_bytes == k.carried_planned == k.carried_held
        for k in joins
    )
    to_joiner = j.shard_bytes + j.carried_bytes
    between = j.moved_bytes - to_joiner
    ring = (
        f"{fmt_bytes(between)} between the running ranks as the ring of carriers re-forms"
        if between
        else "nothing between the running ranks: each already held what the re-formed ring "
        "of carriers gives it"
    )
    return (
        f"From the joiner's start to its first completed step: "
        f"{span([k.total_s for k in joins], 2)} s, of which its start (the interpreter, "
        f"importing torch and the bench, the model) {span([k.start_s for k in joins], 2)} s, "
        f"waiting to be admitted {span([k.wait_s for k in joins], 2)} s (until the running "
        f"ranks' next boundary: they reach one every "
        f"{statistics.median(k.step_before_s for k in joins) * 1e3:.0f} ms here, a step on 2 "
        f"ranks as the joiner starts beside them, so the wait says where in a step the joiner "
        f"announced itself, not what joining costs), "
        f"the growth {span([k.grow_s for k in joins], 2)} s, DDP's rebuild "
        f"{span([k.ddp_s for k in joins], 2)} s and its first step "
        f"{span([k.first_step_s for k in joins], 2)} s. The running ranks pause for the "
        f"`admit` that lets it in, {span([k.admit_s for k in joins], 2)} s on rank 0, and "
        f"their DDP's rebuild, {span([k.running_ddp_s for k in joins], 2)} s; an `admit` that "
        f"finds nobody (one broadcast) takes {statistics.median(empty) * 1e3:.2f} ms "
        f"(median of {len(empty)} calls at the boundaries while the joiner started, "
        f"{min(empty) * 1e3:.2f} to {max(empty) * 1e3:.2f} ms). Sent to the joiner: the "
        f"parameters once ({fmt_bytes(j.broadcast_bytes)}) and the optimizer state of its "
        f"shard and carried copy ({fmt_bytes(to_joiner)}), "
        f"{'as planned' if exact else '**NOT as planned**'}"
        f"{'' if same else ' (**the joins sent different bytes**)'}; DDP's construction "
        f"broadcasts rank 0's parameters once more (its own broadcast from C++, which "
        f"`collective_traffic` does not see). The growth moved "
        f"{fmt_bytes(j.moved_bytes)} of state in all ({ring}), but the outboxes go "
        f"out by one all-gather of pickled objects, so each rank receives every rank's "
        f"outbox: {fmt_bytes(j.gathered_bytes)} reach the joiner. After the join a step takes "
        f"{statistics.median(k.step_after_s for k in joins) * 1e3:.0f} ms on 3 ranks; the "
        f"three ranks' parameters ended {max(k.max_diff for k in joins):.3g} apart."
    )


# ----- the section -----------------------------------------------------------------------


def _headlines(
    costs: Sequence[Cost], losses: Sequence[Loss], joins: Sequence[Join], numel: int
) -> list[Headline]:
    headlines = []
    for c in costs:
        name = (
            f"redundancy=2 (DDP + ZeRO Adam, MLP {numel / 1e6:.1f}M params, "
            f"{c.world_size} gloo ranks, {c.config})"
        )
        sent = c.results[0]["traffic"]
        carried = sum(r["memory"][2]["carried"] for r in c.results)
        planned = sum(r["planned"][2]["carried"] for r in c.results)
        headlines += [
            Headline(
                name,
                "iteration time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("iterations", 2), c.times("iterations", 1)),
                short=f"redundancy=2, {c.world_size} ranks, {c.config}",
            ),
            Headline(
                name,
                "optimizer step time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("steps", 2), c.times("steps", 1)),
                short=f"redundancy=2, {c.world_size} ranks, {c.config}",
            ),
            Headline(
                name,
                "bytes sent per iteration: redundancy=2 / redundancy=1",
                Spread.exact(sent[2]["sent"] / sent[1]["sent"]),
                "== 1",
                sent[2]["sent"] == sent[1]["sent"],
            ),
            Headline(
                name,
                "carried bytes: measured / planned",
                Spread.exact(carried / planned),
                "== 1",
                carried == planned,
            ),
            Headline(
                name,
                f"`verify_replicas(every={VERIFY_EVERY})`: % of an iteration "
                f"(a check / {VERIFY_EVERY} iterations)",
                c.verify_share().scaled(100),
                "<= 1",
                c.verify_share().median <= 0.01,
                short=f"verify_replicas, {c.world_size} ranks, {c.config}",
                why=(
                    f"a check takes {statistics.median(c.checks()) * 1e3:.1f} ms (hashing "
                    f"the model's {c.results[0]['numel'] / 1e6:.1f}M parameters on each rank, "
                    f"then an all-gather) against an iteration of "
                    f"{statistics.median(c.times('iterations', 1)) * 1e3:.1f} ms"
                ),
            ),
        ]
    name = f"a lost rank, redundancy=2 (3 gloo ranks → 2, roll call deadline {DEADLINE_S:g} s)"
    lost = [float(x.steps_lost) for x in losses]
    after = [x.after_detection_s for x in losses]
    headlines += [
        Headline(
            name,
            "seconds from a loss to the next completed step",
            Spread.of([x.total_s for x in losses]),
        ),
        Headline(
            name,
            "seconds from its detection (failed collective, roll call) to the next step",
            Spread.of(after),
            f"<= {AFTER_DETECTION_S:g}",
            statistics.median(after) <= AFTER_DETECTION_S,
            why=(
                f"the rest of `recover` (group, moves, rebuild) takes "
                f"{statistics.median(x.recover_rest_s for x in losses):.2f} s, DDP's rebuild "
                f"{statistics.median(x.ddp_s for x in losses):.2f} s and the step redone "
                f"{statistics.median(x.redo_s for x in losses):.2f} s"
            ),
        ),
        Headline(name, "steps lost per loss", Spread.of(lost), "== 0", max(lost) == 0),
    ]
    name = "a join, redundancy=2 (2 gloo ranks + a new process → 3)"
    sent = [(j.broadcast_bytes + j.shard_bytes + j.carried_bytes) for j in joins]
    planned = [(j.param_bytes + j.shard_planned + j.carried_planned) for j in joins]
    headlines += [
        Headline(
            name,
            "seconds from the joiner's start to its first completed step",
            Spread.of([j.total_s for j in joins]),
        ),
        Headline(
            name,
            "of which seconds in the growth (`admit` began → `join` returned)",
            Spread.of([j.grow_s for j in joins]),
        ),
        Headline(
            name,
            "running ranks' pause: seconds of the `admit` that lets it in",
            Spread.of([j.admit_s for j in joins]),
        ),
        Headline(
            name,
            "ms of an `admit` that finds nobody",
            Spread.of([s for j in joins for s in j.empty_admit_s]).scaled(1e3),
        ),
        Headline(
            name,
            "bytes sent to the joiner: parameters and its state / planned",
            Spread.of([a / b for a, b in zip(sent, planned, strict=True)]),
            "== 1",
            sent == planned,
        ),
    ]
    return headlines


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


def elastic_block(
    costs: Sequence[Cost],
    rounds: int,
    warmup: int,
    losses: Sequence[Loss],
    restart: tuple[str, str] | None,
    joins: Sequence[Join],
) -> str:
    """The Markdown of the ``elastic`` block (``generated_blocks`` adds the
    line saying when and on what it was measured)."""
    numel = costs[0].results[0]["numel"]
    times, memory, lines = cost_tables(costs)
    same = all(
        c.results[0]["traffic"][1]["sent"] == c.results[0]["traffic"][2]["sent"] for c in costs
    )
    diff = max(r["max_diff"] for c in costs for r in c.results)
    repeats = len(losses) // len(MODES)
    per_param = {
        c.config: c.results[0]["memory"][2]["carried"] / c.results[0]["carried_numel"]
        for c in costs
    }
    planned = all(
        r["memory"][2]["carried"] == r["planned"][2]["carried"] for c in costs for r in c.results
    )
    crowded = [c.world_size for c in costs if c.world_size > (os.cpu_count() or 1)]
    shared = f" ({crowded[0]} ranks share this machine's {os.cpu_count()} cores)" if crowded else ""
    costed = "; ".join(f"`{c.name}`: {c.summary}" for c in COSTED)
    costed += (
        "; not `overlap`, whose hook, with `redundancy=2`, takes `plain`'s whole step inside "
        "backward, after an all-reduce of every bucket where its `redundancy=1` twin reduces "
        "each to its owner (1.5 all-reduces' bytes against 1)"
    )
    return "\n\n".join(
        [
            f"**What `redundancy=2` costs a step.** DDP + `ZeroRedundancyOptimizer(Adam)` on "
            f"an MLP of {numel / 1e6:.1f}M parameters ({costed}), batch {BATCH} per rank, "
            "gloo on CPU, "
            f"one thread per rank{shared}: a copy of the model with `redundancy=1` and one "
            f"with `redundancy=2` in the same process group, taking turns with the floor of "
            f"what `redundancy=2` adds, the heaviest carrier's extra work alone (a plain Adam "
            f"step over fresh tensors of its carried shard's shapes, and the copies it makes "
            f"before that step: the parameters' values in, their gradients cloned; with "
            f"masters, which it keeps, the gradients upcast only); "
            f"{warmup} warm-up and {rounds} timed rounds, median [q1, q3]; the optimizer step "
            f"alone (`zero.step()` over the last gradients) in separate rounds.",
            times,
            "Against the floor, which is the bound here (the last column: the ratio the floor "
            "alone would give; a ratio is at it when the ratio's spread holds it): "
            + "; ".join(lines)
            + ".",
            memory,
            f"Bytes sent per iteration (DDP's all-reduce and the ZeRO exchange, "
            f"`collective_traffic`): **{'equal' if same else 'NOT equal'}** with and without "
            f"`redundancy=2`. The carried copy is the memory it costs (its values, or "
            f"masters, and Adam state; bytes per carried parameter on rank 0: "
            + ", ".join(f"{k} {v:.1f}" for k, v in per_param.items())
            + "), "
            + f"{'as planned' if planned else '**NOT as planned**'}. "
            f"The two copies of the model ended {diff:.3g} apart (the same iterations on the "
            "same data).",
            verify_line(costs),
            f"**What a loss costs.** 3 gloo ranks, the same model, `redundancy=2`; rank 2 "
            f"exits at step {LOST_AT} (`examples/train_elastic.py`'s two modes), {repeats} "
            f"time{'s' if repeats > 1 else ''} each; the survivors call `recover(..., "
            f"deadline_s={DEADLINE_S:g})` and go on on 2 ranks. Seconds from the death (the "
            f"dying rank writes the time in the store) on the survivors' new rank 0; state "
            f"moved summed over the survivors.",
            loss_table(losses),
            loss_summary(losses, restart),
            f"**What a join costs.** 2 gloo ranks, the same model, `redundancy=2`, train; "
            f"after their first step rank 0 starts a new process (`python -c`, importing "
            f"torch and this bench) that calls `join(store, model, Adam, redundancy=2, ...)`; "
            f"the running ranks call `admit(zero, store, extra=...)` at every step boundary "
            f"until it is in, then the 3 ranks take {AFTER_JOIN} steps; {len(joins)} "
            f"join{'s, each' if len(joins) > 1 else ''} with a fresh job. Seconds on one "
            f"machine's wall clock, from the moment rank 0 starts the joiner: the joiner's "
            f"start until it calls `join`, its wait until rank 0's `admit` that lets it in "
            f"began, the growth from then until `join` returned (the decision, the new "
            f"default group, the plan, the parameters, the moves, the rebuilt optimizer), "
            f"DDP's rebuild and its first step. The joiner starts beside the 2 running ranks "
            f"on this machine's {os.cpu_count()} cores.",
            join_table(joins),
            join_bytes_table(joins),
            join_summary(joins),
        ]
    )


def bench_elastic(quick: bool) -> Section:
    costs, rounds, warmup = measure_costs(quick)
    losses = measure_losses(quick, 1 if quick else 3)
    joins = measure_joins(quick, 1 if quick else JOINS)
    with open(RESILIENCE_PAGE, encoding="utf-8") as f:
        restart = restart_figures(f.read())
    block = elastic_block(costs, rounds, warmup, losses, restart, joins)
    numel = costs[0].results[0]["numel"]
    return Section(
        "Going on after a lost rank: `redundancy=2` (gloo, CPU)",
        block,
        _headlines(costs, losses, joins, numel),
        blocks={"elastic": block},
    )


BENCHES = {"elastic": bench_elastic}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
