"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint``.

:func:`save_sharded` has every rank write only the state it owns, with no
gather to one rank; :func:`load_sharded` lets every rank read only what it now
owns, at any world size and under any partition mode. Keys and reassembly
come from :mod:`zerofn.zero.sharded_checkpoint`.

A save never writes into the checkpoint it replaces: it writes into a hidden
staging directory beside it, ends with a manifest
(:mod:`zerofn.zero.checkpoint_manifest`) holding the size and SHA-256 of each
file, verifies it on every rank, and only then swaps it for the target in one
rename (:mod:`zerofn_torch.checkpoint_files`). Every load checks the directory
against its manifest, on every rank and before anything is unpickled or
changed, and all ranks refuse together with :class:`zerofn.errors.CheckpointError`.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zerofn.errors import CheckpointError
from zerofn.zero.checkpoint_manifest import (
    FileRecord,
    Manifest,
    check_files,
    check_model,
    is_checkpoint_file,
    refusal,
)
from zerofn.zero.checkpoint_run import is_temporary, newest, staging_name, to_prune, trash_name
from zerofn.zero.partition import Piece
from zerofn.zero.sharded_checkpoint import PREFIX, Copy, cover, parse_key, piece_key
from zerofn_torch import checkpoint_files as files
from zerofn_torch.comm import all_gather_objects, broadcast_object, gather_objects, guarded
from zerofn_torch.zero import ZeroRedundancyOptimizer

__all__ = ["SaveHandle", "latest_checkpoint", "load_sharded", "save_sharded"]

_GROUPS = f"{PREFIX}/param_groups"
_SIZES = f"{PREFIX}/group_sizes"
_EXTRA = "zerofn_extra"
_LOG = logging.getLogger(__name__)
T = TypeVar("T")

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
                    scalar = value.detach().clone() if isinstance(value, torch.Tensor) else value
                    entries[piece_key(piece.param, name, 0, 0)] = scalar
    return entries


def _extra_entries(extra: Mapping[str, Any], prefix: str = _EXTRA) -> dict[str, Any]:
    """``extra`` as flat checkpoint entries (nested mappings become key paths),
    tensors copied.

    Raises:
        ValueError: a key is not a non-empty str without ``/``.
    """
    entries: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(
                f"extra's keys must be non-empty strs without '/', got {key!r} (in {prefix!r})"
            )
        path = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            entries.update(_extra_entries(value, path))
        elif isinstance(value, torch.Tensor):
            entries[path] = value.detach().clone()
        else:
            entries[path] = value
    return entries


def _nested_extra(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """The saved ``extra`` back as nested dicts."""
    out: dict[str, Any] = {}
    for key, value in loaded.items():
        parts = key.split("/")
        if parts[0] != _EXTRA:
            continue
        node = out
        for part in parts[1:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


@attrs.frozen(eq=False)
class _Snapshot:
    """What one rank writes, copied when the save was asked for."""

    entries: dict[str, Any]
    partition: str
    world_size: int
    shapes: list[tuple[int, ...]]
    group_sizes: list[list[int]]


def _snapshot(optimizer: ZeroRedundancyOptimizer, extra: Mapping[str, Any]) -> _Snapshot:
    return _Snapshot(
        entries={**_optimizer_entries(optimizer), **_extra_entries(extra)},
        partition=optimizer._plan.mode,
        world_size=optimizer.world_size,
        shapes=_shapes(optimizer),
        group_sizes=_group_sizes(optimizer),
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


def _manifest(snapshot: _Snapshot, staging: str, gathered: list[Any]) -> Manifest:
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


def _save(snapshot: _Snapshot, target: str, group: Any, keep_last: int | None) -> None:
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


# ----- saves in the background -----------------------------------------------------


class SaveHandle:
    """A save under way (``save_sharded(..., blocking=False)``) or finished.

    :meth:`wait` returns once the checkpoint is committed, or raises what
    failed; a failure nobody waited for raises at the next
    :func:`save_sharded` or :func:`load_sharded` on the same ranks instead.
    """

    def __init__(self, path: str, work: Callable[[], None] | None) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        if work is not None:
            self._thread = threading.Thread(
                target=self._run, args=(work,), name=f"save_sharded {path}", daemon=True
            )
            self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(): a thread has no caller to raise to
            self._error = e

    def done(self) -> bool:
        """Whether the save has ended (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save has ended.

        Args:
            timeout: seconds to wait at most (``None``: until it ends).

        Raises:
            TimeoutError: it is still running after ``timeout`` seconds.
            zerofn.errors.CollectiveError, RuntimeError, ValueError: what the
                save raised (on every rank: the save ends with an agreement).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"save_sharded to {self.path!r} still running")
        self._reported = True
        if self._error is not None:
            raise self._error

    def _settle(self) -> None:
        """Wait; raise a failure only if :meth:`wait` has not reported it yet."""
        if self._thread is not None:
            self._thread.join()
        if not self._reported:
            self.wait()


_IN_FLIGHT: dict[tuple[int, ...], SaveHandle] = {}
_SAVE_GROUPS: dict[tuple[int, ...], Any] = {}


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _settle_in_flight(group: Any) -> None:
    handle = _IN_FLIGHT.pop(_ranks(group), None)
    if handle is not None:
        handle._settle()


def _save_group(group: Any) -> Any:
    """The gloo group background saves of ``group``'s ranks run their
    collectives on, so that they never interleave with training's.

    Created by the first background save (``dist.new_group``: every rank of
    the default group must enter it) with ``group``'s timeout, then reused.
    """
    ranks = _ranks(group)
    known = _SAVE_GROUPS.get(ranks)
    if known is not None and _alive(known):
        return known
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):  # no CPU backend (NCCL alone): gloo's default
        timeout = None
    created = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
    _SAVE_GROUPS[ranks] = created
    return created


def _alive(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):  # destroyed with its world
        return False
    return True


@atexit.register
def _finish_saves_at_exit() -> None:
    # A background save still writing when the program ends would otherwise
    # be cut off, leaving the previous checkpoint as the last.
    for handle in list(_IN_FLIGHT.values()):
        try:
            handle._settle()
        except BaseException as e:
            _LOG.error("save_sharded to %r failed at exit: %s", handle.path, e)
    _IN_FLIGHT.clear()


# ----- the public API --------------------------------------------------------------


def save_sharded(
    optimizer: ZeroRedundancyOptimizer,
    checkpoint_id: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    blocking: bool = True,
) -> SaveHandle:
    """Write each rank's optimizer shard (and ``extra``) as the checkpoint
    directory ``checkpoint_id``, replacing any checkpoint there all at once.

    Collective: call on every rank of the optimizer's group. No rank gathers
    another's state. The files are written into a hidden staging directory
    beside ``checkpoint_id``; each rank hashes what it wrote, rank 0 writes
    the manifest, every rank verifies the staged checkpoint, and only then
    does rank 0 swap it for the old one in one rename. Until that rename the
    previous checkpoint stays whole and loadable; a save that fails or is cut
    short (a rank killed) leaves it exactly as it was.

    Args:
        optimizer: the optimizer whose state to save.
        checkpoint_id: the checkpoint directory (its parent is created if
            missing). An existing one may hold only an earlier checkpoint.
        extra: more state to save in the same checkpoint, the same on every
            rank (e.g. ``{"model": model.state_dict(), "step": step}``):
            tensors, picklable values and nested mappings with ``str`` keys
            without ``/``. :func:`load_sharded` returns it.
        keep_last: keep only this many of the newest checkpoints in
            ``checkpoint_id``'s parent directory (the run's directory), this
            one included; ``None`` removes none.
        blocking: ``False`` copies the state now and writes it in the
            background (collectives on a gloo group of the same ranks, made
            by the first such save), so training goes on; wait with the
            handle, or the next save or load waits for it.

    Returns:
        The save's handle (already finished when ``blocking``).

    Raises:
        ValueError: on every rank, for a bad ``keep_last`` or ``extra`` key,
            or a ``checkpoint_id`` holding files that are not a checkpoint's;
            nothing was written.
        RuntimeError: on every rank, if writing, hashing, verifying or
            committing failed on some rank: the previous checkpoint is intact.
        zerofn.errors.CollectiveError: if the ranks could not agree on it
            (a peer died or hung); the previous checkpoint is intact, or
            the new one was committed whole.
    """
    if keep_last is not None:
        to_prune({}, keep_last, current="")  # checks it before anything is written
    target = os.path.abspath(os.fspath(checkpoint_id))
    group = optimizer.process_group
    _settle_in_flight(group)
    snapshot = _snapshot(optimizer, extra or {})
    if blocking:
        _save(snapshot, target, group, keep_last)
        return SaveHandle(target, None)
    save_group = _save_group(group)
    handle = SaveHandle(target, lambda: _save(snapshot, target, save_group, keep_last))
    _IN_FLIGHT[_ranks(group)] = handle
    return handle


def latest_checkpoint(run: str | os.PathLike[str]) -> str | None:
    """The newest whole checkpoint directly inside the directory ``run``
    (by the save time its manifest records), or ``None`` if there is none.

    Staging directories of saves in progress or cut short, and directories
    without a valid manifest, are never returned. It reads no data file: a
    damaged checkpoint is still refused by :func:`load_sharded`.
    """
    path = os.fspath(run)
    if not os.path.isdir(path):
        return None
    name = newest(files.run_checkpoints(path))
    return None if name is None else os.path.join(path, name)


# ----- loading ---------------------------------------------------------------------


def _listing(path: str) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file()}


def _extra_keys(metadata: Any) -> set[str]:
    return {k for k in metadata.state_dict_metadata if k.startswith(f"{_EXTRA}/")}


def _needed_keys(plans: _Plans, metadata: Any) -> set[str]:
    keys = {_GROUPS, _SIZES} | _extra_keys(metadata)
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
    if is_temporary(os.path.basename(os.path.normpath(path))):
        return (
            ["not a checkpoint: a temporary directory of a save in progress or cut short"],
            None,
            {},
        )
    manifest, problem = files.read_manifest(path)
    if manifest is None:
        return [problem or "no manifest"], None, {}
    sizes = _listing(path)
    hashes = {files.METADATA: files.sha256(os.path.join(path, files.METADATA))}
    hashes = hashes if files.METADATA in sizes else {}
    problems = check_model(manifest, _shapes(optimizer), _group_sizes(optimizer))
    if problems:
        return problems, None, {}
    problems = check_files(manifest, sizes, hashes)
    if problems:
        # Only on a defect: every file's hash tells damage from swapped files
        # or another save's manifest.
        everything = {
            n: files.sha256(os.path.join(path, n))
            for n in sizes
            if n in hashes or is_checkpoint_file(n)
        }
        return check_files(manifest, sizes, everything), None, {}
    metadata = FileSystemReader(path).read_metadata()
    try:
        plans = _plans(optimizer, metadata)
    except ValueError as e:
        return [str(e)], None, {}
    keys = _needed_keys(plans, metadata)
    to_read = {
        info.relative_path for index, info in metadata.storage_data.items() if index.fqn in keys
    }
    hashes = {name: files.sha256(os.path.join(path, name)) for name in sorted(to_read)}
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
    for key in _needed_keys(plans, metadata) - {_GROUPS, _SIZES}:
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


def load_sharded(
    optimizer: ZeroRedundancyOptimizer, checkpoint_id: str | os.PathLike[str]
) -> dict[str, Any]:
    """Load this rank's part of a checkpoint written by :func:`save_sharded`,
    whatever world size or partition mode wrote it, and return its ``extra``.

    Collective: call on every rank of the optimizer's group. Each rank first
    checks the manifest, the model, every file's presence and size, and the
    SHA-256 of the metadata and of each data file it will read; then the
    ranks exchange what they found, and refuse together if any found a defect.

    Args:
        optimizer: the optimizer to load into.
        checkpoint_id: the checkpoint directory.

    Returns:
        The ``extra`` it was saved with, as nested dicts (tensors on the
        CPU); empty if none.

    Raises:
        zerofn.errors.CheckpointError: on every rank, with the same message
            naming each defective file, its defect and the rank(s) that found
            it: no manifest, a corrupt manifest, a missing, extra, truncated
            or corrupt file, a checkpoint for another model, or one lacking a
            rank's state. The optimizer is unchanged.
        zerofn.errors.CollectiveError: if the ranks could not agree.
    """
    path = os.fspath(checkpoint_id)
    _settle_in_flight(optimizer.process_group)
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
    return _nested_extra(request)
