"""Naming and reassembling optimizer state saved shard by shard.

In a sharded checkpoint every rank writes only the state it owns, as pieces:
elements ``[start, stop)`` of one state tensor of one parameter, under a key
that says so. Loading at another world size (or under another partition
mode), a rank asks for the pieces it now owns; :func:`cover` says which saved
pieces, and which of their elements, make each one up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

__all__ = ["PREFIX", "Copy", "SavedPiece", "cover", "parse_key", "piece_key"]

PREFIX = "zerofn_optim"
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
