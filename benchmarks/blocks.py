"""Marked blocks in the repository's pages: what stands between
``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` is generated,
and only these functions rewrite it (:mod:`generated_blocks` decides what
goes into each block; :mod:`code_lines` writes its own)."""

from __future__ import annotations

import re

__all__ = ["rewrite_block", "rewrite_text"]


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- bench:{re.escape(name)}:begin -->\n).*?(<!-- bench:{re.escape(name)}:end -->)",
        re.DOTALL,
    )


def rewrite_text(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s contents replaced by ``body``.

    Raises:
        ValueError: ``text`` holds no block ``name``, or more than one.
    """
    pattern = _pattern(name)
    found = len(pattern.findall(text))
    if found != 1:
        raise ValueError(f"expected one block 'bench:{name}', found {found}")
    inside = body.strip("\n") + "\n" if body.strip("\n") else ""
    return pattern.sub(lambda m: m.group(1) + inside + m.group(2), text)


def rewrite_block(path: str, name: str, body: str) -> None:
    """Rewrite block ``name`` of the file at ``path`` (see :func:`rewrite_text`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(rewrite_text(text, name, body))
