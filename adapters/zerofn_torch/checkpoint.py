"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint``.

:func:`save_sharded` has every rank write only the state it owns, with no
gather to one rank; :func:`load_sharded` lets every rank read only what it now
owns, at any world size and under any partition mode. Keys and reassembly
come from :mod:`zerofn.sharded_checkpoint`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zerofn.partition import FlatPartition, Piece
from zerofn.sharded_checkpoint import PREFIX, cover, parse_key, piece_key
from zerofn_torch.zero import ZeroRedundancyOptimizer

__all__ = ["load_sharded", "save_sharded"]

_GROUPS = f"{PREFIX}/param_groups"
_SIZES = f"{PREFIX}/group_sizes"


def _local_pieces(optimizer: ZeroRedundancyOptimizer) -> list[list[tuple[Piece, int]]]:
    """For each local optimizer parameter: the global pieces it holds, with
    each piece's offset inside the local tensor."""
    partition = optimizer._plan.partition
    rank = optimizer.rank
    if isinstance(partition, FlatPartition):
        out = []
        for pieces in partition.group_pieces_of(rank):
            offset, located = 0, []
            for piece in pieces:
                located.append((piece, offset))
                offset += piece.numel
            out.append(located)
        return out
    return [[(piece, 0)] for piece in partition.pieces_of(rank)]


def save_sharded(optimizer: ZeroRedundancyOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Write each rank's optimizer shard to ``checkpoint_id`` (a directory).

    Collective: call on every rank of the optimizer's group. No rank gathers
    another's state.
    """
    entries: dict[str, Any] = {
        _GROUPS: [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        _SIZES: [list(g) for g in optimizer._plan.partition.group_sizes],
    }
    local = optimizer.optim.state_dict()["state"]
    for local_index, located in enumerate(_local_pieces(optimizer)):
        for name, value in local.get(local_index, {}).items():
            for piece, offset in located:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat = value.detach().reshape(-1)[offset : offset + piece.numel]
                    key = piece_key(piece.param, name, piece.start, piece.stop)
                    entries[key] = flat.clone()
                else:
                    entries[piece_key(piece.param, name, 0, 0)] = value
    dcp_save(
        entries,
        checkpoint_id=checkpoint_id,
        process_group=optimizer.process_group,
        planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )


def _check_files(checkpoint_id: str | os.PathLike[str], metadata: Any) -> None:
    for item in (metadata.storage_data or {}).values():
        path = os.path.join(os.fspath(checkpoint_id), item.relative_path)
        if not os.path.exists(path):
            raise ValueError(
                f"checkpoint {os.fspath(checkpoint_id)!r} is missing {item.relative_path!r}: "
                "a rank's shard was not saved or was removed"
            )


def load_sharded(optimizer: ZeroRedundancyOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Load this rank's part of a checkpoint written by :func:`save_sharded`,
    whatever world size or partition mode wrote it.

    Collective: call on every rank of the optimizer's group.

    Raises:
        ValueError: the checkpoint belongs to another model, or lacks a rank's
            shard. The optimizer is unchanged.
    """
    reader = FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    _check_files(checkpoint_id, metadata)
    partition = optimizer._plan.partition
    if _SIZES not in metadata.state_dict_metadata:
        raise ValueError(f"{os.fspath(checkpoint_id)!r} is not a zerofn optimizer checkpoint")
    saved = [p for k in metadata.state_dict_metadata if (p := parse_key(k)) is not None]

    plans = {}
    problem: ValueError | None = None
    try:
        for piece in partition.pieces_of(optimizer.rank):
            plans[piece] = cover(saved, piece.param, piece.start, piece.stop)
    except ValueError as e:
        problem = e
    # Agree before the collective load, so one rank's refusal is every rank's.
    failed = torch.tensor([problem is not None], dtype=torch.int32, device=optimizer.join_device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=optimizer.process_group)
    if problem is not None:
        raise problem
    if failed.item():
        raise ValueError(
            f"checkpoint {os.fspath(checkpoint_id)!r} lacks state another rank needs; "
            "a rank's shard is missing from it"
        )
    request: dict[str, Any] = {_GROUPS: None, _SIZES: None}
    for plan in plans.values():
        for copies in plan.values():
            for c in copies:
                md = metadata.state_dict_metadata[c.source.key]
                if isinstance(md, TensorStorageMetadata):
                    request[c.source.key] = torch.empty(md.size, dtype=md.properties.dtype)
                else:
                    request[c.source.key] = None
    dcp_load(
        request,
        checkpoint_id=checkpoint_id,
        process_group=optimizer.process_group,
        planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )
    if request[_SIZES] != [list(g) for g in partition.group_sizes]:
        raise ValueError(
            f"checkpoint {os.fspath(checkpoint_id)!r} was saved for parameters of sizes "
            f"{request[_SIZES]}, not this optimizer's: it belongs to another model"
        )

    # A global-format state holding just what this rank owns; elements it does
    # not own stay zero and are cut away again when the shard is taken.
    shapes = [tuple(p.shape) for p in optimizer._all_params]
    state: dict[int, dict[str, Any]] = {}
    for piece, plan in plans.items():
        entry = state.setdefault(piece.param, {})
        for name, copies in plan.items():
            if copies[0].numel == 0:
                entry[name] = request[copies[0].source.key]
                continue
            full = entry.get(name)
            if full is None:
                dtype = request[copies[0].source.key].dtype
                full = entry[name] = torch.zeros(shapes[piece.param], dtype=dtype)
            flat = full.view(-1)
            for c in copies:
                source = request[c.source.key]
                at = piece.start + c.dst_start
                flat[at : at + c.numel] = source[c.src_start : c.src_start + c.numel]
    groups, first = [], 0
    for hyper, sizes in zip(request[_GROUPS], request[_SIZES], strict=True):
        groups.append({**hyper, "params": list(range(first, first + len(sizes)))})
        first += len(sizes)
    owned_state = {index: entry for index, entry in state.items() if entry}
    optimizer.load_state_dict({"state": owned_state, "param_groups": groups})
