"""Faults at moments nobody chose: in each run of DDP + ZeRO(Adam,
``redundancy=2``; ``--config`` names a configuration of
``train_elastic.CONFIGS``: bf16 parameters with fp32 masters, a flat
partition, the int8 exchange, the step inside DDP's backward) on W gloo
ranks, one rank drawn at random is ended (``os._exit``) or paused
(``SIGSTOP``, resumed later by a helper process) from a timer thread after a
random delay, wherever its main thread is: forward, backward, the
all-reduce, the local step, the exchange, between steps, or a recovery. The
others recover in-process and train on::

    .venv/bin/python examples/random_losses.py --world-size 4 --runs 20

Every run is checked by invariants that need no reference: every survivor
completes every step once; every parameter's Adam step count equals the
steps taken (a shard one step behind shows here); the survivors' parameters
agree bit for bit; they agree on the point each recovery went on from; a
paused rank either went on with the others (its pause was shorter than the
group's timeout) or, left behind, failed alone. The first run of each world
size that loses a rank is also checked bit for bit against a reference that
never loses one but shrinks at the same step. ``tests/test_random_losses.py``
runs a few; ``benchmarks/bench_random_losses.py`` runs over a hundred.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diloco_survival import (
    FRAGMENTS,
    VARIANTS,
    WorkerKill,
    Workers,
    make_diloco,
    ranks_per_worker,
    under_ddp,
)
from diloco_survival import run_reference as diloco_reference
from diloco_survival import step_surviving as diloco_step_surviving
from train_elastic import (
    CONFIGS,
    DEADLINE_S,
    PLAIN,
    TIMEOUT_S,
    Config,
    fresh_phase,
    make_ddp,
    make_model,
    make_zero,
    owners_after_loss,
    step_surviving,
)
from zerofn_torch.elastic import recover
from zerofn_torch.runtime.launch import run_local_world

from zerofn.diloco.fragments import plan_fragments, read_fragment
from zerofn.diloco.redundancy import SyncRecovery
from zerofn.diloco.schedule import fragment_synced_at
from zerofn.errors import CollectiveError

STEPS = 30

GROUP_TIMEOUT_S = 120.0
"""The faulted worlds' collective timeout. No survivor waits for it (each
run's survivors finish within half of it, or the run fails), but a rank left
behind may: one paused inside one of PyTorch's own collectives that waits in
C++ while it sends (DDP's bucket rebuild) can stay there until this timeout
before it fails alone. gloo does not fail a send that it queued after the
peer's connection reset (torch 2.13: ``tcp::Pair::signalException`` fails
every pending operation but the unbound-buffer writes in its transmit
queue), and nothing outside gloo can end it (docs/resilience.md, "A rank left
behind inside PyTorch's own collective"). The group's 30-minute default would
hold such a run that long."""

WALL_S = 300.0
"""Seconds a run's world may take (one takes 2 to 20 here, and one whose
left-behind rank waits out :data:`GROUP_TIMEOUT_S` about 130): a run that
hangs fails then, each rank's stack on stderr."""


@dataclass(frozen=True)
class Fault:
    """What happens to one rank of a run, and when.

    Attributes:
        rank: the rank it happens to.
        delay_s: seconds after training starts.
        pause_s: ``None``: the rank ends; else it is stopped this long.
    """

    rank: int
    delay_s: float
    pause_s: float | None = None


def _pause(seconds: float) -> None:
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def _arm(fault: Fault) -> threading.Timer:
    """The fault's timer, started: it strikes wherever the main thread is."""
    strike: Callable[[], None] = (
        (lambda: os._exit(0)) if fault.pause_s is None else (lambda: _pause(fault.pause_s or 0))
    )
    timer = threading.Timer(fault.delay_s, strike)
    timer.daemon = True
    timer.start()
    return timer


def _left_behind(error: CollectiveError, done: int) -> dict[str, Any]:
    """What a rank the others went on without returns: what it raised, and
    the steps it completed.

    Raises:
        zerofn.errors.CollectiveError: ``error`` itself, unless it says the
            rank was left behind.
    """
    if "left behind" not in str(error):
        raise error
    return {"fenced": str(error), "done": done}


def train_with_fault(
    rank: int, world_size: int, fault: Fault, steps: int, config: Config = PLAIN
) -> dict[str, Any]:
    """One rank's run: ``steps`` steps of ``config``, recovering from whatever
    the fault does.

    Returns:
        ``done`` (steps completed), ``adam_steps`` (the Adam step counts in
        the consolidated state, on the final rank 0), ``params``, ``points``
        (per recovery: the ranks lost, the agreed point, the step it was
        noticed in and whether that call finished there), ``fenced`` (what a
        rank left behind raised, else ``None``), ``seconds``.
    """
    model = make_model(config)
    zero = make_zero(model, config)
    ddp = make_ddp(model, zero=zero)
    timer = _arm(fault) if rank == fault.rank else None
    done, points = 0, []
    began = time.perf_counter()
    for step in range(steps):
        try:
            ddp, recovered = step_surviving(ddp, model, zero, step)
        except CollectiveError as fenced:
            return _left_behind(fenced, done)
        points += [
            (r.recovered.lost, r.recovered.point, step, r.recovered.finished_step)
            for r in recovered
        ]
        done += 1
    if timer is not None:  # the rank outlived its timer: nothing happened to it
        timer.cancel()
    while True:  # a rank lost in the last step's exchange may fail the others here
        try:
            zero.consolidate_state_dict(to=0)
            break
        except (CollectiveError, RuntimeError) as error:
            survivors = recover(zero, error, deadline_s=DEADLINE_S)
            points.append((survivors.lost, survivors.point, steps, survivors.finished_step))
    counts = (
        {int(s["step"]) for s in zero.state_dict()["state"].values()} if zero.rank == 0 else None
    )
    return {
        "fenced": None,
        "done": done,
        "adam_steps": counts,
        "params": [p.detach().clone() for p in model.parameters()],
        "points": points,
        "world_size": zero.world_size,
        "seconds": time.perf_counter() - began,
    }


@dataclass(frozen=True)
class Outcome:
    """What a checked run did.

    Attributes:
        lost: a rank was lost (ended, or left behind by a long pause).
        transient: recoveries in which every rank answered.
        recoveries: recoveries in all.
        kept: steps done before the survivors' world took over (``None``:
            nothing was lost).
    """

    lost: bool
    transient: int
    recoveries: int
    kept: int | None


def _survivors(results: list[Any], label: str) -> list[Any]:
    """The ranks that went on to the end, checked to have waited for no
    collective's timeout (each finished within half of it)."""
    survivors = [r for r in results if r is not None and r["fenced"] is None]
    waited = [round(r["seconds"], 1) for r in survivors if r["seconds"] >= GROUP_TIMEOUT_S / 2]
    assert not waited, (label, "a survivor waited for the group's timeout (seconds)", waited)
    return survivors


def check_run(results: list[Any], fault: Fault, steps: int, label: str) -> Outcome:
    """The run's invariants (no reference needed).

    Raises:
        AssertionError: naming ``label`` and what broke.
    """
    survivors = _survivors(results, label)
    fenced = [r for r in results if r is not None and r["fenced"] is not None]
    lost = results[fault.rank] is None or bool(fenced)
    assert all(r["done"] == steps for r in survivors), (label, [r["done"] for r in survivors])
    counted = [r["adam_steps"] for r in survivors if r["adam_steps"] is not None]
    assert counted == [{steps}], (label, "Adam step counts", counted)
    first = survivors[0]["params"]
    assert all(
        all(torch.equal(a, b) for a, b in zip(r["params"], first, strict=True)) for r in survivors
    ), (label, "the survivors' parameters differ")
    agreed = {tuple((lost_, point) for lost_, point, _, _ in r["points"]) for r in survivors}
    assert len(agreed) == 1, (label, "the survivors went on from different points", agreed)
    assert fault.pause_s is not None or not fenced, (label, "a rank fenced without a pause")
    points = survivors[0]["points"]
    transient = sum(1 for lost_, *_ in points if not lost_)
    kept = None
    if lost:
        loss = next(p for p in points if p[0])
        kept = loss[2] + (1 if loss[3] else 0)
    return Outcome(lost, transient, len(points), kept)


def check_against_reference(
    results: list[Any],
    world_size: int,
    lost: int,
    kept: int,
    steps: int,
    config: Config = PLAIN,
) -> None:
    """The survivors' parameters equal a run of ``config`` that shrank at
    step ``kept`` (without rank ``lost``, sharded as the survivors are), bit
    for bit.

    Raises:
        AssertionError: they differ.
    """
    before = run_local_world(
        fresh_phase, world_size, None, range(kept), config, timeout_s=TIMEOUT_S, wall_s=WALL_S
    )[0]
    owners = owners_after_loss(config, world_size, lost)
    after = run_local_world(
        fresh_phase, world_size - 1, before, range(kept, steps), config, owners,
        timeout_s=TIMEOUT_S, wall_s=WALL_S,
    )  # fmt: skip
    survivors = [r for r in results if r is not None and r["fenced"] is None]
    for ours in survivors:
        assert all(
            torch.equal(a, b) for a, b in zip(ours["params"], after[0]["params"], strict=True)
        ), "the survivors' parameters differ from the reference's"


def draw_fault(draw: random.Random, world_size: int, length_s: float, pauses: bool) -> Fault:
    """A fault at a random moment of a run ``length_s`` long: a kill, or
    (with ``pauses``, one run in four) a pause of 0.5 to 12 s."""
    rank, delay = draw.randrange(world_size), draw.uniform(0.0, length_s)
    if pauses and draw.random() < 0.25:
        return Fault(rank, delay, draw.uniform(0.5, 12.0))
    return Fault(rank, delay)


def soak(
    world_size: int,
    runs: int,
    seed: int,
    *,
    pauses: bool = True,
    steps: int = STEPS,
    verbose: bool = False,
    config: Config = PLAIN,
) -> dict[str, Any]:
    """``runs`` runs of ``world_size`` ranks of ``config``, each with a fault
    drawn from ``seed``; every run checked, the first loss also against a reference.

    Returns:
        Counts (runs, losses, pauses, transient recoveries), the seconds of
        each run, and the seed. ``verbose``: each run's outcome on stderr.

    Raises:
        AssertionError: a run broke an invariant (its label names the seed,
            the run and the fault).
    """
    return _soak(
        world_size, runs, seed, pauses, steps, verbose, config.name,
        train_with_fault, config, check_run,
        lambda results, world, lost, kept: check_against_reference(
            results, world, lost, kept, steps, config
        ),
    )  # fmt: skip


def _soak(
    world_size: int,
    runs: int,
    seed: int,
    pauses: bool,
    steps: int,
    verbose: bool,
    name: str,
    train: Callable[..., dict[str, Any]],
    option: Any,
    check: Callable[[list[Any], Fault, int, str], Outcome],
    reference: Callable[[list[Any], int, int, int], None],
    lost_with: Callable[[int], list[int]] = lambda rank: [rank],
) -> dict[str, Any]:
    """The soak's runs, for any configuration: a quiet run timed, then
    ``runs`` runs of ``train(rank, world_size, fault, steps, option)``, each
    checked by ``check``, the first loss also by ``reference(results,
    world_size, lost rank, kept)``; ``lost_with(rank)``: the ranks that may
    end with the one the fault strikes (itself, or its DiLoCo worker's)."""
    draw = random.Random(seed)
    quiet = run_local_world(
        train, world_size, Fault(0, 1e9), steps, option, timeout_s=GROUP_TIMEOUT_S, wall_s=WALL_S
    )
    # The first world of a process warms up: later runs train faster than
    # this one, so the faults are drawn within the first 60 % of it.
    length_s = 0.6 * min(r["seconds"] for r in quiet)
    counts = {"runs": 0, "losses": 0, "pauses": 0, "transient": 0, "referenced": 0}
    seconds = []
    for run in range(runs):
        fault = draw_fault(draw, world_size, length_s, pauses)
        label = f"seed {seed}, run {run}, {world_size} ranks, {name}, {fault}"
        began = time.perf_counter()
        results = run_local_world(
            train, world_size, fault, steps, option, timeout_s=GROUP_TIMEOUT_S,
            may_exit=lost_with(fault.rank), wall_s=WALL_S,
        )  # fmt: skip
        seconds.append(time.perf_counter() - began)
        outcome = check(results, fault, steps, label)
        if verbose:
            print(f"{label}: {outcome}", file=sys.stderr, flush=True)
        counts["runs"] += 1
        counts["losses"] += outcome.lost
        counts["pauses"] += fault.pause_s is not None
        counts["transient"] += outcome.transient
        if outcome.lost and outcome.kept is not None and not counts["referenced"]:
            reference(results, world_size, fault.rank, outcome.kept)
            counts["referenced"] += 1
    return {**counts, "seconds": seconds, "seed": seed}


# ----- DiLoCo workers (--config diloco) --------------------------------------------------


def train_diloco_with_fault(
    rank: int, world_size: int, fault: Fault, steps: int, variant: str = "diloco"
) -> dict[str, Any]:
    """One DiLoCo worker's run (``diloco_survival.py``'s workers), recovering
    from whatever the fault does.

    Returns:
        ``done``, ``inner_steps``, ``params``, ``outer`` (the consolidated
        outer state), ``points`` (per recovery: the ranks lost, the sync it
        went on from and whether it finished that sync forward), ``fenced``,
        ``seconds``.
    """
    workers = world_size // ranks_per_worker(variant)
    job = Workers(0, steps, workers, tuple(range(workers)), variant=variant)
    inner, outer_group = job.worker_groups()
    model = make_model(PLAIN)
    net = under_ddp(model, inner)
    diloco = make_diloco(model, 2, variant, outer_group)
    timer = _arm(fault) if rank == fault.rank else None
    done, points = 0, []
    began = time.perf_counter()
    for step in range(steps):
        try:
            net, recovered = diloco_step_surviving(net, diloco, step, job, rank)
        except CollectiveError as fenced:
            return _left_behind(fenced, done)
        points += [(r.lost, r.sync, r.forward) for r in recovered]
        done += 1
    if timer is not None:
        timer.cancel()
    while True:  # a worker lost at the very end fails the others here
        try:
            outer = diloco.outer_state_dict()
            break
        except (CollectiveError, RuntimeError) as error:
            try:
                survivors = recover(diloco, error, deadline_s=DEADLINE_S)
            except CollectiveError as fenced:
                return _left_behind(fenced, done)
            point = survivors.point
            assert isinstance(point, SyncRecovery)
            points.append((survivors.lost, point.sync, point.forward))
    return {
        "fenced": None,
        "me": rank,
        "done": done,
        "inner_steps": diloco.inner_steps,
        "params": [p.detach().clone() for p in model.parameters()],
        "outer": outer,
        "points": points,
        "world_size": diloco.world_size,
        "seconds": time.perf_counter() - began,
    }


def check_diloco_run(
    results: list[Any], fault: Fault, steps: int, label: str, variant: str = "diloco"
) -> Outcome:
    """A DiLoCo run's invariants: every survivor took every inner step once,
    the survivors hold one outer state bit for bit, the fragment synced last
    is the same on all of them (where a result replaces the local values),
    and they went on from the same syncs.

    Raises:
        AssertionError: naming ``label`` and what broke.
    """
    survivors = _survivors(results, label)
    fenced = [r for r in results if r is not None and r["fenced"] is not None]
    lost = results[fault.rank] is None or bool(fenced)
    assert all(r["done"] == r["inner_steps"] == steps for r in survivors), (label, "steps")
    first = survivors[0]
    for r in survivors[1:]:
        assert same_state(r["outer"], first["outer"]), (label, "the outer states differ")
    config = VARIANTS[variant]
    if config.mixing == 0:
        plan = plan_fragments([p.numel() for p in first["params"]], FRAGMENTS, 1)
        last = plan.fragments[fragment_synced_at(config, steps) or 0]
        synced = [read_fragment(last, r["params"]) for r in survivors]
        assert all(torch.equal(v, synced[0]) for v in synced), (label, "last sync differs")
    agreed = {tuple(r["points"]) for r in survivors}
    assert len(agreed) == 1, (label, "the survivors went on from different points", agreed)
    assert fault.pause_s is not None or not fenced, (label, "a rank fenced without a pause")
    points = first["points"]
    transient = sum(1 for lost_, *_ in points if not lost_)
    kept = None
    if lost:
        _, sync, forward = next(p for p in points if p[0])
        kept = sync if forward else sync - 1
    return Outcome(lost, transient, len(points), kept)


def check_diloco_against_reference(
    results: list[Any], world_size: int, lost: int, kept: int, steps: int, variant: str = "diloco"
) -> None:
    """The survivors' models and outer state equal those of workers that
    lost worker ``lost`` at step ``kept`` without dying, bit for bit.

    Raises:
        AssertionError: they differ.
    """
    kill = WorkerKill(lost, kept, "backward")  # the survivors' world runs from step kept
    workers = world_size // ranks_per_worker(variant)
    reference = diloco_reference(workers, steps, (kill,), variant)
    for ours in (r for r in results if r is not None and r["fenced"] is None):
        theirs = reference["model"][ours["me"]]
        assert all(
            torch.equal(a, b) for a, b in zip(ours["params"], theirs.values(), strict=True)
        ), f"worker {ours['me']}'s parameters differ from the reference's"
        assert same_state(ours["outer"], reference["optimizer"]["diloco"]), "outer state differs"


def same_state(a: Any, b: Any) -> bool:
    """The same structure, every tensor equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def diloco_soak(
    world_size: int, runs: int, seed: int, *, pauses: bool = True, steps: int = STEPS,
    verbose: bool = False, variant: str = "diloco",
) -> dict[str, Any]:  # fmt: skip
    """:func:`soak` for DiLoCo workers (``--config diloco``, or another key
    of ``diloco_survival.VARIANTS``: ``diloco-streaming``, a sync in flight
    across an inner step; ``diloco-int8``, compressed syncs; ``diloco-ddp``,
    workers of two ranks under DDP, ``world_size`` counting ranks)."""
    size = ranks_per_worker(variant)
    if world_size % size:
        raise ValueError(f"{variant}: workers of {size} ranks, so a world size divisible by it")
    return _soak(
        world_size, runs, seed, pauses, steps, verbose, variant,
        train_diloco_with_fault, variant,
        functools.partial(check_diloco_run, variant=variant),
        lambda results, world, lost, kept: check_diloco_against_reference(
            results, world, lost, kept, steps, variant
        ),
        lambda rank: [rank // size * size + i for i in range(size)],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--config", choices=[*sorted(CONFIGS), *sorted(VARIANTS)], default="plain")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.config in VARIANTS:
        result = diloco_soak(args.world_size, args.runs, seed, verbose=True, variant=args.config)
    else:
        result = soak(args.world_size, args.runs, seed, verbose=True, config=CONFIGS[args.config])
    print(
        f"{result['runs']} runs of {args.world_size} ranks of {args.config} (seed {seed}): "
        f"{result['losses']} "
        f"ranks lost, {result['pauses']} paused, {result['transient']} transient recoveries, "
        "every run consistent"
    )


if __name__ == "__main__":
    main()
