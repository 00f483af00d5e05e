"""What DiLoCo keeps per rank: the outer state's bytes, for the planner.

Per parameter element and rank, DiLoCo keeps the anchor (``float32``) and
the outer optimizer's state (``float32`` tensors: one for SGD with momentum,
two for Adam) only for the slices that rank owns, about ``1 / W`` of the
elements on each of ``W`` ranks: ``4 * (1 + state_tensors) / W`` bytes per
parameter, where a replicated anchor costs ``4 * (1 + state_tensors)``.
Compression adds the anchor's replica and the error-feedback residual,
``8`` bytes per parameter on every rank (see
:mod:`zerofn.diloco.compressed_sync`). A sync in flight holds one
fragment's ``float32`` values on top (``4 * N / P`` bytes), until applied.
With ``redundancy=2`` (:mod:`zerofn.diloco.redundancy`) a rank also keeps
a copy of the previous rank's slices and the last sync's sum (one
fragment's ``float32`` values): about twice the outer state, plus
``4 * N / P`` (with a ``delay``, twice that: the values a sync in flight
started from). Its syncs hand the collectives the same bytes (an all-reduce
instead of the reduces), which put 1.5 times the plain sync's on the wire.

:func:`sync_bytes_per_rank` counts what one sync hands to the collectives,
for each codec: fp32 (:func:`zerofn.diloco.sync.sync_bytes`) or compressed
(:func:`zerofn.diloco.compressed_sync.compressed_sync_bytes`).
"""

from __future__ import annotations

from zerofn.diloco.compressed_sync import compressed_sync_bytes
from zerofn.diloco.config import Compression, codec_for
from zerofn.diloco.fragments import FragmentPlan, plan_fragments
from zerofn.diloco.redundancy import carried_rank
from zerofn.diloco.redundant_compressed_sync import redundant_compressed_sync_bytes
from zerofn.diloco.sync import sync_bytes

__all__ = ["outer_state_bytes", "outer_state_bytes_per_rank", "sync_bytes_per_rank"]


def outer_state_bytes(
    plan: FragmentPlan,
    rank: int,
    compressed: bool,
    state_tensors: int = 1,
    redundancy: int = 1,
    delayed: bool = False,
) -> int:
    """The outer state's bytes on rank ``rank``.

    Args:
        plan: how the parameters are cut.
        rank: the rank, in the outer group.
        compressed: whether syncs are compressed (a replica and a residual
            of every parameter).
        state_tensors: ``float32`` state tensors the outer optimizer keeps
            per element (SGD with momentum: 1; without: 0; Adam: 2).
        redundancy: 2: the carried copy of the previous rank's slices, and
            the largest fragment's sum (the last synced one's, at most);
            compressed, its replica and residual as the last sync found them.
        delayed: with ``redundancy=2`` and a ``delay``: the values a sync
            in flight started from too (the largest fragment's).

    Raises:
        ValueError: a negative ``state_tensors``, a rank outside the plan,
            or ``redundancy`` other than 1 or 2.
    """
    if redundancy not in (1, 2):
        raise ValueError(f"redundancy is 1 or 2, got {redundancy}")
    if state_tensors < 0:
        raise ValueError(f"state_tensors must be >= 0, got {state_tensors}")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside an outer group of {plan.world_size}")
    per_element = 4 * (1 + state_tensors)
    owned = per_element * plan.owned_numel(rank)
    if redundancy == 2:
        carried = plan.owned_numel(carried_rank(rank, plan.world_size))
        # The sum, with a delay the starting values, compressed the replica and residual.
        kept = 1 + int(delayed) + 2 * int(compressed)
        owned += per_element * carried + 4 * kept * max(f.numel for f in plan.fragments)
    return owned + (8 * plan.numel if compressed else 0)


def outer_state_bytes_per_rank(
    numel: int,
    world_size: int,
    fragments: int = 1,
    compressed: bool = False,
    state_tensors: int = 1,
    redundancy: int = 1,
) -> int:
    """The outer state's bytes on the rank that keeps the most, for a model
    of ``numel`` elements on an outer group of ``world_size`` ranks.

    Raises:
        ValueError: as :func:`zerofn.diloco.fragments.plan_fragments` and
            :func:`outer_state_bytes`.
    """
    plan = plan_fragments([numel], fragments, world_size)
    return max(
        outer_state_bytes(plan, rank, compressed, state_tensors, redundancy)
        for rank in range(world_size)
    )


def sync_bytes_per_rank(
    numel: int,
    world_size: int,
    fragments: int = 1,
    compression: Compression = None,
    redundancy: int = 1,
) -> int:
    """The bytes the busiest rank hands to the collectives of one sync (the
    largest fragment's), for a model of ``numel`` elements on an outer group
    of ``world_size`` ranks, with ``compression`` as
    :class:`~zerofn.diloco.config.DiLoCoConfig` takes it, and ``redundancy``
    (2: every rank's codes reach every rank; fp32, the same bytes).

    Under ring algorithms a rank sends ``(W - 1) / W`` of it; the ratio
    between two codecs is the ratio of their bytes on the wire.

    Raises:
        ValueError, TypeError: as :func:`~zerofn.diloco.fragments.plan_fragments`
            and :func:`~zerofn.diloco.config.codec_for`.
    """
    codec = codec_for(compression)
    plan = plan_fragments([numel], fragments, world_size)
    if codec is None:
        return max(sync_bytes(f) for f in plan.fragments)
    if redundancy == 2:
        return max(redundant_compressed_sync_bytes(f, codec) for f in plan.fragments)
    return max(
        compressed_sync_bytes(f, codec, rank) for f in plan.fragments for rank in range(world_size)
    )
