"""The plain ZeRO step for N simulated ranks in one process.

:func:`simulate_zero_steps` runs the program
``zerofn_torch.ZeroRedundancyOptimizer.step`` runs,
:func:`zerofn.zero.step.zero_step`, on every rank of the simulated world
(:mod:`zerofn.testing.world`): the same mode records
(:mod:`zerofn.zero.shards`), the same local tensors, each rank answering the
program's local step with its own ``torch.optim`` optimizer. So a property
test of your own partition tests the code training runs, without processes::

    from zerofn.zero.planning.plan import plan_shards
    from zerofn.testing.zero import simulate_zero_steps

    plan = plan_shards([[6, 4, 9]], ["cpu"] * 3, [True] * 3, world_size=2, mode="flat")
    ranks, requests = simulate_zero_steps(plan, params, [grads], torch.optim.Adam, lr=1e-2)
    # ranks[r] are rank r's parameters after the step: equal on every rank,
    # and equal to Adam stepping all parameters unsharded.

The overlapped step has its own harness, :mod:`zerofn.testing.overlap`;
worlds that lose or gain ranks are :mod:`zerofn.testing.elastic`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Program, Request, recording_requests
from zerofn.testing.world import run_programs
from zerofn.zero.compressed.exchange import PIECE_ELEMENTS
from zerofn.zero.exchange import ExchangeCollective
from zerofn.zero.forward_gather import Arrivals
from zerofn.zero.mixed_precision.masters import Masters
from zerofn.zero.options import resolve_options
from zerofn.zero.planning.plan import ShardPlan
from zerofn.zero.rank import ZeroRank, answer_local_step, build_rank
from zerofn.zero.shards import Shards
from zerofn.zero.step import Compressed, run_zero_step

__all__ = [
    "SimulatedRank",
    "param_groups_of",
    "simulate_zero_steps",
    "simulated_ranks",
    "step_simulated",
]


@attrs.frozen(eq=False)
class SimulatedRank:
    """One simulated rank of the plain step: its own copy of the parameters
    and its :class:`~zerofn.zero.rank.ZeroRank`, built by the function the
    optimizer's constructor calls (:func:`~zerofn.zero.rank.build_rank`).

    Attributes:
        params: this rank's parameters (the replica).
        zero: the rank's ZeRO state (shards, masters, local optimizer, ...).
    """

    params: list[torch.Tensor]
    zero: ZeroRank

    @property
    def shards(self) -> Shards:
        """The mode's record, with its exchange buffers."""
        return self.zero.shards

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The local optimizer."""
        return self.zero.optim

    @property
    def masters(self) -> Masters | None:
        """The master copies (``master_dtype`` or a compressed exchange), or ``None``."""
        return self.zero.masters

    @property
    def compressed(self) -> Compressed | None:
        """The compressed exchange's buffers and masters, or ``None``."""
        return self.zero.compressed

    def program(
        self,
        grads: Sequence[torch.Tensor | None],
        collective: ExchangeCollective,
        in_forward_order: Arrivals | None = None,
    ) -> Program[Any]:
        """This rank's step program, its local step answered as the optimizer
        answers it (:func:`~zerofn.zero.rank.answer_local_step`), after this step's
        gradients land in the parameters' ``.grad`` (what DDP leaves); with
        ``in_forward_order``, its exchange as it travels behind the forward
        (:func:`~zerofn.zero.step.zero_step`)."""
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = None if grad is None else grad.clone()
        zero = self.zero
        answer = answer_local_step(zero, self.params, lambda optim: optim.step())
        return run_zero_step(
            zero.shards, self.params, collective, answer, zero.compressed, in_forward_order
        )


def simulated_ranks(
    plan: ShardPlan,
    params: Sequence[torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer],
    bucket_view: bool | None = None,
    master_dtype: torch.dtype | None = None,
    exchange_compression: str | BlockQuantizer | None = None,
    piece_elements: int = PIECE_ELEMENTS,
    redundancy: int = 1,
    elementwise: bool = False,
    **defaults: Any,
) -> list[SimulatedRank]:
    """``plan.world_size`` simulated ranks, each built by the optimizer's own
    :func:`~zerofn.zero.options.resolve_options` and
    :func:`~zerofn.zero.rank.build_rank` (same mode record, local tensors,
    masters and payload buffers, same defaults).

    Args:
        plan: the shard plan (one param group per group of ``params``).
        params: the global parameters' initial values (copied per rank).
        optimizer_class: the local optimizer every rank runs on its shard.
        bucket_view: parameters as views of the exchange buffers (``None``:
            the optimizer's default, on for a flat partition).
        master_dtype: keep master copies in this dtype.
        exchange_compression: as ``ZeroRedundancyOptimizer``'s.
        piece_elements: the compressed exchange's piece length (a small one
            sends every segment in many pieces).
        redundancy: as ``ZeroRedundancyOptimizer``'s (2: each rank also
            steps a carried copy of the previous rank's shard).
        elementwise: as ``ZeroRedundancyOptimizer``'s (a flat plan with an
            optimizer class zerofn does not know to be element-wise).
        **defaults: the optimizer's hyperparameters.

    Raises:
        ValueError, TypeError: what the optimizer's constructor refuses (a
            bad ``master_dtype``, compression or hyperparameter, ...).
    """
    ranks = []
    for rank in range(plan.world_size):
        mine = [p.detach().clone() for p in params]
        groups = param_groups_of(plan, mine)
        options = resolve_options(
            groups, optimizer_class, defaults,
            rank=rank, world_size=plan.world_size, collective="broadcasts", bucket_view=bucket_view,
            overlap_with_ddp=False, partition=plan.mode, master_dtype=master_dtype,
            exchange_compression=exchange_compression, piece_elements=piece_elements,
            redundancy=redundancy, elementwise=elementwise,
        )  # fmt: skip
        ranks.append(SimulatedRank(mine, build_rank(groups, options, plan)))
    return ranks


def step_simulated(
    ranks: Sequence[SimulatedRank],
    grads: Sequence[torch.Tensor | None],
    collective: ExchangeCollective = "broadcasts",
) -> list[list[Request]]:
    """One ZeRO step on every simulated rank (the production program).

    Args:
        ranks: the simulated ranks (:func:`simulated_ranks`).
        grads: every parameter's averaged gradient (what DDP hands every
            rank), or ``None`` for one without.
        collective: how the exchange moves its bytes.

    Returns:
        The requests each rank made.

    Raises:
        zerofn.testing.world.CollectiveMismatch: if the ranks' exchanges differ.
    """
    requests: list[list[Request]] = [[] for _ in ranks]
    programs = [
        recording_requests(sim.program(grads, collective), seen.append)
        for sim, seen in zip(ranks, requests, strict=True)
    ]
    run_programs(programs, purpose="the simulated ZeRO step")
    return requests


def simulate_zero_steps(
    plan: ShardPlan,
    params: Sequence[torch.Tensor],
    grads_per_step: Sequence[Sequence[torch.Tensor | None]],
    optimizer_class: type[torch.optim.Optimizer],
    collective: ExchangeCollective = "broadcasts",
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
        collective: how the exchange moves its bytes.
        bucket_view: parameters as views of the exchange buffers (``None``:
            the optimizer's default, on for a flat partition).
        **defaults: the optimizer's hyperparameters, and ``master_dtype`` or
            ``exchange_compression`` (see :func:`simulated_ranks`).

    Returns:
        ``(params_per_rank, requests_per_rank)``: every rank's parameters
        after the steps, and the requests each rank made (all steps).

    Raises:
        zerofn.testing.world.CollectiveMismatch: if the ranks' exchanges differ.
    """
    ranks = simulated_ranks(plan, params, optimizer_class, bucket_view, **defaults)
    requests: list[list[Request]] = [[] for _ in ranks]
    for grads in grads_per_step:
        for seen, made in zip(requests, step_simulated(ranks, grads, collective), strict=True):
            seen.extend(made)
    return [sim.params for sim in ranks], requests


def param_groups_of(plan: ShardPlan, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """``params`` (one rank's, in the plan's order) cut into ``plan``'s param groups."""
    sizes = [len(group) for group in plan.partition.group_sizes]
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    return [{"params": params[a : a + n]} for a, n in zip(starts, sizes, strict=True)]
