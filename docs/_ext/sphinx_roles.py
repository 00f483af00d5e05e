"""A griffe extension that reads the Sphinx roles in zerofn's docstrings.

The docstrings are Google style but name other objects with Sphinx roles
(``:class:`Partition```, ``:meth:`pieces_of```). Markdown has no roles, so
mkdocstrings would print them literally. This extension rewrites each role
into a mkdocstrings cross-reference, resolved in the scope of the object whose
docstring holds it (the way Sphinx resolves it), and ends a paragraph that
introduces a literal block with one colon instead of reST's ``::``.

A target that cannot be resolved, or that lies outside the documented
packages or behind a private name, becomes plain inline code. A resolved
target that is not rendered anywhere is left to autorefs, which reports it
(an error under ``mkdocs build --strict``) rather than hiding a broken link.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<(.+)>$")
_LITERAL_INTRO = re.compile(r"(\S)::\n\n")
_DOCUMENTED = ("zerofn", "zerofn_torch")


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """Full path of ``target`` seen from ``obj``, or ``None``."""
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, AttributeError, KeyError):
        if head not in _DOCUMENTED:
            return None
        path = head
    full = f"{path}.{rest}" if rest else path
    parts = full.split(".")
    if parts[0] not in _DOCUMENTED or any(p.startswith("_") for p in parts):
        return None
    return full


def _rewrite(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        short, body = match.group(1), match.group(2).strip()
        titled = _TITLED.match(body)
        title, target = (titled.group(1), titled.group(2)) if titled else (body, body)
        if short:
            title = target.rsplit(".", 1)[-1]
        path = _resolve(obj, target)
        return f"[`{title}`][{path}]" if path else f"`{title}`"

    return _LITERAL_INTRO.sub(r"\1:\n\n", _ROLE.sub(replace, text))


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles as cross-references once a package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
