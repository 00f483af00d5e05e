"""The overlapped ZeRO step as a communication hook: :func:`zero_step_hook`.

``zero_step_hook(inner, config)`` wraps any :class:`~zerofn.hooks.hook.CommHook`
so that the ZeRO step happens during DDP's backward. It is an ordinary hook:
its global state (:class:`OverlapHookState`) holds the overlap record
(:class:`~zerofn.overlap.state.OverlapState`: status, bucket ownership), the inner
hook's state and the buckets handed over but not yet stepped; each bucket's
program is the inner hook's, or, once the bucket plan is fixed and the inner
hook is plain averaging, :func:`~zerofn.overlap.step.reduce_to_owners`.

After each bucket the state carries a :class:`StepOrder`: which buckets'
gradients to step now, whether this rank steps all of their parameters
(until DDP's buckets are final) or only the shards it owns, and, once the
plan is fixed, every rank's parameters from then on; or, with
``whole_step`` (an optimizer built with ``redundancy=2``), that every bucket
was averaged and the optimizer takes its own whole step now. Whoever runs the hook
(the adapter's ``hook_with_zero_step``, or :mod:`zerofn.testing.zero` on the
simulated world) carries out the order: it reads the averaged gradients the order
names (:func:`gradients_to_step`), steps them, and sends the owners' updates
with :func:`~zerofn.overlap.step.broadcast_from_owners`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import attrs
import torch

from zerofn.comm import Program
from zerofn.hooks.hook import BucketInfo, CommHook
from zerofn.overlap.state import (
    OverlapState,
    finish_overlap_iteration,
    observe_bucket,
    owned_params_per_rank,
)
from zerofn.overlap.step import reduce_to_owners, shards_of_bucket

__all__ = [
    "OverlapConfig",
    "OverlapHookState",
    "StepOrder",
    "gradients_to_step",
    "zero_step_hook",
]

G = TypeVar("G")
B = TypeVar("B")


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class OverlapConfig:
    """What the overlapped step knows besides its state.

    Attributes:
        sizes: element count of every parameter, in the optimizer's order.
        world_size: number of ranks.
        rank: this rank.
        shard_buckets: a bucket's parameters may be split across ranks.
        interleaved: step each bucket when the next one is handed over,
            instead of all of them after the last.
        reduce_to_owner: the inner hook is plain averaging: once the plan
            is fixed, average each shard onto its owner instead (one
            all-reduce's bytes per step, not one and a half).
        whole_step: every bucket is averaged on every rank by the inner
            hook, and after the last one the optimizer takes its whole step
            (its own partition, its carried copies, its exchange): what a
            carrier needs (``redundancy=2``), at the plain step's bytes
            (one all-reduce and one exchange). Ownership never follows the
            buckets then; not with the options above.
    """

    sizes: tuple[int, ...] = attrs.field(converter=_int_tuple)
    world_size: int
    rank: int
    shard_buckets: bool = False
    interleaved: bool = False
    reduce_to_owner: bool = False
    whole_step: bool = False

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of world_size={self.world_size} ranks")
        if self.whole_step and (self.shard_buckets or self.interleaved or self.reduce_to_owner):
            raise ValueError(
                "whole_step (the optimizer's own step after the last bucket) takes no "
                "shard_buckets, interleaved or reduce_to_owner: they divide the step by buckets"
            )


@attrs.frozen
class StepOrder:
    """What to step after a bucket call.

    Attributes:
        buckets: the buckets whose averaged gradients the step reads.
        everywhere: every rank steps every parameter of them (DDP's buckets
            are not final yet); otherwise each steps the shards it owns and
            sends them.
        reshard: set once the bucket plan was fixed this iteration: the
            parameters each rank owns from now on (keep only yours, after
            this step).
        whole: the buckets named are every bucket, averaged on every rank:
            hand their gradients to the optimizer's whole step
            (:attr:`OverlapConfig.whole_step`).
    """

    buckets: tuple[int, ...]
    everywhere: bool = False
    reshard: tuple[tuple[int, ...], ...] | None = None
    whole: bool = False


@attrs.frozen
class OverlapHookState(Generic[G]):
    """The overlap hook's global state.

    Attributes:
        overlap: the overlap record (status, buckets, plan).
        inner: the inner hook's global state.
        waiting: buckets handed over this iteration and not stepped yet.
        order: what the latest bucket call asks to step (``None``: nothing).
    """

    overlap: OverlapState
    inner: G
    waiting: tuple[int, ...] = ()
    order: StepOrder | None = None


def _order_after(
    state: OverlapHookState[G], config: OverlapConfig, bucket: BucketInfo, overlapped: bool
) -> tuple[tuple[int, ...], StepOrder | None]:
    """The buckets still waiting, and what to step, after ``bucket``."""
    waiting = (*state.waiting, bucket.index)
    if bucket.is_last:
        whole = config.whole_step
        return (), StepOrder(waiting, everywhere=not (overlapped or whole), whole=whole)
    if overlapped and config.interleaved and len(waiting) >= 2:
        return waiting[1:], StepOrder(waiting[:1])
    return waiting, None


def zero_step_hook(
    inner: CommHook[G, B], config: OverlapConfig
) -> CommHook[OverlapHookState[G], B | None]:
    """Wrap ``inner`` so the ZeRO step rides on DDP's buckets.

    The hook needs each bucket's :attr:`~zerofn.hooks.hook.BucketInfo.params`
    (global parameter indices) and :attr:`~zerofn.hooks.hook.BucketInfo.final`
    (DDP has fixed its buckets). A bucket reduced to its owners returns the
    gradient it was given, written in place: on each shard's owner that
    shard holds the average, elsewhere the elements are unspecified (the
    step does not read them there).

    Args:
        inner: the hook that averages gradients (plain, compressed, ...).
        config: sizes, ranks and the overlap's options.

    Returns:
        The hook. Its state's :attr:`OverlapHookState.order` says what to
        step after each call.
    """

    def init() -> OverlapHookState[G]:
        return OverlapHookState(OverlapState(shard_buckets=config.shard_buckets), inner.init())

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: OverlapHookState[G], b: B | None
    ) -> tuple[OverlapHookState[G], Program[tuple[torch.Tensor, B | None]]]:
        overlapped = g.overlap.status == "initialized"
        overlap = observe_bucket(g.overlap, bucket.index, bucket.params, bucket.final)
        waiting, order = _order_after(g, config, bucket, overlapped)
        if overlapped and config.reduce_to_owner:
            assert overlap.plan is not None
            reduced = reduce_to_owners(overlap.plan, bucket.index, grad, config.world_size)
            inner_state, program = g.inner, _with_state(reduced, b)
        else:
            inner_state, program = inner.start(grad, bucket, g.inner, b)  # type: ignore[assignment]
        return OverlapHookState(overlap, inner_state, waiting, order), program

    def end_iteration(g: OverlapHookState[G]) -> OverlapHookState[G]:
        overlap = finish_overlap_iteration(g.overlap, config.sizes, config.world_size)
        order = g.order
        # The plan was fixed just now (finishing a collecting iteration fixes it).
        if g.overlap.status == "collecting" and order is not None and not config.whole_step:
            owned = tuple(tuple(r) for r in owned_params_per_rank(overlap))
            order = attrs.evolve(order, reshard=owned)
        return OverlapHookState(overlap, inner.end_iteration(g.inner), g.waiting, order)

    return CommHook(
        init=init,
        start=start,
        end_iteration=end_iteration,
        name=f"the overlapped ZeRO step around {inner.name}",
    )


def _with_state(
    program: Program[torch.Tensor], bucket_state: B | None
) -> Program[tuple[torch.Tensor, B | None]]:
    """``program``'s gradient, paired with the bucket state it leaves unchanged."""
    grad = yield from program
    return grad, bucket_state


def gradients_to_step(
    state: OverlapHookState[G],
    config: OverlapConfig,
    order: StepOrder,
    bucket: int,
    params: Sequence[int],
    grads: Sequence[torch.Tensor],
) -> dict[int, torch.Tensor]:
    """The gradients of ``bucket`` this rank steps under ``order`` (given
    while the hook was in ``state``), by global parameter index: all of
    ``params``' ``grads`` when the order says ``everywhere``, else those of
    the shards this rank owns under the fixed bucket plan.

    Raises:
        ValueError: an order for owned shards before the bucket plan is fixed.
    """
    if order.everywhere:
        return dict(zip(params, grads, strict=True))
    plan = state.overlap.plan
    if plan is None:
        raise ValueError("an order to step owned shards before the bucket plan is fixed")
    return {
        params[k]: grads[k]
        for shard in shards_of_bucket(plan, bucket)
        if shard.rank == config.rank
        for k in range(shard.offset, shard.offset + shard.count)
    }
