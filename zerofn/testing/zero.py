"""The plain ZeRO step for N simulated ranks in one process.

:func:`simulate_zero_steps` runs the program
``zerofn_torch.ZeroRedundancyOptimizer.step`` runs,
:func:`zerofn.zero.step.zero_step`, on every rank of the simulated world
(:mod:`zerofn.testing.world`): the same mode records
(:mod:`zerofn.zero.shards`), the same local tensors, each rank answering the
program's local step with its own ``torch.optim`` optimizer. So a property
test of your own partition tests the code training runs, without processes::

    from zerofn.zero.plan import plan_shards
    from zerofn.testing.zero import simulate_zero_steps

    plan = plan_shards([[6, 4, 9]], ["cpu"] * 3, [True] * 3, world_size=2, mode="flat")
    ranks, requests = simulate_zero_steps(plan, params, [grads], torch.optim.Adam, lr=1e-2)
    # ranks[r] are rank r's parameters after the step: equal on every rank,
    # and equal to Adam stepping all parameters unsharded.

The overlapped step has its own harness, :mod:`zerofn.testing.overlap`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from zerofn.comm import Request, watched
from zerofn.testing.world import run_programs
from zerofn.zero.exchange import ExchangeVia
from zerofn.zero.partition import FlatPartition
from zerofn.zero.plan import ShardPlan
from zerofn.zero.shards import WholeTensorShards, shards_for
from zerofn.zero.step import LocalStep, run_zero_step

__all__ = ["simulate_zero_steps"]


@attrs.define(eq=False)
class _SimulatedRank:
    """One simulated rank of the plain step: its own copy of the parameters,
    the mode's record (:mod:`zerofn.zero.shards`, as the optimizer builds it)
    and a local optimizer over the same local tensors the optimizer steps."""

    params: list[torch.Tensor]
    shards: WholeTensorShards
    optimizer: torch.optim.Optimizer

    def local_step(self, grads: Sequence[torch.Tensor | None]) -> Callable[[LocalStep], Any]:
        """The answer to the program's :class:`LocalStep`: this step's
        gradients into the parameters' ``.grad`` (what DDP leaves), handed
        to the local tensors as the optimizer hands them, then the step."""

        def answer(_: LocalStep) -> Any:
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = None if grad is None else grad.clone()
            local = [t for g in self.optimizer.param_groups for t in g["params"]]
            self.shards.hand_grads(self.params, local)
            return self.optimizer.step()

        return answer


def _simulated_rank(
    plan: ShardPlan,
    rank: int,
    params: Sequence[torch.Tensor],
    bucket_view: bool,
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
) -> _SimulatedRank:
    mine = [p.detach().clone() for p in params]
    shards = shards_for(
        plan,
        rank,
        mine,
        bucket_view=bucket_view,
        stepped_by_hook=False,
        step_dtype=mine[0].dtype,
        options=defaults,
    )
    sizes = [len(group) for group in plan.partition.group_sizes]
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    groups = [{"params": mine[start : start + n]} for start, n in zip(starts, sizes, strict=True)]
    optimizer = optimizer_class(shards.local_groups(groups, mine), **defaults)
    return _SimulatedRank(mine, shards, optimizer)


def simulate_zero_steps(
    plan: ShardPlan,
    params: Sequence[torch.Tensor],
    grads_per_step: Sequence[Sequence[torch.Tensor | None]],
    optimizer_class: type[torch.optim.Optimizer],
    via: ExchangeVia = "broadcasts",
    bucket_view: bool | None = None,
    **defaults: Any,
) -> tuple[list[list[torch.Tensor]], list[list[Request]]]:
    """Run ZeRO steps on ``plan.world_size`` simulated ranks: the program
    ``ZeroRedundancyOptimizer.step`` runs (:func:`zerofn.zero.step.zero_step`),
    over the same local tensors, each rank answering its local step with its
    own ``optimizer_class``.

    Args:
        plan: the shard plan (one param group per group of ``params``).
        params: the global parameters' initial values (not modified).
        grads_per_step: per step, every parameter's averaged gradient (what
            DDP hands every rank), or ``None`` for one without.
        optimizer_class: the local optimizer every rank runs on its shard.
        via: how the exchange moves its bytes.
        bucket_view: parameters as views of the exchange buffers (``None``:
            the optimizer's default, on for a flat partition).
        **defaults: the optimizer's hyperparameters.

    Returns:
        ``(params_per_rank, requests_per_rank)``: every rank's parameters
        after the steps, and the requests each rank made (all steps).

    Raises:
        zerofn.testing.world.CollectiveMismatch: if the ranks' exchanges differ.
    """
    world = range(plan.world_size)
    view = isinstance(plan.partition, FlatPartition) if bucket_view is None else bucket_view
    ranks = [_simulated_rank(plan, r, params, view, optimizer_class, defaults) for r in world]
    requests: list[list[Request]] = [[] for _ in world]
    for grads in grads_per_step:
        programs = [
            watched(run_zero_step(sim.shards, sim.params, via, sim.local_step(grads)), seen.append)
            for sim, seen in zip(ranks, requests, strict=True)
        ]
        run_programs(programs, purpose="the simulated ZeRO step")
    return [sim.params for sim in ranks], requests
