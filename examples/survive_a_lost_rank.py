"""Lose ranks on purpose, go on without them, and save what the survivors end with.

W gloo ranks on this machine train ``train_elastic.py``'s model with DDP and
``ZeroRedundancyOptimizer(Adam, redundancy=2)``; each ``--kill RANK@STEP:PHASE``
ends a rank in step STEP, and the survivors recover in-process
(``zerofn_torch.elastic.recover``) and go on to step N::

    .venv/bin/python examples/survive_a_lost_rank.py --world-size 4 --steps 22 \\
        --kill 1@10:exchange --kill 2@20:between --out out/killed
    .venv/bin/python examples/survive_a_lost_rank.py --world-size 4 --steps 22 \\
        --kill 1@10:exchange --kill 2@20:between --out out/reference --reference

RANK is the rank the process started as (not its rank in the world of the
moment); steps count from 0. PHASE says where in STEP it dies:

- ``backward``: inside its backward (a hook on a parameter's gradient ends
  the process); the survivors' DDP all-reduce fails and they redo STEP;
- ``exchange``: right after its local optimizer step, inside the ZeRO step's
  exchange; the survivors finish STEP from the carried copies (with the
  exchange behind the forward, ``--config gather``, their ``step()`` has
  returned: their next forward fails, and they redo STEP+1 once STEP is
  finished);
- ``between``: after STEP completed, before STEP+1; the survivors' STEP+1
  fails and they redo it.

Each ``--pause RANK@STEP:SECONDS`` stops that rank (``SIGSTOP``) after STEP
completes and resumes it SECONDS later (a helper process sends
``SIGCONT``): once its heartbeat has been silent for
``zerofn_torch.runtime.heartbeat.WATCH_SILENT_S`` (1.5 s), the survivors
raise the job's alarm and go on without it as if it were lost ``between``
(their result equals ``--reference`` with ``--kill RANK@STEP:between``), and
once resumed it fails alone, fenced off by the job's generation, and says so.

The group keeps PyTorch's default timeout and ``recover`` its default roll
call: no recovery waits for a timeout.

Kills come in step order, one rank at a time: a later one after the
survivors restored redundancy. The dying process ends at once with status 0
(``os._exit(0)``: ``run_local_world`` counts any other end as a failure of
the world); under torchrun the same loop dies with ``SIGKILL`` instead (see
``train_elastic.py``'s ``kill_self`` and ``--torchrun-worker``).

It writes ``OUT/final.pt``: ``{"model": the model's state_dict, "optimizer":
the consolidated ZeRO state_dict}`` from the survivors' rank 0, and prints
last one line per kill: the seconds from the rank's death (or pause, which
it notes in the job's store as it goes) to the survivors' next completed
step, and the steps lost (the Adam step count of the state
the survivors go on from against the steps done: 0 expected).

``--reference`` runs the same model, data and kills without dying: W ranks
up to the first loss (through STEP for ``exchange`` and ``between``, whose
step the survivors keep; up to it for ``backward``, whose step they redo),
the state consolidated, then fresh ranks of the survivors' world size from
it with the same batches (those of a world of that size), and so on per
kill. Its ``final.pt`` equals the killed run's bit for bit
(``tests/test_survive_a_lost_rank.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

import diloco_survival
import torch
import torch.distributed as dist
from diloco_survival import WorkerKill
from torch.nn.parallel import DistributedDataParallel as DDP
from train_elastic import (
    CONFIGS,
    PLAIN,
    Config,
    Owners,
    _exit_after_local_step,
    exit_quietly,
    legend,
    make_ddp,
    make_model,
    make_zero,
    owners_after_loss,
    step_surviving,
)
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import DEADLINE_S
from zerofn_torch.runtime.launch import run_local_world

from zerofn.errors import CollectiveError

BLOCKING_DILOCO = ("diloco", "diloco-int8", "diloco-ddp", "diloco-ddp-int8")
"""The DiLoCo workers this example runs (``diloco_survival.VARIANTS``): a
kill's step places it in a sync without timing."""

PHASES = ("backward", "exchange", "between")
TIMEOUT_S = dist.default_pg_timeout.total_seconds()
"""The gloo group's timeout: PyTorch's default (30 minutes). Nothing waits for
it: a dead or paused rank is known by its heartbeat, and a survivor that gloo
leaves blocked in a collective is released by the job's alarm."""


@dataclass(frozen=True)
class Kill:
    """One rank lost on purpose.

    Attributes:
        rank: the rank the process started as.
        step: the step it dies in (``between``: after it).
        phase: ``backward``, ``exchange`` or ``between``.
    """

    rank: int
    step: int
    phase: str

    @property
    def failing_step(self) -> int:
        """The step whose collective fails on the survivors."""
        return self.step + 1 if self.phase == "between" else self.step

    @property
    def kept(self) -> int:
        """Steps done before the survivors' world takes over (the first step it runs)."""
        return self.step if self.phase == "backward" else self.step + 1

    def __str__(self) -> str:
        return f"{self.rank}@{self.step}:{self.phase}"


@dataclass(frozen=True)
class Pause:
    """One rank stopped on purpose (``SIGSTOP``) and resumed later.

    Attributes:
        rank: the rank the process started as.
        step: the step after which it stops.
        seconds: how long it stays stopped; silent past
            ``WATCH_SILENT_S``, it is left behind, and fails alone once resumed.
    """

    rank: int
    step: int
    seconds: float

    def as_kill(self) -> Kill:
        """What the survivors see: the rank gone after ``step``."""
        return Kill(self.rank, self.step, "between")

    def __str__(self) -> str:
        return f"{self.rank}@{self.step}:{self.seconds:g}"


@dataclass(frozen=True)
class Segment:
    """What one launch of ranks runs.

    Attributes:
        first: the first step.
        last: the step after the last one.
        kills: the ranks lost on the way (none in a reference).
        start: the state to start from (``final.pt``'s format), or a fresh model.
        redundancy: copies of each shard (2 to survive a loss).
        deadline_s: the roll call's deadline.
        pauses: the ranks stopped on the way and resumed later.
        config: the model's dtype and the optimizer's options.
        owners: each rank's parameters (a reference after a loss shards as
            the survivors do); ``None``: the configuration's partition.
    """

    first: int
    last: int
    kills: tuple[Kill, ...] = ()
    start: dict[str, Any] | None = None
    redundancy: int = 2
    deadline_s: float = DEADLINE_S
    pauses: tuple[Pause, ...] = ()
    config: Config = PLAIN
    owners: Owners | None = None


@dataclass
class Recovery:
    """One recovery, as a survivor saw it (times and counts filled in as it goes)."""

    step: int
    lost: tuple[int, ...]
    finished_step: bool
    sizes: tuple[int, int]
    began: float  # when the lost rank went (else, when the failure was caught)
    seconds: float = float("nan")
    steps_lost: int | None = None


def parse_kill(text: str) -> Kill:
    """``RANK@STEP:PHASE`` as a :class:`Kill`."""
    try:
        rank, rest = text.split("@")
        step, phase = rest.split(":")
        kill = Kill(int(rank), int(step), phase)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK@STEP:PHASE") from None
    if phase not in PHASES:
        raise argparse.ArgumentTypeError(f"{text!r}: PHASE is one of {', '.join(PHASES)}")
    return kill


def parse_pause(text: str) -> Pause:
    """``RANK@STEP:SECONDS`` as a :class:`Pause`."""
    try:
        rank, rest = text.split("@")
        step, seconds = rest.split(":")
        pause = Pause(int(rank), int(step), float(seconds))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK@STEP:SECONDS") from None
    if not pause.seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be positive")
    return pause


def _gone_key(generation: int) -> str:
    """Where the rank lost from the world of ``generation`` notes when it went."""
    return f"survive_a_lost_rank/gone/{generation}"


def _note_gone(zero: ZeroRedundancyOptimizer) -> None:
    """Note the moment this rank goes (wall clock, one machine) in the job's
    store: the survivors time their recovery from it."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_gone_key(zero.generation), repr(time.time()))


def _die(zero: ZeroRedundancyOptimizer) -> None:
    _note_gone(zero)
    exit_quietly()


def _gone_at(generation: int) -> float | None:
    """When the rank lost from the world of ``generation`` went (``None``:
    nobody went, the failure was transient)."""
    store = dist.distributed_c10d._get_default_store()
    key = _gone_key(generation)
    return float(store.get(key)) if store.check([key]) else None


def _pause_self(seconds: float, zero: ZeroRedundancyOptimizer) -> None:
    """Stop this process now; a helper process resumes it ``seconds`` later
    (as a launcher's ``kill -STOP`` and ``kill -CONT`` would)."""
    _note_gone(zero)
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def check_kills(
    world_size: int, steps: int, kills: tuple[Kill, ...], config: Config = PLAIN
) -> None:
    """Refuse kills this run of ``config`` cannot honour (with its exchange
    behind the forward, a death inside it is noticed at the next step).

    Raises:
        ValueError: a rank outside the world or killed twice, a kill the
            survivors would never notice (at or after the last step), kills
            out of step order or at the same step, or fewer than 2 survivors.
    """
    ranks = [k.rank for k in kills]
    if any(not 0 <= r < world_size for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"each killed rank is one of 0..{world_size - 1}, once: {ranks}")
    if world_size - len(kills) < 2:
        raise ValueError(
            f"{len(kills)} kills of {world_size} ranks: redundancy=2 needs 2 survivors to go on"
        )
    behind = dict(config.options).get("gather_during_forward", False)
    failing = [k.failing_step + (behind and k.phase == "exchange") for k in kills]
    if any(f >= steps for f in failing) or any(k.step < 0 for k in kills):
        raise ValueError(
            f"every kill must be noticed within the {steps} steps (between, and exchange with "
            "the exchange behind the forward: STEP+1)"
        )
    if failing != sorted(set(failing)):
        raise ValueError(f"kills in step order, one per step: {[str(k) for k in kills]}")


def _die_in_backward(model: torch.nn.Module, zero: ZeroRedundancyOptimizer) -> None:
    """End this process when the gradient of the model's last parameter (the
    first one backward reaches) is computed, before DDP averages any bucket."""
    last = list(model.parameters())[-1]
    last.register_hook(lambda grad: _die(zero))  # type: ignore[no-untyped-call]


def _arm(kill: Kill | None, model: torch.nn.Module, zero: ZeroRedundancyOptimizer) -> None:
    """Set up this rank's death inside the coming step, if it is due."""
    if kill is None or kill.phase == "between":
        return
    if kill.phase == "backward":
        _die_in_backward(model, zero)
    else:
        _exit_after_local_step(zero, lambda: _die(zero))


def _adam_steps(zero: ZeroRedundancyOptimizer) -> int | None:
    """The Adam step count of this rank's shard (``None``: it owns nothing)."""
    counts = [int(s["step"]) for s in zero.optim.state.values() if "step" in s]
    return min(counts) if counts else None


def _done(recovery: Recovery, zero: ZeroRedundancyOptimizer, step: int) -> None:
    """The survivors completed ``step`` after ``recovery``: time it, and count
    the steps lost (the state holds ``step + 1`` Adam steps when none is)."""
    recovery.seconds = time.time() - recovery.began
    applied = _adam_steps(zero)
    recovery.steps_lost = None if applied is None else step + 1 - applied


def _step_surviving(
    ddp: DDP, model: torch.nn.Module, zero: ZeroRedundancyOptimizer, step: int, job: Segment
) -> tuple[DDP, list[Recovery]]:
    """Run ``step`` until it completes, recovering from each rank lost on the
    way (``train_elastic.step_surviving``), each recovery timed from the
    moment the lost rank went.

    Returns:
        The DDP to go on with (rebuilt on the survivors' group after a loss)
        and the recoveries this step needed.
    """
    ddp, survived = step_surviving(ddp, model, zero, step, job.deadline_s)
    recoveries = []
    for s in survived:
        gone_at = _gone_at(s.generation)
        began = s.caught if gone_at is None else gone_at
        r = s.recovered
        sizes = (s.world_size, r.world_size)
        recoveries.append(Recovery(step, r.lost, r.finished_step, sizes, began))
    for recovery in recoveries:
        _done(recovery, zero, step)
    return ddp, recoveries


def run_rank(rank: int, world_size: int, job: Segment) -> dict[str, Any] | None:
    """One rank's training loop, for both modes: steps ``job.first`` to
    ``job.last``, this rank dying where ``job.kills`` say, the others recovering.

    Args:
        rank: the rank this process started as.
        world_size: the ranks started.
        job: what to run.

    Returns:
        On the final world's rank 0: ``final.pt``'s ``model`` and
        ``optimizer``, the ``recoveries`` it went through (as dicts) and the
        final ``world_size``; ``None`` on the other survivors.
    """
    model = make_model(job.config)
    if job.start is not None:
        model.load_state_dict(job.start["model"])
    zero = make_zero(model, job.config, job.redundancy, job.owners)
    if job.start is not None:
        zero.load_state_dict(job.start["optimizer"])
    ddp = make_ddp(model, zero=zero)
    mine = {k.step: k for k in job.kills if k.rank == rank}
    pauses = {p.step: p for p in job.pauses if p.rank == rank}
    recoveries: list[Recovery] = []
    for step in range(job.first, job.last):
        _arm(mine.get(step), model, zero)
        try:
            ddp, done = _step_surviving(ddp, model, zero, step, job)
        except CollectiveError as error:
            if not any(p.rank == rank for p in job.pauses):
                raise
            return {"paused": rank, "error": str(error)}  # left behind: it fails alone
        recoveries += done
        if step in mine and mine[step].phase == "between":
            _die(zero)
        if step in pauses:
            _pause_self(pauses[step].seconds, zero)
    zero.consolidate_state_dict(to=0)
    if zero.rank != 0:
        return None
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": zero.state_dict(),
        "recoveries": [asdict(r) for r in recoveries],
        "world_size": zero.world_size,
    }


def run_killed(
    world_size: int,
    steps: int,
    kills: tuple[Kill, ...],
    deadline_s: float = DEADLINE_S,
    pauses: tuple[Pause, ...] = (),
    config: Config = PLAIN,
) -> dict[str, Any]:
    """``world_size`` ranks for ``steps`` steps of ``config``, losing the
    ranks of ``kills`` and stopping those of ``pauses`` until the others
    went on without them.

    Returns:
        What the final world's rank 0 returned (:func:`run_rank`), with
        ``paused``: what each paused rank raised once resumed.
    """
    check_kills(world_size, steps, merged(kills, pauses), config)
    job = Segment(0, steps, kills, deadline_s=deadline_s, pauses=pauses, config=config)
    gone = [k.rank for k in kills] + [p.rank for p in pauses]
    results = run_local_world(run_rank, world_size, job, timeout_s=TIMEOUT_S, may_exit=gone)
    (final,) = [r for r in results if r is not None and "model" in r]
    paused = [r for r in results if r is not None and "paused" in r]
    return {**final, "paused": paused}


def merged(kills: tuple[Kill, ...], pauses: tuple[Pause, ...]) -> tuple[Kill, ...]:
    """The kills and the pauses (each as the loss the survivors see), in step order."""
    return tuple(sorted([*kills, *(p.as_kill() for p in pauses)], key=lambda k: k.failing_step))


def run_reference(
    world_size: int, steps: int, kills: tuple[Kill, ...], config: Config = PLAIN
) -> dict[str, Any]:
    """The same steps and batches of ``config`` with nobody dying: one launch per world
    (``world_size`` ranks, then one fewer after each kill), each from the
    state the last one consolidated.

    Returns:
        What the last launch's rank 0 returned (:func:`run_rank`, no
        recoveries), with ``segments``: ``(first step, last step + 1, ranks)``
        of each launch.
    """
    check_kills(world_size, steps, kills, config)
    start: dict[str, Any] | None = None
    first, segments = 0, []
    owners: Owners | None = None
    alive = list(range(world_size))
    for lost, end in enumerate([*(k.kept for k in kills), steps]):
        # redundancy=1: nobody dies here, and a loaded state reaches the owners only
        job = Segment(first, end, start=start, redundancy=1, config=config, owners=owners)
        start = run_local_world(run_rank, world_size - lost, job, timeout_s=TIMEOUT_S)[0]
        segments.append((first, end, world_size - lost))
        first = end
        if lost < len(kills):  # the next world shards as the survivors do
            gone = alive.index(kills[lost].rank)
            owners = owners_after_loss(config, len(alive), gone, owners)
            alive.remove(kills[lost].rank)
    assert start is not None
    return {**start, "segments": segments}


def save_final(result: dict[str, Any], out_dir: str) -> str:
    """Write ``final.pt`` (``model`` and ``optimizer``) in ``out_dir``; its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "final.pt")
    torch.save({"model": result["model"], "optimizer": result["optimizer"]}, path)
    return path


def adam_steps(optimizer_state: dict[str, Any]) -> set[int]:
    """The Adam step counts found in a consolidated optimizer state."""
    return {int(s["step"]) for s in optimizer_state["state"].values()}


def report(result: dict[str, Any], kills: tuple[Kill, ...]) -> list[str]:
    """What a run did: per kill, the recovery's seconds and the steps lost
    (a reference: the steps each world ran)."""
    if "segments" in result:
        return [
            f"reference: steps {first} to {end - 1} on {size} ranks"
            for first, end, size in result["segments"]
        ]
    lines = [
        f"rank {p['paused']} (paused) failed alone once resumed: {p['error']}"
        for p in result.get("paused", [])
    ]
    for kill, r in zip(kills, result["recoveries"], strict=True):
        how = "the step finished from the carried copies" if r["finished_step"] else "step redone"
        lines.append(
            f"rank {kill.rank} lost in step {kill.step} ({kill.phase}): "
            f"{r['sizes'][0]} -> {r['sizes'][1]} ranks at step {r['step']}, {how}; "
            f"recovered in {r['seconds']:.2f} s; steps lost: {r['steps_lost']}"
        )
    return lines


def run_diloco(args: argparse.Namespace, kills: tuple[Kill, ...]) -> None:
    """``--config diloco`` (or ``diloco-int8``): each rank a DiLoCo worker
    (``diloco_survival.py``); ``diloco-ddp`` (``-int8``): workers of two
    ranks under DDP."""
    lost = tuple(WorkerKill(k.rank, k.step, k.phase) for k in kills)
    workers = args.world_size // diloco_survival.ranks_per_worker(args.config)
    if args.reference:
        result = diloco_survival.run_reference(workers, args.steps, lost, args.config)
    else:
        result = diloco_survival.run_killed(workers, args.steps, lost, args.deadline_s, args.config)
    path = save_final(result, args.out)
    print(
        f"wrote {path}: {result['world_size']} of {workers} workers at the end, "
        f"{args.steps} steps done, inner step count {result['inner_steps']}"
    )
    for line in diloco_survival.report(result, lost):
        print(line)
    steps_lost = [r["steps_lost"] for r in result["recoveries"]]
    if result["inner_steps"] != [args.steps] or any(n != 0 for n in steps_lost):
        raise SystemExit(f"steps were lost: inner steps {result['inner_steps']}, {steps_lost}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks to start")
    parser.add_argument("--steps", type=int, required=True, help="steps to train")
    parser.add_argument(
        "--kill",
        type=parse_kill,
        action="append",
        default=[],
        metavar="RANK@STEP:PHASE",
        help=f"lose the rank started as RANK in STEP; PHASE: {', '.join(PHASES)}",
    )
    parser.add_argument(
        "--pause",
        type=parse_pause,
        action="append",
        default=[],
        metavar="RANK@STEP:SECONDS",
        help="stop the rank started as RANK (SIGSTOP) after STEP, resume it SECONDS later",
    )
    parser.add_argument(
        "--config",
        choices=[*sorted(CONFIGS), *BLOCKING_DILOCO],
        default="plain",
        help=f"{legend()}; diloco: DiLoCo workers (diloco_survival.py), diloco-int8: their "
        "syncs compressed, diloco-ddp (-int8): workers of two ranks under DDP",
    )
    parser.add_argument("--out", required=True, help="directory for final.pt")
    parser.add_argument("--reference", action="store_true", help="the same, without dying")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="roll call deadline")
    args = parser.parse_args(argv)
    pauses = tuple(args.pause)
    kills = merged(tuple(args.kill), pauses)
    try:
        check_kills(args.world_size, args.steps, kills, CONFIGS.get(args.config, PLAIN))
    except ValueError as error:
        parser.error(str(error))
    if args.config in BLOCKING_DILOCO:
        if pauses:
            parser.error("--pause is for the ZeRO configurations; --config diloco takes --kill")
        if args.world_size % diloco_survival.ranks_per_worker(args.config):
            parser.error(f"--config {args.config}: --world-size counts ranks, two per worker")
        run_diloco(args, kills)
        return
    config = CONFIGS[args.config]
    if args.reference:
        result = run_reference(args.world_size, args.steps, kills, config)
    else:
        result = run_killed(
            args.world_size, args.steps, tuple(args.kill), args.deadline_s, pauses, config
        )
    path = save_final(result, args.out)
    counts = sorted(adam_steps(result["optimizer"]))
    print(
        f"wrote {path}: {result['world_size']} of {args.world_size} ranks at the end, "
        f"{args.steps} steps done, Adam step count {counts} in the optimizer state"
    )
    for line in report(result, kills):
        print(line)
    lost = [r["steps_lost"] for r in result["recoveries"]]
    if counts != [args.steps] or any(n != 0 for n in lost):
        raise SystemExit(f"steps were lost: Adam step counts {counts}, per recovery {lost}")


if __name__ == "__main__":
    main()
