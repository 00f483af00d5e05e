"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint``.

:func:`save_sharded` has every rank write only the state it owns, with no
gather to one rank; :func:`load_sharded` lets every rank read only what it now
owns, at any world size and under any partition mode. Keys and reassembly
come from :mod:`zerofn.zero.sharded_checkpoint`.

Every save ends with a manifest (:mod:`zerofn.zero.checkpoint_manifest`) holding
the size and SHA-256 of each file written; every load checks the directory
against it, on every rank and before anything is unpickled or changed, and
all ranks refuse together with :class:`zerofn.errors.CheckpointError`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zerofn.errors import CheckpointError
from zerofn.zero.checkpoint_manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    check_files,
    check_model,
    is_checkpoint_file,
    refusal,
)
from zerofn.zero.partition import Piece
from zerofn.zero.sharded_checkpoint import PREFIX, Copy, cover, parse_key, piece_key
from zerofn_torch.comm import all_gather_objects, broadcast_object, gather_objects, guarded
from zerofn_torch.zero import ZeroRedundancyOptimizer

__all__ = ["load_sharded", "save_sharded"]

_GROUPS = f"{PREFIX}/param_groups"
_SIZES = f"{PREFIX}/group_sizes"
_METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file
_BLOCK = 1 << 20

_Plans = dict[Piece, dict[str, list[Copy]]]


def _local_pieces(optimizer: ZeroRedundancyOptimizer) -> list[list[tuple[Piece, int]]]:
    """For each tensor of the local state dict: the global pieces it holds
    (as the partition says), with each piece's offset inside the tensor."""
    out = []
    for pieces in optimizer._plan.partition.local_tensors(optimizer.rank):
        offsets = itertools.accumulate((p.numel for p in pieces), initial=0)
        out.append(list(zip(pieces, offsets, strict=False)))
    return out


def _shapes(optimizer: ZeroRedundancyOptimizer) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in optimizer._all_params]


def _group_sizes(optimizer: ZeroRedundancyOptimizer) -> list[list[int]]:
    # The parameters' own sizes, not the partition's (a flat one counts
    # frozen parameters as empty): the manifest names the model.
    return [[p.numel() for p in g["params"]] for g in optimizer.param_groups]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _zerofn_version() -> str:
    try:
        return importlib.metadata.version("zerofn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


# ----- saving ----------------------------------------------------------------------


def _entries(optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's state as checkpoint entries: its pieces, and the groups."""
    entries: dict[str, Any] = {
        _GROUPS: [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        _SIZES: [list(g) for g in optimizer._plan.partition.group_sizes],
    }
    local = optimizer._local_state_dict()["state"]
    for local_index, located in enumerate(_local_pieces(optimizer)):
        for name, value in local.get(local_index, {}).items():
            for piece, offset in located:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat = value.detach().reshape(-1)[offset : offset + piece.numel]
                    key = piece_key(piece.param, name, piece.start, piece.stop)
                    entries[key] = flat.clone()
                else:
                    entries[piece_key(piece.param, name, 0, 0)] = value
    return entries


def _on_first_rank(
    optimizer: ZeroRedundancyOptimizer, action: Callable[[], None], what: str
) -> None:
    """Run ``action`` on rank 0, then tell every rank how it went: a failure
    raises ``RuntimeError`` on every rank, so none goes on alone."""
    outcome: str | None = None
    cause: Exception | None = None
    if optimizer.rank == 0:
        try:
            action()
        except Exception as e:
            outcome, cause = f"{type(e).__name__}: {e}", e
    purpose = f"save_sharded ({what})"
    outcome = broadcast_object(outcome, 0, optimizer.process_group, purpose)
    if outcome is not None:
        raise RuntimeError(f"save_sharded: {what} failed on rank 0: {outcome}") from cause


def _clear(path: str) -> None:
    """Remove a previous checkpoint's manifest, then its files."""
    if not os.path.isdir(path):
        return
    # The manifest goes first: from here until the new one is written, the
    # directory is refused as "no manifest". Stale data files of a larger
    # world would otherwise stay and be refused as extra files.
    names = sorted(os.listdir(path), key=lambda n: n != MANIFEST_NAME)
    for name in names:
        if name == MANIFEST_NAME or is_checkpoint_file(name):
            os.remove(os.path.join(path, name))


def _own_files(path: str, rank: int) -> list[FileRecord]:
    """The files this rank wrote: ``torch.distributed.checkpoint`` names data
    files ``__<rank>_<n>.distcp``; rank 0, its coordinator, writes the metadata."""
    mine = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = [n for n in os.listdir(path) if mine.match(n)]
    if rank == 0:
        names.append(_METADATA)
    return [_record(path, name) for name in names]


def _record(path: str, name: str) -> FileRecord:
    full = os.path.join(path, name)
    return FileRecord(name, os.path.getsize(full), _sha256(full))


def _write_manifest(optimizer: ZeroRedundancyOptimizer, path: str, gathered: list[Any]) -> None:
    """On rank 0: every rank's records (or errors) into the manifest, written
    atomically so that no reader ever sees half of one."""
    errors = [error for _, error in gathered if error is not None]
    if errors:
        raise OSError("; ".join(errors))
    records = [r for rank_records, _ in gathered for r in rank_records]
    claimed = {r.name for r in records}
    # A file no rank claimed (should DCP ever name files otherwise) is hashed
    # here, so the manifest still lists everything DCP wrote.
    for name in sorted(os.listdir(path)):
        if is_checkpoint_file(name) and name not in claimed:
            records.append(_record(path, name))
    manifest = Manifest(
        zerofn_version=_zerofn_version(),
        partition=optimizer._plan.mode,
        world_size=optimizer.world_size,
        shapes=_shapes(optimizer),
        group_sizes=_group_sizes(optimizer),
        files=records,
    )
    temporary = os.path.join(path, f"{MANIFEST_NAME}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(manifest.to_dict(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST_NAME))


def save_sharded(optimizer: ZeroRedundancyOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Write each rank's optimizer shard to ``checkpoint_id`` (a directory),
    then the manifest :func:`load_sharded` checks it against.

    Collective: call on every rank of the optimizer's group. No rank gathers
    another's state; each hashes the files it wrote, and rank 0 gathers the
    hashes and writes the manifest last, so an interrupted save leaves no
    manifest (and :func:`load_sharded` refuses it). A checkpoint already in
    the directory is replaced: its manifest and data files are removed first.

    Args:
        optimizer: the optimizer whose state to save.
        checkpoint_id: the checkpoint directory (created if missing).

    Raises:
        RuntimeError: on every rank, if clearing the directory, hashing or
            writing the manifest failed on some rank.
        zerofn.errors.CollectiveError: if the ranks could not agree on it.
    """
    path = os.fspath(checkpoint_id)
    group = optimizer.process_group
    # The broadcast that ends the clearing also orders it before any rank writes.
    _on_first_rank(optimizer, lambda: _clear(path), "clearing the directory")
    with guarded("torch.distributed.checkpoint.save", f"save_sharded to {path!r}", group):
        dcp_save(
            _entries(optimizer),
            checkpoint_id=checkpoint_id,
            process_group=group,
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
    mine: tuple[list[FileRecord], str | None]
    try:
        mine = (_own_files(path, optimizer.rank), None)
    except OSError as e:
        mine = ([], f"rank {optimizer.rank} could not hash its files: {e}")
    gathered = gather_objects(mine, 0, group, "save_sharded (hashes for the manifest)")
    _on_first_rank(
        optimizer,
        lambda: _write_manifest(optimizer, path, gathered or []),
        "writing the manifest",
    )


# ----- loading ---------------------------------------------------------------------


def _read_manifest(path: str) -> tuple[Manifest | None, str | None]:
    """The manifest, or why there is none (a problem for :func:`refusal`)."""
    if not os.path.isdir(path):
        return None, "not a zerofn checkpoint (no manifest): the directory does not exist"
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"not a zerofn checkpoint (no manifest {MANIFEST_NAME!r})"
    try:
        return Manifest.from_dict(json.loads(raw.decode("utf-8"))), None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"manifest {MANIFEST_NAME} is corrupt: {e}"


def _listing(path: str) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file()}


def _needed_keys(plans: _Plans) -> set[str]:
    keys = {_GROUPS, _SIZES}
    for plan in plans.values():
        for copies in plan.values():
            keys.update(c.source.key for c in copies)
    return keys


def _plans(optimizer: ZeroRedundancyOptimizer, metadata: Any) -> _Plans:
    """For each piece this rank owns: which saved pieces rebuild it.

    Raises:
        ValueError: the checkpoint lacks some of it.
    """
    if _SIZES not in metadata.state_dict_metadata:
        raise ValueError("it is not a zerofn optimizer checkpoint (no group sizes in it)")
    saved = [p for k in metadata.state_dict_metadata if (p := parse_key(k)) is not None]
    partition = optimizer._plan.partition
    return {
        piece: cover(saved, piece.param, piece.start, piece.stop)
        for piece in partition.pieces_of(optimizer.rank)
    }


def _verify(optimizer: ZeroRedundancyOptimizer, path: str) -> tuple[list[str], Any, _Plans]:
    """What this rank finds wrong, before anything is unpickled: the manifest,
    the model, every file's presence and size, the metadata's hash; then
    (the metadata trusted) the hash of every data file this rank will read.

    Returns:
        The problems (empty if none), the DCP metadata and this rank's plans
        (``None`` and empty when there were problems).
    """
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return [problem or "no manifest"], None, {}
    sizes = _listing(path)
    hashes = {_METADATA: _sha256(os.path.join(path, _METADATA))} if _METADATA in sizes else {}
    problems = check_model(manifest, _shapes(optimizer), _group_sizes(optimizer))
    problems += check_files(manifest, sizes, hashes)
    if problems:
        return problems, None, {}
    metadata = FileSystemReader(path).read_metadata()
    try:
        plans = _plans(optimizer, metadata)
    except ValueError as e:
        return [str(e)], None, {}
    keys = _needed_keys(plans)
    to_read = {
        info.relative_path for index, info in metadata.storage_data.items() if index.fqn in keys
    }
    hashes = {name: _sha256(os.path.join(path, name)) for name in sorted(to_read)}
    return check_files(manifest, sizes, hashes), metadata, plans


def _agree(optimizer: ZeroRedundancyOptimizer, path: str, problems: list[str]) -> None:
    """Every rank's problems to every rank; if any rank found one, every rank
    raises the same :class:`CheckpointError`."""
    purpose = f"load_sharded (checking {path!r})"
    everyone = all_gather_objects(problems, optimizer.process_group, purpose)
    message = refusal(everyone)
    if message is not None:
        raise CheckpointError(f"checkpoint {path!r} refused, nothing was loaded: {message}")


def _request(plans: _Plans, metadata: Any) -> dict[str, Any]:
    """Empty tensors (or ``None`` for other values) for DCP to load into."""
    request: dict[str, Any] = {_GROUPS: None, _SIZES: None}
    for key in _needed_keys(plans) - {_GROUPS, _SIZES}:
        md = metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            request[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            request[key] = None
    return request


def _global_state(
    optimizer: ZeroRedundancyOptimizer, plans: _Plans, loaded: dict[str, Any]
) -> dict[str, Any]:
    """A global-format state dict holding just what this rank owns; elements
    it does not own stay zero and are cut away again when the shard is taken."""
    shapes = _shapes(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for piece, plan in plans.items():
        entry = state.setdefault(piece.param, {})
        for name, copies in plan.items():
            if copies[0].numel == 0:
                entry[name] = loaded[copies[0].source.key]
                continue
            full = entry.get(name)
            if full is None:
                dtype = loaded[copies[0].source.key].dtype
                full = entry[name] = torch.zeros(shapes[piece.param], dtype=dtype)
            flat = full.view(-1)
            for c in copies:
                source = loaded[c.source.key]
                at = piece.start + c.dst_start
                flat[at : at + c.numel] = source[c.src_start : c.src_start + c.numel]
    groups, first = [], 0
    for hyper, sizes in zip(loaded[_GROUPS], loaded[_SIZES], strict=True):
        groups.append({**hyper, "params": list(range(first, first + len(sizes)))})
        first += len(sizes)
    owned_state = {index: entry for index, entry in state.items() if entry}
    return {"state": owned_state, "param_groups": groups}


def load_sharded(optimizer: ZeroRedundancyOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Load this rank's part of a checkpoint written by :func:`save_sharded`,
    whatever world size or partition mode wrote it.

    Collective: call on every rank of the optimizer's group. Each rank first
    checks the manifest, the model, every file's presence and size, and the
    SHA-256 of the metadata and of each data file it will read; then the
    ranks exchange what they found, and refuse together if any found a defect.

    Args:
        optimizer: the optimizer to load into.
        checkpoint_id: the checkpoint directory.

    Raises:
        zerofn.errors.CheckpointError: on every rank, with the same message
            naming each defective file, its defect and the rank(s) that found
            it: no manifest, a corrupt manifest, a missing, extra, truncated
            or corrupt file, a checkpoint for another model, or one lacking a
            rank's state. The optimizer is unchanged.
        zerofn.errors.CollectiveError: if the ranks could not agree.
    """
    path = os.fspath(checkpoint_id)
    try:
        problems, metadata, plans = _verify(optimizer, path)
    except Exception as e:  # every rank must reach the agreement, or the others wait in it
        problems, metadata, plans = [f"it could not be checked: {type(e).__name__}: {e}"], None, {}
    _agree(optimizer, path, problems)
    request = _request(plans, metadata)
    group = optimizer.process_group
    with guarded("torch.distributed.checkpoint.load", f"load_sharded from {path!r}", group):
        dcp_load(
            request,
            checkpoint_id=checkpoint_id,
            process_group=group,
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
    if request[_SIZES] != [list(g) for g in optimizer._plan.partition.group_sizes]:
        raise CheckpointError(
            f"checkpoint {path!r} was saved for parameters of sizes "
            f"{request[_SIZES]}, not this optimizer's: it belongs to another model"
        )
    optimizer.load_state_dict(_global_state(optimizer, plans, request))
