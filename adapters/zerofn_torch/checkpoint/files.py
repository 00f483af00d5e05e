"""The file-system side of sharded checkpoints: hashing, the manifest on
disk, and the renames that make a save all-or-nothing.

No collectives here: :mod:`zerofn_torch.checkpoint.sharded` decides on which rank
each runs and tells every rank how it went. Which names are temporaries and
which checkpoints to keep are pure decisions of :mod:`zerofn.zero.checkpoint.run`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import shutil
import sys

from zerofn.zero.checkpoint.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    is_checkpoint_file,
)
from zerofn.zero.checkpoint.run import is_temporary, temporaries

__all__ = [
    "METADATA",
    "commit",
    "discard",
    "own_files",
    "prepare_staging",
    "prune",
    "read_manifest",
    "record",
    "remove_temporaries",
    "run_checkpoints",
    "sha256",
    "write_manifest",
]

METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file
_BLOCK = 1 << 20
_RENAME_EXCHANGE = 2  # linux/fs.h


def sha256(path: str) -> str:
    """The hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def record(directory: str, name: str) -> FileRecord:
    """The size and hash of ``directory/name``, as read back from disk."""
    full = os.path.join(directory, name)
    return FileRecord(name, os.path.getsize(full), sha256(full))


def own_files(directory: str, rank: int) -> list[FileRecord]:
    """The files this rank wrote: ``torch.distributed.checkpoint`` names data
    files ``__<rank>_<n>.distcp``; rank 0, its coordinator, writes the metadata."""
    mine = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = [n for n in os.listdir(directory) if mine.match(n)]
    if rank == 0:
        names.append(METADATA)
    return [record(directory, name) for name in sorted(names)]


def read_manifest(directory: str) -> tuple[Manifest | None, str | None]:
    """The manifest of ``directory``, or why there is none."""
    if not os.path.isdir(directory):
        return None, "not a zerofn checkpoint (no manifest): the directory does not exist"
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"not a zerofn checkpoint (no manifest {MANIFEST_NAME!r})"
    try:
        return Manifest.from_dict(json.loads(raw.decode("utf-8"))), None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"manifest {MANIFEST_NAME} is corrupt: {e}"


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write the manifest so that no reader ever sees half of one, and make it
    (and every file beside it) durable before the directory is committed."""
    temporary = os.path.join(directory, f"{MANIFEST_NAME}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(manifest.to_dict(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST_NAME))
    for name in os.listdir(directory):
        _fsync_file(os.path.join(directory, name))
    _fsync_directory(directory)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path: str) -> None:
    # A rename or a new entry is durable only once its directory is.
    if sys.platform == "win32":  # directories cannot be opened there
        return
    _fsync_file(path)


def _replaceable(target: str) -> None:
    """Refuse a target whose files a save would destroy: anything other than
    an earlier checkpoint's (the manifest and ``torch.distributed.checkpoint``'s
    files)."""
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target) or os.path.islink(target):
        raise ValueError(f"{target!r} exists and is not a directory: not replacing it")
    foreign = sorted(
        n
        for n in os.listdir(target)
        if n not in (MANIFEST_NAME, f"{MANIFEST_NAME}.tmp") and not is_checkpoint_file(n)
    )
    if foreign:
        raise ValueError(
            f"{target!r} holds files that are not a zerofn checkpoint's ({', '.join(foreign)}): "
            "a save replaces the whole directory, so it would remove them; save into a "
            "directory of its own, and pass the model's state as save_sharded(..., extra=...)"
        )


def discard(staging: str) -> None:
    """Remove a staged checkpoint that failed verification."""
    shutil.rmtree(staging, ignore_errors=True)


def remove_temporaries(parent: str, target: str | None) -> None:
    """Remove what interrupted saves and removals left in ``parent`` (those of
    ``target`` only, when given)."""
    for name in temporaries(os.listdir(parent), target):
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def prepare_staging(target: str, staging: str, whole_run: bool) -> None:
    """Check that ``target`` may be replaced, clear earlier temporaries (of the
    whole run directory when ``whole_run``), and create ``staging``."""
    _replaceable(target)
    parent = os.path.dirname(staging)
    os.makedirs(parent, exist_ok=True)
    remove_temporaries(parent, None if whole_run else os.path.basename(target))
    os.mkdir(staging)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2``); False
    where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system without it
        return False
    raise OSError(code, f"renameat2 exchange of {a!r} and {b!r}: {os.strerror(code)}")


def commit(staging: str, target: str, trash: str) -> None:
    """Make the verified ``staging`` directory the checkpoint at ``target``.

    Where ``target`` holds an earlier checkpoint the two are swapped in one
    atomic rename, so ``target`` is at every instant the old checkpoint or
    the new one; the old one, now under the staging name, is then removed.
    Without an atomic swap (not Linux), the old one is first renamed to
    ``trash``: for that instant ``target`` is absent, and a restart then
    finds the run's previous checkpoint (or, cut short there, none).
    """
    parent = os.path.dirname(staging)
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.rename(target, trash)
        os.rename(staging, target)
        shutil.rmtree(trash, ignore_errors=True)
    _fsync_directory(parent)


def run_checkpoints(run: str) -> dict[str, float]:
    """Every whole checkpoint directly in the directory ``run``: name -> when
    it was saved. Temporaries and directories without a valid manifest are
    not checkpoints."""
    found = {}
    for entry in os.scandir(run):
        if entry.is_dir() and not is_temporary(entry.name):
            manifest, _ = read_manifest(entry.path)
            if manifest is not None:
                found[entry.name] = manifest.saved_at
    return found


def prune(run: str, names: list[str], trash_of: dict[str, str]) -> None:
    """Remove the checkpoints ``names`` of ``run``, each renamed to its trash
    name first, so a removal cut short leaves no plain-named partial checkpoint."""
    for name in names:
        trash = os.path.join(run, trash_of[name])
        os.rename(os.path.join(run, name), trash)
        shutil.rmtree(trash, ignore_errors=True)
    if names:
        _fsync_directory(run)
