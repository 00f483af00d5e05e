"""A ZeRO rank's optimizer state as dicts: this rank's shard as checkpoints
keep it, every rank's shard joined into ``torch.optim``'s format, and a full
state dict cut back to this rank's shard and loaded. The joining and cutting
are :mod:`zerofn.zero.shard_state`'s; moving the shards between ranks is the
adapter's (``zerofn_torch.zero.state_dicts``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn.zero.elastic.piece_state import load_states, whole_pieces
from zerofn.zero.mixed_precision.masters import with_masters, without_masters
from zerofn.zero.params import StateDict, global_groups
from zerofn.zero.planning.partition import Piece
from zerofn.zero.rank import ZeroRank, copy_hyperparameters, flat_params
from zerofn.zero.shard_state import consolidate, shard

__all__ = [
    "cpu_copy",
    "full_state_dict",
    "held_pieces",
    "joined_state",
    "load_global_state",
    "local_state_cpu",
    "local_state_dict",
    "regroup",
    "state_before_any_step",
]


def cpu_copy(value: Any) -> Any:
    """A snapshot of ``value`` with every tensor copied to the CPU, so that
    later steps cannot change it through shared storage."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cpu_copy(v) for v in value)
    return value


def held_pieces(rank: ZeroRank) -> tuple[Piece, ...]:
    """The parameter elements whose optimizer state ``rank`` holds: those it
    owns, then (``redundancy=2``) those of the shard it carries. A load
    restores all of them."""
    carried = rank.carried.pieces if rank.carried is not None else ()
    return rank.plan.partition.pieces_of(rank.options.rank) + carried


def local_state_dict(rank: ZeroRank) -> StateDict:
    """The local optimizer's state dict, one tensor per group under a flat
    partition (chunks merged), masters as ``"master_param"``; tensors are
    the live ones."""
    sd: StateDict = rank.optim.state_dict()
    if rank.masters is not None:
        sd = with_masters(sd, rank.masters)
    return rank.shards.saved_state(sd)


def local_state_cpu(rank: ZeroRank, groups: Sequence[dict[str, Any]]) -> StateDict:
    """:func:`local_state_dict` with the live groups' options, copied to the
    CPU: what this rank sends when the shards are joined."""
    copy_hyperparameters(groups, rank.optim.param_groups)
    sd: StateDict = cpu_copy(local_state_dict(rank))
    return sd


def joined_state(
    rank: ZeroRank, groups: Sequence[Mapping[str, Any]], gathered: Sequence[StateDict]
) -> StateDict:
    """Every rank's :func:`local_state_cpu` (in rank order) joined into the
    global state, global parameter indices."""
    shapes = [tuple(p.shape) for p in flat_params(groups)]
    return consolidate(rank.plan.partition, gathered, shapes)


def full_state_dict(
    consolidated: StateDict | None, groups: Sequence[Mapping[str, Any]], rank: int
) -> StateDict:
    """The consolidated state in ``torch.optim``'s format, with the live
    groups' options (its groups numbered as :func:`state_before_any_step`'s,
    as consolidation numbers them).

    Raises:
        RuntimeError: nothing was consolidated on this rank.
    """
    if consolidated is None:
        raise RuntimeError(
            "Optimizer state has not been consolidated on this rank. Call "
            f"consolidate_state_dict(to={rank}) on all ranks first."
        )
    return {**state_before_any_step(groups), "state": dict(consolidated["state"])}


def state_before_any_step(groups: Sequence[Mapping[str, Any]]) -> StateDict:
    """The full state of a ZeRO optimizer that no step and no load has
    touched, in ``torch.optim``'s format: no per-parameter state (masters,
    where there are any, are the parameters' values, which a load re-derives),
    and the live groups' options. Every rank knows it without a collective."""
    counts = [len(group["params"]) for group in groups]
    return {"state": {}, "param_groups": global_groups(counts, groups)}


def load_global_state(
    rank: ZeroRank, groups: Sequence[dict[str, Any]], state_dict: StateDict
) -> None:
    """Load this rank's shard of a full (checked) state dict into the local
    optimizer and the masters (and the carried copy's, with
    ``redundancy=2``), and its groups' options into ``groups``;
    ``state_dict`` is not modified (its tensors are copied)."""
    optim = rank.optim
    local = cpu_copy(shard(rank.plan.partition, state_dict, rank.options.rank))
    local = rank.shards.loaded_state(local, optim.param_groups)
    local, masters = without_masters(local)
    optim.load_state_dict(local)
    _load_masters(rank, groups, masters)
    if (carried := rank.carried) is not None:  # the carried copy is the owner's state again
        sizes = [p.numel() for p in flat_params(groups)]
        known = whole_pieces(state_dict["state"], sizes)
        load_states(carried.optim, carried.pieces, known, carried.masters)
    copy_hyperparameters(state_dict["param_groups"], groups)
    copy_hyperparameters(groups, optim.param_groups)


def _load_masters(
    rank: ZeroRank, groups: Sequence[Mapping[str, Any]], saved: dict[int, torch.Tensor]
) -> None:
    """Set the masters from ``saved`` (local index -> master); a master
    not saved (a state dict from PyTorch, or without masters) is copied
    up from its parameter."""
    if rank.masters is None:
        return
    rank.shards.refresh(flat_params(groups))
    rank.masters.load(saved)


def regroup(groups: Sequence[Mapping[str, Any]], state: StateDict) -> StateDict:
    """Give ``state``'s groups the current global indices (groups only grew)."""
    counts = [len(live["params"]) for live in groups]
    return {**state, "param_groups": global_groups(counts, state["param_groups"])}
