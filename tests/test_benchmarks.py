"""The benchmark reporting helpers and the pure benchmark sections.

The timed sections run in CI through ``make bench BENCH_ARGS=--quick``; here
only what is pure: the summary records, the Markdown writer, and the partition
and scaling sections (which must keep meeting their own claims).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import bench_zero
from report import Spread, md_table, paired_ratios

samples = st.lists(st.floats(0.001, 1e3, allow_nan=False), min_size=1, max_size=50)


@given(samples)
def test_spread_orders_its_quartiles(xs: list[float]) -> None:
    s = Spread.of(xs)
    assert min(xs) <= s.q1 <= s.median <= s.q3 <= max(xs)
    assert s.n == len(xs)
    assert s.iqr >= 0


@given(samples, st.floats(0.1, 10))
def test_paired_ratios_of_a_scaled_sample_are_the_scale(xs: list[float], k: float) -> None:
    r = paired_ratios([k * x for x in xs], xs)
    assert r.median == pytest.approx(k)
    assert r.q1 == pytest.approx(k) and r.q3 == pytest.approx(k)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        Spread.of([])
    with pytest.raises(ValueError, match="unpaired"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="cells"):
        md_table(["a", "b"], [[1]])


def test_md_table_right_aligns_numeric_columns() -> None:
    table = md_table(["name", "ms"], [["x", "1.5 [1.0, 2.0]"], ["y", "-"]])
    assert table.splitlines()[1] == "| --- | ---: |"


def test_imbalance_section_keeps_its_claims() -> None:
    section = bench_zero.bench_imbalance(quick=True)
    flat_vs_greedy = [h for h in section.headlines if "flat / greedy" in h.measure]
    assert flat_vs_greedy and all(h.value.median <= 1.0 for h in flat_vs_greedy)
    assert all(h.met is not False for h in section.headlines)
    assert "| GPT-2 small" in section.body


def test_scaling_section_reports_growth_per_function() -> None:
    section = bench_zero.bench_scaling(quick=True)
    measured = {h.measure.split(" time")[0] for h in section.headlines}
    assert {"greedy", "balanced", "flat", "assign_buckets"} <= measured
    assert [c.label for c in section.panels[0].curves] == [
        "greedy",
        "balanced",
        "flat",
        "assign_buckets",
    ]
