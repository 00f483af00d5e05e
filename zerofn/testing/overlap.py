"""The ZeRO step overlapped with DDP's backward, for N simulated ranks in one process.

:func:`simulate_overlapped_step` runs the overlapped step
(``hook_with_zero_step``) over several iterations: the core hook
:func:`zerofn.overlap.hook.zero_step_hook` on every rank, bucket by bucket,
and each rank, built as the optimizer builds it
(:func:`zerofn.zero.hook_driven.build_hook_driven_rank`), obeying the
step orders it gives with the core's :func:`zerofn.overlap.orders.obey_order`
and stepping as the optimizer steps, as the adapter's runner does::

    from zerofn.testing.overlap import simulate_overlapped_step

    # Parameters 2, 1 | 0 in two DDP buckets; two ranks; DDP's buckets are
    # final from iteration 1 (it collects the plan), iteration 2 overlaps.
    run = simulate_overlapped_step([[2, 1], [0]], params, grads, torch.optim.SGD,
                                   final_from=1, lr=0.1)
    # run.params[r]: rank r's parameters, equal to DDP + SGD on every rank;
    # run.requests[2][r]: rank r's Reduce and Broadcast requests of iteration 2.

What is left here is the world's part: DDP handing buckets over in order,
every rank's programs run in lockstep, the iteration's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Program, Request, recording_requests, split_like
from zerofn.hooks.hook import (
    BucketInfo,
    CommHook,
    allreduce_mean,
    begin_bucket,
    finish_bucket,
    finish_iteration,
    init_hook_state,
)
from zerofn.overlap.ddp_buckets import BucketPlan
from zerofn.overlap.hook import (
    OverlapConfig,
    OverlapHookState,
    StepOrder,
    zero_step_hook,
)
from zerofn.overlap.orders import (
    OrderObeyed,
    OverlapBinding,
    Sent,
    StepChecks,
    StepGradients,
    obey_order,
    write_updates,
)
from zerofn.testing.world import run_programs
from zerofn.zero.forward_gather import ForwardGather, check_gather_with_hook
from zerofn.zero.hook_driven import (
    attach,
    build_hook_driven_rank,
    send_compressed,
    step_rank_with_gradients,
)
from zerofn.zero.options import resolve_options
from zerofn.zero.rank import ZeroRank, flat_params
from zerofn.zero.replan import sharded_by_owners

__all__ = ["OverlappedRun", "simulate_overlapped_step"]

R = TypeVar("R")


@attrs.frozen
class OverlappedRun:
    """What :func:`simulate_overlapped_step` returns.

    Attributes:
        params: ``params[rank]``: each rank's parameters after the last iteration.
        requests: ``requests[iteration][rank]``: the collectives each rank
            made in each iteration, in order (the hook's and the broadcasts).
        plan: the bucket plan the hook fixed (rank 0's; every rank's is the
            same), or ``None`` if the buckets were never final long enough.
        held: ``held[rank]``: the parameters the rank keeps optimizer state
            for after the last iteration, as the order's ``reshard`` said
            (``None``: all of them; the plan is not fixed).
    """

    params: list[list[torch.Tensor]]
    requests: list[list[list[Request]]]
    plan: BucketPlan | None
    held: list[tuple[int, ...] | None]


_Sent = Sent


class _OverlapRank:
    """One simulated rank of the overlapped step: its hook state, its ZeRO
    rank as the optimizer builds it (:func:`~zerofn.zero.hook_driven.build_hook_driven_rank`:
    every parameter until the plan is fixed, then its share, kept by
    :func:`~zerofn.zero.replan.sharded_by_owners`), the averaged buckets not
    stepped yet, and the owners' updates to write at the iteration's end.

    Its steps are the optimizer's own
    (:func:`~zerofn.zero.hook_driven.step_rank_with_gradients`); an order to
    step a parameter whose state the rank gave up is refused here (the
    optimizer would skip it silently).
    """

    def __init__(
        self,
        hook: CommHook[OverlapHookState[Any], Any],
        config: OverlapConfig,
        groups: list[dict[str, Any]],
        zero: ZeroRank,
        first_use: Sequence[int | None] | None = None,
    ) -> None:
        self.hook, self.config = hook, config
        self.state = init_hook_state(hook)
        self.groups, self.zero = groups, zero
        self.params = flat_params(groups)
        self.handed: dict[int, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        self.incoming: list[tuple[tuple[int, ...], _Sent, bool]] = []
        self.behind_forward: list[Program[None]] = []
        # What the optimizer's bind_overlap_hook gives the adapter's hook.
        self.binding = OverlapBinding(
            self._step,
            self._adopt_owners,
            lambda: send_compressed(self.zero, self.params),
            forward_order=lambda: first_use,
            behind_forward=self._send_behind_forward,
        )

    @property
    def held(self) -> tuple[int, ...] | None:
        """The parameters this rank keeps optimizer state for (``None``:
        all of them, the plan is not fixed)."""
        if self.zero.overlap != "sharded":
            return None
        return self.zero.plan.partition.params_of(self.config.rank)  # type: ignore[union-attr]

    def begin(self, grads: Sequence[torch.Tensor], info: BucketInfo) -> Program[tuple[Any, Any]]:
        """Hand bucket ``info`` over: the hook's program for this rank."""
        # A fresh tensor: the hook may reduce it in place.
        flat = torch.cat([grads[i].reshape(-1) for i in info.params])
        self.state, program = begin_bucket(self.hook, self.state, flat, info)
        return program

    def finish(
        self, info: BucketInfo, averaged: torch.Tensor, bucket_state: Any
    ) -> StepOrder | None:
        """Record the bucket's result; the order the hook gives after it."""
        self.state = finish_bucket(self.state, info.index, bucket_state)
        like = [self.params[i] for i in info.params]
        self.handed[info.index] = (info.params, split_like(averaged, like))
        if info.is_last:  # before reading the order, as the adapter's HookCell does
            self.state = finish_iteration(self.hook, self.state)
        return self.state.global_state.order

    def obeying(self, order: StepOrder) -> Program[OrderObeyed]:
        """The core's :func:`zerofn.overlap.orders.obey_order` for
        ``order``, through this rank's binding (the buckets it names are taken)."""
        handed = {index: self.handed.pop(index) for index in order.buckets}
        state = self.state.global_state
        return obey_order(
            self.binding, state, self.config, order, handed, self.params, StepChecks()
        )

    def _step(self, request: StepGradients) -> None:
        """Step as the optimizer does; the parameters not named sit out."""
        held = self.held
        if held is not None and not set(request.grads) <= set(held):
            raise AssertionError(
                f"rank {self.config.rank} is ordered to step parameters "
                f"{sorted(set(request.grads) - set(held))}, whose state it gave up"
            )
        step_rank_with_gradients(self.zero, self.groups, request)

    def _adopt_owners(self, owned: Sequence[Sequence[int]]) -> None:
        self.zero = sharded_by_owners(self.zero, self.groups, owned)

    def _send_behind_forward(self, gather: ForwardGather, program: Program[None]) -> None:
        self.behind_forward.append(program)

    def sends(self, done: OrderObeyed) -> list[Program[_Sent]]:
        """The owners' sends of an obeyed order, their results kept to write
        at the iteration's end."""
        return [
            self._sending(program, indices, done.differences) for indices, program in done.sends
        ]

    def _sending(
        self, program: Program[_Sent], indices: tuple[int, ...], differences: bool
    ) -> Program[_Sent]:
        """``program``, its result kept to write at the iteration's end."""
        sent = yield from program
        self.incoming.append((indices, sent, differences))
        return sent

    def receive(self) -> None:
        """Write what the other ranks sent into this rank's parameters."""
        incoming, self.incoming = self.incoming, []
        for indices, sent, differences in incoming:
            write_updates(self.params, indices, sent, differences)


def _in_turn(programs: Sequence[Program[R]]) -> Program[list[R]]:
    """Run ``programs`` one after another, as one program."""
    results = []
    for program in programs:
        results.append((yield from program))
    return results


def _hand_over(
    ranks: Sequence[_OverlapRank],
    info: BucketInfo,
    grads_per_rank: Sequence[Sequence[torch.Tensor]],
    made: Sequence[list[Request]],
) -> None:
    """One bucket on every rank: the hook's programs, then each rank's order
    (its step, its broadcasts), and at the last bucket the received updates."""
    programs = [
        recording_requests(rank.begin(grads, info), seen.append)
        for rank, grads, seen in zip(ranks, grads_per_rank, made, strict=True)
    ]
    purpose = f"DDP bucket {info.index} (the overlapped ZeRO step's hook)"
    results = run_programs(programs, purpose=purpose)
    orders = [rank.finish(info, *result) for rank, result in zip(ranks, results, strict=True)]
    sends: list[list[Program[_Sent]]] = [[] for _ in ranks]
    if all(order is not None for order in orders):
        obeying = [
            recording_requests(rank.obeying(order), seen.append)
            for rank, order, seen in zip(ranks, orders, made, strict=True)
            if order is not None
        ]
        done = run_programs(obeying, purpose=f"after DDP bucket {info.index}: the step")
        sends = [rank.sends(done_order) for rank, done_order in zip(ranks, done, strict=True)]
    elif any(order is not None for order in orders):
        raise AssertionError(f"after bucket {info.index} only some ranks were ordered to step")
    if any(sends):
        run_programs(
            [
                recording_requests(_in_turn(s), seen.append)
                for s, seen in zip(sends, made, strict=True)
            ],
            purpose=f"after DDP bucket {info.index}: the owners' updated parameters",
        )
    if info.is_last and any(rank.behind_forward for rank in ranks):
        # The next forward collects them, in the order they travel.
        behind = [_in_turn(rank.behind_forward) for rank in ranks]
        for rank in ranks:
            rank.behind_forward = []
        run_programs(
            [
                recording_requests(program, seen.append)
                for program, seen in zip(behind, made, strict=True)
            ],
            purpose="behind the next forward: the owners' updated parameters",
        )
    if info.is_last:
        for rank in ranks:
            rank.receive()


def _checked_world(
    buckets: Sequence[Sequence[int]],
    num_params: int,
    grads_per_iteration_per_rank: Sequence[Sequence[Sequence[torch.Tensor]]],
) -> int:
    """The world size; raises ValueError for buckets that do not cover every
    parameter once, or iterations with different numbers of ranks."""
    if sorted(i for bucket in buckets for i in bucket) != list(range(num_params)):
        raise ValueError(f"the buckets {buckets} must hold each of {num_params} parameters once")
    if any(not bucket for bucket in buckets):
        raise ValueError("DDP never hands over an empty bucket")
    counts = {len(grads) for grads in grads_per_iteration_per_rank}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"every iteration needs one gradient list per rank, got {counts or 'none'}"
        )
    return counts.pop()


def simulate_overlapped_step(
    buckets: Sequence[Sequence[int]],
    params: Sequence[torch.Tensor],
    grads_per_iteration_per_rank: Sequence[Sequence[Sequence[torch.Tensor]]],
    optimizer_class: type[torch.optim.Optimizer],
    inner: CommHook[Any, Any] | None = None,
    *,
    reduce_to_owner: bool | None = None,
    shard_buckets: bool = False,
    interleaved: bool = False,
    final_from: int = 0,
    exchange_compression: str | BlockQuantizer | None = None,
    forward_order: Sequence[int | None] | None = None,
    **defaults: Any,
) -> OverlappedRun:
    """Iterations of the overlapped ZeRO step (``hook_with_zero_step``) on
    simulated ranks: the core hook :func:`zerofn.overlap.hook.zero_step_hook`
    wrapping ``inner``, obeyed as the adapter's runner obeys it.

    Per iteration, per bucket in order, every rank hands the bucket's flat
    gradient to the hook (``final`` from iteration ``final_from`` on), all
    ranks' programs run together, and each rank obeys the hook's
    :class:`~zerofn.overlap.hook.StepOrder`: it steps the named buckets'
    averaged gradients (all of them while DDP's buckets are not final, then
    the shards it owns) and sends the owners' updates, which every rank writes
    into its parameters after the last bucket.

    Args:
        buckets: global parameter indices of each DDP bucket, in the order
            DDP hands them over; together, every parameter once.
        params: the global parameters' initial values (not modified).
        grads_per_iteration_per_rank: ``[iteration][rank][param]``: each
            rank's local gradient of every parameter (same shape as it).
        optimizer_class: the ``torch.optim`` optimizer every rank runs (one
            param group of all parameters; see :class:`_OverlapRank`).
        inner: the hook that averages gradients; plain averaging
            (:func:`zerofn.hooks.hook.allreduce_mean`) when omitted.
        reduce_to_owner: reduce each shard onto its owner once the plan is
            fixed; only right for plain averaging, which the hook then
            replaces. Default: whether ``inner`` was omitted (as the adapter
            decides for PyTorch's and zerofn's ``allreduce_hook``).
        shard_buckets: a bucket's parameters may be split across ranks.
        interleaved: step each bucket when the next one is handed over.
        final_from: the first iteration whose buckets are final (DDP has
            rebuilt them); it collects the plan, the next ones overlap.
        exchange_compression: as ``ZeroRedundancyOptimizer``'s: every rank
            steps exact copies of the parameters, and owners send quantized
            differences once the plan is fixed.
        forward_order: each parameter's first use in the forward
            (:func:`zerofn.zero.forward_gather.first_uses`): the owners'
            updates travel behind the next forward in that order, as with
            ``gather_during_forward=True`` (``None``: inside the last
            bucket's hook call).
        **defaults: the optimizer's hyperparameters.

    Returns:
        An :class:`OverlappedRun`: every rank's parameters, each iteration's
        requests per rank, the plan and the parameters each rank still holds
        optimizer state for.

    Raises:
        ValueError: buckets that do not cover the parameters once; no
            iteration, or iterations with different numbers of ranks; a
            ``forward_order`` with ``interleaved``.
        zerofn.testing.world.CollectiveMismatch: if the ranks' collectives differ.
        AssertionError: the hook ordered a rank to step a parameter whose
            state it had given up (a ``reshard`` the order did not keep to).
    """
    check_gather_with_hook(forward_order is not None, interleaved)
    world_size = _checked_world(buckets, len(params), grads_per_iteration_per_rank)
    sizes = tuple(p.numel() for p in params)
    config = OverlapConfig(
        sizes=sizes,
        world_size=world_size,
        rank=0,
        shard_buckets=shard_buckets,
        interleaved=interleaved,
        reduce_to_owner=inner is None if reduce_to_owner is None else reduce_to_owner,
    )
    hook_inner = allreduce_mean() if inner is None else inner
    ranks = []
    for rank in range(world_size):
        mine = attrs.evolve(config, rank=rank)
        groups = [{"params": [p.detach().clone().requires_grad_() for p in params]}]
        options = resolve_options(
            groups, optimizer_class, defaults,
            rank=rank, world_size=world_size, collective="broadcasts", bucket_view=None,
            overlap_with_ddp=True, partition="greedy", master_dtype=None,
            exchange_compression=exchange_compression,
        )  # fmt: skip
        zero = attach(build_hook_driven_rank(groups, options))
        hook = zero_step_hook(hook_inner, mine)
        ranks.append(_OverlapRank(hook, mine, groups, zero, forward_order))
    requests = [
        _iteration(ranks, buckets, grads, final=iteration >= final_from)
        for iteration, grads in enumerate(grads_per_iteration_per_rank)
    ]
    plan = ranks[0].state.global_state.overlap.plan
    held = [rank.held for rank in ranks]
    params_per_rank = [[p.detach() for p in rank.params] for rank in ranks]
    return OverlappedRun(params_per_rank, requests, plan, held)


def _iteration(
    ranks: Sequence[_OverlapRank],
    buckets: Sequence[Sequence[int]],
    grads_per_rank: Sequence[Sequence[torch.Tensor]],
    final: bool,
) -> list[list[Request]]:
    """One iteration on every rank; the requests each rank made."""
    made: list[list[Request]] = [[] for _ in ranks]
    params = ranks[0].params
    for index, bucket in enumerate(buckets):
        info = BucketInfo(
            index,
            tuple(tuple(params[i].shape) for i in bucket),
            len(ranks),
            is_last=index == len(buckets) - 1,
            params=tuple(bucket),
            final=final,
        )
        _hand_over(ranks, info, grads_per_rank, made)
    return made
