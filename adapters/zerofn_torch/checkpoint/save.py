"""How a sharded save writes: what each rank snapshots, and the protocol that
makes the save all or nothing (:func:`zerofn_torch.checkpoint.save_sharded`).

Every rank writes into a hidden staging directory beside the target; each
hashes what it wrote, rank 0 writes the manifest, every rank verifies the
staged checkpoint, and rank 0 swaps it in with one rename. Each step that
runs on rank 0 alone ends with a broadcast of how it went, so every rank
raises together or goes on together.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zerofn.zero.checkpoint.manifest import (
    FileRecord,
    Manifest,
    check_files,
    is_checkpoint_file,
    refusal,
)
from zerofn.zero.checkpoint.run import staging_name, to_prune, trash_name
from zerofn.zero.checkpoint.sharded import PREFIX, extra_entries, piece_key
from zerofn.zero.planning.partition import Piece
from zerofn_torch.checkpoint import files as files
from zerofn_torch.runtime.collective_errors import guarded
from zerofn_torch.runtime.object_collectives import (
    all_gather_objects,
    broadcast_object,
    gather_objects,
)
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["GROUPS", "SIZES", "Snapshot", "group_sizes", "save", "shapes", "snapshot"]

GROUPS = f"{PREFIX}/param_groups"
SIZES = f"{PREFIX}/group_sizes"
T = TypeVar("T")


def _local_pieces(optimizer: ZeroRedundancyOptimizer) -> list[list[tuple[Piece, int]]]:
    """For each tensor of the local state dict: the global pieces it holds
    (as the partition says), with each piece's offset inside the tensor."""
    out = []
    for pieces in optimizer.shard_plan.partition.local_tensors(optimizer.rank):
        offsets = itertools.accumulate((p.numel for p in pieces), initial=0)
        out.append(list(zip(pieces, offsets, strict=False)))
    return out


def shapes(optimizer: ZeroRedundancyOptimizer) -> list[tuple[int, ...]]:
    """Every parameter's shape, in global order."""
    return [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]


def group_sizes(optimizer: ZeroRedundancyOptimizer) -> list[list[int]]:
    """Every parameter's element count, per param group."""
    # The parameters' own sizes, not the partition's (a flat one counts
    # frozen parameters as empty): the manifest names the model.
    return [[p.numel() for p in g["params"]] for g in optimizer.param_groups]


def _zerofn_version() -> str:
    try:
        return importlib.metadata.version("zerofn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


# ----- what a rank saves -----------------------------------------------------------


def _optimizer_entries(optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's state as checkpoint entries: its pieces, and the groups.
    Every tensor is a copy, so training may go on while they are written."""
    entries: dict[str, Any] = {
        GROUPS: [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        SIZES: [list(g) for g in optimizer.shard_plan.partition.group_sizes],
    }
    local = optimizer.local_state_dict()["state"]
    for local_index, located in enumerate(_local_pieces(optimizer)):
        for name, value in local.get(local_index, {}).items():
            for piece, offset in located:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat = value.detach().reshape(-1)[offset : offset + piece.numel]
                    key = piece_key(piece.param, name, piece.start, piece.stop)
                    entries[key] = flat.clone()
                else:
                    scalar = value.detach().clone() if isinstance(value, torch.Tensor) else value
                    entries[piece_key(piece.param, name, 0, 0)] = scalar
    return entries


@attrs.frozen(eq=False)
class Snapshot:
    """What one rank writes, copied when the save was asked for."""

    entries: dict[str, Any]
    partition: str
    world_size: int
    shapes: list[tuple[int, ...]]
    group_sizes: list[list[int]]


def _copied(entries: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}


def snapshot(optimizer: ZeroRedundancyOptimizer, extra: Mapping[str, Any]) -> Snapshot:
    """Copies of what this rank saves, taken now (training may go on after).

    Raises:
        ValueError: a key of ``extra`` is not a plain name.
    """
    return Snapshot(
        entries={**_optimizer_entries(optimizer), **_copied(extra_entries(extra))},
        partition=optimizer.shard_plan.mode,
        world_size=optimizer.world_size,
        shapes=shapes(optimizer),
        group_sizes=group_sizes(optimizer),
    )


# ----- the save, all or nothing ----------------------------------------------------


def _decided_by_first_rank(group: Any, action: Callable[[], T], what: str) -> T:
    """Run ``action`` on rank 0 and hand its result to every rank; a failure
    raises on every rank (``ValueError`` for a refused argument, else
    ``RuntimeError``), so none goes on alone."""
    outcome: tuple[Any, str | None, bool] = (None, None, False)
    cause: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            outcome = (action(), None, False)
        except Exception as e:
            outcome, cause = (None, f"{type(e).__name__}: {e}", isinstance(e, ValueError)), e
    value, error, refused = broadcast_object(outcome, 0, group, f"save_sharded ({what})")
    if error is not None:
        kind = ValueError if refused else RuntimeError
        raise kind(f"save_sharded: {what} failed on rank 0: {error}") from cause
    return value  # type: ignore[no-any-return]


def _manifest(snapshot: Snapshot, staging: str, gathered: list[Any]) -> Manifest:
    """On rank 0: the manifest of every rank's files (or their errors)."""
    errors = [error for _, error in gathered if error is not None]
    if errors:
        raise OSError("; ".join(errors))
    records = [r for rank_records, _ in gathered for r in rank_records]
    claimed = {r.name for r in records}
    # A file no rank claimed (should DCP ever name files otherwise) is hashed
    # here, so the manifest still lists everything DCP wrote.
    for name in sorted(os.listdir(staging)):
        if is_checkpoint_file(name) and name not in claimed:
            records.append(files.record(staging, name))
    return Manifest(
        zerofn_version=_zerofn_version(),
        partition=snapshot.partition,
        world_size=snapshot.world_size,
        shapes=snapshot.shapes,
        group_sizes=snapshot.group_sizes,
        files=records,
        saved_at=time.time(),
    )


def _staged_problems(staging: str, mine: list[FileRecord]) -> list[str]:
    """What this rank finds wrong with the staged checkpoint: the manifest
    must parse, list every file present at its size, and hold this rank's
    files with the hashes it read back from disk."""
    manifest, problem = files.read_manifest(staging)
    if manifest is None:
        return [problem or "no manifest"]
    sizes = {e.name: e.stat().st_size for e in os.scandir(staging) if e.is_file()}
    hashes = {r.name: r.sha256 for r in mine}
    hashes[files.METADATA] = files.sha256(os.path.join(staging, files.METADATA))
    return check_files(manifest, sizes, hashes)


def _verify_staged(group: Any, staging: str, mine: list[FileRecord]) -> None:
    try:
        problems = _staged_problems(staging, mine)
    except OSError as e:
        problems = [f"it could not be checked: {e}"]
    everyone = all_gather_objects(problems, group, "save_sharded (verifying the new checkpoint)")
    message = refusal(everyone)
    if message is None:
        return
    if dist.get_rank(group) == 0:
        files.discard(staging)
    raise RuntimeError(f"save_sharded: the new checkpoint failed verification: {message}")


def _commit(staging: str, target: str, token: str, keep_last: int | None) -> None:
    """On rank 0: swap the staged checkpoint in, then drop the run's oldest."""
    run, name = os.path.split(target)
    files.commit(staging, target, os.path.join(run, trash_name(name, token)))
    if keep_last is None:
        return
    dropped = to_prune(files.run_checkpoints(run), keep_last, current=name)
    files.prune(run, dropped, {n: trash_name(n, token) for n in dropped})


def _prepare(target: str, keep_last: int | None) -> tuple[str, str]:
    """On rank 0: a fresh staging directory beside ``target`` and the save's token."""
    token = secrets.token_hex(8)
    run, name = os.path.split(target)
    staging = os.path.join(run, staging_name(name, token))
    files.prepare_staging(target, staging, whole_run=keep_last is not None)
    return staging, token


def save(snapshot: Snapshot, target: str, group: Any, keep_last: int | None) -> None:
    """The whole save on ``group``: stage, write, hash, manifest, verify, commit.

    The previous checkpoint at ``target`` is untouched until the commit, a
    single rename; a save that fails or is cut short at any earlier point
    leaves only a staging directory, which the next save removes.
    """
    staging, token = _decided_by_first_rank(
        group, lambda: _prepare(target, keep_last), "preparing a staging directory"
    )
    rank = dist.get_rank(group)
    with guarded("torch.distributed.checkpoint.save", f"save_sharded to {target!r}", group):
        dcp_save(
            snapshot.entries,
            checkpoint_id=staging,
            process_group=group,
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
    mine: tuple[list[FileRecord], str | None]
    try:
        mine = (files.own_files(staging, rank), None)
    except OSError as e:
        mine = ([], f"rank {rank} could not hash its files: {e}")
    gathered = gather_objects(mine, 0, group, "save_sharded (hashes for the manifest)")
    _decided_by_first_rank(
        group,
        lambda: files.write_manifest(staging, _manifest(snapshot, staging, gathered or [])),
        "writing the manifest",
    )
    _verify_staged(group, staging, mine[0])
    _decided_by_first_rank(
        group, lambda: _commit(staging, target, token, keep_last), "committing the checkpoint"
    )
