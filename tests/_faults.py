"""Fault injection on real gloo ranks: one victim per case, the other ranks
survivors.

A *case* is a training loop ``case(rank, tick)`` run by every rank; it calls
``tick(step)`` once per step (at its start, unless the case says otherwise).
On the victim (the last rank), ``tick`` injects the fault at the chosen step:
``os._exit`` (a peer that dies) or a long sleep (a peer that hangs past the
group timeout). Every survivor records what it saw: the error's type and
message, or that it finished, and the seconds from its latest ``tick`` to the
error. A case runs on 2 ranks (one survivor) unless given another world size.

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
from typing import Any, Literal

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
    seconds: float = 0.0  # from the survivor's latest tick to the error
    step: int = -1  # the survivor's latest step
    trace: str = ""  # the error's traceback, for a failing test's report
    rank: int = 0
    world_size: int = 2
    others: tuple[Outcome, ...] = ()  # rank 0's record holds the other survivors'

    @property
    def survivors(self) -> tuple[Outcome, ...]:
        """This survivor's outcome and the other survivors', by rank."""
        return (self, *self.others)


def _outcome(row: dict[str, Any]) -> Outcome:
    """An :class:`Outcome` from ``attrs.asdict``'s dict of one."""
    return Outcome(**{**row, "others": tuple(_outcome(other) for other in row["others"])})


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


def _init(store: str, rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )


def _victim_main(
    cases: Mapping[str, Case],
    name: str,
    fault: FaultKind,
    store: str,
    timeout_s: float,
    world_size: int,
) -> None:
    _init(store, world_size - 1, world_size)
    cases[name](world_size - 1, _victim_tick(fault, timeout_s))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of a forked child


def _record(
    cases: Mapping[str, Case], name: str, fault: FaultKind, timeout_s: float, rank: int
) -> Outcome:
    """Run the case as survivor ``rank`` of the initialised group.

    Returns:
        What this survivor saw.
    """
    world_size = dist.get_world_size()
    latest = [-1, time.perf_counter()]

    def tick(step: int) -> None:
        _shorten_timeout(step, timeout_s)
        latest[:] = [step, time.perf_counter()]

    # Only strings leave the handler: the error's traceback holds the case's
    # DDP model and group alive, and Python drops it with the handler.
    try:
        cases[name](rank, tick)
        return Outcome(
            name, fault, finished=True, step=int(latest[0]), rank=rank, world_size=world_size
        )
    except Exception as e:
        return Outcome(
            name,
            fault,
            finished=False,
            error_type=type(e).__name__,
            message="".join(traceback.format_exception_only(e)).strip(),
            seconds=time.perf_counter() - latest[1],
            step=int(latest[0]),
            trace="".join(traceback.format_exception(e)),
            rank=rank,
            world_size=world_size,
        )


def _other_survivor_main(
    cases: Mapping[str, Case],
    name: str,
    fault: FaultKind,
    store: str,
    timeout_s: float,
    ranks: tuple[int, int],
    out: str,
) -> None:
    rank, world_size = ranks
    _init(store, rank, world_size)
    torch.save(attrs.asdict(_record(cases, name, fault, timeout_s, rank)), out)
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of a forked child


def _collect(process: Any, out: str, name: str, fault: FaultKind, rank: int) -> Outcome:
    """The outcome another survivor saved, once it has exited."""
    process.join(60)
    if process.is_alive() or not os.path.exists(out):
        process.kill()
        process.join()
        return Outcome(name, fault, finished=False, message="did not report", rank=rank)
    return _outcome(torch.load(out, weights_only=False))


def _survive(
    cases: Mapping[str, Case],
    name: str,
    fault: FaultKind,
    tmp: str,
    timeout_s: float,
    world_size: int,
    forks: mp.context.BaseContext,
) -> Outcome:
    folder = tempfile.mkdtemp(dir=tmp)
    store = os.path.join(folder, "store")
    victim = forks.Process(  # type: ignore[attr-defined]
        target=_victim_main,
        args=(cases, name, fault, store, timeout_s, world_size),
        daemon=True,
    )
    victim.start()
    others: dict[int, tuple[Any, str]] = {}
    for rank in range(1, world_size - 1):
        out = os.path.join(folder, f"rank{rank}.pt")
        others[rank] = (
            forks.Process(  # type: ignore[attr-defined]
                target=_other_survivor_main,
                args=(cases, name, fault, store, timeout_s, (rank, world_size), out),
                daemon=True,
            ),
            out,
        )
        others[rank][0].start()
    _init(store, 0, world_size)
    outcome = _record(cases, name, fault, timeout_s, 0)
    # The other survivors finish before the victim is killed and before this
    # rank leaves the group, so that what they see is the fault, not the
    # harness: without a fault they may still be talking to the victim.
    seen = tuple(_collect(p, out, name, fault, rank) for rank, (p, out) in others.items())
    victim.kill()
    victim.join()
    dist.destroy_process_group()
    return attrs.evolve(outcome, others=seen)


def _survivor_main(
    cases: Mapping[str, Case],
    faults: Sequence[FaultKind],
    timeout_s: float,
    world_sizes: Mapping[str, int],
    out: str,
) -> None:
    forks = mp.get_context("forkserver")
    # Victims fork from a server that has imported everything a case needs.
    modules = {case.__module__ for case in cases.values()}
    forks.set_forkserver_preload(["torch", "zerofn_torch", *sorted(modules)])
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            for fault in faults:
                world_size = world_sizes.get(name, 2)
                outcomes.append(_survive(cases, name, fault, tmp, timeout_s, world_size, forks))
    torch.save([attrs.asdict(o) for o in outcomes], out)


def run_family(
    cases: Mapping[str, Case],
    faults: Sequence[FaultKind] = ("none", "exit", "hang"),
    timeout_s: float = 2.0,
    world_sizes: Mapping[str, int] | None = None,
) -> dict[tuple[str, FaultKind], Outcome]:
    """Run every case under every fault in one spawned survivor process.

    ``cases`` must be a module-level mapping of module-level functions (the
    survivor and the victims import them by name).

    Args:
        cases: name -> case.
        faults: the faults to inject, each in a fresh group.
        timeout_s: the group's timeout from step ``SHORT_FROM`` on.
        world_sizes: name -> ranks, for cases with more than 2; ranks
            between rank 0 and the victim are survivors too, forked like
            the victim.

    Returns:
        ``(case, fault) -> Outcome`` of rank 0, which holds the other
        survivors' outcomes (:attr:`Outcome.others`).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.pt")
        survivor = mp.get_context("spawn").Process(
            target=_survivor_main,
            args=(cases, list(faults), timeout_s, dict(world_sizes or {}), out),
        )
        survivor.start()
        survivor.join()
        if survivor.exitcode != 0:
            raise RuntimeError(f"the survivor process exited with code {survivor.exitcode}")
        rows = torch.load(out, weights_only=False)
    return {(row["case"], row["fault"]): _outcome(row) for row in rows}
