"""Going on without lost DiLoCo workers (``DiLoCoOptimizer(redundancy=2)``):
:func:`recover_diloco`, which :func:`zerofn_torch.elastic.recover` calls for
a DiLoCo optimizer, and :func:`worker_groups`, the groups of workers of
several ranks whose connections a loss can shut.

The decisions are the core's (:mod:`zerofn.diloco.workers`,
:mod:`zerofn.diloco.redundancy`); the roll call is
:mod:`zerofn_torch.roll_call`'s.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch.distributed as dist

from zerofn.comm import answered_locally
from zerofn.diloco.outer import OuterStep
from zerofn.diloco.redundancy import regroup_program, sync_recovery
from zerofn.diloco.schedule import fragment_synced_at
from zerofn.diloco.workers import after_loss
from zerofn.errors import CollectiveError
from zerofn_torch.diloco import DiLoCoOptimizer
from zerofn_torch.replicas import verify_replicas
from zerofn_torch.roll_call import (
    DEADLINE_S,
    GENERATION,
    Recovered,
    agree,
    decided,
    group_of,
)
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.object_collectives import broadcast_object

__all__ = ["WorkerGroups", "recover_diloco", "worker_groups"]


def recover_diloco(
    diloco: DiLoCoOptimizer,
    error: BaseException,
    *,
    store: Any | None = None,
    deadline_s: float = DEADLINE_S,
) -> Recovered:
    """Go on without the DiLoCo workers that are gone, after ``error``: call
    it on every surviving rank, in the ``except`` of the failed call
    (``step``, which raises at once on a rank between syncs once another
    raised the alarm; or a backward under DDP).

    The ranks of the whole job agree on who is alive and where each stood
    in the syncs (:func:`~zerofn_torch.roll_call.roll_call`). A worker with
    a lost rank is lost whole: its other ranks leave. The ranks of each
    surviving worker take the state of its furthest rank
    (:func:`~zerofn.diloco.workers.after_loss`) over the worker's new group,
    so every outer group decides the same
    (:func:`~zerofn.diloco.redundancy.sync_recovery`): finish the
    interrupted sync forward with a survivor's sum, or leave it to run
    again. Each outer group then cuts the outer state for its world from
    owners and carriers (:func:`~zerofn.diloco.redundancy.regroup_program`),
    merges the result of a sync it stepped, and checks the new copies. A
    survivor that was inside a sync nobody could finish runs it again on the
    survivors' group before it returns; the others run it when their inner
    steps get there.

    Returns:
        As :func:`~zerofn_torch.elastic.recover`, with ``inner_group`` for
        workers of several ranks; ``finished_step``: the call that failed
        here is complete (the survivors stand past its step): do not redo it.

    Raises:
        ValueError: ``diloco`` keeps no copies (``redundancy=1``), a
            worker and its carrier are both lost, or fewer than 2 workers
            are left whole: restart from a checkpoint.
        BaseException: ``error`` itself, when every rank answered and it is
            no failed collective.
        zerofn.errors.CollectiveError: this rank was left behind, or its
            worker lost another rank (it ends here and touches nothing);
            the survivors' positions admit no common outer state; or a
            collective on the new groups failed.
        zerofn.replicas.ReplicaMismatch: a carried copy differs from its
            owner's, or a worker's ranks end with different parameters.
    """
    own = diloco.position()
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    diloco.leave_group()
    workers, place = diloco.workers, diloco.place
    _, loss, _ = agree(
        diloco, own, lambda c: after_loss(workers, c.alive, c.positions), error, store,
        deadline_s, (place, len(workers.ranks), workers.together()),
    )  # fmt: skip
    worker, local = workers.place(workers.ranks[place])
    if worker in loss.lost:
        _leave(worker, loss.lost, error)
    recovery = decided(sync_recovery, loss.positions, diloco.generation, error)
    new_rank = loss.kept.index(worker)
    group = group_of(diloco.process_group, loss.kept)
    inner = None
    if workers.ranks_per_worker > 1:
        inner = group_of(dist.group.WORLD, loss.survivors.inner(new_rank), part_of=group)
    diloco.enter_world(group, loss.survivors)
    if inner is not None:
        source = loss.sources[new_rank]
        purpose = "DiLoCo: handing the furthest rank's state to its worker's other ranks"
        handed = broadcast_object(
            diloco.handed_state() if local == source else None, source, inner, purpose
        )
        if local != source:
            diloco.take_state(handed)
    position = loss.positions[new_rank]
    index = fragment_synced_at(diloco.config, recovery.sync)
    codec = diloco.config.compression
    program = regroup_program(
        recovery,
        position,
        diloco.plan,
        loss.kept,
        new_rank,
        lambda: diloco.finishing(index if index is not None else 0),
        lambda: diloco.held_state_dicts(recovery),
        None if codec is None else (codec, index),
    )
    purpose = "DiLoCo: regrouping the outer state without the lost ranks"
    regrouped = drive(
        answered_locally(program, OuterStep, diloco.answer_outer_step), group, purpose
    ).wait()
    diloco.regroup(group, new_rank, regrouped)
    if new_rank == 0:
        store.set(GENERATION, str(diloco.generation))
    diloco.resume(recovery, position, regrouped.results)
    diloco.verify_copies()
    if recovery.runs_again(position):
        diloco.run_again(position)
    if inner is not None:  # every outer group decided alike: a worker's replicas agree
        verify_replicas([p for g in diloco.param_groups for p in g["params"]], inner)
    # The failed call is done once the survivors stand past the step it was.
    finished = position.steps + int(position.taken) > own.steps
    return Recovered(group, new_rank, len(loss.kept), loss.lost, finished, recovery, inner)


def _leave(worker: int, lost: tuple[int, ...], error: BaseException) -> None:
    """End a live rank of a lost worker: it touches nothing more.

    Raises:
        zerofn.errors.CollectiveError: always, saying why.
    """
    raise CollectiveError(
        "the roll call",
        "going on without the lost ranks",
        f"DiLoCo worker {worker}",
        f"this rank was left behind: its worker lost another of its ranks (workers "
        f"{list(lost)} are gone), and a worker goes on whole or not at all; the others go on "
        "without it, and this rank ends here and touches nothing",
    ) from error


@attrs.frozen
class WorkerGroups:
    """This rank's groups in a job of DiLoCo workers of several ranks.

    Attributes:
        inner: its worker's ranks (build DDP on it).
        outer: the ranks of its local index across workers (the
            ``process_group`` of its ``DiLoCoOptimizer``).
    """

    inner: Any
    outer: Any


def worker_groups(ranks_per_worker: int) -> WorkerGroups:
    """Cut the job into workers of ``ranks_per_worker`` consecutive ranks
    (worker ``k``: ranks ``k * ranks_per_worker`` onwards) and make this
    rank's groups. Collective: every rank of the job calls it, alike.

    Their connections are noted as the job's
    (:mod:`zerofn_torch.runtime.group_sockets`), so the alarm of a loss
    shuts them: that frees a rank blocked in one of DDP's own collectives on
    them (its bucket rebuild, its buffer broadcast), which nothing else can
    end before the group's timeout. Groups from ``dist.new_group`` work too,
    without that.

    Raises:
        ValueError: ``ranks_per_worker`` below 1 or not dividing the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_worker < 1 or world % ranks_per_worker:
        raise ValueError(
            f"ranks_per_worker must divide the world size {world} (each worker the same "
            f"number of ranks), got {ranks_per_worker}"
        )
    count = world // ranks_per_worker
    inners = [[k * ranks_per_worker + i for i in range(ranks_per_worker)] for k in range(count)]
    outers = [[k * ranks_per_worker + i for k in range(count)] for i in range(ranks_per_worker)]
    made = [_noted_group(ranks) for ranks in [*inners, *outers]]
    worker, local = divmod(rank, ranks_per_worker)
    return WorkerGroups(made[worker], made[count + local])


def _noted_group(ranks: list[int]) -> Any:
    """``dist.new_group(ranks)``, its connections noted as the job's."""
    return group_sockets.opened(lambda: dist.new_group(ranks), part_of=dist.group.WORLD)
