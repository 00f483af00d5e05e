"""A ZeRO rank re-planned: grown by a param group (greedy keeps every owner
and grows the local optimizer in place; other modes re-partition and move the
old state to its new owners), or sharded by the owners DDP's buckets fixed
(every rank held every parameter's state until then)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from zerofn.zero.elastic.carried import CarriedShard, carried_shard
from zerofn.zero.elastic.piece_state import load_states
from zerofn.zero.elastic.regroup import carried_states
from zerofn.zero.params import StateDict, hyperparameters, plan_for
from zerofn.zero.planning.plan import ShardPlan
from zerofn.zero.rank import (
    ZeroRank,
    copy_hyperparameters,
    extend_local_optimizer,
    flat_params,
    rank_for_plan,
)
from zerofn.zero.rank_state import load_global_state, local_state_dict, regroup

__all__ = ["sharded_by_owners", "with_added_group"]


def with_added_group(
    rank: ZeroRank, groups: list[dict[str, Any]], old_state: StateDict | None
) -> ZeroRank:
    """The rank once ``groups`` got a new last group.

    Args:
        rank: the rank before the group was added.
        groups: the param groups, the new one last (its missing options are
            filled in from the local optimizer's defaults).
        old_state: the global state gathered before the group was added, to
            move to the new owners; ``None`` with the greedy partition, which
            keeps every owner (the local optimizer is then grown in place,
            and a carried copy keeps its state beside its new parameters).

    Returns:
        The new rank; ``groups`` get the local optimizer's options back.
    """
    for name, default in rank.optim.defaults.items():
        groups[-1].setdefault(name, default)
    plan = plan_for(groups, rank.options.world_size, rank.plan.mode)
    if old_state is None:
        if rank.carried is not None:
            rank = attrs.evolve(rank, carried=_grown_carried(rank, groups, plan))
        rank = rank_for_plan(groups, rank.options, plan, rank.overlap, rebuilt=True, kept=rank)
        rank = extend_local_optimizer(rank, groups)
    else:
        rank = rank_for_plan(groups, rank.options, plan, rank.overlap, rebuilt=True)
        old_state["param_groups"].append({**hyperparameters(groups[-1]), "params": []})
        load_global_state(rank, groups, regroup(groups, old_state))
    copy_hyperparameters(rank.optim.param_groups, groups)
    return rank


def _grown_carried(rank: ZeroRank, groups: list[dict[str, Any]], plan: ShardPlan) -> CarriedShard:
    """The carried copy (``redundancy=2``) once the greedy plan grew by a
    group: the same owner's shard, its new parameters added fresh (no state
    yet, masters from their values), its old ones' state and masters kept."""
    options = rank.options
    carried = carried_shard(
        plan, options.rank, groups, options.optimizer_class, options.defaults,
        options.master_dtype,
    )  # fmt: skip
    load_states(carried.optim, carried.pieces, carried_states(rank), carried.masters)
    return carried


def sharded_by_owners(
    rank: ZeroRank, groups: list[dict[str, Any]], owned: Sequence[Sequence[int]]
) -> ZeroRank:
    """Keep only this rank's parameters and their state from now on (every
    rank held all of it until DDP's bucket plan was fixed).

    Args:
        rank: a rank holding every parameter's state (``"attached"``).
        groups: the param groups.
        owned: global parameter indices each rank owns.

    Returns:
        The ``"sharded"`` rank, its local optimizer over this rank's share.
    """
    full_state = local_state_dict(rank)  # global indices: it held every parameter
    params = flat_params(groups)
    # DDP's buckets hold what required grad when DDP was built; only those
    # are stepped in this mode, so only those need an owner.
    synced = {i for ranks in owned for i in ranks}
    trainable = tuple(i in synced for i in range(len(params)))
    partition = [[params[i] for i in ranks] for ranks in owned]
    plan = plan_for(groups, rank.options.world_size, partition, trainable)
    sharded = rank_for_plan(groups, rank.options, plan, "sharded", rebuilt=False)
    load_global_state(sharded, groups, full_state)
    return sharded
