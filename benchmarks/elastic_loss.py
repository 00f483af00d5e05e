"""Part 2 of ``bench_elastic.py``, a loss with ``redundancy=2`` (its docstring
says how it is measured): the ranks of which one dies and the others recover
(``_loss_rank``), the survivors' figures (:class:`Loss`,
:func:`measure_losses`), the table and closing lines the block quotes, and the
restart path's figures read from the kill-and-restart soak's block
(:func:`restart_figures`)."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import zerofn_torch.roll_call as survivors_roll_call
from bench_soak_restart import BEGIN as SOAK_BEGIN
from bench_soak_restart import END as SOAK_END
from bench_soak_restart import FULL as SOAK
from elastic_setup import (
    GROUP_TIMEOUT_S,
    _tensor_bytes,
    _watch_outboxes,
    batch,
    iteration,
    make_model,
    span,
)
from report import fmt_bytes, md_table
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import SILENT_AFTER_S, recover
from zerofn_torch.runtime.launch import run_local_world

from zerofn.errors import CollectiveError

DEADLINE_S = 1.0
"""The roll call's deadline: realistic for a small job on one machine (the
default is 5 s)."""

LOST, LOST_AT = 2, 3
"""Rank 2 of 3 is lost at step 3 (0-based: three steps done on 3 ranks)."""

STEPS = 6
MODES = ((False, "before its step"), (True, "inside the exchange"))
AFTER_DETECTION_S = 1.0
"""The target for a loss: at most this long from its detection (the failed
collective, then the roll call that proves who is gone) to the next step."""


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


def _instrument(spent: dict[str, float]) -> None:
    """Time ``recover``'s roll call (called by name, in this process's copy
    of ``zerofn_torch.roll_call``) and count the state it sends."""
    roll_call = survivors_roll_call.roll_call

    def timed_roll_call(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return roll_call(*args, **kwargs)
        finally:
            spent["roll_call_s"] += time.perf_counter() - began

    def counted(outbox: Any) -> None:
        spent["moved_bytes"] += _tensor_bytes(outbox)

    setattr(survivors_roll_call, "roll_call", timed_roll_call)  # noqa: B010
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
                    "recover no longer calls zerofn_torch.roll_call.roll_call and "
                    "zerofn.zero.elastic.regroup.outgoing_states by name: elastic_loss._instrument "
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
