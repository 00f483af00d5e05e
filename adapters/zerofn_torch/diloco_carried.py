"""The live part of ``DiLoCoOptimizer(redundancy=2)``: this rank's copy of
the previous rank's outer state, stepped beside its own, and where it
stands in the syncs (what the roll call of
:func:`zerofn_torch.elastic.recover` reads).

The algorithm is the core's (:mod:`zerofn.diloco.redundancy`); this module
holds the tensors it asks for and answers its outer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerofn.diloco.checkpoint import rank_state_dict
from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.fragments import Fragment, FragmentPlan
from zerofn.diloco.outer import OuterOptimizerFactory, check_outer_optimizer
from zerofn.diloco.redundancy import (
    Regrouped,
    StateDicts,
    SyncPosition,
    SyncRecovery,
    carried_rank,
    copies_disagreement,
    outer_state_tensors,
)
from zerofn.diloco.redundant_compressed_sync import as_found
from zerofn.diloco.schedule import fragment_synced_at
from zerofn.diloco.state import DiLoCoState, take_inner_step
from zerofn.diloco.workers import Workers
from zerofn.errors import CollectiveError
from zerofn.replicas import ReplicaMismatch, digests
from zerofn_torch.runtime.heartbeat import Heartbeat, next_generation, start_heartbeat
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.runtime.wrapped_optimizer import parameters_written, zero_rank_of

__all__ = ["CarriedOuter", "CarryingWorker", "check_redundancy", "state_tensors", "workers_of"]


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state (what its memory holds beyond the parameters)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def check_redundancy(
    redundancy: int,
    config: DiLoCoConfig,
    workers: Workers,
    inner: torch.optim.Optimizer | None = None,
) -> None:
    """Refuse a ``redundancy`` DiLoCo cannot keep, before anything is built.

    Args:
        redundancy: copies of each rank's outer state.
        config: the schedule.
        workers: the job's workers (:func:`workers_of`).
        inner: the inner optimizer (one that shards over several ranks,
            a ZeRO optimizer's, is refused).

    Raises:
        ValueError: ``redundancy`` other than 1 or 2; 2 with one worker,
            or over an inner optimizer sharded across ranks.
    """
    if redundancy not in (1, 2):
        raise ValueError(f"redundancy must be 1 (outer state on its owner) or 2, got {redundancy}")
    if redundancy == 1:
        return
    zero = None if inner is None else zero_rank_of(inner)
    inner_ranks = 1 if zero is None else zero.options.world_size
    why = None
    if workers.count < 2:
        why = "one worker has nobody to keep a copy of its outer state"
    elif inner_ranks > 1:
        why = (
            f"the inner ZeroRedundancyOptimizer shards over {inner_ranks} ranks, and a lost "
            "rank would take its shard with it; give each rank its own inner optimizer "
            "(under DDP over the worker's ranks)"
        )
    if why is not None:
        raise ValueError(f"DiLoCoOptimizer(redundancy=2) is not available here: {why}")


def workers_of(group: Any, gather: bool) -> Workers:
    """The job's workers, over ``group`` (this rank's outer group).

    When ``group`` holds every rank of the job, each rank is a worker. Else,
    with ``gather``, every rank of the job names its outer group (a
    collective of the default group: every rank builds its optimizer at the
    same time); without it, this rank's outer group alone stands for them
    (enough for the syncs, which never look past it).

    Raises:
        ValueError: the outer groups are no grid of workers (sizes that
            differ, ranks in two groups).
        zerofn.errors.CollectiveError: the gathering failed.
    """
    mine = tuple(dist.get_process_group_ranks(group))
    if len(mine) == dist.get_world_size() or not gather:
        return Workers((mine,))
    every = all_gather_objects(mine, dist.group.WORLD, "DiLoCo: which ranks make up each worker")
    return Workers.from_outer_groups(every)


class CarriedOuter:
    """This rank's copy of the previous rank's anchor slices and outer
    optimizer, and the sync it entered last.

    Attributes:
        anchors: the carried rank's anchor slice of every fragment.
        outer: an outer optimizer over them (the user's factory's).
        sync: the inner step whose sync this rank entered last (0: none).
        due: the inner step that sync's result is merged at.
        summed: it holds that sync's sum (and stepped both slices from it).
        total: that sum (kept until the next sync starts: a survivor that
            lacks it after a loss takes it from here).
        start: with a ``delay``, the values that sync started from (the
            parameters move on before its result is due, and a sync run
            again after a loss needs them); ``None`` without one.
        replica_before, residual_before: with compressed syncs, the
            fragment's replica and this rank's residual as that sync found
            them (it changes both; a recovery reads them); else ``None``.
    """

    def __init__(
        self, plan: FragmentPlan, rank: int, factory: OuterOptimizerFactory, device: torch.device
    ) -> None:
        carried = carried_rank(rank, plan.world_size)
        self.factory = factory
        self.anchors = [
            torch.empty(f.lengths[carried], dtype=torch.float32, device=device)
            for f in plan.fragments
        ]
        self.outer = check_outer_optimizer(factory(self.anchors), self.anchors)
        self.sync = self.due = 0
        self.summed = True
        self.total: torch.Tensor | None = None
        self.start: torch.Tensor | None = None
        self.replica_before: torch.Tensor | None = None
        self.residual_before: torch.Tensor | None = None

    def fill(self, plan: FragmentPlan, rank: int, start: Sequence[torch.Tensor]) -> None:
        """Set the carried anchors from the fragments' starting values."""
        carried = carried_rank(rank, plan.world_size)
        for anchor, f, values in zip(self.anchors, plan.fragments, start, strict=True):
            anchor.copy_(values[f.owned(carried)])

    def entered(
        self,
        t: int,
        due: int,
        values: torch.Tensor,
        replica: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> None:
        """The sync after inner step ``t`` starts, with ``values`` (it holds
        the sum once summed), its result due after inner step ``due``; with
        compressed syncs, over the fragment's ``replica`` and ``residual``."""
        self.start = values.clone() if due > t else None
        self.sync, self.due, self.summed, self.total = t, due, False, values
        self.replica_before = None if replica is None else replica.clone()
        self.residual_before = None if residual is None else residual.clone()

    def position(self, state: DiLoCoState, taken: bool) -> SyncPosition:
        """Where this rank stands, for the roll call (``taken``: the call
        that failed had taken its inner step)."""
        return SyncPosition(state.step, self.sync, self.due, self.summed, taken)

    def state_dict(self, plan: FragmentPlan, rank: int, state: DiLoCoState) -> dict[str, Any]:
        """The copy as the carried rank's state dict (:mod:`zerofn.diloco.checkpoint`)."""
        carried = carried_rank(rank, plan.world_size)
        return rank_state_dict(plan, carried, state, None, self.anchors, self.outer.state_dict())

    def tensors(self) -> list[torch.Tensor]:
        """What the copy holds in memory: anchors, outer state and the kept sum."""
        maybe = (self.total, self.start, self.replica_before, self.residual_before)
        kept = [t for t in maybe if t is not None]
        return [*self.anchors, *state_tensors(self.outer), *kept]

    def load(self, saved: Mapping[str, Any]) -> None:
        """Hold ``saved`` (the carried rank's state dict) from now on: new
        tensors, and a new outer optimizer over them. Every sync it ever
        stepped is whole now."""
        self.anchors = [a.detach().clone() for a in saved["anchor"]]
        self.outer = check_outer_optimizer(self.factory(self.anchors), self.anchors)
        self.outer.load_state_dict(saved["outer"])
        self.summed = True

    def handed(self) -> dict[str, Any]:
        """Everything this copy holds, for a sibling to take (:meth:`take`)."""
        return {
            "anchors": self.anchors,
            "outer": self.outer.state_dict(),
            "sync": (self.sync, self.due, self.summed),
            "kept": (self.total, self.start, self.replica_before, self.residual_before),
        }

    def take(self, handed: Mapping[str, Any]) -> None:
        """Hold what a sibling's :meth:`handed` gave, as its own."""
        self.load({"anchor": handed["anchors"], "outer": handed["outer"]})
        self.sync, self.due, self.summed = handed["sync"]
        self.total, self.start, self.replica_before, self.residual_before = (
            None if t is None else t.clone() for t in handed["kept"]
        )


class CarryingWorker:
    """What ``DiLoCoOptimizer`` does to go on without a lost rank
    (``redundancy=2``): its place in the syncs, its state dicts for the
    regroup, and taking up the regrouped state. The recovery's sequence is
    :func:`zerofn_torch.diloco_recovery.recover_diloco`'s; these are its hands."""

    config: DiLoCoConfig
    process_group: Any
    optim: torch.optim.Optimizer
    outer: torch.optim.Optimizer
    _params: list[Any]  # the parameters, as the inner optimizer holds them
    _workers: Workers
    _me: int
    _carried: CarriedOuter | None
    _heartbeat: Heartbeat | None
    _generation: int
    _rank: int
    _plan: FragmentPlan
    _state: DiLoCoState
    _anchors: list[torch.Tensor]
    _factory: OuterOptimizerFactory
    _result: torch.Tensor | None
    _replica: torch.Tensor | None
    _residual: torch.Tensor | None
    _flight: Any
    _taken: bool

    _merge: Callable[[int, torch.Tensor], None]
    _start: Callable[[int, int, torch.Tensor | None], None]
    drain: Callable[[], None]

    @property
    def carries_copies(self) -> bool:
        """Whether this rank keeps a copy of another's outer state (``redundancy=2``)."""
        return self._carried is not None

    @property
    def generation(self) -> int:
        """This world's number in the job (``redundancy=2``): where its
        heartbeats, alarm and roll call live in the job's store."""
        return self._generation

    @property
    def workers(self) -> Workers:
        """The job's workers, as this world has them (``redundancy=2``): which
        ranks each worker has, and which are in this rank's outer group."""
        return self._workers

    @property
    def place(self) -> int:
        """This rank's place in the job's roll call and heartbeats: its index
        in :attr:`Workers.ranks`."""
        return self._workers.ranks.index(self._me)

    @property
    def rank(self) -> int:
        """This rank in the outer group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Ranks in the outer group."""
        return self._plan.world_size

    @property
    def plan(self) -> FragmentPlan:
        """How the parameters are cut into fragments and owners' slices."""
        return self._plan

    def _start_beating(self, group: Any, workers: Workers, redundancy: int) -> None:
        """Beat as this rank of ``workers`` (with ``redundancy=2``): the
        others tell it is alive by its heartbeat (:mod:`zerofn_torch.elastic`).
        With workers of several ranks the alarm shuts the connections of the
        job's groups (:func:`~zerofn_torch.diloco_recovery.worker_groups`
        notes them as the default group's), else those of ``group``."""
        self._me, self._workers = dist.get_rank(), workers
        self._generation = next_generation() if redundancy == 2 else 0
        self._heartbeat = None
        if redundancy == 2:
            over = group if workers.ranks_per_worker == 1 else dist.group.WORLD
            self._heartbeat = start_heartbeat(
                self._generation, self.place, len(workers.ranks), over
            )

    def _check_alarm(self) -> None:
        """Fail at once when another rank raised this world's alarm: a
        worker between syncs waits on nobody, and would otherwise learn of
        a loss only at its next sync, long after the roll call.

        Raises:
            zerofn.errors.CollectiveError: the alarm is raised.
        """
        beating = self._heartbeat
        if beating is None or beating.generation != self._generation or beating.alarm is None:
            return
        raise CollectiveError(
            "the next inner step",
            "DiLoCo with redundancy=2",
            f"the outer group of {self.world_size} ranks (this is rank {self._rank})",
            f"another rank raised the job's alarm ({beating.alarm}); recover on every rank",
        )

    def position(self) -> SyncPosition:
        """Where this rank stands in the syncs, for the roll call.

        Raises:
            ValueError: built with ``redundancy=1``.
        """
        return self._carrying().position(self._state, self._taken)

    def _carrying(self) -> CarriedOuter:
        if self._carried is None:
            raise ValueError(
                "this DiLoCoOptimizer keeps no copies of other ranks' outer state: build it "
                "with redundancy=2 to go on without a lost rank"
            )
        return self._carried

    def leave_group(self) -> None:
        """Never poll or wait for the sync in flight on the failed group
        again, nor let the process's exit wait for it (it may never
        complete): a recovery finishes it or runs it again on the new
        group, and a rank left behind ends."""
        if self._flight is not None:
            self._flight.abandon()

    def held_state_dicts(self, recovery: SyncRecovery | None = None) -> StateDicts:
        """This rank's own DiLoCo rank state dict and its carried copy's;
        for ``recovery``, with compressed syncs, its own holds the replica
        and residual as :func:`~zerofn.diloco.redundancy.regrouped` reads them."""
        replica, residual = self._as_found(recovery)
        own = rank_state_dict(
            self._plan,
            self._rank,
            self._state,
            None,
            self._anchors,
            self.outer.state_dict(),
            replica,
            residual,
        )
        return own, self._carrying().state_dict(self._plan, self._rank, self._state)

    def _as_found(
        self, recovery: SyncRecovery | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if recovery is None or self._replica is None or self._residual is None:
            return None, None
        carried = self._carrying()
        index = fragment_synced_at(self.config, carried.sync)
        fragment = None if index is None else self._plan.fragments[index]
        before = None
        if carried.replica_before is not None and carried.residual_before is not None:
            before = (carried.replica_before, carried.residual_before)
        return as_found(recovery, carried.sync, fragment, (self._replica, self._residual), before)

    def finishing(self, index: int) -> tuple[Fragment, torch.Tensor | None, Any, Any]:
        """What finishing the sync of fragment ``index`` forward reads here:
        the fragment, this rank's sum of it (``None``: it lacks it), its
        anchor slice and its carried anchor slice."""
        carried = self._carrying()
        total = carried.total if carried.summed else None
        return self._plan.fragments[index], total, self._anchors[index], carried.anchors[index]

    def enter_world(self, group: Any, workers: Workers) -> None:
        """Beat (and watch, and heed the alarm) in the next world, over
        ``group`` (this rank's new outer group), from now on, as one of
        ``workers``: before the first collective of the new world, which the
        old world's alarm must not end."""
        self._generation += 1
        self._workers = workers
        if self._heartbeat is not None:
            self._heartbeat.beat_as(self._generation, self.place, len(workers.ranks), group)

    def handed_state(self) -> dict[str, Any]:
        """Everything a sibling (a rank of the same worker) needs to stand
        where this rank stands: the parameters, the inner optimizer's state,
        the outer state and its copy, and where it is in the syncs
        (:meth:`take_state`)."""
        return {
            "params": [p.detach() for p in self._params],
            "inner": self.optim.state_dict(),
            "state": (self._state, self._taken),
            "anchors": self._anchors,
            "outer": self.outer.state_dict(),
            "kept": (self._result, self._replica, self._residual),
            "carried": self._carrying().handed(),
        }

    def take_state(self, handed: Mapping[str, Any]) -> None:
        """Stand where the sibling that gave ``handed`` (:meth:`handed_state`)
        stands. Not for training loops: :func:`zerofn_torch.elastic.recover` calls it."""
        with torch.no_grad():
            for param, value in zip(self._params, handed["params"], strict=True):
                param.copy_(value)
        self.optim.load_state_dict(handed["inner"])
        parameters_written(self.optim)
        self._state, self._taken = handed["state"]
        result, replica, residual = handed["kept"]
        self._hold_outer(handed["anchors"], handed["outer"], replica, residual)
        self._result = None if result is None else result.clone()
        self._carrying().take(handed["carried"])

    def _hold_outer(
        self,
        anchors: Sequence[torch.Tensor],
        outer: dict[str, Any],
        replica: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> None:
        """Hold ``anchors`` (copies), a new outer optimizer over them loaded
        from ``outer``, and (compressed syncs) ``replica`` and ``residual``."""
        self._anchors = [a.detach().clone() for a in anchors]
        self.outer = check_outer_optimizer(self._factory(self._anchors), self._anchors)
        self.outer.load_state_dict(outer)
        if self._replica is not None and self._residual is not None:
            assert replica is not None and residual is not None  # compressed: always held
            self._replica.copy_(replica)
            self._residual.copy_(residual)

    def regroup(self, group: Any, new_rank: int, regrouped: Regrouped) -> None:
        """Go on as rank ``new_rank`` of ``group`` with the regrouped outer
        state (own and carried), in the world :meth:`enter_world` entered.
        Not for training loops: :func:`zerofn_torch.elastic.recover` calls it."""
        carried = self._carrying()
        self.process_group = group
        self._rank, self._plan = new_rank, regrouped.plan
        own = regrouped.own
        self._hold_outer(own["anchor"], own["outer"], own["replica"], own["residual"])
        carried.load(regrouped.carried)
        # The sync in flight, if any, was the old group's (left already): it
        # is finished or run again from here (resume, run_again).
        self._flight, self._result = None, None

    def resume(self, recovery: SyncRecovery, position: SyncPosition, results: Any) -> None:
        """Bring this rank's parameters and schedule to where ``recovery``
        leaves them: the result of a sync it stepped (from the regrouped
        ``results``) merged now if the failed call was to merge it, else kept
        for its due step; a sync to run again is :meth:`run_again`'s."""
        self._taken = False
        index = fragment_synced_at(self.config, position.sync)
        if recovery.applies_consolidated(position):
            assert index is not None
            if position.merges_now:
                self._merge(index, results[index])
            else:
                self._result = results[index].clone()
        if position.taken:
            self._state = take_inner_step(self.config, self._state)[0]

    def run_again(self, position: SyncPosition) -> None:
        """Start again, on the new group, the sync this rank entered last,
        from the values it started from (the survivors' sync, without the
        lost ranks' parameters), and merge its result if the failed call
        was to merge it; the others run it when their inner steps get there.

        Raises:
            zerofn.errors.CollectiveError: the sync failed.
        """
        index = fragment_synced_at(self.config, position.sync)
        assert index is not None
        start = self._carrying().start
        self._start(index, position.sync, None if start is None else start.clone())
        if position.merges_now:
            self.drain()
            assert self._result is not None
            self._merge(index, self._result)
            self._result = None

    def verify_copies(self) -> None:
        """Check that every carried copy of the outer state equals its
        owner's, bit for bit. Collective: call on every rank.

        Raises:
            zerofn.replicas.ReplicaMismatch: a copy differs (naming both ranks).
            zerofn.errors.CollectiveError: the gathering failed.
        """
        own, carried = (digests(outer_state_tensors(d)).tolist() for d in self.held_state_dicts())
        every = all_gather_objects((own, carried), self.process_group, "DiLoCo: checking copies")
        wrong = copies_disagreement([o for o, _ in every], [c for _, c in every])
        if wrong is not None:
            raise ReplicaMismatch(f"{wrong}: restart from a checkpoint")
