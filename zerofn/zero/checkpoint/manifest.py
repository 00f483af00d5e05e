"""What a sharded checkpoint holds, and whether a directory still holds it.

:func:`zerofn_torch.checkpoint.save_sharded` ends by writing a
:class:`Manifest` beside the files ``torch.distributed.checkpoint`` wrote: the
model's parameter shapes, how the state was partitioned, and the size and
SHA-256 of every data file. Before loading, the adapter lists the directory,
hashes what it is about to read, and asks :func:`check_files` and
:func:`check_model` what is wrong; :func:`refusal` turns every rank's answers
into the one message all ranks raise. Nothing here reads a file or
communicates: the adapter observes, the functions judge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PARTITION_MODES",
    "READABLE_VERSIONS",
    "FileRecord",
    "Manifest",
    "check_files",
    "check_model",
    "is_checkpoint_file",
    "refusal",
]

MANIFEST_NAME = "zerofn_manifest.json"
"""The manifest's file name inside a checkpoint directory."""

FORMAT_VERSION = 2
"""The manifest format this version of zerofn writes (2 added ``saved_at``)."""

READABLE_VERSIONS = (1, 2)
"""Every manifest format this version of zerofn reads."""

PARTITION_MODES = ("greedy", "balanced", "flat", "manual")
"""The partition modes a manifest may name (``"manual"``: a given partition)."""

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS_V1 = (
    "format_version",
    "zerofn_version",
    "partition",
    "world_size",
    "shapes",
    "group_sizes",
    "files",
)
_FIELDS = {1: _FIELDS_V1, 2: (*_FIELDS_V1, "saved_at")}


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is one ``torch.distributed.checkpoint`` writes (a data
    file ``*.distcp`` or a metadata file ``*.metadata``): such a file in a
    checkpoint directory must be in its manifest. Other files (the model's
    own checkpoint, notes) are left alone."""
    return name.endswith((".distcp", ".metadata"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_tuples(value: Any) -> tuple[tuple[int, ...], ...]:
    """Lists (or tuples) of lists of non-negative ints, as tuples."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of lists of ints, got {type(value).__name__}")
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or not all(_is_int(n) and n >= 0 for n in item):
            raise ValueError(f"expected a list of non-negative ints, got {item!r}")
        out.append(tuple(item))
    return tuple(out)


def _check_name(_instance: object, _attribute: object, name: str) -> None:
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"file name {name!r} is not a plain file name")


def _check_size(_instance: object, _attribute: object, size: int) -> None:
    if not _is_int(size) or size < 0:
        raise ValueError(f"file size {size!r} is not a non-negative int")


def _check_sha256(_instance: object, _attribute: object, digest: str) -> None:
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ValueError(f"sha256 {digest!r} is not 64 lowercase hex digits")


@attrs.frozen
class FileRecord:
    """One file of a checkpoint as it was written.

    Attributes:
        name: the file's name inside the checkpoint directory.
        size: its size in bytes.
        sha256: the hex SHA-256 of its contents.
    """

    name: str = attrs.field(validator=_check_name)
    size: int = attrs.field(validator=_check_size)
    sha256: str = attrs.field(validator=_check_sha256)


def _sorted_files(files: Iterable[FileRecord]) -> tuple[FileRecord, ...]:
    out = tuple(files)
    for f in out:
        if not isinstance(f, FileRecord):
            raise ValueError(f"files must be FileRecords, got {type(f).__name__}")
    return tuple(sorted(out, key=lambda f: f.name))


@attrs.frozen
class Manifest:
    """What :func:`zerofn_torch.checkpoint.save_sharded` wrote.

    Attributes:
        zerofn_version: the version of zerofn that saved it.
        partition: the partition mode of the saving optimizer.
        world_size: how many ranks saved it.
        shapes: every parameter's shape, in global order.
        group_sizes: every parameter's element count, per param group.
        files: every file ``torch.distributed.checkpoint`` wrote, by name.
        saved_at: when the save was committed (rank 0's clock, seconds since
            the epoch); orders a run's checkpoints (0.0 in format 1).
        format_version: the manifest format (one of :data:`READABLE_VERSIONS`).

    Raises:
        ValueError: at construction, for a field of the wrong type or range,
            duplicate file names, or group sizes that disagree with the shapes.
    """

    zerofn_version: str
    partition: str
    world_size: int
    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_int_tuples)
    group_sizes: tuple[tuple[int, ...], ...] = attrs.field(converter=_int_tuples)
    files: tuple[FileRecord, ...] = attrs.field(converter=_sorted_files)
    saved_at: float = 0.0
    format_version: int = FORMAT_VERSION

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.format_version) or self.format_version not in READABLE_VERSIONS:
            raise ValueError(
                f"manifest format version {self.format_version!r}; "
                f"this zerofn reads versions {list(READABLE_VERSIONS)}"
            )
        if isinstance(self.saved_at, bool) or not isinstance(self.saved_at, (int, float)):
            raise ValueError(f"saved_at must be a number of seconds, got {self.saved_at!r}")
        if self.format_version == 1 and self.saved_at != 0.0:
            raise ValueError("a format 1 manifest has no saved_at: leave it 0.0")
        if not isinstance(self.zerofn_version, str):
            raise ValueError(f"zerofn_version must be a str, got {self.zerofn_version!r}")
        if self.partition not in PARTITION_MODES:
            raise ValueError(f"partition {self.partition!r} is not one of {PARTITION_MODES}")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size {self.world_size!r} is not a positive int")
        sizes = [n for group in self.group_sizes for n in group]
        if sizes != [math.prod(shape) for shape in self.shapes]:
            raise ValueError(
                f"group sizes {self.group_sizes} do not match parameter shapes {self.shapes}"
            )
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError(f"file names repeat: {names}")

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-able data (:meth:`from_dict` inverts it)."""
        saved_at = {"saved_at": self.saved_at} if self.format_version >= 2 else {}
        return {
            "format_version": self.format_version,
            "zerofn_version": self.zerofn_version,
            "partition": self.partition,
            "world_size": self.world_size,
            "shapes": [list(s) for s in self.shapes],
            "group_sizes": [list(g) for g in self.group_sizes],
            "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in self.files},
            **saved_at,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """The manifest ``data`` (as :meth:`to_dict` made it, e.g. parsed JSON) holds.

        Raises:
            ValueError: ``data`` is not a manifest: a field is missing, extra,
                or of the wrong type or range (the message says which).
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        fields = _FIELDS[version if version in READABLE_VERSIONS and _is_int(version) else 2]
        missing = [k for k in fields if k not in data]
        extra = sorted(str(k) for k in data if k not in fields)
        if missing or extra:
            raise ValueError(f"fields missing: {missing}, unexpected: {extra}")
        files = data["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and set(v) == {"size", "sha256"} for v in files.values()
        ):
            raise ValueError("'files' must map each name to {'size': ..., 'sha256': ...}")
        records = [FileRecord(name, v["size"], v["sha256"]) for name, v in files.items()]
        values = {k: data[k] for k in fields if k != "files"}
        return cls(files=records, **values)


def check_files(
    manifest: Manifest, sizes: Mapping[str, int], hashes: Mapping[str, str]
) -> list[str]:
    """What is wrong with a checkpoint directory's files, by the manifest.

    Args:
        manifest: the checkpoint's manifest.
        sizes: every file found in the directory: name -> size in bytes.
        hashes: the hex SHA-256 of the files that were hashed (any subset;
            files not hashed are judged by size alone).

    Returns:
        One problem per defective file, sorted by name, each naming the file
        and its defect: missing, extra (a checkpoint file the manifest does
        not list, see :func:`is_checkpoint_file`), of another size, or of
        another hash (checked only where the size matches); a file holding
        what the manifest lists under another name is named as swapped. When
        two or more files were compared and none matches, the one problem is
        that the manifest belongs to another save. Empty when every file is
        as written.
    """
    expected = {f.name: f for f in manifest.files}
    names = set(expected) | {n for n in sizes if is_checkpoint_file(n)}
    problems = [
        p
        for name in sorted(names)
        if (p := _file_problem(manifest, name, sizes, hashes)) is not None
    ]
    compared = [n for n in expected if n in sizes]
    matched = [n for n in compared if _file_problem(manifest, n, sizes, hashes) is None]
    if len(compared) >= 2 and not matched:
        return [
            f"none of the {len(compared)} files the manifest lists matches it: "
            "the manifest belongs to another save (or the files do)"
        ]
    return problems


def _file_problem(
    manifest: Manifest, name: str, sizes: Mapping[str, int], hashes: Mapping[str, str]
) -> str | None:
    record = next((f for f in manifest.files if f.name == name), None)
    if record is None:
        return f"{name} is an extra file: the manifest does not list it"
    if name not in sizes:
        return f"{name} is missing (the manifest lists it, {record.size} bytes)"
    if name in hashes and sizes[name] == record.size and hashes[name] == record.sha256:
        return None
    twin = _twin(manifest, name, sizes[name], hashes.get(name))
    if twin is not None and hashes.get(name) != record.sha256:
        return f"{name} holds what the manifest lists for {twin}: files swapped or renamed"
    if sizes[name] != record.size:
        how = "truncated" if sizes[name] < record.size else "of the wrong size"
        return f"{name} is {how}: {sizes[name]} bytes, the manifest says {record.size}"
    if name in hashes:
        return (
            f"{name} is corrupt: its sha256 is {hashes[name][:12]}..., "
            f"the manifest says {record.sha256[:12]}..."
        )
    return None


def _twin(manifest: Manifest, name: str, size: int, digest: str | None) -> str | None:
    """Another file the manifest lists with exactly the content ``name`` has
    (size and hash; unknown without a hash)."""
    if digest is None:
        return None
    return next(
        (f.name for f in manifest.files if f.name != name and (f.size, f.sha256) == (size, digest)),
        None,
    )


def check_model(
    manifest: Manifest,
    shapes: Sequence[Sequence[int]],
    group_sizes: Sequence[Sequence[int]],
) -> list[str]:
    """Whether the checkpoint is for this model. World size and partition
    mode may differ: loading reshards.

    Args:
        manifest: the checkpoint's manifest.
        shapes: the loading optimizer's parameter shapes, in global order.
        group_sizes: its parameters' element counts, per param group.

    Returns:
        One problem if the parameters' count, shapes or grouping differ from
        the checkpoint's, naming the first difference; else empty.
    """
    mine = tuple(tuple(s) for s in shapes)
    if len(mine) != len(manifest.shapes):
        return [
            f"the checkpoint is for another model: it holds {len(manifest.shapes)} "
            f"parameters, this optimizer has {len(mine)}"
        ]
    for index, (theirs, ours) in enumerate(zip(manifest.shapes, mine, strict=True)):
        if theirs != ours:
            return [
                f"the checkpoint is for another model: parameter {index} has shape "
                f"{list(theirs)} in it, {list(ours)} in this optimizer"
            ]
    counts = [len(g) for g in manifest.group_sizes]
    if counts != [len(g) for g in group_sizes]:
        return [
            f"the checkpoint is for another model: its param groups hold {counts} "
            f"parameters, this optimizer's hold {[len(g) for g in group_sizes]}"
        ]
    return []


def refusal(problems_by_rank: Sequence[Sequence[str]]) -> str | None:
    """The one message every rank raises, from what each rank found.

    Args:
        problems_by_rank: each rank's problems (empty where it found none).

    Returns:
        ``None`` when no rank found a problem; else each distinct problem,
        in order of first finding, with the ranks that found it.
    """
    found: dict[str, list[int]] = {}
    for rank, problems in enumerate(problems_by_rank):
        for problem in problems:
            found.setdefault(problem, []).append(rank)
    if not found:
        return None
    parts = []
    for problem, ranks in found.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{problem} (found by {who})")
    return "; ".join(parts)
