"""What a user passes, in the core's terms: param groups checked before
anything is built from them, and the one way groups, their hyperparameters
and their global indices are read and written (optimizer, consolidation,
checkpoints); what the optimizer's constructor and calls refuse before
anything is built or sent, and the plan a set of param groups and a
partition (a mode, or the tensors each rank owns) make."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn.zero.planning.plan import PlanMode, ShardPlan, plan_shards

__all__ = [
    "StateDict",
    "check_added_group",
    "check_rank",
    "check_same_dense_type",
    "global_groups",
    "hyperparameters",
    "manual_indices",
    "normalize_params",
    "plan_for",
]

StateDict = dict[str, Any]
"""An optimizer state dict: ``{"state": ..., "param_groups": [...]}``."""


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's options: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def global_groups(
    counts: Sequence[int], hyper: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """State-dict param groups holding global parameter indices: group ``g``
    has ``counts[g]`` parameters, numbered on from the previous group's, and
    ``hyper[g]``'s options.

    Raises:
        ValueError: ``counts`` and ``hyper`` differ in length.
    """
    if len(counts) != len(hyper):
        raise ValueError(f"{len(counts)} group sizes but {len(hyper)} groups of options")
    groups, start = [], 0
    for count, options in zip(counts, hyper, strict=True):
        groups.append({**hyperparameters(options), "params": list(range(start, start + count))})
        start += count
    return groups


def normalize_params(params: Any) -> list[dict[str, Any]]:
    """Turn ``params`` (an iterable of tensors, or of param-group dicts) into a
    list of param groups, each with its ``params`` as a list.

    Args:
        params: what the user passed to the optimizer.

    Returns:
        New group dicts (the user's dicts are not modified).

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or mixes tensors and
            dicts, or a group holds something other than tensors.
        ValueError: ``params`` is empty, or a group has no ``'params'`` key.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params should be an iterable of Tensors or dicts, but got a single "
            f"{torch.typename(params)}; wrap it in a list"
        )
    try:
        items = list(params)
    except TypeError as e:
        raise TypeError(
            f"params should be an iterable of Tensors or dicts, but got {torch.typename(params)}"
        ) from e
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in items):
        groups = [{"params": items}]
    elif all(isinstance(p, dict) for p in items):
        groups = []
        for g, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"param group {g} has no 'params' key")
            tensors = group["params"]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            groups.append({**group, "params": tensors})
    else:
        kinds = sorted({torch.typename(p) for p in items})
        raise TypeError(
            f"params should be all Tensors or all dicts, but got a mix of {', '.join(kinds)}"
        )
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param group {g}, entry {i}: expected a Tensor, got {torch.typename(p)}"
                )
    return groups


def check_same_dense_type(tensors: list[torch.Tensor]) -> None:
    """Require one dense layout, dtype and device for all ``tensors``.

    Raises:
        ValueError: naming the first sparse tensor, or the two differing types.
    """
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ValueError(
                f"parameter {i} is {t.layout}; ZeroRedundancyOptimizer needs dense parameters"
            )
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "ZeroRedundancyOptimizer needs all parameters of one dtype and device, but "
                f"parameter 0 is {first.dtype} on {first.device} and parameter {i} is "
                f"{t.dtype} on {t.device}"
            )


def check_added_group(
    mode: PlanMode,
    overlap_with_ddp: bool,
    params: Sequence[torch.Tensor],
    param_group: Mapping[str, Any],
) -> None:
    """Refuse a param group the optimizer cannot add, before anything changes.

    Args:
        mode: the current plan's mode.
        overlap_with_ddp: whether DDP's hook steps the optimizer.
        params: the parameters it holds now.
        param_group: the group to add.

    Raises:
        RuntimeError: with ``overlap_with_ddp`` or a manual partition (one
            param group only).
        TypeError, ValueError: the group is malformed, or its tensors differ
            from ``params`` in layout, dtype or device.
    """
    if overlap_with_ddp:
        raise RuntimeError(
            "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single param group"
        )
    if mode == "manual":
        raise RuntimeError(
            "a manual partition (params_per_rank) supports a single param group; "
            "build a new optimizer with every group, using an automatic partition"
        )
    check_same_dense_type([*params, *normalize_params([param_group])[0]["params"]])


def manual_indices(
    partition: Sequence[Sequence[Any]], params: Sequence[torch.Tensor], world_size: int
) -> list[list[int]]:
    """A manual partition's tensors as global parameter indices.

    Args:
        partition: for each rank, the parameter tensors it owns.
        params: every parameter, in the optimizer's order.
        world_size: number of ranks.

    Returns:
        For each rank, the global indices of its tensors.

    Raises:
        TypeError: an entry is not a tensor (an index, say).
        ValueError: not one entry per rank, or a tensor the optimizer does
            not hold.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    if len(partition) != world_size:
        raise ValueError(
            f"params_per_rank has {len(partition)} entries; it needs one per rank "
            f"(world_size={world_size})"
        )
    manual = []
    for rank, rank_params in enumerate(partition):
        indices = []
        for p in rank_params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"partition[{rank}] holds a {type(p).__name__} ({p!r}); a manual "
                    "partition lists, for each rank, the parameter tensors it owns "
                    "(e.g. [[model.weight], [model.bias]]), not their indices"
                )
            if id(p) not in index_of:
                raise ValueError(
                    f"params_per_rank[{rank}] holds a tensor of shape {tuple(p.shape)} "
                    "that was not passed to the optimizer"
                )
            indices.append(index_of[id(p)])
        manual.append(indices)
    return manual


def plan_for(
    groups: Sequence[Mapping[str, Any]],
    world_size: int,
    partition: str | Sequence[Sequence[torch.Tensor]],
    trainable: Sequence[bool] | None = None,
) -> ShardPlan:
    """The plan for ``groups`` under ``partition`` (a mode, or the tensors per rank).

    Args:
        groups: the param groups, in the optimizer's order.
        world_size: number of ranks.
        partition: a partition mode, or each rank's parameter tensors.
        trainable: which parameters the plan must give an owner (default:
            those requiring grad now).

    Returns:
        The :class:`~zerofn.zero.planning.plan.ShardPlan`.

    Raises:
        TypeError: a manual partition lists something other than tensors.
        ValueError: an unknown mode; a bad manual partition (wrong length, a
            stranger, a parameter twice, a trainable parameter left to no rank).
    """
    params = [p for g in groups for p in g["params"]]
    group_sizes = [[p.numel() for p in g["params"]] for g in groups]
    keys = [f"{p.device}/{p.dtype}" for p in params]
    flags = tuple(p.requires_grad for p in params) if trainable is None else tuple(trainable)
    if isinstance(partition, str):
        return plan_shards(group_sizes, keys, flags, world_size, partition)  # type: ignore[arg-type]
    manual = manual_indices(partition, params, world_size)
    return plan_shards(group_sizes, keys, flags, world_size, "greedy", manual)


def check_rank(to: Any, world_size: int) -> None:
    """Refuse a ``to`` that names no rank of the group, before any collective:
    a gather to a rank that does not exist would fail inside the collective
    and look like a broken group.

    Raises:
        TypeError: ``to`` is not an int (a bool is not a rank either).
        ValueError: ``to`` is outside ``0 .. world_size - 1``.
    """
    if not isinstance(to, int) or isinstance(to, bool):
        raise TypeError(
            f"consolidate_state_dict(to=...) takes a group rank, an int in "
            f"0..{world_size - 1}; got {type(to).__name__} {to!r}"
        )
    if not 0 <= to < world_size:
        raise ValueError(
            f"consolidate_state_dict(to={to}): the group has {world_size} rank(s), "
            f"so to must be in 0..{world_size - 1}"
        )
