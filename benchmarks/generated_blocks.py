"""Figures outside the benchmark page, rewritten by ``make bench``.

README and the docs quote measured numbers only inside marked blocks::

    <!-- bench:NAME:begin -->
    ... written by make bench ...
    <!-- bench:NAME:end -->

:func:`rewrite_block` replaces what stands between the markers, so no page
keeps a number a later run contradicts; a page without the block is an
error (a block named in code but not on the page would silently not update).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from report import Section, headline_table

__all__ = ["QUOTED", "quote_everywhere", "rewrite_block", "rewrite_text"]

QUOTED: dict[str, tuple[str, ...]] = {
    "README.md": ("summary",),
    "docs/powersgd.md": ("powersgd",),
    "docs/overlap.md": ("overlap",),
    "docs/zero.md": ("zero-step", "modes"),
    "docs/compressed_exchange.md": ("compressed-bytes", "compressed-step", "compressed-soak"),
    "docs/diloco.md": ("diloco",),
}
"""Each page that quotes measured numbers, and its blocks: ``summary`` is
every benchmark's summary rows, any other name one benchmark's (a key of
``run_all.BENCHES``)."""


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


def _body(rows: str, when: str) -> str:
    return f"_Measured by `make bench` on {when}_\n\n{rows}"


def quote_everywhere(root: str, sections: Mapping[str, Section], when: str) -> list[str]:
    """Rewrite every block of :data:`QUOTED` under ``root`` from ``sections``
    (benchmark name -> its section, all of them from one run).

    Returns:
        The pages rewritten.

    Raises:
        KeyError: a block names a benchmark not in ``sections``.
        ValueError: a page lacks one of its blocks.
    """
    everything = [h for section in sections.values() for h in section.headlines]
    for page, names in QUOTED.items():
        path = os.path.join(root, page)
        for name in names:
            rows = everything if name == "summary" else list(sections[name].headlines)
            rewrite_block(path, name, _body(headline_table(rows), when))
    return list(QUOTED)
