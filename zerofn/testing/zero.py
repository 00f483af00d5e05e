"""The ZeRO step, plain and overlapped with DDP, for N simulated ranks in one process.

:func:`simulate_zero_steps` runs the same sequence as
``zerofn_torch.ZeroRedundancyOptimizer.step`` on every rank: step the shard
this rank owns with a local ``torch.optim`` optimizer, pack it into the
exchange buffers, run :func:`zerofn.exchange.exchange_program` (in the
simulated world, :mod:`zerofn.testing.world`), unpack what the other ranks
sent. Ownership, layouts and the exchange all come from the core, so a
property test of your own partition runs here without processes::

    from zerofn.plan import plan_shards
    from zerofn.testing.zero import simulate_zero_steps

    plan = plan_shards([[6, 4, 9]], ["cpu"] * 3, [True] * 3, world_size=2, mode="flat")
    ranks, requests = simulate_zero_steps(plan, params, [grads], torch.optim.Adam, lr=1e-2)
    # ranks[r] are rank r's parameters after the step: equal on every rank,
    # and equal to Adam stepping all parameters unsharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from zerofn.comm import Program, Request, Response, split_like
from zerofn.ddp_buckets import assign_buckets
from zerofn.exchange import ExchangeVia, exchange_program, flat_grad, group_slots, pack, unpack
from zerofn.overlap import OverlapState, owned_params_per_rank
from zerofn.overlap_step import broadcast_from_owners, owned_gradients, reduce_to_owners
from zerofn.partition import FlatPartition
from zerofn.plan import ShardPlan
from zerofn.testing.world import run_programs

__all__ = ["simulate_overlapped_step", "simulate_zero_steps"]

R = TypeVar("R")


def _local_params(
    plan: ShardPlan, rank: int, params: list[torch.Tensor], buffers: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """What rank ``rank``'s local optimizer steps, per param group: the
    parameters it owns, or (flat) one view of its part of the buffer."""
    partition = plan.partition
    if not isinstance(partition, FlatPartition):
        return [[params[i] for i in group] for group in partition.assignment[rank]]
    if not plan.layouts:  # nothing trainable
        return []
    views = []
    for slots in group_slots(plan.layouts[0], partition, rank):
        buffer = buffers[0]
        views.append([buffer[slots[0].offset : slots[-1].stop] if slots else buffer[:0]])
    return views


def _counted(program: Program[R], seen: list[Request]) -> Program[R]:
    """``program``, recording each request it makes."""
    try:
        request = next(program)
    except StopIteration as stop:
        done: R = stop.value
        return done
    while True:
        seen.append(request)
        response: Response = yield request
        try:
            request = program.send(response)
        except StopIteration as stop:
            result: R = stop.value
            return result


class _Rank:
    """One simulated rank: its copy of the parameters, buffers and optimizer."""

    def __init__(
        self,
        plan: ShardPlan,
        rank: int,
        params: Sequence[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
    ) -> None:
        self.plan, self.rank = plan, rank
        self.params = [p.detach().clone() for p in params]
        dtype, device = params[0].dtype, params[0].device
        self.buffers = [torch.zeros(ly.numel, dtype=dtype, device=device) for ly in plan.layouts]
        for layout, buffer in zip(plan.layouts, self.buffers, strict=True):
            for slots in layout.slots:
                pack(buffer, slots, self.params)
        local = _local_params(plan, rank, self.params, self.buffers)
        # A rank that owns nothing has no optimizer (torch.optim refuses one).
        self.optimizer = (
            optimizer_class([{"params": ps} for ps in local], **defaults)
            if any(p.numel() for ps in local for p in ps)
            else None
        )

    def step(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Load ``grads`` into the local shard and step it, then pack it."""
        partition = self.plan.partition
        if self.optimizer is None:
            return
        if isinstance(partition, FlatPartition):
            slots_per_group = group_slots(self.plan.layouts[0], partition, self.rank)
            for group, slots in zip(self.optimizer.param_groups, slots_per_group, strict=True):
                (flat,) = group["params"]
                flat.grad = flat_grad(slots, grads, None)
        else:
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = None if grad is None else grad.clone()
        self.optimizer.step()
        if not isinstance(partition, FlatPartition):
            for layout, buffer in zip(self.plan.layouts, self.buffers, strict=True):
                pack(buffer, layout.slots[self.rank], self.params)

    def receive(self) -> None:
        """Unpack every segment (the exchange has filled the buffers)."""
        for layout, buffer in zip(self.plan.layouts, self.buffers, strict=True):
            for slots in layout.slots:
                unpack(buffer, slots, self.params)


def simulate_zero_steps(
    plan: ShardPlan,
    params: Sequence[torch.Tensor],
    grads_per_step: Sequence[Sequence[torch.Tensor | None]],
    optimizer_class: type[torch.optim.Optimizer],
    via: ExchangeVia = "broadcasts",
    **defaults: Any,
) -> tuple[list[list[torch.Tensor]], list[list[Request]]]:
    """Run ZeRO steps on ``plan.world_size`` simulated ranks.

    Args:
        plan: the shard plan (one param group per group of ``params``).
        params: the global parameters' initial values (not modified).
        grads_per_step: per step, every parameter's averaged gradient (what
            DDP hands every rank), or ``None`` for one without.
        optimizer_class: the local optimizer every rank runs on its shard.
        via: how the exchange moves its bytes.
        **defaults: the optimizer's hyperparameters.

    Returns:
        ``(params_per_rank, requests_per_rank)``: every rank's parameters
        after the steps, and the requests each rank made (all steps).

    Raises:
        zerofn.testing.world.CollectiveMismatch: if the ranks' exchanges differ.
    """
    world = range(plan.world_size)
    ranks = [_Rank(plan, r, params, optimizer_class, defaults) for r in world]
    requests: list[list[Request]] = [[] for _ in world]
    for grads in grads_per_step:
        for simulated in ranks:
            simulated.step(grads)
        run_programs(
            [
                _counted(exchange_program(plan.layouts, sim.buffers, sim.rank, via), requests[r])
                for r, sim in enumerate(ranks)
            ],
            purpose="the simulated ZeRO step's exchange",
        )
        for simulated in ranks:
            simulated.receive()
    return [sim.params for sim in ranks], requests


def simulate_overlapped_step(
    buckets: Sequence[Sequence[int]],
    params: Sequence[torch.Tensor],
    grads_per_rank: Sequence[Sequence[torch.Tensor]],
    optimizer_class: type[torch.optim.Optimizer],
    shard_buckets: bool = False,
    **defaults: Any,
) -> tuple[list[list[torch.Tensor]], list[list[Request]]]:
    """One overlapped ZeRO step (``hook_with_zero_step`` with plain
    averaging, buckets fixed) on ``len(grads_per_rank)`` simulated ranks.

    Each bucket's gradients are averaged onto their owners
    (:func:`zerofn.overlap_step.reduce_to_owners`), every owner steps what it
    owns, and the updated parameters go back out
    (:func:`zerofn.overlap_step.broadcast_from_owners`).

    Args:
        buckets: global parameter indices of each DDP bucket, in bucket order.
        params: the global parameters' values (not modified).
        grads_per_rank: each rank's local gradient of every parameter.
        optimizer_class: the optimizer every rank runs on what it owns.
        shard_buckets: whether a bucket may be split across ranks.
        **defaults: the optimizer's hyperparameters.

    Returns:
        ``(params_per_rank, requests_per_rank)`` after the step.
    """
    world_size = len(grads_per_rank)
    sizes = [[params[i].numel() for i in bucket] for bucket in buckets]
    plan = assign_buckets(sizes, world_size, shard_buckets)
    ranks = [[p.detach().clone() for p in params] for _ in range(world_size)]
    requests: list[list[Request]] = [[] for _ in range(world_size)]
    owned: list[dict[int, torch.Tensor]] = [{} for _ in range(world_size)]
    for index, bucket in enumerate(buckets):
        flats = [torch.cat([g[i].reshape(-1) for i in bucket]) for g in grads_per_rank]
        averaged = run_programs(
            [
                _counted(reduce_to_owners(plan, index, flats[r], world_size), requests[r])
                for r in range(world_size)
            ]
        )
        for r in range(world_size):
            grads = split_like(averaged[r], [params[i] for i in bucket])
            owned[r] |= owned_gradients(plan, r, index, bucket, grads)
    fixed = OverlapState(status="initialized", buckets=tuple(map(tuple, buckets)), plan=plan)
    for r, mine in enumerate(owned_params_per_rank(fixed)):
        local = [ranks[r][i] for i in mine]
        if any(p.numel() for p in local):
            for i in mine:
                ranks[r][i].grad = owned[r][i].clone()
            optimizer_class(local, **defaults).step()
    for index, bucket in enumerate(buckets):
        sent = run_programs(
            [
                _counted(
                    broadcast_from_owners(plan, r, index, [ranks[r][i] for i in bucket]),
                    requests[r],
                )
                for r in range(world_size)
            ]
        )
        for r in range(world_size):
            for shard, flat in sent[r]:
                targets = [ranks[r][i] for i in bucket[shard.offset : shard.offset + shard.count]]
                for p, value in zip(targets, split_like(flat, targets), strict=True):
                    p.detach().copy_(value)
    return ranks, requests
