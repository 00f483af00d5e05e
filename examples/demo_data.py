"""The demo's text: the English of the Python standard library's docstrings, as bytes.

Every Python installation ships it, so nothing is downloaded. The text is the
docstrings (module, class and function, cleaned of their indentation) of the
top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]``, in sorted
order, a blank line between two, concatenated until ``max_bytes``; the last
``held_out`` fraction (other modules' docstrings than the training part,
mostly) is kept aside to measure the loss on text the model never trained on.
Prose rather than source, so that a model trained long enough writes words a
reader recognises. Tokens are bytes (a vocabulary of 256), so any text decodes.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

VOCAB = 256
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_WORD = re.compile(rb"[A-Za-z]+")
MIN_WORD = 3  # shorter words ("a", "s", "is") would pass as known by chance


@attrs.frozen
class Corpus:
    """The demo's text as token ids (one per byte).

    Attributes:
        train: the training part, ``uint8``.
        held_out: the tail kept aside for the held-out loss, ``uint8``.
        files: how many source files the text came from.
    """

    train: torch.Tensor
    held_out: torch.Tensor
    files: int


def stdlib_sources(root: str | None = None) -> list[Path]:
    """The top-level ``*.py`` files of the standard library (or of ``root``), sorted."""
    directory = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    return sorted(p for p in directory.glob("*.py") if p.is_file())


def docstrings(source: bytes) -> Iterator[str]:
    """The docstrings of a module's source, module first, then in the order
    ``ast.walk`` meets classes and functions; none if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python this interpreter reads
        return
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node)
            if text:
                yield text


def load_corpus(
    max_bytes: int = 4_000_000, held_out: float = 0.05, root: str | None = None
) -> Corpus:
    """Up to ``max_bytes`` of standard-library docstrings, split into training and held-out text.

    Raises:
        ValueError: fewer bytes than a few batches need, or ``held_out`` not in (0, 1).
    """
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    chunks: list[bytes] = []
    files = total = 0
    for path in stdlib_sources(root):
        if total >= max_bytes:
            break
        texts = [t.encode() for t in docstrings(path.read_bytes())]
        if not texts:
            continue
        data = (b"\n\n".join(texts) + b"\n\n")[: max_bytes - total]
        chunks.append(data)
        files += 1
        total += len(data)
    if total < 10_000:
        raise ValueError(f"only {total} bytes of docstrings found under {root!r}")
    text = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    split = int(len(text) * (1 - held_out))
    return Corpus(train=text[:split], held_out=text[split:], files=files)


def _words(data: bytes) -> list[bytes]:
    """Runs of ASCII letters of at least ``MIN_WORD``, lower-cased."""
    return [w.lower() for w in _WORD.findall(data) if len(w) >= MIN_WORD]


def vocabulary(text: torch.Tensor) -> frozenset[bytes]:
    """The words of ``text`` (``uint8`` tokens), as :func:`known_word_share` reads them."""
    return frozenset(_words(bytes(text.tolist())))


def known_word_share(sample: bytes, known: frozenset[bytes]) -> float:
    """The share of ``sample``'s words (runs of ASCII letters of at least
    ``MIN_WORD``, lower-cased) that are in ``known``: how much of a generated
    text a reader would recognise. 0 when it has no words at all."""
    words = _words(sample)
    return sum(w in known for w in words) / len(words) if words else 0.0


def batch(
    text: torch.Tensor, step: int, seed: int, global_batch: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: ``global_batch`` windows of ``context``
    tokens at offsets drawn from ``(seed, step)``, and the same windows shifted
    by one (the targets). Every rank draws the same batch and trains on its slice."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - context - 1, (global_batch,), generator=generator)
    windows = torch.stack([text[s : s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def rank_slice(
    xy: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s equal share of a global batch."""
    x, y = xy
    per_rank = len(x) // world_size
    lo = rank * per_rank
    return x[lo : lo + per_rank], y[lo : lo + per_rank]


def printable(data: bytes) -> str:
    """Generated bytes as text a terminal shows safely: invalid UTF-8 becomes
    U+FFFD, control characters other than newline and tab become '.'."""
    text = data.decode("utf-8", errors="replace")
    return "".join(c if c in "\n\t" or c.isprintable() else "." for c in text)
