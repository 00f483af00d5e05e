"""Ranks lost at moments nobody chose: in each run of DDP + ZeRO(Adam,
``redundancy=2``) one rank, drawn at random, ends itself (``os._exit``) from
a timer thread after a random delay, wherever its main thread is: in
forward, backward, the all-reduce, the local step, the exchange, or between
steps. The survivors recover in-process and train on. Every run is checked
by invariants that need no reference: every survivor completes every step
once, every parameter's Adam step count equals the steps taken (a shard one
step behind shows here), and the survivors' parameters agree bit for bit.
The seeds are drawn anew each run and printed with any failure."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import train_elastic as example
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import recover
from zerofn_torch.runtime.launch import run_local_world

from zerofn.errors import CollectiveError

STEPS = 30


def train_until_lost(rank: int, world_size: int, victim: int, delay_s: float) -> dict[str, Any]:
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = DDP(model)
    timer = threading.Timer(delay_s, os._exit, (0,)) if rank == victim else None
    if timer is not None:
        timer.start()
    done, points = 0, []
    began = time.perf_counter()
    for step in range(STEPS):
        while True:
            try:
                example.train_step(ddp, zero, step)
                break
            except (CollectiveError, RuntimeError) as error:
                survivors = recover(zero, error, deadline_s=example.DEADLINE_S)
                ddp = DDP(model, process_group=survivors.group)
                points.append((survivors.lost, survivors.point))
                if survivors.finished_step:
                    break
        done += 1
    if timer is not None:  # the victim outlived its timer: no loss in this run
        timer.cancel()
    zero.consolidate_state_dict(to=0)
    steps = (
        {int(s["step"]) for s in zero.state_dict()["state"].values()} if zero.rank == 0 else None
    )
    return {
        "done": done,
        "adam_steps": steps,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "points": points,
        "seconds": time.perf_counter() - began,
    }


def check_run(results: list[Any], victim: int, seed: int) -> bool:
    """The run's invariants; whether a rank was lost in it."""
    survivors = [r for r in results if r is not None]
    lost = results[victim] is None
    assert all(r["done"] == STEPS for r in survivors), (seed, [r["done"] for r in survivors])
    counted = [r["adam_steps"] for r in survivors if r["adam_steps"] is not None]
    assert counted == [{STEPS}], (seed, counted)  # one count, every step once
    first = survivors[0]["params"]
    assert all(torch.equal(r["params"], first) for r in survivors), seed
    points = {tuple(r["points"]) for r in survivors}
    assert len(points) == 1, (seed, points)  # the survivors agree where they went on from
    return lost


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ranks_lost_at_random_moments_leave_one_consistent_state(world_size: int) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    draw = random.Random(seed)
    losses = 0
    for run in range(6):
        victim = draw.randrange(world_size)
        delay_s = draw.uniform(0.0, 0.25)  # 30 steps take about 0.27 s here
        results = run_local_world(
            train_until_lost,
            world_size,
            victim,
            delay_s,
            timeout_s=example.TIMEOUT_S,
            may_exit=[victim],
        )
        losses += check_run(results, victim, seed * 100 + run)
    assert losses >= 3, f"seed {seed}: only {losses} of 6 runs lost a rank (the delays ran late)"


def train_with_a_pause(rank: int, world_size: int, paused: int, pause_s: float) -> dict[str, Any]:
    """Rank ``paused`` stops itself (SIGSTOP) at step 5 and a helper process
    resumes it ``pause_s`` later: long enough for the others to recover
    without it. Once resumed, it must fail alone."""
    import signal
    import subprocess

    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = DDP(model)
    done = 0
    for step in range(STEPS):
        if rank == paused and step == 5:
            subprocess.Popen(["sh", "-c", f"sleep {pause_s}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:
            try:
                example.train_step(ddp, zero, step)
                break
            except (CollectiveError, RuntimeError) as error:
                try:
                    survivors = recover(zero, error, deadline_s=example.DEADLINE_S)
                except CollectiveError as fenced:
                    return {"fenced": str(fenced), "done": done}
                ddp = DDP(model, process_group=survivors.group)
                if survivors.finished_step:
                    break
        done += 1
    return {"fenced": None, "done": done, "world_size": zero.world_size}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_paused_rank_that_comes_back_late_fails_alone() -> None:
    results = run_local_world(
        train_with_a_pause, 3, 1, 14.0, timeout_s=example.TIMEOUT_S, may_exit=[1]
    )
    paused = results[1]
    assert paused is not None and paused["fenced"] and "left behind" in paused["fenced"]
    for survivor in (results[0], results[2]):
        assert survivor["fenced"] is None and survivor["done"] == STEPS
        assert survivor["world_size"] == 2
