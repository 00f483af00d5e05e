"""Overlapping the ZeRO step with DDP's backward: the bookkeeping, as data.

DDP decides its gradient buckets during the first iterations and then
freezes them ("rebuilt buckets"). The overlap needs them: each bucket (or a
run of parameters inside it, with ``shard_buckets``) is owned by one rank,
which steps those parameters as soon as the bucket's gradients are reduced.
Until the buckets are final, every rank steps all parameters itself (the
same numbers, no overlap), so no iteration goes without an update.

:class:`OverlapState` moves through three statuses:

* ``"uninitialized"``: DDP's buckets may still change;
* ``"collecting"``: DDP has rebuilt its buckets; this iteration records
  which parameters each bucket holds;
* ``"initialized"``: the bucket plan is fixed; steps overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from zerofn.overlap.ddp_buckets import BucketPlan, BucketShard, assign_buckets

__all__ = [
    "OverlapState",
    "OverlapStatus",
    "finish_overlap_iteration",
    "observe_bucket",
    "owned_params_per_rank",
    "shard_element_range",
]

OverlapStatus = Literal["uninitialized", "collecting", "initialized"]


@attrs.frozen
class OverlapState:
    """Where the overlap stands.

    Attributes:
        status: see the module docstring.
        shard_buckets: whether a bucket may be split across ranks.
        buckets: global parameter indices of each DDP bucket, in bucket order
            (filled while collecting).
        plan: the bucket-to-rank assignment, once initialized.

    Raises:
        ValueError: at construction, for a record no transition makes: a
            plan without ``"initialized"`` (or that status without one), or
            buckets while still ``"uninitialized"``.
    """

    status: OverlapStatus = attrs.field(
        default="uninitialized",
        validator=attrs.validators.in_(("uninitialized", "collecting", "initialized")),
    )
    shard_buckets: bool = False
    buckets: tuple[tuple[int, ...], ...] = ()
    plan: BucketPlan | None = None

    def __attrs_post_init__(self) -> None:
        if (self.status == "initialized") != (self.plan is not None):
            raise ValueError(
                f"an overlap state is 'initialized' exactly when it has a plan; got status "
                f"{self.status!r} with{'out' if self.plan is None else ''} a plan"
            )
        if self.status == "uninitialized" and self.buckets:
            raise ValueError("an 'uninitialized' overlap state has collected no buckets")


def observe_bucket(
    state: OverlapState, index: int, params: Sequence[int], ddp_rebuilt: bool
) -> OverlapState:
    """Note that DDP handed over bucket ``index`` holding ``params``.

    Args:
        state: the current state.
        index: the bucket's index.
        params: global indices of the bucket's parameters, in bucket order.
        ddp_rebuilt: whether DDP has finalized its buckets.

    Returns:
        The new state (collecting starts at bucket 0 of the first iteration
        after DDP rebuilt its buckets).

    Raises:
        ValueError: if buckets arrive out of order while collecting.
    """
    if state.status == "initialized" or not ddp_rebuilt:
        return state
    if state.status == "uninitialized":
        if index != 0:
            return state  # the rebuild happened mid-iteration: start at the next one
        return attrs.evolve(state, status="collecting", buckets=(tuple(params),))
    if index != len(state.buckets):
        raise ValueError(
            f"DDP bucket {index} arrived after {len(state.buckets)} buckets; buckets must "
            "arrive in index order"
        )
    return attrs.evolve(state, buckets=(*state.buckets, tuple(params)))


def finish_overlap_iteration(
    state: OverlapState, sizes: Sequence[int], world_size: int
) -> OverlapState:
    """After an iteration's last bucket: fix the plan if buckets were collected.

    Args:
        state: the current state.
        sizes: element count of every global parameter.
        world_size: number of ranks.

    Returns:
        ``"initialized"`` with a plan after a collecting iteration; else unchanged.
    """
    if state.status != "collecting":
        return state
    bucket_sizes = [[sizes[i] for i in bucket] for bucket in state.buckets]
    plan = assign_buckets(bucket_sizes, world_size, state.shard_buckets)
    return attrs.evolve(state, status="initialized", plan=plan)


def owned_params_per_rank(state: OverlapState) -> list[list[int]]:
    """Global indices each rank updates, its shards in assignment order.

    Raises:
        ValueError: before the plan is fixed.
    """
    if state.plan is None:
        raise ValueError("the overlap plan is not fixed yet")
    owned: list[list[int]] = [[] for _ in range(state.plan.world_size)]
    for shard in state.plan.shards:
        bucket = state.buckets[shard.bucket]
        owned[shard.rank].extend(bucket[shard.offset : shard.offset + shard.count])
    return owned


def shard_element_range(plan: BucketPlan, shard: BucketShard) -> tuple[int, int]:
    """``[start, stop)`` of the shard's gradients inside its bucket's flat buffer."""
    sizes = plan.bucket_sizes[shard.bucket]
    start = sum(sizes[: shard.offset])
    return start, start + shard.numel
