"""The code-line counter of ``benchmarks/code_lines.py`` and the block it fills.

Pure and fast: one synthetic source counted exactly, every feature's files
found, and ``docs/design.md``'s ``code-lines`` block equal to what the script
prints now (so a change that moves the counts must regenerate the block).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import code_lines

SOURCE = '''\
"""A module docstring
over two lines."""

# a comment line
import os  # a trailing comment


def f(a, b):
    """A function docstring
    spanning
    three lines."""
    # another comment

    x = (
        a
        + b  # inside a multi-line expression
    )
    return x


class C:
    """One line."""

    text = """a multi-line string
that is no docstring"""

    def g(self):
        return 1
'''
"""Code lines: ``import os``, ``def f``, the four lines of ``x = (...)``,
``return x``, ``class C``, the two lines of ``text``, ``def g``, ``return 1``."""


def test_the_counter_counts_only_lines_with_code() -> None:
    assert code_lines.count_code_lines(SOURCE) == 12


def test_an_empty_file_and_a_docstring_alone_have_no_code_lines() -> None:
    assert code_lines.count_code_lines("") == 0
    assert code_lines.count_code_lines('"""Only a docstring."""\n# and a comment\n') == 0


def test_every_feature_has_files_on_both_sides_and_they_exist() -> None:
    for feature in code_lines.FEATURES:
        ours = code_lines.resolve(code_lines.ROOT, feature.ours, feature.ours_minus)
        theirs = code_lines.resolve(code_lines.TORCH, feature.theirs)
        assert ours and theirs, feature.name
        for base, paths in ((code_lines.ROOT, ours), (code_lines.TORCH, theirs)):
            for path in paths:
                assert os.path.isfile(os.path.join(base, path)), path
        assert not set(feature.ours_minus) & set(ours), feature.name


def test_the_design_pages_block_is_what_the_script_prints() -> None:
    with open(os.path.join(code_lines.ROOT, "docs", "design.md"), encoding="utf-8") as f:
        page = f.read()
    found = re.findall(
        r"<!-- bench:code-lines:begin -->\n(.*?)<!-- bench:code-lines:end -->", page, re.DOTALL
    )
    assert len(found) == 1, "docs/design.md needs exactly one bench:code-lines block"
    assert found[0] == code_lines.table() + "\n", (
        "docs/design.md's code-lines block is stale: regenerate it with "
        "`python benchmarks/code_lines.py --write` (or any `make bench`, "
        "`BENCH_ARGS=--quick` included)"
    )
