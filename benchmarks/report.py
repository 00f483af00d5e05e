"""What every benchmark returns, and how it is written out.

A benchmark returns a :class:`Section` record: its Markdown tables, the rows
it contributes to the summary table (:class:`Headline`: a ratio, or a measured
quantity, with its spread) and the curves it wants drawn (:class:`Panel`).
``run_all.py`` gathers the sections of all benchmarks into one Markdown page
and one figure; each benchmark script run alone prints its own sections.

Spreads: when two implementations take turns round by round, the ratio is taken
per round (zerofn's time in round *i* over PyTorch's in round *i*) and
summarised by its median and interquartile range, so that a slow moment of the
machine, which hits both turns of a round, cancels out of the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class Spread:
    """Median and quartiles of a sample (all three equal for a single value)."""

    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        """Summarise ``xs``; raises ``ValueError`` when it is empty."""
        if not xs:
            raise ValueError("cannot summarise an empty sample")
        if len(xs) == 1:
            return cls(xs[0], xs[0], xs[0], 1)
        q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(q2, q1, q3, len(xs))

    @classmethod
    def exact(cls, value: float) -> Spread:
        """A deterministic quantity (a byte count, a load): no spread."""
        return cls(value, value, value, 1)

    @classmethod
    def unmeasured(cls) -> Spread:
        """No measurement at all (a benchmark that could not run here): shown
        as "-", never drawn."""
        return cls(math.nan, math.nan, math.nan, 0)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def scaled(self, factor: float) -> Spread:
        return Spread(self.median * factor, self.q1 * factor, self.q3 * factor, self.n)

    def fmt(self, digits: int = 2) -> str:
        """``median`` alone when exact, else ``median [q1, q3]``; "-" when unmeasured."""
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.q1:.{digits}f}, {self.q3:.{digits}f}]"


def take_turns(
    runs: Mapping[str, Callable[[], object]], rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Time every one of ``runs`` once per round, who goes first rotating each
    round, each call after a ``dist.barrier()`` so that all ranks start it
    together. Returns the seconds of the last ``rounds`` rounds per name
    (the first ``warmup`` rounds run untimed), aligned round by round."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for k in range(len(names)):
            name = names[(k + r) % len(names)]
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return times


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """Spread of ``numerators[i] / denominators[i]`` over rounds ``i``."""
    if len(numerators) != len(denominators):
        raise ValueError(f"unpaired samples: {len(numerators)} vs {len(denominators)}")
    return Spread.of([a / b for a, b in zip(numerators, denominators, strict=True)])


def share_of(part: Sequence[float], whole: Sequence[float]) -> float:
    """How much of ``whole`` a part takes: the median over rounds of
    ``part[i] / whole[i]`` (samples aligned round by round)."""
    return paired_ratios(part, whole).median


def round_sums(*samples: Sequence[float]) -> list[float]:
    """Round-by-round sums of aligned samples (parts adding up to a floor)."""
    return [sum(values) for values in zip(*samples, strict=True)]


def floor_verdict(
    names: tuple[str, str],
    step: Sequence[float],
    floor: Sequence[float],
    reference: Sequence[float],
    reference_floor: Sequence[float] | None = None,
) -> str:
    """The clause that ends a missed ratio's why line: where ``step`` (the
    numerator, named ``names[0]``) sits against its floor and against
    ``reference`` (the denominator, ``names[1]``), all aligned round by round.

    With one floor for both (``reference_floor`` omitted) and the two steps
    apart by no more than the floor's own interquartile range, it says both
    sit at the same floor and how far ``step`` is from it; otherwise it gives
    each one's multiple of its floor.
    """
    name, ref = names
    over_ms = statistics.median(s - f for s, f in zip(step, floor, strict=True)) * 1e3
    if reference_floor is None:
        gap_ms = statistics.median(s - r for s, r in zip(step, reference, strict=True)) * 1e3
        spread_ms = Spread.of(floor).iqr * 1e3
        if abs(gap_ms) <= spread_ms:
            return (
                f"{name}'s step is {gap_ms:+.1f} ms from {ref}'s, within the floor's own "
                f"spread ({spread_ms:.1f} ms), so both sit at the same floor, {name} "
                f"{over_ms:+.1f} ms from it (overhead and noise)"
            )
        reference_floor = floor
    mine = paired_ratios(step, floor).median
    theirs = paired_ratios(reference, reference_floor).median
    return (
        f"{name} runs {mine:.2f}x its floor ({over_ms:+.1f} ms a step) and {ref} "
        f"{theirs:.2f}x {'the same' if reference_floor is floor else 'its own'}"
    )


@attrs.frozen
class Headline:
    """One row of the summary table: a ratio (or a measured quantity) and its target.

    Attributes:
        benchmark: what ran (model, world size).
        measure: what is measured; for a ratio, numerator first.
        value: its median and spread: a ratio, or the quantity ``measure`` names.
        target: the goal it is held to ("<= 0.8"), or "" when none.
        met: whether the median meets the target; ``None`` when there is none.
        short: a few words naming the row in the figure ("" = ``benchmark``).
        why: for a missed target, one line saying why (what bound the value
            sits near on this machine).

    Raises:
        ValueError: a target without a verdict (``met`` is ``None``): every
            row held to a target says whether it met it.
    """

    benchmark: str
    measure: str
    value: Spread
    target: str = ""
    met: bool | None = None
    short: str = ""
    why: str = ""

    def __attrs_post_init__(self) -> None:
        if self.target and self.met is None:
            raise ValueError(
                f"{self.benchmark}: {self.measure}: a target ({self.target!r}) needs a verdict"
            )

    @property
    def verdict(self) -> str:
        """``"yes"``, ``"no"``, or ``"-"`` where there is no target."""
        return "-" if self.met is None else "yes" if self.met else "no"


def _met(h: Headline) -> str:
    return f"no: {h.why}" if h.met is False and h.why else h.verdict


@attrs.frozen
class Curve:
    label: str
    x: tuple[float, ...] = attrs.field(converter=tuple)
    y: tuple[float, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"curve {self.label!r}: {len(self.x)} x values, {len(self.y)} y")


@attrs.frozen
class Panel:
    """One plot of the figure: curves over shared axes."""

    title: str
    x_label: str
    y_label: str
    curves: tuple[Curve, ...] = attrs.field(converter=tuple)
    log_x: bool = False
    log_y: bool = False


@attrs.frozen
class Section:
    """A benchmark's output: Markdown body, summary rows, plots, and the
    blocks other pages quote beside its summary rows (``blocks``: a
    ``<!-- bench:NAME:begin -->`` block's name -> its Markdown, see
    ``generated_blocks.quote_everywhere``)."""

    title: str
    body: str
    headlines: tuple[Headline, ...] = attrs.field(default=(), converter=tuple)
    panels: tuple[Panel, ...] = attrs.field(default=(), converter=tuple)
    seconds: float = 0.0
    blocks: Mapping[str, str] = attrs.field(factory=dict)

    def markdown(self) -> str:
        timing = f"\n\n_section took {self.seconds:.1f} s_" if self.seconds else ""
        return f"## {self.title}\n\n{self.body}{timing}"


def _numeric(value: object) -> bool:
    if isinstance(value, int | float):
        return True
    text = str(value).replace(",", "").removesuffix("x").split(" [")[0]
    if text in ("", "-"):  # an empty cell does not make a column textual
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; numeric columns right-aligned."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells, header {len(header)}: {row!r}")
    aligns = [
        "---:" if rows and all(_numeric(row[i]) for row in rows) else "---"
        for i in range(len(header))
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_table(headlines: Sequence[Headline]) -> str:
    """The summary table: one row per :class:`Headline`."""
    rows = [
        [
            h.benchmark,
            h.measure,
            h.value.fmt(),
            h.target or "-",
            _met(h),
        ]
        for h in headlines
    ]
    return md_table(
        ["benchmark", "measure", "median [q1, q3]", "target", "met"],
        rows,
    )


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


Bench = Callable[[bool], Section]
"""A benchmark: ``quick`` (a small smoke-run) -> its section."""


def run_benches(
    benches: Mapping[str, Bench], quick: bool, only: Iterable[str] | None = None
) -> list[Section]:
    """Run ``benches`` (those named in ``only``, when given) in order, printing
    each section as it finishes."""
    wanted = set(only or benches)
    unknown = wanted - set(benches)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {list(benches)}")
    sections = []
    for name, bench in benches.items():
        if name in wanted:
            started = time.perf_counter()
            section = attrs.evolve(bench(quick), seconds=time.perf_counter() - started)
            print("\n" + section.markdown(), flush=True)
            sections.append(section)
    return sections


def environment() -> str:
    """One line saying when and on what the numbers were taken."""
    return (
        f"{datetime.date.today().isoformat()}; torch {torch.__version__}; "
        f"Python {platform.python_version()}; {os.cpu_count()} CPU cores; {platform.machine()}."
    )


def parser_for(benches: Mapping[str, Bench], doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] or None)
    parser.add_argument("--quick", action="store_true", help="small models, few rounds")
    parser.add_argument("--only", action="append", choices=list(benches), help="run just these")
    return parser


def standalone_main(
    benches: Mapping[str, Bench], doc: str | None, argv: Sequence[str] | None = None
) -> None:
    """A benchmark script run alone: its sections and their summary, on stdout."""
    args = parser_for(benches, doc).parse_args(argv)
    print(environment())
    sections = run_benches(benches, args.quick, args.only)
    print("\n" + headline_table([h for s in sections for h in s.headlines]))
