"""Optimizer state across ranks: consolidate shards, and cut a global state into shards.

Two formats meet here, both PyTorch's ``Optimizer.state_dict()`` format
(``{"state": {index: {name: value}}, "param_groups": [{..., "params": [...]}]}``):

* a *local* state dict, of one rank's local optimizer, indexed by the rank's
  local order (see :meth:`Partition.params_of`);
* the *global* state dict, indexed by global parameter index, loadable into a
  plain ``torch.optim`` optimizer over all parameters.

:func:`consolidate` goes local -> global and :func:`shard` global -> local for
any ``(rank, world_size)``, so a checkpoint taken at one world size reshards to
another by ``shard(consolidate(...), new_partition, rank)``. No function here
communicates or mutates its inputs; tensors are shared, not copied, except
where flat shards are cut or joined.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn.zero.params import StateDict, global_groups
from zerofn.zero.planning.partition import FlatPartition, Partition, Piece

__all__ = ["StateDict", "consolidate", "is_elementwise", "shard", "validate_global"]


def _check_local_count(partition: Partition | FlatPartition, local: Sequence[StateDict]) -> None:
    if len(local) != partition.world_size:
        raise ValueError(
            f"got {len(local)} shard state dicts for world_size={partition.world_size}; "
            "every rank's shard is needed"
        )
    for rank, sd in enumerate(local):
        if "state" not in sd or "param_groups" not in sd:
            raise ValueError(f"shard state dict of rank {rank} lacks 'state' or 'param_groups'")
        if len(sd["param_groups"]) != len(partition.group_sizes):
            raise ValueError(
                f"shard state dict of rank {rank} has {len(sd['param_groups'])} param groups, "
                f"the partition has {len(partition.group_sizes)}"
            )


def validate_global(partition: Partition | FlatPartition, state_dict: Mapping[str, Any]) -> None:
    """Check that ``state_dict`` is a global state dict of the partitioned model.

    Raises:
        ValueError: naming the first mismatch (missing keys, param group count,
            parameters per group, or a state index with no parameter).
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("an optimizer state dict needs the keys 'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    if len(groups) != len(partition.group_sizes):
        raise ValueError(
            f"state dict has {len(groups)} param groups but the optimizer has "
            f"{len(partition.group_sizes)}: it belongs to another model or optimizer"
        )
    for g, (group, sizes) in enumerate(zip(groups, partition.group_sizes, strict=True)):
        if len(group["params"]) != len(sizes):
            raise ValueError(
                f"param group {g} of the state dict has {len(group['params'])} parameters "
                f"but the optimizer's has {len(sizes)}: it belongs to another model"
            )
    num_params = len(partition.sizes)
    for index in state_dict["state"]:
        if not isinstance(index, int) or not 0 <= index < num_params:
            raise ValueError(
                f"state dict holds state for parameter {index!r}, but the optimizer has "
                f"parameters 0..{num_params - 1}"
            )
    sizes = partition.sizes
    for index, entry in state_dict["state"].items():
        for name, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.numel() != sizes[index]
            ):
                raise ValueError(
                    f"state {name!r} of parameter {index} has {value.numel()} elements, "
                    f"the parameter has {sizes[index]}: it belongs to another model"
                )


def consolidate(
    partition: Partition | FlatPartition,
    local_state_dicts: Sequence[StateDict],
    shapes: Sequence[Sequence[int]] | None = None,
) -> StateDict:
    """Join every rank's local state dict into one global state dict.

    Args:
        partition: the partition the shards were made under.
        local_state_dicts: rank ``r``'s local optimizer ``state_dict()`` at
            index ``r``. Hyperparameters are taken from rank 0's groups.
        shapes: each global parameter's shape; used by a flat partition to
            give joined state its parameter's shape (flat 1-D when omitted).

    Returns:
        The global state dict, state sorted by parameter index.

    Raises:
        ValueError: if a rank's shard is missing or does not fit the partition.
    """
    _check_local_count(partition, local_state_dicts)
    counts = [len(group) for group in partition.group_sizes]
    groups = global_groups(counts, local_state_dicts[0]["param_groups"])
    if isinstance(partition, FlatPartition):
        state = _consolidate_flat(partition, local_state_dicts, shapes)
    else:
        state = {}
        for rank, sd in enumerate(local_state_dicts):
            owned = partition.params_of(rank)
            listed = sum(len(group["params"]) for group in sd["param_groups"])
            if listed != len(owned):
                raise ValueError(
                    f"shard state dict of rank {rank} lists {listed} parameters, "
                    f"the partition gives that rank {len(owned)}"
                )
            for local_index, entry in sd["state"].items():
                state[owned[local_index]] = entry
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def shard(partition: Partition | FlatPartition, state_dict: StateDict, rank: int) -> StateDict:
    """Cut the global ``state_dict`` down to ``rank``'s local state dict.

    Args:
        partition: the partition to shard for (any world size).
        state_dict: a global state dict (PyTorch's optimizer format).
        rank: the rank whose shard to return.

    Returns:
        The local state dict for ``rank``'s optimizer. Under a flat partition
        a rank's group is one tensor, so it can carry one value of each scalar
        state (the step count, say): that of the group's first parameter.

    Raises:
        ValueError: if ``state_dict`` does not fit the partitioned model.
    """
    validate_global(partition, state_dict)
    if not 0 <= rank < partition.world_size:
        raise ValueError(f"rank {rank} is outside world_size={partition.world_size}")
    if isinstance(partition, FlatPartition):
        return _shard_flat(partition, state_dict, rank)
    owned, known = partition.params_of(rank), state_dict["state"]
    counts = [len(indices) for indices in partition.assignment[rank]]
    return {
        "state": {local: known[i] for local, i in enumerate(owned) if i in known},
        "param_groups": global_groups(counts, state_dict["param_groups"]),
    }


# Per-parameter scalars that torch.optim's element-wise optimizers keep as 0-dim
# tensors. Any other 0-dim state of a one-element parameter (a 0-dim parameter's
# ``exp_avg``, say) is that parameter's element, not a scalar.
_SCALAR_STATE_NAMES = frozenset({"step", "mu_product", "eta", "mu"})


def is_elementwise(value: Any, name: str = "", param_numel: int = -1) -> bool:
    """Whether ``value`` (state entry ``name`` of a parameter of
    ``param_numel`` elements) holds one value per element, rather than one
    per parameter (a step count)."""
    return isinstance(value, torch.Tensor) and (
        value.dim() > 0 or (param_numel == 1 and name not in _SCALAR_STATE_NAMES)
    )


def _consolidate_flat(
    partition: FlatPartition,
    local_state_dicts: Sequence[StateDict],
    shapes: Sequence[Sequence[int]] | None,
) -> dict[int, dict[str, Any]]:
    # Collect, per global parameter, (piece, rank's flat state, offset in it).
    found: dict[int, list[tuple[Piece, Mapping[str, Any], int]]] = {}
    for rank, sd in enumerate(local_state_dicts):
        for g, pieces in enumerate(partition.local_tensors(rank)):
            entry = sd["state"].get(g)
            offset = 0
            for piece in pieces:
                if entry is not None:
                    found.setdefault(piece.param, []).append((piece, entry, offset))
                offset += piece.numel
    state: dict[int, dict[str, Any]] = {}
    for index, parts in found.items():
        parts.sort(key=lambda part: part[0].start)
        covered = sum(piece.numel for piece, _, _ in parts)
        if covered != partition.sizes[index]:
            raise ValueError(
                f"parameter {index}: only {covered} of {partition.sizes[index]} elements "
                "have state; a rank's shard is missing"
            )
        first = parts[0][1]
        joined_entry: dict[str, Any] = {}
        for name, value in first.items():
            if not is_elementwise(value):
                # Each parameter gets its own copy: an optimizer loading this
                # state must not find one step counter shared by many params.
                joined_entry[name] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            joined = torch.cat([e[name].reshape(-1)[o : o + p.numel] for p, e, o in parts])
            joined_entry[name] = (
                joined.reshape(tuple(shapes[index])) if shapes is not None else joined
            )
        state[index] = joined_entry
    return state


def _shard_flat(
    partition: FlatPartition,
    state_dict: StateDict,
    rank: int,
) -> StateDict:
    state: dict[int, Any] = {}
    global_state = state_dict["state"]
    for g, pieces in enumerate(partition.local_tensors(rank)):
        with_state = [p for p in pieces if p.param in global_state]
        if not with_state:
            continue
        if len(with_state) != len(pieces):
            missing = next(p.param for p in pieces if p.param not in global_state)
            raise ValueError(
                f"parameter {missing} has no state while others in its param group do; "
                "a flat shard needs state for all or none of them"
            )
        first = global_state[pieces[0].param]
        entry: dict[str, Any] = {}
        for name, value in first.items():
            if not is_elementwise(value, name, partition.sizes[pieces[0].param]):
                entry[name] = value
                continue
            entry[name] = torch.cat(
                [global_state[p.param][name].reshape(-1)[p.start : p.stop] for p in pieces]
            )
        state[g] = entry
    # Each group's one tensor is its local index.
    groups = global_groups([1] * len(partition.group_sizes), state_dict["param_groups"])
    return {"state": state, "param_groups": groups}
