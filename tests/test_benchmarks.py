"""The benchmark reporting helpers and the pure benchmark sections.

The timed sections run in CI through ``make bench BENCH_ARGS=--quick``; here
only what is pure: the summary records, the Markdown writer, the partition
and scaling sections (which must keep meeting their own claims), the soak's
growth and section from made-up traces, the lines that say why a timed
target was missed (from made-up timings), and the mixed-precision
benchmark's model, planned bytes and live-tensor count (on one in-process
rank).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import bench_modes
import bench_overlap
import bench_precision
import bench_soak
import bench_zero
import blocks
import elastic_costs
import elastic_join
import elastic_loss
import elastic_setup
import generated_blocks
from report import (
    Headline,
    Spread,
    floor_verdict,
    headline_table,
    md_table,
    paired_ratios,
    round_sums,
)

from zerofn.model_shapes import MODELS
from zerofn.zero.planning.partition import Piece

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
    assert all(h.verdict in ("yes", "no") for h in section.headlines if h.target)
    assert [c.label for c in section.panels[0].curves] == [
        "greedy",
        "balanced",
        "flat",
        "assign_buckets",
    ]


def test_growth_is_held_to_n_log_n_and_a_miss_says_why() -> None:
    linear = bench_zero.growth_headline("greedy", 10_000, 100_000, 0.01, 0.1)
    assert (linear.target, linear.met, linear.why) == ("<= 12.5 (n log n)", True, "")
    steeper = bench_zero.growth_headline("greedy", 10_000, 100_000, 0.01, 0.2)
    assert steeper.met is False and steeper.value.median == pytest.approx(20.0)
    assert "1.00 µs per parameter at 10,000 and 2.00 µs at 100,000" in steeper.why


STEPS = tuple(range(0, 2001, 100))


def _trace(
    rss_per_step: float = 0.0, unequal_from: int | None = None, wobble: int = 0
) -> bench_soak.RankTrace:
    """A made-up soak trace: RSS ``300 MiB + rss_per_step * step`` (+/- ``wobble``
    bytes, alternating), replicas unequal from step ``unequal_from`` on."""
    rss = [
        300 * 2**20 + int(rss_per_step * s) + (wobble if k % 2 else -wobble)
        for k, s in enumerate(STEPS)
    ]
    equal = [unequal_from is None or s < unequal_from for s in STEPS]
    return bench_soak.RankTrace(
        steps=STEPS,
        rss=rss,
        equal=equal,
        diff=[0.0 if eq else 1e-7 for eq in equal],
        loss=[float("nan")] + [1.0 / (1 + s) for s in STEPS[1:]],
        first_loss=0.4,
        seconds=60.0,
    )


def test_rss_growth_of_a_steady_leak_is_its_rate() -> None:
    leak = 2**20 / 1000  # one MiB per 1,000 steps
    g = bench_soak.rss_growth(STEPS, _trace(leak).rss, warmup=200)
    assert (g.start_step, g.end_step) == (200, 2000)
    assert g.mib == pytest.approx(1.8, abs=1e-5)
    assert g.mib_per_1000 == pytest.approx(1.0, abs=1e-5)
    assert g.trend == pytest.approx(1.0, abs=1e-5)


def test_rss_trend_ignores_what_only_the_ends_show() -> None:
    # Flat RSS wobbling 1 MiB either side of its level: the ends (low at step
    # 200, high at 1900) differ by 2 MiB, the fit sees next to nothing.
    g = bench_soak.rss_growth(STEPS[:-1], _trace(wobble=2**20).rss[:-1], warmup=200)
    assert g.mib == pytest.approx(2.0)
    assert abs(g.trend) < 0.5


def test_rss_growth_needs_two_checks_after_warmup() -> None:
    with pytest.raises(ValueError, match="two checks"):
        bench_soak.rss_growth(STEPS, _trace().rss, warmup=2000)


def test_soak_section_meets_its_targets_when_flat_and_equal() -> None:
    section = bench_soak.soak_section([_trace(), _trace()], warmup=200, setup="MLP")
    equal, growth = section.headlines
    assert (equal.value.median, equal.target, equal.met) == (1.0, "== 1", True)
    assert growth.met is True and growth.value.median == pytest.approx(0.0)
    assert "bitwise equal at all 21 checks" in section.body
    assert [c.label for c in section.panels[0].curves] == ["rank 0", "rank 1"]
    assert section.panels[0].curves[0].y[0] == pytest.approx(300.0)


def test_soak_section_reports_drift_and_a_leak() -> None:
    leak = 10 * 2**20 / 1000  # 10 MiB per 1,000 steps, on rank 1 only
    traces = [_trace(unequal_from=700), _trace(leak, unequal_from=700)]
    section = bench_soak.soak_section(traces, warmup=200, setup="MLP")
    equal, growth = section.headlines
    assert (equal.value.median, equal.met) == (0.0, False)
    assert growth.met is False and growth.value.median == pytest.approx(10.0)
    assert "NOT bitwise equal** at 14 of 21 checks, first at step 700" in section.body
    assert bench_soak.first_unequal_step(traces) == 700


def test_soak_section_without_a_target_does_not_judge_growth() -> None:
    leak = 10 * 2**20 / 1000
    section = bench_soak.soak_section([_trace(leak)], 200, "MLP", growth_target=None)
    growth = section.headlines[1]
    assert (growth.target, growth.met) == ("", None)
    assert growth.value.median == pytest.approx(10.0)
    assert "without a target" in section.body


def test_rank_trace_is_read_from_what_a_rank_returns() -> None:
    trace = _trace()
    returned = {**attrs.asdict(trace), "numel": 1, "buckets": 2, "compression": 3.0}
    assert bench_soak.RankTrace.of(returned) == trace


def test_mode_rows_hold_each_setting_against_the_floor_of_its_kernel() -> None:
    rounds = 3
    times = {label: [0.2] * rounds for label, *_ in bench_modes.SETTINGS}
    times |= {label: [0.4] * rounds for label in bench_modes.PYTORCH}
    times |= {"update alone, default": [0.15] * rounds, "update alone, fused": [0.05] * rounds}
    times["exchange alone"] = [0.05] * rounds
    rows, to_floor = bench_modes._rows(times)
    default, fused = bench_modes.SETTINGS[0][0], bench_modes.SETTINGS[-1][0]
    assert to_floor[default].median == pytest.approx(1.0)  # 0.2 / (0.15 + 0.05)
    assert to_floor[fused].median == pytest.approx(2.0)  # 0.2 / (0.05 + 0.05)
    assert len(rows) == len(bench_modes.SETTINGS) + len(bench_modes.PYTORCH) + 2


def test_precision_model_has_gpt2_small_structure() -> None:
    assert bench_precision.gpt2_like(768, 3072, 50257, 1024, 12) == MODELS["gpt2-small"]()
    _, quick = bench_precision.model_shapes(quick=True)
    assert 2e6 < sum(math.prod(s) for s in quick) < 10e6


def test_precision_planned_bytes_follow_the_formulas() -> None:
    planned = bench_precision.computed_bytes_per_param(MODELS["gpt2-small"](), 8)
    assert planned["fp32"] == pytest.approx(bench_precision.pytorch_formula(8), rel=1e-4)
    assert planned["bf16"] == pytest.approx(bench_precision.target_formula(8), rel=1e-4)
    # Whole-tensor ownership: the embedding alone outweighs 1/8 of the model.
    assert planned["torch"] > bench_precision.pytorch_formula(8) + 1


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("setup", ["torch", "fp32", "bf16"])
def test_precision_counts_every_live_tensor_once(setup: str) -> None:
    shapes = [(16, 8), (8,), (8, 4)]
    numel = sum(math.prod(s) for s in shapes)
    opt, params = bench_precision._build(setup, shapes)
    opt.step()
    counted, _ = bench_precision.count_bytes(opt, params)
    width = 2 if setup == "bf16" else 4
    assert counted["parameters"] == counted["gradients"] == width * numel
    assert counted["masters"] == (4 * numel if setup == "bf16" else 0)
    # Adam's two fp32 moments on every element (one rank), and 4-byte step counters.
    assert counted["optimizer_state"] - 8 * numel in range(4, 4 * len(shapes) + 1)
    if setup != "torch":
        api = opt.memory_bytes()
        assert api["parameters"] == counted["parameters"]
        assert api["gradients"] == counted["gradients"]
        assert api["master_weights"] == counted["masters"]
        assert api["optimizer_state"] == counted["optimizer_state"]
    del opt
    assert all(p.dtype == (torch.bfloat16 if setup == "bf16" else torch.float32) for p in params)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_block_is_rewritten_between_its_markers_only() -> None:
    text = "a 0.64\n<!-- bench:x:begin -->\nold 1.13\n<!-- bench:x:end -->\nz\n"
    new = blocks.rewrite_text(text, "x", "| new |\n")
    assert new == "a 0.64\n<!-- bench:x:begin -->\n| new |\n<!-- bench:x:end -->\nz\n"
    with pytest.raises(ValueError, match="found 0"):
        blocks.rewrite_text(text, "y", "")
    with pytest.raises(ValueError, match="found 2"):
        blocks.rewrite_text(text + text, "x", "")


@pytest.mark.parametrize("page", sorted(generated_blocks.QUOTED))
def test_every_page_that_quotes_figures_has_its_generated_blocks(page: str) -> None:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    for name in generated_blocks.QUOTED[page]:
        blocks.rewrite_text(text, name, "")  # raises unless exactly one block


def test_a_target_without_a_verdict_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a verdict"):
        Headline("b", "m", Spread.exact(1.0), "<= 1.0")
    assert Headline("b", "m", Spread.exact(1.0)).verdict == "-"


def _made_up_headlines() -> list[Headline]:
    """A summary with every README pick in it, and rows beside them."""
    rows = [
        Headline(
            f"{pick.benchmark}x{', ' + pick.setting if pick.setting else ''})",
            pick.measure,
            Spread.of([0.5, 0.6, 0.7, 0.8]) if k % 2 else Spread.exact(0.25),
            "<= 1.0" if k % 3 else "",
            True if k % 3 == 1 else False if k % 3 == 2 else None,
            why="the parts say so" if k % 3 == 2 else "",
        )
        for k, pick in enumerate(generated_blocks.README_ROWS)
    ]
    rows.append(Headline("other", "not a headline", Spread.exact(2.0), "<= 1.0", False))
    return rows


def test_readme_gets_a_short_headline_table_with_a_verdict_on_every_target() -> None:
    assert len(generated_blocks.README_ROWS) <= 8
    rows = [generated_blocks.Row.of(h) for h in _made_up_headlines()]
    lines = generated_blocks.readme_table(rows).splitlines()[2:]
    assert len(lines) == len(generated_blocks.README_ROWS)
    for line in lines:
        cells = line.strip("| ").split(" | ")
        target, met = cells[-2], cells[-1]
        assert met in ("yes", "no") if target != "-" else met == "-"
        assert "parts say so" not in line  # the why stays on the full page
    assert "not a headline" not in "\n".join(lines)


def test_a_missing_or_ambiguous_headline_is_refused() -> None:
    rows = [generated_blocks.Row.of(h) for h in _made_up_headlines()]
    with pytest.raises(ValueError, match="matches 0 summary rows"):
        generated_blocks.readme_table(rows[1:])
    with pytest.raises(ValueError, match="matches 2 summary rows"):
        generated_blocks.readme_table([*rows, rows[0]])


def test_readme_from_a_run_equals_readme_from_the_page_it_wrote() -> None:
    headlines = _made_up_headlines()
    page = (
        "# Benchmarks\n\nMeasured by `make bench` on 2026-01-02; torch 2.13.0+cpu; x86_64. "
        f"Every timing ...\n\n## Summary\n\n{headline_table(headlines)}\n\n![x](y.png)\n"
    )
    from_run = generated_blocks.readme_block(
        [generated_blocks.Row.of(h) for h in headlines], "2026-01-02; torch 2.13.0+cpu; x86_64."
    )
    assert generated_blocks.readme_block_from_page(page) == from_run
    assert generated_blocks.summary_rows(page) == [generated_blocks.Row.of(h) for h in headlines]


def test_readmes_headline_block_is_made_from_the_benchmark_page() -> None:
    with open(os.path.join(ROOT, generated_blocks.BENCHMARKS_PAGE), encoding="utf-8") as f:
        page = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    expected = generated_blocks.readme_block_from_page(page)
    assert blocks.rewrite_text(readme, "headlines", expected) == readme, (
        "README's headline table is not what docs/benchmarks.md makes: "
        "run python benchmarks/generated_blocks.py"
    )


# ----------------------------------------------------------------------------
# Why a timed target was missed, from made-up rounds (seconds per round)


def test_a_missed_headline_shows_its_why_in_the_met_column() -> None:
    missed = Headline("b", "m", Spread.exact(1.2), "<= 1.0", False, why="the parts say so")
    bare = Headline("b", "m", Spread.exact(1.2), "<= 1.0", False)
    rows = headline_table([missed, bare]).splitlines()[2:]
    assert rows[0].endswith("| no: the parts say so |")
    assert rows[1].endswith("| no |")


@given(samples, samples)
def test_equal_steps_sit_at_one_shared_floor(steps: list[float], floor: list[float]) -> None:
    n = min(len(steps), len(floor))
    verdict = floor_verdict(("a", "b"), steps[:n], floor[:n], steps[:n])
    assert "same floor" in verdict and "+0.0 ms from b's" in verdict


@given(samples, samples)
def test_steps_with_their_own_floors_are_each_held_to_theirs(
    steps: list[float], floor: list[float]
) -> None:
    n = min(len(steps), len(floor))
    verdict = floor_verdict(("a", "b"), steps[:n], floor[:n], steps[:n], floor[:n])
    assert "same floor" not in verdict and verdict.endswith("x its own")


def test_steps_apart_beyond_the_floor_spread_get_their_multiples() -> None:
    verdict = floor_verdict(("a", "b"), [0.3, 0.3, 0.3], [0.1, 0.1, 0.1], [0.2, 0.2, 0.2])
    assert verdict == "a runs 3.00x its floor (+200.0 ms a step) and b 2.00x the same"


def _zero_parts(update: float, sent: float) -> dict[str, list[float]]:
    return {
        bench_zero.UPDATE: [update] * 3,
        bench_zero.BYTES: [sent] * 3,
        bench_zero.COPY: [0.01] * 3,
    }


def test_zero_step_miss_names_its_parts_and_their_floor() -> None:
    # The update and the bytes alone fill 0.9 of PyTorch's step: above the target.
    line = bench_zero.missed_step_line([0.1] * 3, [0.1] * 3, _zero_parts(0.05, 0.04), True)
    assert "update alone takes 0.50 of PyTorch's step" in line
    assert "fp32 bytes alone 0.40, 0.90 together" in line
    assert "no step doing both in turn goes below that" in line
    assert "same floor" in line and "copies" not in line


def test_zero_step_miss_without_bucket_views_names_the_copy() -> None:
    # Floor 0.5 of PyTorch's step; zerofn twice as far above it as PyTorch.
    line = bench_zero.missed_step_line([0.2] * 3, [0.1] * 3, _zero_parts(0.03, 0.02), False)
    assert "no step doing both" not in line
    assert "copies the model through its flat buffer (0.10 alone)" in line
    assert line.endswith(
        "zerofn runs 4.00x its floor (+150.0 ms a step) and PyTorch 2.00x the same"
    )


def _mode_times(rounds: int = 3) -> dict[str, list[float]]:
    times = {label: [0.2] * rounds for label, *_ in bench_modes.SETTINGS}
    times |= {label: [0.4] * rounds for label in bench_modes.PYTORCH}
    for kernel in bench_modes.KERNELS:
        times[f"update alone, {kernel}"] = [0.05] * rounds
        times[bench_modes.whole(kernel)] = [0.08] * rounds
    times[bench_modes.EXCHANGE] = [0.05] * rounds
    times[bench_modes.COPY] = [0.01] * rounds
    return times


def test_copies_without_bucket_views_are_every_share_and_flat_its_own_again() -> None:
    assert bench_modes.copied_shares("greedy", True) == bench_modes.copied_shares("flat", True) == 0
    assert bench_modes.copied_shares("balanced", False, world_size=4) == 4
    assert bench_modes.copied_shares("flat", False, world_size=4) == 5


def test_worst_mode_miss_adds_up_the_settings_own_parts() -> None:
    line = bench_modes.worst_line(_mode_times(), "zerofn flat, bucket_view=False, fused")
    assert "the floor (100.0 ms) is the fused update alone (0.50 of it)" in line
    assert "update over whole tensors alone takes 0.80" in line
    assert "its copies of 3 shares without bucket views 0.30" in line
    # 0.8 + 0.5 + 0.3 of the floor; the step is 2.0 of it: 40 ms left, no spread.
    assert "own parts come to 1.60 of the floor and the step 2.00" in line
    assert "the rest (40.0 ms a step) beyond the floor's own spread (0.0 ms)" in line


def test_worst_mode_miss_of_flat_per_tensor_loop_keeps_the_floors_update() -> None:
    line = bench_modes.worst_line(_mode_times(), "zerofn flat, bucket_view=True, default")
    assert "whole tensors" not in line and "copies" not in line
    assert "own parts come to 1.00 of the floor" in line


def test_flat_over_greedy_miss_names_what_differs_between_them() -> None:
    times = _mode_times()
    times["zerofn flat, bucket_view=False, default"] = [0.25] * 3
    line = bench_modes.flat_greedy_line(times, "default", bucket_view=False)
    assert "update alone (0.25 of greedy's step) plus the exchange alone (0.25)" in line
    assert "greedy's, over whole tensors, takes 0.40 alone" in line
    assert "flat copies 1 share more a step than greedy (0.05 alone)" in line
    assert line.endswith("flat runs 2.50x its floor (+150.0 ms a step) and greedy 2.00x the same")
    fused = bench_modes.flat_greedy_line(times, "fused", bucket_view=True)
    assert "whole tensors" not in fused and "same floor" in fused


def test_overlap_miss_sets_the_reduction_against_the_all_reduce() -> None:
    times = {name: [0.1] * 3 for name in bench_overlap.PARTS}
    times[bench_overlap.ALL_REDUCE] = [0.2] * 3
    times |= {"overlapped": [1.2] * 3, "pytorch": [1.0] * 3}
    line = bench_overlap.missed_time_line(times, "pytorch", "the PyTorch iteration")
    assert "forward + backward alone take 0.10 of the PyTorch iteration" in line
    assert "gradients 0.10 reduced to their owners (0.20 all-reduced)" in line
    assert "0.40 in all (0.50 with the all-reduce)" in line
    assert line.endswith(
        "overlapped iteration runs 3.00x its floor (+800.0 ms a step) and the "
        "PyTorch iteration 2.00x its own"
    )


def test_the_gather_behind_the_forward_is_set_against_what_hiding_could_save() -> None:
    times = {name: [0.01] * 3 for name in bench_overlap.PARTS}
    times[bench_overlap.BROADCAST] = [0.1] * 3
    times[bench_overlap.SEPARATE_ROW] = [0.8] * 3  # 0.2 s an iteration
    times[bench_overlap.GATHERED_ROW] = [0.72] * 3  # 0.18 s an iteration
    headline, text = bench_overlap.gather_headline(times, "model")
    assert headline.value.median == pytest.approx(0.9) and headline.met
    assert "it saves 20.0 ms an iteration" in text
    assert "against 75.0 ms of broadcast that 3 of 4 iterations could hide" in text
    times[bench_overlap.GATHERED_ROW] = [0.88] * 3
    missed, _ = bench_overlap.gather_headline(times, "model")
    assert missed.met is False and missed.why.startswith("only the forward (inside the 10.0 ms")
    unheld, _ = bench_overlap.gather_headline(times, "model", held=False)
    assert unheld.met is None and unheld.target == "" and unheld.why == ""


def test_overlap_bytes_miss_says_what_the_collectives_carried() -> None:
    line = bench_overlap.missed_bytes_line({"reduce": 400, "broadcast": 400}, 400.0, 300.0)
    assert line == (
        "its collectives carried broadcast 400 bytes, reduce 400 bytes, which a ring on 2 "
        "ranks sends as 400 bytes against 300 for one all-reduce of the gradients"
    )


# ----- going on after a lost rank (bench_elastic) ------------------------------------


def _survivor(applied: int = 3, finished: bool = False, detect_s: float = 0.05) -> dict[str, Any]:
    """What a survivor of :func:`elastic_loss._loss_rank` returns (made up)."""
    loss = {
        "step": 3,
        "done_before": 3,
        "applied": applied,
        "finished_step": finished,
        "lost": (2,),
        "detect_s": detect_s,
        "roll_call_s": 1.0,
        "recover_rest_s": 0.1,
        "ddp_s": 0.02,
        "redo_s": 0.0 if finished else 0.1,
        "total_s": detect_s + 1.22,
        "moved_bytes": 8.0,
        "error": "CollectiveError: ...",
    }
    steps = [(3, 0.15)] * 3 + [(2, 0.1)] * 2
    return {"loss": loss, "state_bytes": 32, "step_s": steps, "world_size": 2, "steps": 6}


def test_a_loss_counts_the_steps_its_survivors_state_lacks() -> None:
    redone = elastic_loss.Loss.of(False, [_survivor(), _survivor(), None])
    assert (redone.steps_lost, redone.moved_bytes, redone.state_bytes) == (0, 16.0, 32)
    assert (redone.step_before_s, redone.step_after_s) == (0.15, 0.1)
    finished = elastic_loss.Loss.of(True, [_survivor(4, True), _survivor(4, True), None])
    assert finished.steps_lost == 0  # the step finished from the carried copies counts
    assert elastic_loss.Loss.of(False, [_survivor(2), _survivor(2), None]).steps_lost == 1
    gone_on_alone = _survivor() | {"world_size": 3}
    with pytest.raises(RuntimeError, match="did not go on"):
        elastic_loss.Loss.of(False, [_survivor(), gone_on_alone, None])


def test_the_loss_summary_quotes_the_restart_soak_and_a_stall_at_the_timeout() -> None:
    with open(os.path.join(ROOT, "docs", "resilience.md"), encoding="utf-8") as f:
        figures = elastic_loss.restart_figures(f.read())
    assert figures is not None, "the soak block on docs/resilience.md lost its summary line"
    seconds, lost = figures
    assert float(seconds.split()[0]) > 0 and float(lost.split()[0]) >= 0
    assert elastic_loss.restart_figures("a page without the soak block") is None
    losses = [elastic_loss.Loss.of(False, [_survivor(), _survivor(), None])] * 2
    summary = elastic_loss.loss_summary(losses, figures)
    assert f"{seconds} s from a kill to training again and {lost} steps lost" in summary
    assert "0.50 of the model's optimizer state" in summary and "timeout" not in summary
    stalled = elastic_loss.Loss.of(True, [_survivor(4, True, 29.99), _survivor(4, True), None])
    summary = elastic_loss.loss_summary([*losses, stalled], None)
    assert "In 1 of 3 losses the survivors' collective failed only at the group's 30 s" in summary
    assert "its soak block was not found" in summary


def test_the_extra_of_redundancy_is_held_to_the_carriers_own_work() -> None:
    one = [0.10, 0.12, 0.09, 0.11]
    adam, copies = [0.010, 0.012, 0.011, 0.010], [0.004, 0.005, 0.004, 0.006]
    at = round_sums(one, round_sums(adam, copies))
    line = elastic_costs.bound_line("2 ranks, iteration", one, at, adam, copies)
    assert line.startswith("2 ranks, iteration: redundancy=2 adds +15.5 ms, 1.48x the extra")
    assert line.endswith("1.00x the whole floor; its ratio 1.14 is at the floor's 1.14")
    above = elastic_costs.bound_line("x", one, [t * 2 for t in one], adam, copies)
    assert "is above the floor's (the step pays more than the carrier's own work) 1.1" in above
    cost = elastic_costs.Cost(
        2,
        [
            {"steps": {elastic_costs.ADAM: [1.0, 3.0], elastic_costs.COPIES: [1.0, 1.0]}},
            {"steps": {elastic_costs.ADAM: [2.0, 1.0], elastic_costs.COPIES: [1.0, 0.0]}},
        ],
    )
    assert cost.floor("steps") == [3.0, 4.0]  # the slowest carrier's, round by round
    assert cost.floor("steps", elastic_costs.ADAM) == [2.0, 3.0]


def test_a_replica_check_is_charged_its_slowest_rank_over_its_interval() -> None:
    iterations = {elastic_costs.ITERATION[1]: [0.1, 0.2]}
    cost = elastic_costs.Cost(
        2,
        [
            {"iterations": iterations | {elastic_costs.VERIFY: [0.01, 0.02]}, "tensors": 8},
            {"iterations": {elastic_costs.VERIFY: [0.03, 0.01]}},
        ],
    )
    assert cost.checks() == [0.03, 0.02]
    every = elastic_costs.VERIFY_EVERY
    assert cost.verify_share().median == pytest.approx((0.03 / 0.1 + 0.02 / 0.2) / 2 / every)
    line = elastic_costs.verify_line([cost])
    assert "each of the model's 8 tensors" in line
    assert "2 ranks, plain: a check takes 25.00 [22.50, 27.50] ms, 0.20 [0.15, 0.25] %" in line


def _grown(
    to_joiner: dict[int, int], between: int = 0, empty: tuple[float, ...] = (0.002, 0.004)
) -> list[dict[str, Any]]:
    """What the 2 running ranks of :func:`elastic_join._running_rank` return
    (made up): a model of 4 parameters of 10, 10, 20 and 20 elements; the
    joiner owns parameter 2 and carries 0 and 1."""
    params = [torch.zeros(3)]
    sizes = [10, 10, 20, 20]
    joiner = {
        "rank": 2,
        "world_size": 3,
        "called": 105.0,
        "joined": 106.5,
        "ddp": 106.6,
        "first": 106.8,
        "broadcasts": {"broadcast": 4},
        "broadcast_bytes": {"broadcast": 240},
        "outbox": {"to": {}, "pickled": 50},
        "held": {"owned": (2,), "carried": (0, 1), "shard_state": 164, "carried_state": 168},
        "params": params,
    }

    def rank(r: int, to: dict[int, dict[int, int]], pickled: int) -> dict[str, Any]:
        return {
            "started": 100.0,
            "admit_began": 105.2 + r * 0.01,
            "admit_s": 1.3,
            "ddp_s": 0.05,
            "step_s": [0.1, 0.2, 0.15],
            "empty_admit_s": list(empty),
            "after_s": [0.2, 0.14, 0.14],
            "joined": 1,
            "world_size": 3,
            "outbox": {"to": to, "pickled": pickled},
            "params": params,
            "param_bytes": 240,
            "sizes": sizes,
        } | ({"joiner": joiner} if r == 0 else {})

    first = {i: b for i, b in to_joiner.items() if i != 2}
    second = {i: b for i, b in to_joiner.items() if i == 2}
    return [rank(0, {2: first, 1: {3: between}}, 400), rank(1, {2: second}, 300)]


def test_a_join_splits_the_joiners_seconds_and_the_state_it_was_sent() -> None:
    sent = {0: 84, 1: 84, 2: 164}  # Adam: 2 float32 states per element, a 4-byte step
    join = elastic_join.Join.of(_grown(sent))
    parts = (join.start_s, join.wait_s, join.grow_s, join.ddp_s, join.first_step_s)
    assert parts == pytest.approx((5.0, 0.2, 1.3, 0.1, 0.2))
    assert sum(parts) == pytest.approx(join.total_s)  # the parts add up to the whole
    assert (join.admit_s, join.step_before_s, join.step_after_s) == (1.3, 0.15, 0.14)
    assert (join.shard_bytes, join.carried_bytes, join.moved_bytes) == (164, 168, 332)
    assert (join.shard_planned, join.carried_planned) == (164, 168)
    assert join.gathered_bytes == 2 * 400  # every outbox padded to the largest, from 2 ranks
    assert elastic_join.planned_state_bytes([10, 20], [1]) == 2 * 20 * 4 + 4
    summary = elastic_join.join_summary([join, join])
    assert "to its first completed step: 6.80 (6.80 to 6.80) s" in summary
    assert "they reach one every 150 ms here" in summary
    assert "(median of 4 calls at the boundaries" in summary and "takes 3.00 ms" in summary
    assert "as planned;" in summary and "nothing between the running ranks" in summary
    assert "ended 0 apart" in summary
    moved = elastic_join.Join.of(_grown(sent, between=2**20))
    assert "1.0 MiB between the running ranks as the ring" in elastic_join.join_summary([moved])
    short = elastic_join.Join.of(_grown({0: 84, 2: 164}))  # the carried copy half sent
    assert "**NOT as planned**" in elastic_join.join_summary([short])
    assert "the state addressed to it" in elastic_join.join_bytes_table([join])
    assert elastic_join.join_table([join, short]).count("\n") == 3


def test_a_join_that_went_wrong_is_refused() -> None:
    stray = _grown({3: 8})  # state for a parameter the joiner neither owns nor carries
    with pytest.raises(RuntimeError, match=r"parameters \[3\] reached the joiner"):
        elastic_join.Join.of(stray)
    alone = _grown({2: 164})
    del alone[0]["joiner"]
    with pytest.raises(RuntimeError, match="did not grow"):
        elastic_join.Join.of(alone)
    with pytest.raises(RuntimeError, match="made 0 outboxes"):
        elastic_join._grown_outbox([])
    halves = {
        Piece(5, 0, 2): {"exp_avg": torch.zeros(2)},
        Piece(5, 2, 4): {"exp_avg": torch.zeros(2)},
    }
    sized = elastic_join._grown_outbox([{2: halves}])
    assert sized["to"] == {2: {5: 16}} and sized["pickled"] > 16
    command = elastic_join._joiner_command("/tmp/job", "/tmp/out.pt", True)
    assert (
        command[0] == sys.executable
        and "joiner_main('/tmp/job', '/tmp/out.pt', True)" in command[2]
    )


def test_the_elastic_bench_watches_names_the_library_still_calls() -> None:
    """The bench wraps ``zerofn_torch.roll_call.roll_call`` and the core's
    ``zerofn.zero.elastic.regroup.outgoing_states`` by name; a rename or a
    move there fails here, not in ``make bench`` only, and the watched
    regrouping sees the outbox each rank sends and ends as the core's does."""
    import zerofn_torch.roll_call as survivors_roll_call

    from zerofn.testing.elastic import survivors_of
    from zerofn.testing.zero import simulated_ranks, step_simulated
    from zerofn.zero.elastic import regroup
    from zerofn.zero.planning.plan import plan_shards

    sizes = (6, 4, 5, 3)
    plan = plan_shards([list(sizes)], ["kind"] * 4, [True] * 4, 3)
    params = [torch.randn(n) for n in sizes]

    def world() -> Any:
        ranks = simulated_ranks(plan, params, torch.optim.SGD, redundancy=2, lr=0.1, momentum=0.9)
        step_simulated(ranks, [torch.ones(n) for n in sizes])
        return ranks

    # recover's agreement looks the roll call up in that module's namespace,
    # where the bench's wrapper replaces it.
    assert "roll_call" in survivors_roll_call.agree.__code__.co_names
    kept = regroup.outgoing_states
    seen: list[Any] = []
    try:
        elastic_setup._watch_outboxes(seen.append)
        watched = survivors_of(world(), [2])
    finally:
        regroup.outgoing_states = kept  # type: ignore[assignment]
    plain = survivors_of(world(), [2])
    assert len(seen) == 2 and any(any(outbox.values()) for outbox in seen)
    assert sum(elastic_setup._tensor_bytes(outbox) for outbox in seen) > 0
    for mine, theirs in zip(watched, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine.params, theirs.params, strict=True))
