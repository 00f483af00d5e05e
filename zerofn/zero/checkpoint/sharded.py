"""Naming and reassembling optimizer state saved shard by shard.

In a sharded checkpoint every rank writes only the state it owns, as pieces:
elements ``[start, stop)`` of one state tensor of one parameter, under a key
that says so. Loading at another world size (or under another partition
mode), a rank asks for the pieces it now owns; :func:`cover` says which saved
pieces, and which of their elements, make each one up. State saved beside the
optimizer's (the model's, a step count) travels under keys of its own:
:func:`extra_entries` and :func:`nested_extra`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = [
    "EXTRA_PREFIX",
    "PREFIX",
    "Copy",
    "SavedPiece",
    "cover",
    "extra_entries",
    "is_extra_key",
    "nested_extra",
    "parse_key",
    "piece_key",
]

PREFIX = "zerofn_optim"
EXTRA_PREFIX = "zerofn_extra"
"""The key prefix of the state saved with ``save_sharded(..., extra=...)``."""
_KEY = re.compile(rf"^{PREFIX}/state/(\d+)/([^/]+)/(\d+)-(\d+)$")


@attrs.frozen
class SavedPiece:
    """Elements ``[start, stop)`` of state ``name`` of parameter ``param``.

    A scalar state (a step count, say) is saved with ``start == stop == 0``.
    """

    param: int
    name: str
    start: int
    stop: int

    @property
    def key(self) -> str:
        """The checkpoint key this piece is saved under."""
        return piece_key(self.param, self.name, self.start, self.stop)


@attrs.frozen
class Copy:
    """Copy ``source`` elements ``[src_start, src_start + numel)`` to
    ``[dst_start, dst_start + numel)`` of the piece being rebuilt."""

    source: SavedPiece
    src_start: int
    dst_start: int
    numel: int


def piece_key(param: int, name: str, start: int, stop: int) -> str:
    """The checkpoint key for one saved piece.

    Raises:
        ValueError: if ``name`` contains ``/`` (it would make the key ambiguous).
    """
    if "/" in name:
        raise ValueError(f"state name {name!r} contains '/'")
    return f"{PREFIX}/state/{param}/{name}/{start}-{stop}"


def parse_key(key: str) -> SavedPiece | None:
    """The piece a key names, or ``None`` for a key that is not a piece."""
    match = _KEY.match(key)
    if match is None:
        return None
    param, name, start, stop = match.groups()
    return SavedPiece(int(param), name, int(start), int(stop))


def cover(saved: Iterable[SavedPiece], param: int, start: int, stop: int) -> dict[str, list[Copy]]:
    """How to rebuild elements ``[start, stop)`` of every state of ``param``.

    Args:
        saved: every piece in the checkpoint.
        param: the global parameter index.
        start: first element needed.
        stop: one past the last element needed.

    Returns:
        For each state name: the copies that fill ``[start, stop)`` (a scalar
        state gets one copy of ``numel == 0``). Empty when ``param`` has no
        saved state at all (it never stepped).

    Raises:
        ValueError: if some elements of a state are in no saved piece: the
            checkpoint is missing a rank's shard.
    """
    by_name: dict[str, list[SavedPiece]] = {}
    for piece in saved:
        if piece.param == param:
            by_name.setdefault(piece.name, []).append(piece)
    plans: dict[str, list[Copy]] = {}
    for name, pieces in by_name.items():
        scalars = [p for p in pieces if p.start == p.stop == 0]
        if scalars and len(scalars) == len(pieces):
            plans[name] = [Copy(scalars[0], 0, 0, 0)]
            continue
        copies = []
        position = start
        for piece in sorted(pieces, key=lambda p: p.start):
            lo, hi = max(piece.start, position), min(piece.stop, stop)
            if lo > position:
                break
            if hi > lo:
                copies.append(Copy(piece, lo - piece.start, lo - start, hi - lo))
                position = hi
        if position < stop:
            raise ValueError(
                f"the checkpoint holds no {name!r} state for elements {position}..{stop - 1} "
                f"of parameter {param}: a rank's shard is missing from it"
            )
        plans[name] = copies
    return plans


def extra_entries(extra: Mapping[str, Any], prefix: str = EXTRA_PREFIX) -> dict[str, Any]:
    """``extra`` as flat checkpoint entries: nested mappings become key paths
    (``{"model": {"w": t}}`` is ``{"zerofn_extra/model/w": t}``); values are
    kept as they are (the caller copies tensors it will go on changing).

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
            entries.update(extra_entries(value, path))
        else:
            entries[path] = value
    return entries


def is_extra_key(key: str) -> bool:
    """Whether ``key`` holds state saved as ``extra``."""
    return key.startswith(f"{EXTRA_PREFIX}/")


def nested_extra(entries: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` among ``entries`` back as nested dicts (inverts
    :func:`extra_entries`, except that an empty mapping saved nothing)."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if not is_extra_key(key):
            continue
        *path, last = key.split("/")[1:]
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out
