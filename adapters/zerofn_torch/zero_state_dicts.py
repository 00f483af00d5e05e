"""A ZeRO optimizer's state dicts: this rank's shard as checkpoints keep it,
every rank's joined into ``torch.optim``'s format (on one rank or all), and a
full state dict cut back to this rank's shard. The joining and cutting are
:mod:`zerofn.zero.shard_state`'s; this module moves the shards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerofn.zero.masters import with_masters, without_masters
from zerofn.zero.params import StateDict, global_groups, hyperparameters
from zerofn.zero.shard_state import consolidate, shard
from zerofn_torch.object_collectives import all_gather_objects, gather_objects
from zerofn_torch.zero_local import sync_hyperparameters
from zerofn_torch.zero_setup import ZeroSetup, flat_params

__all__ = [
    "consolidate_on",
    "cpu_copy",
    "full_state_dict",
    "gather_global_state",
    "load_global_state",
    "local_state_dict",
    "regroup",
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


def local_state_dict(setup: ZeroSetup, optim: Optimizer) -> StateDict:
    """The local optimizer's state dict, one tensor per group under a flat
    partition (chunks merged), masters as ``"master_param"``; tensors are
    the live ones."""
    sd: StateDict = optim.state_dict()
    if setup.masters is not None:
        sd = with_masters(sd, setup.masters)
    return setup.shards.saved_state(sd)


def _local_state_cpu(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]], optim: Optimizer
) -> StateDict:
    sync_hyperparameters(groups, optim.param_groups)
    sd: StateDict = cpu_copy(local_state_dict(setup, optim))
    return sd


def _shapes(groups: Sequence[Mapping[str, Any]]) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in flat_params(groups)]


def gather_global_state(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]], optim: Optimizer, group: Any
) -> StateDict:
    """Every rank's shard, joined into the global state on every rank
    (collective).

    Raises:
        zerofn.errors.CollectiveError: the all-gather failed.
    """
    purpose = "gathering every rank's optimizer shard"
    gathered = all_gather_objects(_local_state_cpu(setup, groups, optim), group, purpose)
    return consolidate(setup.plan.partition, gathered, _shapes(groups))


def consolidate_on(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]], optim: Optimizer, group: Any, to: int
) -> StateDict | None:
    """Every rank's shard, joined into the global state on rank ``to``
    (collective; only the local shards travel, to one rank).

    Returns:
        The global state on rank ``to``, ``None`` elsewhere.

    Raises:
        zerofn.errors.CollectiveError: the gather failed.
    """
    purpose = f"consolidating the optimizer state on rank {to}"
    gathered = gather_objects(_local_state_cpu(setup, groups, optim), to, group, purpose)
    if gathered is None:
        return None
    return consolidate(setup.plan.partition, gathered, _shapes(groups))


def full_state_dict(
    consolidated: StateDict | None, groups: Sequence[Mapping[str, Any]], rank: int
) -> StateDict:
    """The consolidated state in ``torch.optim``'s format, with the live
    groups' options.

    Raises:
        RuntimeError: nothing was consolidated on this rank.
    """
    if consolidated is None:
        raise RuntimeError(
            "Optimizer state has not been consolidated on this rank. Call "
            f"consolidate_state_dict(to={rank}) on all ranks first."
        )
    return {
        "state": dict(consolidated["state"]),
        "param_groups": [
            {**hyperparameters(live), "params": list(saved["params"])}
            for live, saved in zip(groups, consolidated["param_groups"], strict=True)
        ],
    }


def load_global_state(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]], optim: Optimizer, state_dict: StateDict
) -> None:
    """Load this rank's shard of a full (checked) state dict into ``optim``
    and the masters, and its groups' options into ``groups``; ``state_dict``
    is not modified (its tensors are copied)."""
    local = cpu_copy(shard(setup.plan.partition, state_dict, setup.options.rank))
    local = setup.shards.loaded_state(local, optim.param_groups)
    local, masters = without_masters(local)
    optim.load_state_dict(local)
    _load_masters(setup, groups, masters)
    for live, saved in zip(groups, state_dict["param_groups"], strict=True):
        live.update(hyperparameters(saved))
    sync_hyperparameters(groups, optim.param_groups)


def _load_masters(
    setup: ZeroSetup, groups: Sequence[Mapping[str, Any]], saved: dict[int, torch.Tensor]
) -> None:
    """Set the masters from ``saved`` (local index -> master); a master
    not saved (a state dict from PyTorch, or without masters) is copied
    up from its parameter."""
    if setup.masters is None:
        return
    setup.shards.refresh(flat_params(groups))
    missing = [i for i in range(len(setup.masters.master)) if i not in saved]
    setup.masters.reseed(missing)
    with torch.no_grad():
        for index, master in saved.items():
            setup.masters.master[index].copy_(master)


def regroup(groups: Sequence[Mapping[str, Any]], state: StateDict) -> StateDict:
    """Give ``state``'s groups the current global indices (groups only grew)."""
    counts = [len(live["params"]) for live in groups]
    return {**state, "param_groups": global_groups(counts, state["param_groups"])}
