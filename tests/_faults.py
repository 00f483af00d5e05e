"""Fault injection on real gloo ranks: one survivor, one victim per case.

A *case* is a training loop ``case(rank, tick)`` run by both ranks; it calls
``tick(step)`` at the start of every step. On the victim (rank 1), ``tick``
injects the fault at the chosen step: ``os._exit`` (a peer that dies) or a
long sleep (a peer that hangs past the group timeout). The survivor (rank 0)
records what it saw: the error's type and message, or that it finished, and
the seconds from the start of its latest step to the error.

:func:`run_family` runs many cases in one spawned survivor process. Each case
gets a fresh process group and a fresh victim, forked from a forkserver that
has torch imported already, so a case costs a fork, not an interpreter
start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Literal

import attrs
import torch
import torch.distributed as dist

Tick = Callable[[int], None]
Case = Callable[[int, Tick], None]
FaultKind = Literal["exit", "hang", "none"]

STEPS = 7
SHORT_FROM = 3  # the step from which the group's timeout is short (earlier steps warm up)
FAULT_STEP = 4  # the step at which the victim fails


@attrs.frozen
class Outcome:
    """What the survivor saw in one case."""

    case: str
    fault: FaultKind
    finished: bool
    error_type: str = ""
    message: str = ""
    seconds: float = 0.0  # from the start of the survivor's latest step to the error
    step: int = -1  # the survivor's latest step
    trace: str = ""  # the error's traceback, for a failing test's report


def _shorten_timeout(step: int, timeout_s: float) -> None:
    # Both ranks warm up (lazy imports, DDP's bucket rebuild) under a long
    # timeout, so that a slow first step is not mistaken for a hung peer.
    if step == SHORT_FROM:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


def _victim_tick(fault: FaultKind, timeout_s: float) -> Tick:
    def tick(step: int) -> None:
        _shorten_timeout(step, timeout_s)
        if step != FAULT_STEP:
            return
        if fault == "exit":
            os._exit(0)
        if fault == "hang":
            time.sleep(600)  # killed by the survivor once it has its outcome

    return tick


def _init(store: str, rank: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )


def _victim_main(
    cases: Mapping[str, Case], name: str, fault: FaultKind, store: str, timeout_s: float
) -> None:
    _init(store, 1)
    cases[name](1, _victim_tick(fault, timeout_s))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of a forked child


def _survive(
    cases: Mapping[str, Case],
    name: str,
    fault: FaultKind,
    tmp: str,
    timeout_s: float,
    forks: mp.context.BaseContext,
) -> Outcome:
    store = os.path.join(tempfile.mkdtemp(dir=tmp), "store")
    victim = forks.Process(  # type: ignore[attr-defined]
        target=_victim_main, args=(cases, name, fault, store, timeout_s), daemon=True
    )
    victim.start()
    _init(store, 0)
    latest = [-1, time.perf_counter()]

    def tick(step: int) -> None:
        _shorten_timeout(step, timeout_s)
        latest[:] = [step, time.perf_counter()]

    try:
        cases[name](0, tick)
        outcome = Outcome(name, fault, finished=True, step=int(latest[0]))
    except Exception as e:
        outcome = Outcome(
            name,
            fault,
            finished=False,
            error_type=type(e).__name__,
            message="".join(traceback.format_exception_only(e)).strip(),
            seconds=time.perf_counter() - latest[1],
            step=int(latest[0]),
            trace="".join(traceback.format_exception(e)),
        )
        del e  # its traceback holds the case's DDP model and group alive
    victim.kill()
    victim.join()
    dist.destroy_process_group()
    return outcome


def _survivor_main(
    cases: Mapping[str, Case], faults: Sequence[FaultKind], timeout_s: float, out: str
) -> None:
    forks = mp.get_context("forkserver")
    # Victims fork from a server that has imported everything a case needs.
    modules = {case.__module__ for case in cases.values()}
    forks.set_forkserver_preload(["torch", "zerofn_torch", *sorted(modules)])
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            for fault in faults:
                outcomes.append(_survive(cases, name, fault, tmp, timeout_s, forks))
    torch.save([attrs.asdict(o) for o in outcomes], out)


def run_family(
    cases: Mapping[str, Case],
    faults: Sequence[FaultKind] = ("none", "exit", "hang"),
    timeout_s: float = 2.0,
) -> dict[tuple[str, FaultKind], Outcome]:
    """Run every case under every fault in one spawned survivor process.

    ``cases`` must be a module-level mapping of module-level functions (the
    survivor and the victims import them by name).

    Returns:
        ``(case, fault) -> Outcome``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.pt")
        survivor = mp.get_context("spawn").Process(
            target=_survivor_main, args=(cases, list(faults), timeout_s, out)
        )
        survivor.start()
        survivor.join()
        if survivor.exitcode != 0:
            raise RuntimeError(f"the survivor process exited with code {survivor.exitcode}")
        rows = torch.load(out, weights_only=False)
    return {(row["case"], row["fault"]): Outcome(**row) for row in rows}
