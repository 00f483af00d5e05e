"""Figures outside the benchmark page, rewritten by ``make bench``.

README and the docs quote measured numbers only inside marked blocks::

    <!-- bench:NAME:begin -->
    ... written by make bench ...
    <!-- bench:NAME:end -->

:func:`blocks.rewrite_text` replaces what stands between the markers, so no page
keeps a number a later run contradicts; a page without the block is an
error (a block named in code but not on the page would silently not update).

README's block is the headline table: the few rows of :data:`README_ROWS`,
with short cells and a verdict, each linking to the page that shows it; the
full summary, with the why of every missed target, stays on
``docs/benchmarks.md``. The headline table is made from summary rows
(:class:`Row`), which come either from a run's :class:`~report.Headline`
records or, parsed back, from the summary table that run wrote on
``docs/benchmarks.md`` (:func:`summary_rows`), and both give the same table:
so README can be rebuilt from the committed page without a run
(:func:`rewrite_readme`; ``python benchmarks/run_all.py --rewrite-readme``).

Blocks of :data:`COUNTED` are counted, not measured (code lines against
PyTorch's, :mod:`code_lines`): they need no benchmark run, so every
``make bench`` rewrites them, ``--quick`` and ``--only`` included
(:func:`rewrite_counted`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import code_lines
from blocks import rewrite_block
from report import Headline, Section, headline_table, md_table

__all__ = [
    "COUNTED",
    "QUOTED",
    "README_ROWS",
    "Pick",
    "Row",
    "quote_everywhere",
    "readme_block",
    "readme_block_from_page",
    "readme_table",
    "rewrite_counted",
    "rewrite_readme",
    "summary_rows",
]

QUOTED: dict[str, tuple[str, ...]] = {
    "README.md": ("headlines",),
    "docs/powersgd.md": ("powersgd", "pays-at-powersgd"),
    "docs/overlap.md": ("overlap", "pays-at-overlap"),
    "docs/zero.md": ("zero-step", "modes"),
    "docs/compressed_exchange.md": (
        "compressed-bytes",
        "compressed-step",
        "compressed-soak",
        "pays-at-compressed",
    ),
    "docs/diloco.md": ("diloco", "diloco-codecs", "pays-at-diloco"),
    "docs/links.md": ("links",),
    "docs/resilience.md": ("elastic", "recovery"),
}
"""Each page that quotes measured numbers, and its blocks: ``headlines`` is
the headline table (:data:`README_ROWS`); a name one section lists in its
``blocks`` (the link section's ``pays-at-*``: the rate at which a feature
starts to pay) that section's Markdown; any other name one benchmark's
summary rows (a key of ``run_all.BENCHES``)."""

COUNTED: dict[str, tuple[str, Callable[[], str]]] = {
    code_lines.PAGE: (code_lines.BLOCK, code_lines.table),
}
"""Each page with a block that is counted rather than measured: the block's
name and what makes its contents (no benchmark runs)."""

BENCHMARKS_PAGE = "docs/benchmarks.md"
"""The page with every summary row (relative to the repository root)."""


@attrs.frozen
class Pick:
    """One row of README's headline table.

    Attributes:
        label: the row's words in README.
        page: the docs page that shows the result (from the repository root).
        benchmark: how the summary row's benchmark cell starts.
        measure: the summary row's measure, exactly.
        setting: a further part the benchmark cell must contain ("" = none).
    """

    label: str
    page: str
    benchmark: str
    measure: str
    setting: str = ""

    def matches(self, row: Row) -> bool:
        return (
            row.benchmark.startswith(self.benchmark)
            and self.setting in row.benchmark
            and row.measure == self.measure
        )


README_ROWS: tuple[Pick, ...] = (
    Pick(
        "ZeRO step (Adam): zerofn / PyTorch's ZeRO",
        "docs/zero.md",
        "ZeRO step (",
        "step time: zerofn / PyTorch",
        "bucket_view=False",
    ),
    Pick(
        "On a 1 Gbit/s link, int8 shard exchange: ZeRO step / PyTorch's",
        "docs/links.md",
        "link 1 Gbit/s: ZeRO step (",
        "step time: zerofn int8 / PyTorch",
    ),
    Pick(
        "On a 1 Gbit/s link, ZeRO step overlapped with DDP's backward: iteration / "
        "DDP + PyTorch's ZeRO step",
        "docs/links.md",
        "link 1 Gbit/s: DDP + ZeRO",
        "iteration time: overlapped / PyTorch's DDP + separate ZeRO step",
    ),
    Pick(
        "DDP + PowerSGD iteration: zerofn / PyTorch",
        "docs/powersgd.md",
        "DDP + PowerSGD",
        "iteration time: zerofn / PyTorch",
    ),
    Pick(
        "On a 1 Gbit/s link, DDP + PowerSGD rank 4: iteration / DDP's all-reduce",
        "docs/links.md",
        "link 1 Gbit/s: DDP + PowerSGD",
        "iteration time: zerofn PowerSGD / DDP all-reduce",
    ),
    Pick(
        "DiLoCo, a sync every 10 steps: bytes per step / DDP's",
        "docs/diloco.md",
        "DiLoCo H=10 ",
        "bytes per inner step: DiLoCo / DDP all-reduce",
    ),
    Pick(
        "bf16 + fp32 master shards: bytes per parameter, heaviest rank",
        "docs/mixed_precision.md",
        "mixed precision",
        "bytes/param, heaviest rank: zerofn bf16 + fp32 masters (live tensors)",
    ),
    Pick(
        "flat partition, GPT-2 small on 8 ranks: heaviest rank / PyTorch's",
        "docs/zero.md",
        "partition, GPT-2",
        "heaviest rank: flat / greedy (PyTorch's)",
    ),
)
"""README's headline table, in order: the results that matter most."""


@attrs.frozen
class Row:
    """A summary row as the page shows it: every cell as text, and the
    verdict alone (``"yes"``, ``"no"`` or ``"-"``), without its why."""

    benchmark: str
    measure: str
    value: str
    target: str
    met: str

    @classmethod
    def of(cls, h: Headline) -> Row:
        """The row ``h`` makes in the summary table."""
        return cls(h.benchmark, h.measure, h.value.fmt(), h.target or "-", h.verdict)


def summary_rows(page: str) -> list[Row]:
    """The rows of the summary table on the benchmark page's text ``page``
    (as :func:`report.headline_table` wrote it under ``## Summary``).

    Raises:
        ValueError: the page has no summary table, or a row has other cells.
    """
    _, heading, after = page.partition("\n## Summary\n")
    table = after.strip("\n").split("\n\n", 1)[0]
    if not heading or not table.startswith("| "):
        raise ValueError("the page has no '## Summary' table")
    rows = []
    for line in table.splitlines()[2:]:
        cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
        if len(cells) != 5:
            raise ValueError(f"a summary row has {len(cells)} cells, not 5: {line!r}")
        benchmark, measure, value, target, met = cells
        rows.append(Row(benchmark, measure, value, target, met.split(":", 1)[0]))
    return rows


def readme_table(rows: Sequence[Row]) -> str:
    """README's headline table: one row per :data:`README_ROWS` entry, found
    among ``rows``.

    Raises:
        ValueError: a pick matches no row or several, or its row has a target
            and no verdict.
    """
    lines = []
    for pick in README_ROWS:
        found = [row for row in rows if pick.matches(row)]
        if len(found) != 1:
            raise ValueError(f"headline {pick.label!r} matches {len(found)} summary rows, not 1")
        row = found[0]
        if row.target != "-" and row.met not in ("yes", "no"):
            raise ValueError(f"headline {pick.label!r} has a target and no verdict")
        lines.append([f"[{pick.label}]({pick.page})", row.value, row.target, row.met])
    return md_table(["result", "median [q1, q3]", "target", "met"], lines)


def readme_block(rows: Sequence[Row], when: str) -> str:
    """The contents of README's ``headlines`` block."""
    return (
        f"_Measured by `make bench` on {when} Every row, with the why of each missed "
        f"target: [{BENCHMARKS_PAGE}]({BENCHMARKS_PAGE})._\n\n{readme_table(rows)}"
    )


def _measured_on(page: str) -> str:
    """When and on what the page's numbers were taken (what
    :func:`report.environment` said), from its first line saying so."""
    found = re.search(r"Measured by `make bench` on (.*?\.)(?=\s)", page)
    if found is None:
        raise ValueError("the page does not say when it was measured")
    return found.group(1)


def readme_block_from_page(page: str) -> str:
    """README's ``headlines`` block, from the benchmark page's text alone."""
    return readme_block(summary_rows(page), _measured_on(page))


def rewrite_readme(root: str) -> None:
    """Rebuild README's headline block under ``root`` from the summary table
    on ``docs/benchmarks.md`` (no benchmark runs)."""
    with open(os.path.join(root, BENCHMARKS_PAGE), encoding="utf-8") as f:
        page = f.read()
    rewrite_block(os.path.join(root, "README.md"), "headlines", readme_block_from_page(page))


def _body(rows: str, when: str) -> str:
    return f"_Measured by `make bench` on {when}_\n\n{rows}"


def quote_everywhere(root: str, sections: Mapping[str, Section], when: str) -> list[str]:
    """Rewrite every block of :data:`QUOTED` under ``root`` from ``sections``
    (benchmark name -> its section, all of them from one run).

    Returns:
        The pages rewritten.

    Raises:
        KeyError: a block names neither a section's own block nor a benchmark
            in ``sections``.
        ValueError: a page lacks one of its blocks.
    """
    everything = [Row.of(h) for section in sections.values() for h in section.headlines]
    extra = {name: text for s in sections.values() for name, text in s.blocks.items()}
    for page, names in QUOTED.items():
        path = os.path.join(root, page)
        for name in names:
            if name == "headlines":
                body = readme_block(everything, when)
            elif name in extra:
                body = _body(extra[name], when)
            else:
                body = _body(headline_table(sections[name].headlines), when)
            rewrite_block(path, name, body)
    return list(QUOTED)


def rewrite_counted(root: str) -> list[str]:
    """Rewrite every block of :data:`COUNTED` under ``root``.

    Returns:
        The pages rewritten.
    """
    for page, (name, make) in COUNTED.items():
        rewrite_block(os.path.join(root, page), name, make())
    return list(COUNTED)


if __name__ == "__main__":
    # python benchmarks/generated_blocks.py: README's headline table from the
    # committed docs/benchmarks.md, without the benchmarks' own dependencies.
    rewrite_readme(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(f"README.md's headline table rebuilt from {BENCHMARKS_PAGE}")
