"""What ``redundancy=2`` costs per step, and what losing a rank costs with it.

1. **The cost per step** (2 and 3 gloo ranks on CPU, one thread each; an MLP
   of ~4M parameters; DDP + ``zerofn_torch.ZeroRedundancyOptimizer(Adam)``).
   One process group holds two copies of the model, one trained with
   ``redundancy=1`` and one with ``redundancy=2``; their iterations (forward,
   backward with DDP's all-reduce, the ZeRO step) take turns round by round
   with the floor of what ``redundancy=2`` adds: a plain ``torch.optim.Adam``
   step over fresh tensors of the carried shard's shapes (the extra local
   step, 1/W of the parameters). Separate rounds time the optimizer step
   alone (``zero.step()`` over the gradients the last iteration left), with
   the same floor. The two copies take the same iterations on the same data,
   so they must end with the same parameters (checked). Bytes per iteration
   are counted for both (``collective_traffic``; DDP runs zerofn's all-reduce
   hook so that its all-reduce is counted too) and must be equal; memory from
   ``memory_bytes()`` (its ``carried`` key) against
   ``plan_footprint(..., redundancy=2)``.
2. **A loss** (3 gloo ranks, the same model, ``redundancy=2``): rank 2 exits
   at step :data:`LOST_AT`, before its step or inside the step's exchange
   (right after its local step): ``examples/train_elastic.py``'s two modes,
   with a roll-call deadline of :data:`DEADLINE_S` s. The dying rank writes
   the time in the store first; the survivors time from then: until their
   collective failed, the roll call (a dead rank never answers, so it lasts
   the deadline), the rest of ``recover`` (the survivors' group, the moves,
   the rebuilt optimizer, and after a loss inside the exchange the exchange
   again), DDP's rebuild, and the step redone, up to their next completed
   step; the state bytes moved to restore redundancy (the outboxes of
   ``outgoing_states``) against the model's optimizer state; steps lost (the
   steps done before the loss that the state the survivors go on from lacks,
   by Adam's step count in it).
   Beside it, the restart path's figures, read from the kill-and-restart
   soak's block on ``docs/resilience.md`` (``bench_soak_restart.py``; ``make
   bench`` runs it first).

Its block (``bench:elastic``) is quoted on ``docs/resilience.md``
(``generated_blocks.QUOTED``; full runs of ``make bench`` only). Run
``python benchmarks/bench_elastic.py [--quick]`` for this section alone.
"""

from __future__ import annotations

import math
import os
import re
import statistics
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
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import recover
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.errors import CollectiveError
from zerofn.footprint import plan_footprint

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
GROUP_TIMEOUT_S = 30.0
"""The process group's timeout in the loss runs (as ``examples/train_elastic.py``)."""


def model_size(quick: bool) -> tuple[int, int]:
    """Width and depth of the MLP: ~4.2M parameters (``quick``: ~0.2M)."""
    return (256, 3) if quick else (1024, 4)


def make_model(quick: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    width, depth = model_size(quick)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def batch(seed: int, quick: bool) -> torch.Tensor:
    width, _ = model_size(quick)
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(seed))


def iteration(ddp: DDP, zero: ZeroRedundancyOptimizer, x: torch.Tensor) -> Callable[[], None]:
    """One training iteration: forward, backward (DDP's all-reduce), ZeRO step."""

    def run() -> None:
        zero.zero_grad()
        ddp(x).square().mean().backward()
        zero.step()

    return run


# ----- 1. the cost per step ------------------------------------------------------------


def copies_alone(shapes: Sequence[tuple[int, ...]]) -> Callable[[], None]:
    """What the carrier does besides its Adam step (``step_carried``): its
    tensors of ``shapes`` set to the parameters' values, and each parameter's
    gradient cloned for them."""
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    targets = [torch.empty(s) for s in shapes]

    def run() -> None:
        with torch.no_grad():
            for target, source, grad in zip(targets, sources, grads, strict=True):
                target.copy_(source)
                target.grad = grad.clone()
        for target in targets:
            target.grad = None

    return run


def _cost_rank(rank: int, world_size: int, quick: bool, rounds: int, warmup: int) -> Any:
    x = batch(rank, quick)
    models, zeros, iterations = {}, {}, {}
    for r in (1, 2):
        model = make_model(quick)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=r, lr=1e-3)
        ddp = DDP(model)
        ddp.register_comm_hook(None, allreduce_hook)  # the same all-reduce, visible to the count
        models[r], zeros[r], iterations[r] = model, zero, iteration(ddp, zero, x)
    carried = zeros[2].zero_rank.carried
    assert carried is not None
    shapes = [tuple(t.shape) for t in carried.tensors()]
    parts = {ADAM: update_alone(shapes), COPIES: copies_alone(shapes)}
    # Iterations only, so both copies take the same steps on the same data.
    iterations_s = take_turns(
        {ITERATION[1]: iterations[1], ITERATION[2]: iterations[2], **parts}, rounds, warmup
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
    planned = {
        r: attrs.asdict(plan_footprint(models[r], world_size, redundancy=r).ranks[rank])
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
        "carried_numel": sum(math.prod(s) for s in shapes),
    }


@attrs.frozen
class Cost:
    """One world size's cost of ``redundancy=2``: what every rank returned
    (its rounds aligned with the others' by ``take_turns``' barriers)."""

    world_size: int
    results: Sequence[Mapping[str, Any]]

    def times(self, timed: str, redundancy: int) -> list[float]:
        """Rank 0's seconds per round of ``timed`` (``"iterations"`` or
        ``"steps"``) with ``redundancy``."""
        names = ITERATION if timed == "iterations" else STEP
        return list(self.results[0][timed][names[redundancy]])

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
                    label,
                    Spread.of(one).scaled(1e3).fmt(1),
                    Spread.of(two).scaled(1e3).fmt(1),
                    paired_ratios(two, one).fmt(),
                    Spread.of(adam).scaled(1e3).fmt(1),
                    Spread.of(copies).scaled(1e3).fmt(1),
                    paired_ratios(round_sums(one, floor), one).fmt(),
                ]
            )
            lines.append(bound_line(f"{c.world_size} ranks, {label}", one, two, adam, copies))
    times = md_table(
        [
            "ranks",
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


def measure_costs(quick: bool) -> tuple[list[Cost], int, int]:
    rounds, warmup = (5, 1) if quick else (20, 3)
    costs = []
    for world_size in (2,) if quick else (2, 3):
        costs.append(
            Cost(world_size, run_local_world(_cost_rank, world_size, quick, rounds, warmup))
        )
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


def _instrument(spent: dict[str, float]) -> None:
    """Time ``recover``'s roll call and count the state it sends (this
    process's copy of ``zerofn_torch.elastic``; ``recover`` calls both by name)."""
    roll_call, outgoing = elastic.roll_call, elastic.outgoing_states

    def timed_roll_call(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return roll_call(*args, **kwargs)
        finally:
            spent["roll_call_s"] += time.perf_counter() - began

    def counted_outgoing(*args: Any, **kwargs: Any) -> Any:
        out = outgoing(*args, **kwargs)
        spent["moved_bytes"] += _tensor_bytes(out)
        return out

    setattr(elastic, "roll_call", timed_roll_call)  # noqa: B010
    setattr(elastic, "outgoing_states", counted_outgoing)  # noqa: B010


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
                    "outgoing_states by name: bench_elastic._instrument timed nothing"
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
    line = (
        f"From a loss to the survivors' next completed step: "
        f"{span([x.total_s for x in losses], 2)} s, of which the roll call "
        f"{span([x.roll_call_s for x in losses], 2)} s (its {DEADLINE_S:g} s deadline: a dead "
        f"rank never answers) and everything else {span(rest, 2)} s (the failed collective "
        f"{span([x.detect_s for x in losses], 2)} s, the rest of `recover` "
        f"{span([x.recover_rest_s for x in losses], 2)} s, DDP's rebuild "
        f"{span([x.ddp_s for x in losses], 2)} s). State moved to restore redundancy: "
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


# ----- the section -----------------------------------------------------------------------


def _headlines(costs: Sequence[Cost], losses: Sequence[Loss], numel: int) -> list[Headline]:
    headlines = []
    for c in costs:
        name = (
            f"redundancy=2 (DDP + ZeRO Adam, MLP {numel / 1e6:.1f}M params, "
            f"{c.world_size} gloo ranks)"
        )
        sent = c.results[0]["traffic"]
        carried = sum(r["memory"][2]["carried"] for r in c.results)
        planned = sum(r["planned"][2]["carried"] for r in c.results)
        headlines += [
            Headline(
                name,
                "iteration time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("iterations", 2), c.times("iterations", 1)),
                short=f"redundancy=2, {c.world_size} ranks",
            ),
            Headline(
                name,
                "optimizer step time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("steps", 2), c.times("steps", 1)),
                short=f"redundancy=2, {c.world_size} ranks",
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
        ]
    name = f"a lost rank, redundancy=2 (3 gloo ranks → 2, roll call deadline {DEADLINE_S:g} s)"
    lost = [float(x.steps_lost) for x in losses]
    headlines += [
        Headline(
            name,
            "seconds from a loss to the next completed step",
            Spread.of([x.total_s for x in losses]),
        ),
        Headline(
            name,
            "of which seconds besides the roll call",
            Spread.of([x.total_s - x.roll_call_s for x in losses]),
        ),
        Headline(name, "steps lost per loss", Spread.of(lost), "== 0", max(lost) == 0),
    ]
    return headlines


def elastic_block(
    costs: Sequence[Cost],
    rounds: int,
    warmup: int,
    losses: Sequence[Loss],
    restart: tuple[str, str] | None,
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
    r0 = costs[0].results[0]
    per_param = r0["memory"][2]["carried"] / r0["carried_numel"]
    planned = all(
        r["memory"][2]["carried"] == r["planned"][2]["carried"] for c in costs for r in c.results
    )
    crowded = [c.world_size for c in costs if c.world_size > (os.cpu_count() or 1)]
    shared = f" ({crowded[0]} ranks share this machine's {os.cpu_count()} cores)" if crowded else ""
    return "\n\n".join(
        [
            f"**What `redundancy=2` costs a step.** DDP + `ZeroRedundancyOptimizer(Adam)` on "
            f"an MLP of {numel / 1e6:.1f}M parameters, batch {BATCH} per rank, gloo on CPU, "
            f"one thread per rank{shared}: a copy of the model with `redundancy=1` and one "
            f"with `redundancy=2` in the same process group, taking turns with the floor of "
            f"what `redundancy=2` adds, the heaviest carrier's extra work alone (a plain Adam "
            f"step over fresh tensors of its carried shard's shapes, and the copies it makes "
            f"before that step: the parameters' values in, their gradients cloned); "
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
            f"`redundancy=2`. The carried copy is the memory it costs (its values and Adam "
            f"state, {per_param:.1f} bytes per carried parameter on rank 0), "
            f"{'as planned' if planned else '**NOT as planned**'}. "
            f"The two copies of the model ended {diff:.3g} apart (the same iterations on the "
            "same data).",
            f"**What a loss costs.** 3 gloo ranks, the same model, `redundancy=2`; rank 2 "
            f"exits at step {LOST_AT} (`examples/train_elastic.py`'s two modes), {repeats} "
            f"time{'s' if repeats > 1 else ''} each; the survivors call `recover(..., "
            f"deadline_s={DEADLINE_S:g})` and go on on 2 ranks. Seconds from the death (the "
            f"dying rank writes the time in the store) on the survivors' new rank 0; state "
            f"moved summed over the survivors.",
            loss_table(losses),
            loss_summary(losses, restart),
        ]
    )


def bench_elastic(quick: bool) -> Section:
    costs, rounds, warmup = measure_costs(quick)
    losses = measure_losses(quick, 1 if quick else 3)
    with open(RESILIENCE_PAGE, encoding="utf-8") as f:
        restart = restart_figures(f.read())
    block = elastic_block(costs, rounds, warmup, losses, restart)
    numel = costs[0].results[0]["numel"]
    return Section(
        "Going on after a lost rank: `redundancy=2` (gloo, CPU)",
        block,
        _headlines(costs, losses, numel),
        blocks={"elastic": block},
    )


BENCHES = {"elastic": bench_elastic}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
