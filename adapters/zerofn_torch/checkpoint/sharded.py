"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint``.

:func:`save_sharded` has every rank write only the state it owns, with no
gather to one rank; :func:`load_sharded` lets every rank read only what it now
owns, at any world size and under any partition mode. Keys and reassembly
come from :mod:`zerofn.zero.checkpoint.sharded`.

A save never writes into the checkpoint it replaces: it writes into a hidden
staging directory beside it, ends with a manifest
(:mod:`zerofn.zero.checkpoint.manifest`) holding the size and SHA-256 of each
file, verifies it on every rank, and only then swaps it for the target in one
rename (:mod:`zerofn_torch.checkpoint.files`). Every load checks the directory
against its manifest, on every rank and before anything is unpickled or
changed, and all ranks refuse together with :class:`zerofn.errors.CheckpointError`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from zerofn.errors import CheckpointError
from zerofn.zero.checkpoint.manifest import (
    check_files,
    check_model,
    is_checkpoint_file,
    refusal,
)
from zerofn.zero.checkpoint.run import is_temporary, newest, to_prune
from zerofn.zero.checkpoint.sharded import (
    Copy,
    cover,
    is_extra_key,
    nested_extra,
    parse_key,
)
from zerofn.zero.params import global_groups
from zerofn.zero.planning.partition import Piece
from zerofn.zero.rank_state import held_pieces
from zerofn_torch.checkpoint import files as files
from zerofn_torch.checkpoint.background import SaveHandle, in_flight, save_group, settle_in_flight
from zerofn_torch.checkpoint.save import GROUPS, SIZES, group_sizes, save, shapes, snapshot
from zerofn_torch.runtime.collective_errors import guarded
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.runtime.wrapped_optimizer import WrappedOptimizer
from zerofn_torch.zero.forward_gather import wait_for_gathers
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["SaveHandle", "latest_checkpoint", "load_sharded", "save_sharded"]

_Plans = dict[Piece, dict[str, list[Copy]]]


_WRAPPERS = "zerofn_wrappers"
"""The ``extra`` key the state of the optimizers around a ZeRO optimizer
(DiLoCo's outer state, post-local SGD's averager step) is saved under."""


def _chain(optimizer: Any) -> tuple[list[WrappedOptimizer], ZeroRedundancyOptimizer]:
    """The wrappers around the ZeRO optimizer whose shards a sharded
    checkpoint holds (outermost first), and that optimizer.

    Raises:
        TypeError: no ZeRO optimizer at the bottom, naming what to save instead.
    """
    wrappers = []
    inner = optimizer
    while isinstance(inner, WrappedOptimizer):
        wrappers.append(inner)
        inner = inner.optim
    if not isinstance(inner, ZeroRedundancyOptimizer):
        raise TypeError(
            "save_sharded and load_sharded keep the shards of a ZeroRedundancyOptimizer (or of "
            f"optimizers wrapping one), not of a {type(inner).__name__}: save an unsharded "
            "optimizer with torch.save(optimizer.state_dict(), path)"
        )
    return wrappers, inner


def _check_one_group_a_path(
    wrappers: list[WrappedOptimizer], zero: ZeroRedundancyOptimizer, target: str, doing: str
) -> None:
    """Refuse, on every rank, one checkpoint directory for several groups of
    shards: a wrapper whose group reaches past the ZeRO optimizer's (DiLoCo's
    outer group, across workers) means each of those groups writes its own
    shards, under the same file names, so each needs its own directory.

    Raises:
        ValueError: two of the wrapper group's ranks name the same directory.
    """
    mine = set(dist.get_process_group_ranks(zero.process_group))
    for wrapper in wrappers:
        group = getattr(wrapper, "process_group", None)
        if group is None or set(dist.get_process_group_ranks(group)) <= mine:
            continue
        purpose = f"{doing}: each group of shards' directory"
        targets = all_gather_objects(target, group, purpose)
        if len(set(targets)) < len(targets):
            raise ValueError(
                f"{doing} was given one checkpoint directory ({target!r}) for "
                f"{len(targets)} {type(wrapper).__name__} workers, each of which holds its "
                "own ZeroRedundancyOptimizer shards under the same file names: give each "
                "worker its own directory (for example os.path.join(path, f'worker{k}')); "
                "nothing was written or loaded"
            )


def _kinds(wrappers: list[WrappedOptimizer]) -> list[str]:
    return [type(w).__name__ for w in wrappers]


# ----- the public API --------------------------------------------------------------


def save_sharded(
    optimizer: ZeroRedundancyOptimizer | WrappedOptimizer,
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
        optimizer: the optimizer whose state to save: a
            ``ZeroRedundancyOptimizer``, or optimizers wrapping one
            (``DiLoCoOptimizer``, ``PostLocalSGDOptimizer``), whose own state
            travels beside the shards (DiLoCo's joined over its outer group,
            :meth:`~zerofn_torch.averaging.DiLoCoOptimizer.outer_state_dict`,
            so it too loads at another world size).
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
        TypeError: ``optimizer`` is no ZeRO optimizer, nor wraps one.
        ValueError: on every rank, for a bad ``keep_last`` or ``extra`` key,
            a ``checkpoint_id`` holding files that are not a checkpoint's, or
            one ``checkpoint_id`` for several DiLoCo workers (each writes its
            own shards: give each its own); nothing was written.
        RuntimeError: on every rank, if writing, hashing, verifying or
            committing failed on some rank: the previous checkpoint is intact.
        zerofn.errors.CollectiveError: if the ranks could not agree on it
            (a peer died or hung); the previous checkpoint is intact, or
            the new one was committed whole.
    """
    wait_for_gathers()  # the shards must hold every step's update
    if keep_last is not None:
        to_prune({}, keep_last, current="")  # checks it before anything is written
    wrappers, optimizer = _chain(optimizer)
    target = os.path.abspath(os.fspath(checkpoint_id))
    _check_one_group_a_path(wrappers, optimizer, target, "save_sharded")
    if wrappers:  # their own state travels beside the shards (DiLoCo's is collective)
        states = [w.wrapper_state_dict() for w in wrappers]
        extra = {**(extra or {}), _WRAPPERS: [_kinds(wrappers), states]}
    group = optimizer.process_group
    settle_in_flight(group)
    started = time.perf_counter()
    snap = snapshot(optimizer, extra or {})
    if blocking:
        return SaveHandle(
            target, lambda: save(snap, target, group, keep_last), background=False, started=started
        )
    on = save_group(group)
    handle = SaveHandle(
        target, lambda: save(snap, target, on, keep_last), background=True, started=started
    )
    in_flight(group, handle)
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
    return {k for k in metadata.state_dict_metadata if is_extra_key(k)}


def _needed_keys(plans: _Plans, metadata: Any) -> set[str]:
    keys = {GROUPS, SIZES} | _extra_keys(metadata)
    for plan in plans.values():
        for copies in plan.values():
            keys.update(c.source.key for c in copies)
    return keys


def _plans(optimizer: ZeroRedundancyOptimizer, metadata: Any) -> _Plans:
    """For each piece whose state this rank holds (owned, and with
    ``redundancy=2`` carried): which saved pieces rebuild it.

    Raises:
        ValueError: the checkpoint lacks some of it.
    """
    if SIZES not in metadata.state_dict_metadata:
        raise ValueError("it is not a zerofn optimizer checkpoint (no group sizes in it)")
    saved = [p for k in metadata.state_dict_metadata if (p := parse_key(k)) is not None]
    return {
        piece: cover(saved, piece.param, piece.start, piece.stop)
        for piece in held_pieces(optimizer.zero_rank)
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
    hashes = (
        {files.METADATA: files.sha256(os.path.join(path, files.METADATA))}
        if files.METADATA in sizes
        else {}
    )
    problems = check_model(manifest, shapes(optimizer), group_sizes(optimizer))
    if problems:
        return problems, None, {}
    problems = check_files(manifest, sizes, hashes)
    if problems:
        # Only on a defect: every file's hash tells damage from swapped files
        # or another save's manifest.
        everything = {
            **hashes,
            **{
                n: files.sha256(os.path.join(path, n))
                for n in sizes
                if is_checkpoint_file(n) and n not in hashes
            },
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
    request: dict[str, Any] = {GROUPS: None, SIZES: None}
    for key in _needed_keys(plans, metadata) - {GROUPS, SIZES}:
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
    param_shapes = shapes(optimizer)
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
                full = entry[name] = torch.zeros(param_shapes[piece.param], dtype=dtype)
            flat = full.view(-1)
            for c in copies:
                source = loaded[c.source.key]
                at = piece.start + c.dst_start
                flat[at : at + c.numel] = source[c.src_start : c.src_start + c.numel]
    groups = global_groups([len(sizes) for sizes in loaded[SIZES]], loaded[GROUPS])
    owned_state = {index: entry for index, entry in state.items() if entry}
    return {"state": owned_state, "param_groups": groups}


def load_sharded(
    optimizer: ZeroRedundancyOptimizer | WrappedOptimizer, checkpoint_id: str | os.PathLike[str]
) -> dict[str, Any]:  # fmt: skip
    """Load this rank's part of a checkpoint written by :func:`save_sharded`,
    whatever world size or partition mode wrote it, and return its ``extra``.

    Collective: call on every rank of the optimizer's group. Each rank first
    checks the manifest, the model, every file's presence and size, and the
    SHA-256 of the metadata and of each data file it will read; then the
    ranks exchange what they found, and refuse together if any found a defect.

    Args:
        optimizer: the optimizer to load into (wrappers around the ZeRO
            optimizer, as saved, load their own state too).
        checkpoint_id: the checkpoint directory.

    Returns:
        The ``extra`` it was saved with, as nested dicts (tensors on the
        CPU); empty if none.

    Raises:
        TypeError: ``optimizer`` is no ZeRO optimizer, nor wraps one.
        zerofn.errors.CheckpointError: on every rank, with the same message
            naming each defective file, its defect and the rank(s) that found
            it: no manifest, a corrupt manifest, a missing, extra, truncated
            or corrupt file, a checkpoint for another model, or one lacking a
            rank's state. The optimizer is unchanged.
        ValueError: on every rank, one ``checkpoint_id`` for several DiLoCo
            workers (each saved its own shards); nothing was loaded.
        zerofn.errors.CollectiveError: if the ranks could not agree.
    """
    wait_for_gathers()  # the shards must hold every step's update
    path = os.fspath(checkpoint_id)
    wrappers, zero = _chain(optimizer)
    if wrappers:  # the shards, then the wrappers' own state
        _check_one_group_a_path(wrappers, zero, os.path.abspath(path), "load_sharded")
        extra = load_sharded(zero, checkpoint_id)
        kinds, states = extra.pop(_WRAPPERS, [[], []])
        if kinds != _kinds(wrappers):
            raise CheckpointError(
                f"checkpoint {path!r} was saved from {' > '.join([*kinds, 'ZeRO']) or 'ZeRO'}, "
                f"not {' > '.join([*_kinds(wrappers), 'ZeRO'])}: its shards are loaded into the "
                "ZeroRedundancyOptimizer; load the rest as it was saved"
            )
        for wrapper, state in zip(wrappers, states, strict=True):
            wrapper.load_wrapper_state_dict(state)
        return extra
    optimizer = zero
    settle_in_flight(optimizer.process_group)
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
    if request[SIZES] != [list(g) for g in optimizer.shard_plan.partition.group_sizes]:
        raise CheckpointError(
            f"checkpoint {path!r} was saved for parameters of sizes "
            f"{request[SIZES]}, not this optimizer's: it belongs to another model"
        )
    optimizer.load_state_dict(_global_state(optimizer, plans, request))
    return nested_extra(request)
