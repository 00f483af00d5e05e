"""The code-line counter of ``benchmarks/code_lines.py`` and the block it fills.

Pure and fast: one synthetic source counted exactly, every feature's files
found, and ``docs/design.md``'s ``code-lines`` block equal to what the script
prints now (so a change that moves the counts must regenerate the block).
"""

from __future__ import annotations

import ast
import os
import re
import sys

import pytest

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


def test_top_level_spans_of_a_source() -> None:
    tree = ast.parse(SOURCE)
    spans = code_lines.top_level_spans(tree)
    assert set(spans) == {"f", "C", "C.g"}
    assert spans["f"] == range(8, 19) and spans["C"] == range(21, 29)
    assert spans["C.g"] == range(27, 29)


def test_every_beyond_row_names_what_exists_and_claims_its_own_lines() -> None:
    rows = code_lines.beyond_counts()
    assert [name for name, _, _ in rows] == [row.name for row in code_lines.BEYOND]
    assert all(n > 0 for _, _, n in rows)


@pytest.mark.parametrize(
    "row",
    [
        code_lines.Beyond(
            "a missing name",
            "PowerSGD",
            definitions=("zerofn/hooks/powersgd/state.py:no_such_function",),
        ),
        code_lines.Beyond("a file of another feature", "PowerSGD", files=("zerofn/join.py",)),
    ],
)
def test_a_beyond_row_naming_what_is_not_there_fails_the_count(
    monkeypatch: pytest.MonkeyPatch, row: code_lines.Beyond
) -> None:
    monkeypatch.setattr(code_lines, "BEYOND", (row,))
    with pytest.raises(LookupError):
        code_lines.beyond_counts()


def test_two_beyond_rows_claiming_one_line_fail_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    path = "zerofn/hooks/powersgd/config.py"
    rows = (
        code_lines.Beyond("the file", "PowerSGD", files=(path,)),
        code_lines.Beyond("a function in it", "PowerSGD", definitions=(path + ":PowerSGDConfig",)),
    )
    monkeypatch.setattr(code_lines, "BEYOND", rows)
    with pytest.raises(LookupError, match="claims lines"):
        code_lines.beyond_counts()


def test_every_feature_has_files_on_both_sides_and_they_exist() -> None:
    for feature in code_lines.FEATURES:
        ours = code_lines.resolve(code_lines.ROOT, feature.ours, feature.ours_minus)
        theirs = code_lines.resolve(code_lines.TORCH, feature.theirs)
        assert ours and theirs, feature.name
        for base, paths in ((code_lines.ROOT, ours), (code_lines.TORCH, theirs)):
            for path in paths:
                assert os.path.isfile(os.path.join(base, path)), path
        assert not set(feature.ours_minus) & set(ours), feature.name


def test_make_bench_writes_the_design_pages_block(tmp_path: pytest.TempPathFactory) -> None:
    """The block is generated (what every ``make bench`` runs), not checked
    for its figures: a copy of the page, rewritten, holds the script's table."""
    import generated_blocks

    assert generated_blocks.COUNTED["docs/design.md"][0] == "code-lines"
    docs = tmp_path / "docs"  # type: ignore[operator]
    docs.mkdir()
    with open(os.path.join(code_lines.ROOT, "docs", "design.md"), encoding="utf-8") as f:
        (docs / "design.md").write_text(f.read())
    assert generated_blocks.rewrite_counted(str(tmp_path)) == ["docs/design.md"]
    found = re.findall(
        r"<!-- bench:code-lines:begin -->\n(.*?)<!-- bench:code-lines:end -->",
        (docs / "design.md").read_text(),
        re.DOTALL,
    )
    assert found == [code_lines.table() + "\n"]
