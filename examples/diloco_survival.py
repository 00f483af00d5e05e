"""DiLoCo workers that lose one of their own and go on: ``--config diloco`` of
``survive_a_lost_rank.py`` and ``random_losses.py``.

Each rank is a worker: ``train_elastic.py``'s model, Adam as the inner
optimizer, and ``DiLoCoOptimizer(sync_every=2, fragments=2,
redundancy=2)``, so one of the two fragments syncs after every inner step
(each step has a sync to die in). A worker trains on its own batches
(``train_elastic.batch`` of the rank it started as, in the world it started
in), so a loss changes nobody's data.

With ``--config diloco-ddp`` a worker is two ranks: the model under DDP over
the worker's group (zerofn's ``allreduce_hook``), one DiLoCo outer group per
local index, each rank on its own batches (``-int8`` and ``-streaming`` as
below). The functions here count workers (twice as many processes; the
command lines' ``--world-size`` counts ranks), and a kill names the rank
(process) that dies: its worker is lost whole, its other rank leaving (left
behind) while the other workers go on and rebuild DDP on the group
``recover`` returns.

Where a kill lands, for DiLoCo:

- ``exchange``: inside the sync of STEP, right after its outer steps (its
  all-reduce completed): the survivors finish that sync forward, with the
  lost worker's parameters in it;
- ``backward``: inside the backward of STEP: the survivors' sync of STEP
  fails before anyone holds its sum, and they run it again without it;
- ``between``: after STEP completed: the same, at the sync of STEP+1.

``--reference`` runs the same workers without dying: all of them up to
the point the survivors went on from, every worker's model and optimizer
saved, then fresh ranks of the survivors from those states (the outer state
consolidated and cut for their world). Its ``final.pt`` equals the killed
run's bit for bit: every worker's model, inner state and the consolidated
outer state.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from train_elastic import PLAIN, batch, exit_quietly, make_model
from zerofn_torch.diloco import DiLoCoOptimizer
from zerofn_torch.elastic import DEADLINE_S, recover, worker_groups
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.runtime.launch import run_local_world

from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.redundancy import SyncRecovery
from zerofn.errors import CollectiveError

SYNC_EVERY, FRAGMENTS = 2, 2
VARIANTS = {
    "diloco": DiLoCoConfig(SYNC_EVERY, FRAGMENTS),
    "diloco-streaming": DiLoCoConfig(4, 2, delay=1, mixing=0.5),
    "diloco-int8": DiLoCoConfig(SYNC_EVERY, FRAGMENTS, compression="int8"),
    "diloco-ddp": DiLoCoConfig(SYNC_EVERY, FRAGMENTS),
    "diloco-ddp-streaming": DiLoCoConfig(4, 2, delay=1, mixing=0.5),
    "diloco-ddp-int8": DiLoCoConfig(SYNC_EVERY, FRAGMENTS, compression="int8"),
}
"""The workers' schedules by ``--config``: blocking syncs; Streaming DiLoCo
(a fragment's sync every 2 steps, each merged half and half one inner step
after it starts, so a loss can land while a sync is in flight across an
inner step); and blocking syncs whose pseudo-gradients and anchor updates
travel as int8 codes with error feedback; then the same three between
workers of two ranks each (``diloco-ddp``, ``-streaming``, ``-int8``)."""
RANKS_PER_WORKER = {"diloco-ddp": 2, "diloco-ddp-streaming": 2, "diloco-ddp-int8": 2}
"""Ranks per worker by ``--config`` (1 where it is not named)."""


def ranks_per_worker(variant: str) -> int:
    """How many ranks each worker of ``variant`` has (:data:`RANKS_PER_WORKER`)."""
    return RANKS_PER_WORKER.get(variant, 1)


TIMEOUT_S = dist.default_pg_timeout.total_seconds()
"""PyTorch's default group timeout: nothing waits for it."""


@dataclass(frozen=True)
class WorkerKill:
    """One worker lost on purpose (the rank it started as, the step, where in it)."""

    rank: int
    step: int
    phase: str

    @property
    def kept(self) -> int:
        """The first step the survivors' world runs: the step whose sync
        runs again without the lost worker (``backward``: STEP; ``between``:
        STEP+1), or the step after the sync finished forward (``exchange``)."""
        return self.step if self.phase == "backward" else self.step + 1


@dataclass(frozen=True)
class Workers:
    """What one launch of workers runs.

    Attributes:
        first: the first step.
        last: the step after the last one.
        started: how many workers the job started with (their batches).
        workers: the workers of this launch, by the rank each started as.
        kills: the workers lost on the way (none in a reference).
        start: each worker's saved state (``model``, ``optimizer``), or a fresh start.
        redundancy: 2 to survive a loss.
        deadline_s: the roll call's deadline.
        variant: the schedule, a key of :data:`VARIANTS`.
    """

    @property
    def ranks_per_worker(self) -> int:
        """Processes per worker (:func:`ranks_per_worker`)."""
        return ranks_per_worker(self.variant)

    def worker_groups(self) -> tuple[Any, Any]:
        """This rank's groups (``zerofn_torch.elastic.worker_groups``): its
        worker's (the inner group) and its local index's across workers (the
        outer group); ``(None, None)`` when each rank is a worker."""
        if self.ranks_per_worker == 1:
            return None, None
        groups = worker_groups(self.ranks_per_worker)
        return groups.inner, groups.outer

    def started_as(self, rank: int) -> int:
        """The rank process ``rank`` of this launch started the job as (its batches)."""
        size = self.ranks_per_worker
        return self.workers[rank // size] * size + rank % size

    @property
    def processes(self) -> int:
        """Processes in this launch."""
        return len(self.workers) * self.ranks_per_worker

    first: int
    last: int
    started: int
    workers: tuple[int, ...]
    kills: tuple[WorkerKill, ...] = ()
    start: dict[int, dict[str, Any]] | None = None
    redundancy: int = 2
    deadline_s: float = DEADLINE_S
    variant: str = "diloco"


@dataclass
class WorkerRecovery:
    """One recovery, as a survivor saw it."""

    step: int
    lost: tuple[int, ...]
    finished_step: bool
    forward: bool
    sizes: tuple[int, int]
    began: float
    seconds: float = float("nan")
    steps_lost: int | None = None
    sync: int = 0


def make_diloco(
    model: torch.nn.Module, redundancy: int, variant: str = "diloco", group: Any = None
) -> DiLoCoOptimizer:
    """The worker's optimizer: inner Adam, DiLoCo's default outer SGD, across
    ``group`` (default: every rank)."""
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    c = VARIANTS[variant]
    return DiLoCoOptimizer(
        inner, c.sync_every, fragments=c.fragments, delay=c.delay, mixing=c.mixing,
        compression=c.compression, process_group=group, redundancy=redundancy,
    )  # fmt: skip


def under_ddp(model: torch.nn.Module, group: Any) -> torch.nn.Module:
    """``model`` under DDP over ``group`` (a worker's ranks) with zerofn's
    all-reduce hook, whose futures the job's alarm fails; ``model`` itself
    without a group."""
    if group is None:
        return model
    ddp = DDP(model, process_group=group)
    ddp.register_comm_hook(group, allreduce_hook)
    return ddp


def _gone_key(generation: int) -> str:
    return f"diloco_survival/gone/{generation}"


def _die(diloco: DiLoCoOptimizer) -> None:
    """Note the moment this worker goes in the job's store, and end."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_gone_key(diloco.generation), repr(time.time()))
    exit_quietly()


def _gone_at(generation: int) -> float | None:
    store = dist.distributed_c10d._get_default_store()
    key = _gone_key(generation)
    return float(store.get(key)) if store.check([key]) else None


def _arm(kill: WorkerKill | None, model: torch.nn.Module, diloco: DiLoCoOptimizer) -> None:
    """Set up this worker's death inside the coming step, if it is due."""
    if kill is None or kill.phase == "between":
        return
    if kill.phase == "backward":
        last = list(model.parameters())[-1]
        last.register_hook(lambda grad: _die(diloco))  # type: ignore[no-untyped-call]
        return
    answer = diloco.answer_outer_step

    def step_then_die(request: Any) -> torch.Tensor:
        stepped = answer(request)
        # Both outer steps of the sync this step starts (a delayed sync may
        # still be stepping one started before): it holds that sync's sum.
        if request.carried and diloco.position().sync == kill.step + 1:
            _die(diloco)
        return stepped

    diloco.answer_outer_step = step_then_die  # type: ignore[method-assign]


def _inner_step(
    net: torch.nn.Module, diloco: DiLoCoOptimizer, step: int, job: Workers, me: int
) -> None:
    x, y = batch(step, me, job.started * job.ranks_per_worker)
    diloco.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    diloco.step()


def step_surviving(
    net: torch.nn.Module, diloco: DiLoCoOptimizer, step: int, job: Workers, me: int
) -> tuple[torch.nn.Module, list[WorkerRecovery]]:
    """Run ``step`` until it completes, recovering from each worker lost on
    the way (``recover``), each recovery timed from the moment the lost
    worker noted it went (else from when the failure was caught). A rank of
    a worker that lost another rank ends quietly, as the lost one did.

    Returns:
        What to train from now on (``net``, or its model under DDP over the
        worker's new group), and the recoveries.

    Raises:
        zerofn.errors.CollectiveError: this worker was left behind (the
            others went on without it), or the recovery failed.
    """
    recoveries = []
    while True:
        try:
            _inner_step(net, diloco, step, job, me)
            return net, recoveries
        except (CollectiveError, RuntimeError) as error:
            caught, generation, size = time.time(), diloco.generation, diloco.world_size
            try:
                recovered = recover(diloco, error, deadline_s=job.deadline_s)
            except CollectiveError as left:
                if job.ranks_per_worker > 1 and "left behind" in str(left):
                    exit_quietly()  # its worker is lost: it goes with it
                raise
            if recovered.inner_group is not None:
                assert isinstance(net, DDP)
                net = under_ddp(net.module, recovered.inner_group)
            gone_at = _gone_at(generation)
            point = recovered.point
            assert isinstance(point, SyncRecovery)
            recoveries.append(
                WorkerRecovery(
                    step,
                    recovered.lost,
                    recovered.finished_step,
                    point.forward,
                    (size, recovered.world_size),
                    caught if gone_at is None else gone_at,
                    sync=point.sync,
                )
            )
            if recovered.finished_step:
                return net, recoveries


def run_worker(rank: int, world_size: int, job: Workers) -> dict[str, Any] | None:
    """One rank's loop: steps ``job.first`` to ``job.last``, dying where
    ``job.kills`` say, the others recovering.

    Returns:
        Every survivor's ``me`` (the rank it started as), ``model`` and
        ``optimizer`` (``consolidated_state_dict``: its inner state and the
        whole outer state), its ``recoveries`` and the final ``world_size``
        (in workers).
    """
    me = job.started_as(rank)
    inner, outer = job.worker_groups()
    model = make_model(PLAIN)
    net = under_ddp(model, inner)
    diloco = make_diloco(model, job.redundancy, job.variant, outer)
    if job.start is not None:  # after the constructor's broadcast of rank 0's parameters
        model.load_state_dict(job.start[me]["model"])
        diloco.load_state_dict(job.start[me]["optimizer"])
    mine = {k.step: k for k in job.kills if k.rank == me}
    recoveries: list[WorkerRecovery] = []
    for step in range(job.first, job.last):
        _arm(mine.get(step), model, diloco)
        net, more = step_surviving(net, diloco, step, job, me)
        recoveries += more
        for recovery in recoveries:
            if recovery.steps_lost is None:  # the first step completed since
                recovery.seconds = time.time() - recovery.began
                recovery.steps_lost = step + 1 - diloco.inner_steps
        if step in mine and mine[step].phase == "between":
            _die(diloco)
    return {
        "me": me,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": diloco.consolidated_state_dict(),
        "residual": diloco.state_dict()["diloco"]["residual"],
        "inner_steps": diloco.inner_steps,
        "recoveries": [asdict(r) for r in recoveries],
        "world_size": diloco.world_size,
    }


def final_of(results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """``final.pt`` from the last world's workers: each worker's model and
    inner state (by the rank it started as), and the consolidated outer
    state (the same on all of them)."""
    alive = [r for r in results if r is not None]
    return {
        "model": {r["me"]: r["model"] for r in alive},
        "optimizer": {
            "inner": {
                r["me"]: {k: v for k, v in r["optimizer"].items() if k != "diloco"} for r in alive
            },
            "diloco": alive[0]["optimizer"]["diloco"],
        },
        "inner_steps": sorted({r["inner_steps"] for r in alive}),
        "recoveries": alive[0]["recoveries"],
        "world_size": alive[0]["world_size"],
    }


def run_killed(
    world_size: int,
    steps: int,
    kills: tuple[WorkerKill, ...],
    deadline_s: float = DEADLINE_S,
    variant: str = "diloco",
) -> dict[str, Any]:
    """``world_size`` workers for ``steps`` steps, losing those of ``kills``."""
    workers = tuple(range(world_size))
    job = Workers(0, steps, world_size, workers, kills, deadline_s=deadline_s, variant=variant)
    size = job.ranks_per_worker
    gone = [k.rank // size * size + i for k in kills for i in range(size)]  # whole workers
    return final_of(
        run_local_world(run_worker, job.processes, job, timeout_s=TIMEOUT_S, may_exit=gone)
    )


def run_reference(
    world_size: int, steps: int, kills: tuple[WorkerKill, ...], variant: str = "diloco"
) -> dict[str, Any]:
    """The same workers and batches with nobody dying: one launch per world,
    each from every worker's state at the point the survivors went on from.

    Returns:
        As :func:`run_killed`, with ``segments``: ``(first step, last step
        + 1, workers)`` of each launch.
    """
    workers = tuple(range(world_size))
    start: dict[int, dict[str, Any]] | None = None
    first, segments = 0, []
    final: dict[str, Any] = {}
    for lost, end in enumerate([*(k.kept for k in kills), steps]):
        job = Workers(first, end, world_size, workers, start=start, variant=variant)
        results = run_local_world(run_worker, job.processes, job, timeout_s=TIMEOUT_S)
        start = {r["me"]: {"model": r["model"], "optimizer": r["optimizer"]} for r in results}
        final = final_of(results)
        segments.append((first, end, len(workers)))
        first = end
        if lost < len(kills):
            size = job.ranks_per_worker
            workers = tuple(w for w in workers if w != kills[lost].rank // size)
            kept = [r for r in results if r["me"] // size in workers]
            _owe_the_survivors_mean(start, kept, size)
    return {**final, "segments": segments}


def _owe_the_survivors_mean(
    start: dict[int, dict[str, Any]], survivors: list[dict[str, Any]], size: int = 1
) -> None:
    """With compressed syncs, start every survivor from the mean of the
    surviving workers' residuals (one per worker: the ranks of a worker hold
    the same), as a recovery does: a lost worker's error feedback is gone
    with it (the consolidated state holds the mean over all workers)."""
    if survivors[0]["residual"] is None:
        return
    each = [r["residual"] for r in survivors if r["me"] % size == 0]
    mean = torch.stack(each).mean(dim=0)
    for r in survivors:
        start[r["me"]]["optimizer"]["diloco"]["residual"] = mean


def as_seen(
    kills: tuple[WorkerKill, ...], recoveries: list[dict[str, Any]]
) -> tuple[WorkerKill, ...]:
    """The kills as the survivors went on from them: each lost worker's
    reference world takes over after the sync finished forward, or before
    the one run again. With a delay, where a kill lands in the syncs in
    flight depends on timing; the recoveries say where it landed."""
    return tuple(
        WorkerKill(k.rank, r["sync"] if r["forward"] else r["sync"] - 1, "backward")
        for k, r in zip(kills, recoveries, strict=True)
    )


def report(result: dict[str, Any], kills: tuple[WorkerKill, ...]) -> list[str]:
    """Per kill, what the survivors did and the seconds it took (a
    reference: the steps each world ran)."""
    if "segments" in result:
        return [
            f"reference: steps {first} to {end - 1} on {size} workers"
            for first, end, size in result["segments"]
        ]
    lines = []
    for kill, r in zip(kills, result["recoveries"], strict=True):
        how = "the sync finished forward" if r["forward"] else "the sync run again without it"
        lines.append(
            f"rank {kill.rank} lost in step {kill.step} ({kill.phase}): "
            f"{r['sizes'][0]} -> {r['sizes'][1]} workers at step {r['step']}, {how}; "
            f"recovered in {r['seconds']:.2f} s; steps lost: {r['steps_lost']}"
        )
    return lines
