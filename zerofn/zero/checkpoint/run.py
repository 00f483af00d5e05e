"""Which directories of a run are checkpoints, which are saves in progress,
and which checkpoints a save keeps.

:func:`zerofn_torch.checkpoint.save_sharded` never writes into the directory a
checkpoint is loaded from. It writes into a *staging* directory beside it
(hidden, named by :func:`staging_name`), verifies it, and only then swaps it
for the target in one rename; checkpoints dropped by ``keep_last`` are first
renamed to a *trash* name (:func:`trash_name`) and then removed. So a
directory with a plain name is a whole checkpoint or none at all, and a save
interrupted at any point leaves only temporaries, which the next save removes.

Everything here judges names and save times the adapter observed; nothing
reads a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = [
    "is_temporary",
    "newest",
    "staging_name",
    "temporaries",
    "to_prune",
    "trash_name",
]

_MARK = ".zerofn-"
_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_TEMPORARY = re.compile(rf"^\.(?P<target>.+){re.escape(_MARK)}(staging|trash)-[0-9a-f]{{8,64}}$")


def _temporary(target: str, kind: str, token: str) -> str:
    if not target or "/" in target or target in (".", ".."):
        raise ValueError(f"checkpoint name {target!r} is not a plain directory name")
    if not _TOKEN.match(token):
        raise ValueError(f"token {token!r} is not 8 to 64 lowercase hex digits")
    return f".{target}{_MARK}{kind}-{token}"


def staging_name(target: str, token: str) -> str:
    """The hidden directory, beside ``target``, that one save writes into.

    Args:
        target: the checkpoint directory's name (not a path).
        token: the save's random token (hex), the same on every rank.

    Raises:
        ValueError: ``target`` is not a plain name or ``token`` not hex.
    """
    return _temporary(target, "staging", token)


def trash_name(target: str, token: str) -> str:
    """The hidden name a dropped checkpoint is renamed to before removal, so
    that a removal cut short never leaves a plain-named partial checkpoint."""
    return _temporary(target, "trash", token)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a staging or trash directory's name: never a checkpoint."""
    return _TEMPORARY.match(name) is not None


def temporaries(names: Iterable[str], target: str | None = None) -> list[str]:
    """The temporaries among ``names`` (of ``target`` only, when given), sorted.

    A save removes these first: each is what an earlier, interrupted save or
    removal left behind.
    """
    out = []
    for name in names:
        match = _TEMPORARY.match(name)
        if match is not None and (target is None or match["target"] == target):
            out.append(name)
    return sorted(out)


def to_prune(saved_at: Mapping[str, float], keep_last: int, current: str) -> list[str]:
    """Which of a run's checkpoints to remove so that ``keep_last`` remain.

    Args:
        saved_at: each checkpoint of the run (directory name) and when it
            was saved (seconds, from its manifest).
        keep_last: how many to keep, at least 1.
        current: the checkpoint just written; always kept, whatever its
            time says (a clock that stepped back must not remove it).

    Returns:
        The names to remove, oldest first.

    Raises:
        ValueError: ``keep_last`` is not a positive int.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
    others = sorted((n for n in saved_at if n != current), key=lambda n: (saved_at[n], n))
    kept = keep_last - 1
    return others[: max(len(others) - kept, 0)]


def newest(saved_at: Mapping[str, float]) -> str | None:
    """The most recently saved checkpoint's name (ties: the greatest name), or
    ``None`` for none."""
    if not saved_at:
        return None
    return max(saved_at, key=lambda n: (saved_at[n], n))
