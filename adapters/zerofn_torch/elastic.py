"""Going on without a lost rank: the survivors agree on who is alive, form a
process group of their own in-process, take the lost ranks' shards from
their carriers (``ZeroRedundancyOptimizer(redundancy=2)``) and continue from a
step boundary, with no restart and no checkpoint read::

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                   redundancy=2, lr=1e-3)
    ddp = DistributedDataParallel(model)
    for step in range(steps):
        while True:
            try:
                train_step(ddp, zero, batch(step, rank, world_size))
                break
            except (CollectiveError, RuntimeError) as error:  # DDP raises RuntimeError
                survivors = recover(zero, error)
                ddp = DistributedDataParallel(model, process_group=survivors.group)
                rank, world_size = survivors.rank, survivors.world_size
                if survivors.finished_step:  # lost inside the step's exchange
                    break  # the step was finished from the carried copies

Which decisions are made where: the roll call is
:mod:`zerofn_torch.roll_call`'s (the job's store, a deadline; its names are
importable from here too); DiLoCo's recovery is
:mod:`zerofn_torch.diloco_recovery`'s; who owns and carries what afterwards, what moves, and
the rebuilt rank are the core's (:func:`zerofn.zero.elastic.redundancy.plan_after_loss`,
:mod:`zerofn.zero.elastic.regroup`), the same functions the simulated world runs
(:func:`zerofn.testing.elastic.survivors_of`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofn.zero.elastic.recovery_point import recovery_point
from zerofn.zero.elastic.redundancy import plan_after_loss
from zerofn_torch.diloco import DiLoCoOptimizer
from zerofn_torch.diloco_recovery import WorkerGroups, recover_diloco, worker_groups

# Growing back is its own module; its names stay importable from here, beside recover.
from zerofn_torch.growing import JOINERS, Admitted, Fingerprint, Joined, admit, fingerprint, join
from zerofn_torch.replicas import verify_replicas

# The roll call's names stay importable from here, beside recover.
from zerofn_torch.roll_call import (
    DEADLINE_S,
    GENERATION,
    SILENT_AFTER_S,
    Recovered,
    RollCall,
    agree,
    group_of,
    roll_call,
)

# Starting the job through it lets a loss free a rank blocked in PyTorch's own collectives.
from zerofn_torch.runtime.group_sockets import init_process_group
from zerofn_torch.runtime.object_collectives import broadcast_object
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "DEADLINE_S",
    "GENERATION",
    "JOINERS",
    "SILENT_AFTER_S",
    "Admitted",
    "Fingerprint",
    "Joined",
    "Recovered",
    "RollCall",
    "WorkerGroups",
    "admit",
    "fingerprint",
    "init_process_group",
    "join",
    "recover",
    "recover_diloco",
    "roll_call",
    "worker_groups",
]


def recover(
    zero: ZeroRedundancyOptimizer | DiLoCoOptimizer,
    error: BaseException,
    *,
    store: Any | None = None,
    deadline_s: float = DEADLINE_S,
) -> Recovered:
    """Go on without the ranks that are gone, after ``error`` (a failed
    collective: DDP's backward, the ZeRO step's exchange). Call it on every
    surviving rank, in the ``except`` of the failed step.

    The survivors agree on who is alive and where each stood in the step
    (:func:`roll_call`), and from that on one point to go on from
    (:func:`zerofn.zero.elastic.recovery_point.recovery_point`), whichever collective
    failed on which rank. They form a process group in-process
    (``new_group(..., use_local_synchronization=True)``), re-plan
    (:func:`zerofn.zero.elastic.redundancy.plan_after_loss`), and reach that point:
    a survivor that failed before its local step while another took it takes
    it from the other's averaged gradients; a step whose exchange did not
    complete is finished, the lost shards' updates coming from their carriers'
    copies. Then they send the copies that restore redundancy, rebuild the
    optimizer on the new group, and check that their parameters and shard
    copies agree (:func:`zerofn_torch.verify_replicas`). When every rank
    answered (a transient failure: a slow or paused rank came back in time)
    the same world goes on, on a new group, from the same agreed point.

    A :class:`~zerofn_torch.diloco.DiLoCoOptimizer` built with
    ``redundancy=2`` goes on the same way, by its syncs
    (:func:`recover_diloco`).

    Args:
        zero: the optimizer (built with ``redundancy=2``).
        error: what the failed step raised; raised again when every rank
            answered and it is no failed collective (a bug, not a loss).
        store: where the roll call is held (default: the default process
            group's store, which the launcher keeps).
        deadline_s: how long a rank never seen to beat has to answer the
            roll call (one whose heartbeat stands still is declared lost
            sooner; one that beats on is waited for up to the group's
            timeout, as its next collective would be).
            A survivor blocked in the failed collective is freed by the
            alarm: zerofn's waits end, and the connections of the world's
            group are shut (:mod:`zerofn_torch.runtime.group_sockets`; the
            default group's when the job was started by
            :func:`init_process_group`).

    Returns:
        The new group (with the old group's timeout), this rank's place in
        it, and whether the step call that failed here is complete.

    Raises:
        ValueError: ``zero`` keeps one copy of each shard (``redundancy=1``),
            or what :func:`~zerofn.zero.elastic.redundancy.plan_after_loss` refuses (a
            shard and its carrier both lost): restart from a checkpoint.
        BaseException: ``error`` itself, when every rank answered and it is
            no failed collective.
        zerofn.errors.CollectiveError: this rank was left behind (the job
            recovered without it: it must not touch the job's state); the
            survivors disagree on who is alive or stand at no common point;
            or a collective on the new group failed.
        zerofn.replicas.ReplicaMismatch: the survivors' parameters or shard
            copies differ.
    """
    if isinstance(zero, DiLoCoOptimizer):
        return recover_diloco(zero, error, store=store, deadline_s=deadline_s)
    old = zero.zero_rank
    if old.carried is None:
        raise ValueError(
            "recover needs ZeroRedundancyOptimizer(..., redundancy=2): with one copy of "
            "each shard a lost rank's optimizer state is gone; restart from a checkpoint"
        )
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    _, point, lost = agree(
        zero, zero.position, lambda c: recovery_point(c.positions), error, store, deadline_s
    )
    regrouping = plan_after_loss(old.plan, lost)
    group = group_of(zero.process_group, regrouping.survivors)
    params = [p for g in zero.param_groups for p in g["params"]]
    new_rank = regrouping.new_rank(zero.rank)
    zero.enter_world(group, new_rank, len(regrouping.survivors))
    if point.behind:
        assert point.source is not None
        grads = broadcast_object(
            zero.step_gradients if new_rank == point.source else None,
            point.source,
            group,
            "handing the averaged gradients to survivors that missed the local step",
        )
        if new_rank in point.behind:
            zero.take_missed_local_step(grads)
    # With the exchange behind the forward, the step had returned: the call
    # that failed (a forward, DDP's collectives) is no step to skip.
    finished = point.finished_step(zero.position) and not zero.exchange_behind_forward
    zero.regroup(group, regrouping, new_rank, finish_step=point.finish)
    if new_rank == 0:
        store.set(GENERATION, str(zero.generation))
    verify_replicas(params, group, optimizer=zero)
    return Recovered(group, new_rank, len(regrouping.survivors), lost, finished, point)
