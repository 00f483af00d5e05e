"""Moving a ZeRO optimizer's shards between ranks to join them into the
global state (on one rank or on all). What each rank sends and how the
shards are joined are :mod:`zerofn.zero.rank_state`'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerofn.zero.params import StateDict
from zerofn.zero.rank import ZeroRank
from zerofn.zero.rank_state import joined_state, local_state_cpu
from zerofn_torch.runtime.object_collectives import all_gather_objects, gather_objects

__all__ = ["consolidate_on", "gather_global_state"]


def gather_global_state(rank: ZeroRank, groups: Sequence[dict[str, Any]], group: Any) -> StateDict:
    """Every rank's shard, joined into the global state on every rank
    (collective).

    Raises:
        zerofn.errors.CollectiveError: the all-gather failed.
    """
    purpose = "gathering every rank's optimizer shard"
    gathered = all_gather_objects(local_state_cpu(rank, groups), group, purpose)
    return joined_state(rank, groups, gathered)


def consolidate_on(
    rank: ZeroRank, groups: Sequence[dict[str, Any]], group: Any, to: int
) -> StateDict | None:
    """Every rank's shard, joined into the global state on rank ``to``
    (collective; only the local shards travel, to one rank).

    Returns:
        The global state on rank ``to``, ``None`` elsewhere.

    Raises:
        zerofn.errors.CollectiveError: the gather failed.
    """
    purpose = f"consolidating the optimizer state on rank {to}"
    gathered = gather_objects(local_state_cpu(rank, groups), to, group, purpose)
    if gathered is None:
        return None
    return joined_state(rank, groups, gathered)
