"""The shaped-link benchmark's pure parts (``benchmarks/bench_links.py`` and
its ``links_*.py`` modules).

The measurements run inside network namespaces through ``make bench`` (CI:
``--quick``, one short run at 1 Gbit/s); here, on one process and without a
namespace: the delay that covers a link, the bytes a compressed DiLoCo sync
puts on it, the why lines from made-up timings, the section built from a
made-up child's output (targets held at the rates they are set for, every miss
with its why, an aborted PyTorch hook reported), where each feature starts to
pay from made-up parts, DiLoCo's utilization model, and the section where
namespaces cannot be made (the reason, no numbers, nothing run).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import bench_compressed
import bench_hooks
import bench_links
import bench_loss_time
import bench_overlap
import generated_blocks
import links_curves
import links_payoffs
import links_ranks
import links_setup
import links_why
from report import headline_table

from zerofn.blockquant import quantizer_for
from zerofn.diloco.compressed_sync import compressed_sync_bytes
from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.fragments import plan_fragments

GBIT = 1e9


def test_link_time_is_bytes_times_eight_over_the_rate() -> None:
    assert links_setup.link_seconds(125_000_000, GBIT) == pytest.approx(1.0)
    assert links_setup.rate_label(1e9) == "1 Gbit/s"
    assert links_setup.rate_label(1e10) == "10 Gbit/s"
    assert links_setup.rate_label(1e8) == "100 Mbit/s"


def test_the_delay_covers_the_link_time_in_whole_steps() -> None:
    # 4.33 MB at 1 Gbit/s: 34.6 ms; steps of 10 ms need 4 of them.
    assert links_setup.streaming_delay(4_330_000, GBIT, 0.010) == 4
    # Exactly one step's worth needs one step, not two.
    assert links_setup.streaming_delay(1_250_000, GBIT, 0.010) == 1
    # A link faster than a step still delays by one (delay 0 would block).
    assert links_setup.streaming_delay(1_000, GBIT, 0.010) == 1
    with pytest.raises(ValueError, match="must take time"):
        links_setup.streaming_delay(1_000, GBIT, 0.0)


@given(st.integers(0, 60), st.sampled_from([1, 2, 4, 5]))
def test_sync_every_admits_the_delay(delay: int, fragments: int) -> None:
    h = links_setup.streaming_sync_every(delay, fragments)
    assert h >= links_setup.MIN_SYNC_EVERY and h % fragments == 0
    DiLoCoConfig(h, fragments, delay)  # raises unless delay < h // fragments
    if delay + 1 < -(-links_setup.MIN_SYNC_EVERY // fragments):
        assert h == fragments * -(-links_setup.MIN_SYNC_EVERY // fragments)


def test_fragment_bytes_on_the_link_are_every_owners_payload_twice() -> None:
    sizes = [1000, 24, 3000]
    quantizer = quantizer_for("int8")
    plan = plan_fragments(sizes, 2, 2)
    expected = max(2 * sum(quantizer.payload_nbytes(n) for n in f.lengths) for f in plan.fragments)
    assert links_setup.fragment_link_bytes(sizes, 2, "int8") == expected
    # What both ranks send is what they hand over, less what each keeps: the
    # all-to-all's own part is empty, and a broadcast's root does not receive.
    handed = sum(compressed_sync_bytes(plan.fragments[0], quantizer, r) for r in range(2))
    payloads = sum(quantizer.payload_nbytes(n) for n in plan.fragments[0].lengths)
    assert handed - payloads == 2 * payloads
    # int8: about a byte per element of the fragment, twice.
    assert links_setup.fragment_link_bytes([4096], 1, "int8") == pytest.approx(2 * 4096, rel=0.04)


def test_the_delay_formula_shows_its_numbers() -> None:
    line = links_setup.delay_formula(4_329_600, GBIT, 0.010)
    assert "ceil(4,329,600 x 8 / 1 Gbit/s / 10.00 ms)" in line
    assert "ceil(34.64 ms / 10.00 ms) = 4" in line
    assert "H = 50 (P = 2, stride 25 > delay)" in line


# ----- why lines from made-up timings -------------------------------------------------

ROUNDS = 5


def _flat(value: float) -> list[float]:
    return [value] * ROUNDS


def _zero_times(int8: float = 0.40) -> dict[str, list[float]]:
    times = {
        bench_compressed.PYTORCH_DEFAULT: _flat(0.80),
        "zerofn exact": _flat(0.78),
        "zerofn int8": _flat(int8),
        "zerofn int4": _flat(0.15),
        bench_compressed.UPDATE: _flat(0.06),
        bench_compressed.CODEC_ALONE["int8"]: _flat(0.10),
        bench_compressed.CODEC_ALONE["int4"]: _flat(0.04),
    }
    for name, alone in zip(bench_compressed.BYTES_ALONE.values(), (0.66, 0.17, 0.09), strict=True):
        times[name] = _flat(alone)
    return times


def test_zero_why_sets_the_codec_in_turn_against_beside_the_wire() -> None:
    why = links_why.zero_why("zerofn int8", _zero_times(), 21_300_000, GBIT)
    # 21.3 MB at 1 Gbit/s = 170 ms; in turn (60 + 100 + 170) / 800 = 0.41;
    # beside the wire max(60 + 100, 170) / 800 = 0.21; 400 / 330 = 1.21.
    assert "its bytes take 170 ms on the link alone (21.3 MB x 8 / 1 Gbit/s" in why
    assert "half-duplex" in why and "broadcast alone 170 ms" in why
    assert "the int8 codec alone 100 ms and the update alone 60 ms" in why
    assert "they allow 0.41, with the update and the codec beside the wire 0.21" in why
    assert "the int8 step takes 400 ms, 1.21x the parts in turn" in why


def test_zero_why_of_the_exact_step_sits_it_at_pytorchs_floor() -> None:
    why = links_why.zero_why("zerofn exact", _zero_times(), 82_700_000, GBIT)
    assert "its bytes take 662 ms on the link alone" in why
    assert "the same bytes as PyTorch's" in why
    assert "zerofn exact runs" in why or "both sit at the same floor" in why


def _overlap_times() -> dict[str, list[float]]:
    return {
        "overlapped": _flat(0.40),
        "separate": _flat(0.50),
        "pytorch": _flat(0.48),
        bench_overlap.COMPUTE: _flat(0.02),
        bench_overlap.UPDATE: _flat(0.01),
        bench_overlap.REDUCE: _flat(0.30),
        bench_overlap.ALL_REDUCE: _flat(0.27),
        bench_overlap.BROADCAST: _flat(0.14),
        bench_overlap.SEPARATE_ROW: _flat(2.0),  # 4 iterations of 0.50
        bench_overlap.GATHERED_ROW: _flat(1.98),
        bench_overlap.OVERLAP_ROW: _flat(1.6),  # 4 iterations of 0.40
        bench_overlap.BOTH_ROW: _flat(1.5),
    }


def test_both_halves_hidden_are_held_to_the_overlapped_step_and_on_a_link_to_its_floor() -> None:
    times = _overlap_times()
    (alone,), text = bench_overlap.both_headlines(times, "m")
    assert alone.value.median == pytest.approx(1.5 / 1.6) and alone.met
    assert "takes 375.0 ms an iteration" in text and "floor" not in text
    # 42 MB at 1 Gbit/s: 336 ms on the link, above forward + backward + update (30 ms).
    _, floor = bench_overlap.both_headlines(times, "m", link=(42_000_000, GBIT))[0]
    assert floor.value.median == pytest.approx(0.375 / 0.336)
    assert floor.target == "<= 1.15" and floor.met and not floor.why
    # At 10 Gbit/s the bytes take 33.6 ms: the iteration is far above its floor.
    _, floor = bench_overlap.both_headlines(times, "m", link=(42_000_000, 10 * GBIT))[0]
    assert floor.met is False
    assert floor.why.startswith("341.4 ms above the floor (the bytes bound it)")
    assert "each alone, add up to 470.0 ms and the iteration takes 0.80 of that sum" in floor.why


def test_overlap_why_gives_each_iterations_bytes_on_the_link_first() -> None:
    factors = {"reduce": 2.25, "all-reduce": 2.0, "broadcast": 1.0}
    on_link = {"overlapped": 42_000_000, "pytorch": 50_400_000}
    why = links_why.overlap_why(_overlap_times(), on_link, factors, GBIT)
    assert why.startswith("the overlapped iteration puts 42.0 MB on the link (336 ms at 1 Gbit/s)")
    assert "against PyTorch's 50.4 MB (403 ms), 0.83 of its bytes" in why
    assert "gloo's own reduce puts 2.25x its payload on the link" in why
    assert "forward + backward alone take" in why  # then bench_overlap's parts and floors


def test_powersgd_why_says_what_the_iteration_spends_beside_its_bytes() -> None:
    times = {"zerofn": _flat(0.10), bench_hooks.BUILTIN: _flat(0.30)}
    why = links_why.powersgd_why(times, 150_000, 33_600_000, GBIT)
    assert "DDP's all-reduce puts 33.6 MB on the link (269 ms at 1 Gbit/s)" in why
    assert "PowerSGD 150.0 kB (1.20 ms)" in why
    assert "of which 99 ms beside its bytes" in why and "0.33 of DDP's 300 ms" in why


def _diloco_raw(delay: int = 2, step: float = 0.020) -> dict[str, Any]:
    long = links_setup.covering_name(delay)
    short = long if delay == 1 else links_setup.streaming_name(1)
    names = [
        links_setup.QUIET,
        links_setup.DDP_NAME,
        *map(links_setup.blocking_name, links_setup.BLOCKING),
        long,
        short,
    ]
    steps = {name: 10 for name in names} | {
        links_setup.blocking_name(50): 50,
        links_setup.DDP_NAME: links_setup.DDP_STEPS,
    }
    per_step = {
        links_setup.QUIET: step,
        links_setup.DDP_NAME: 5 * step,
        links_setup.blocking_name(10): 3 * step,
        links_setup.blocking_name(50): 1.4 * step,
        long: 1.2 * step,
        short: 1.08 * step,
    }
    return {
        "times": {name: _flat(per_step[name] * steps[name]) for name in names},
        "steps": steps,
        "wire": {name: 1e6 * steps[name] for name in names}
        | {
            links_setup.DDP_NAME: 19.2e6 * links_setup.DDP_STEPS,
            links_setup.blocking_name(10): 19.2e6,
            links_setup.blocking_name(50): 19.2e6,
        },
        "codec": _flat(0.030),  # both ranks' arithmetic: 15 ms a sync each
        "quiet_step": step,
        "fragment_link_bytes": 4_329_600,
        "delays": {long: delay, short: 1},
        "long": long,
        "delay_1": short,
        "sync_every": 10,
        "numel": 2_400_000,
    }


def test_diloco_why_sets_the_syncs_link_time_against_the_steps_it_hides_under() -> None:
    raw = _diloco_raw()
    why = links_why.diloco_why(links_setup.streaming_name(1), raw, GBIT)
    # 34.6 ms on the link under one 20 ms step: 14.6 ms to wait, 2.93 ms per step (stride 5).
    said = "puts 4,329,600 bytes on the link, 35 ms at 1 Gbit/s, more than the 1 inner step"
    assert f"{said} of 20 ms it may take" in why
    assert "(15 ms left to wait, 2.93 ms per inner step)" in why
    assert (
        "takes 15 ms a sync on the rank's one core, 3.00 ms per inner step (0.15 of a step)" in why
    )
    # 1.60 ms more per step; 2.93 + 3.00 of it explained: -4.33 ms beyond.
    assert "the run took 1.60 ms per inner step more than without communication" in why
    assert "-4.33 ms beyond the wait and the arithmetic" in why
    # Blocking with the same H (10): 3 steps' time per step, 40 ms over the quiet one.
    assert why.endswith(
        "; blocking DiLoCo with the same H = 10, which hides nothing, took 40 ms more"
    )
    alone = links_why.diloco_why(links_setup.streaming_name(1), raw | {"sync_every": 20}, GBIT)
    assert alone.endswith("beyond the wait and the arithmetic")
    covered = links_why.diloco_why(raw["long"], raw, GBIT)
    assert "within the 2 inner steps of 20 ms it may take (0.00 ms left to wait" in covered


# ----- the section from a made-up child's output -------------------------------------


def _zero_raw() -> dict[str, Any]:
    labels = links_setup.ZERO_LABELS
    return {
        "times": _zero_times(),
        "on_link": dict(zip(labels, (83e6, 83e6, 21.4e6, 11.1e6), strict=True)),
        "payload": dict(zip(labels, (82.7e6, 82.7e6, 21.3e6, 11.0e6), strict=True)),
        "link_parts": dict(
            zip(bench_compressed.BYTES_ALONE.values(), (83e6, 21.4e6, 11.1e6), strict=True)
        ),
        "numel": 20_700_000,
        "tensors": 60,
        "equal": True,
    }


def _overlap_raw() -> dict[str, Any]:
    return {
        "times": _overlap_times(),
        "grad_bytes": 16_800_000,
        "link_parts": {
            bench_overlap.REDUCE: 37_800_000,
            bench_overlap.ALL_REDUCE: 33_600_000,
            bench_overlap.BROADCAST: 16_800_000,
        },
        "on_link": {"overlapped": 42_000_000, "separate": 50_400_000, "pytorch": 50_400_000},
        "kinds": {
            "overlapped": {"reduce": 16_800_000, "broadcast": 16_800_000},
            "separate": {"all_reduce": 16_800_000, "broadcast": 16_800_000},
            "pytorch": {"all_reduce": 16_800_000, "broadcast": 16_800_000},
        },
    }


def _powersgd_raw(aborted: str | None = None) -> dict[str, Any]:
    times = {"zerofn": _flat(0.08), bench_hooks.BUILTIN: _flat(0.29)}
    on_link = {"zerofn": 150_000, bench_hooks.BUILTIN: 33_600_000}
    if aborted is None:
        times["pytorch"] = _flat(0.10)
        on_link["pytorch"] = 150_000
    return {"times": times, "on_link": on_link, "numel": 4_200_000, "aborted": aborted}


def _results(aborted: str | None = None) -> dict[str, Any]:
    return {
        "zero": _zero_raw(),
        "overlap": _overlap_raw(),
        "powersgd": _powersgd_raw(aborted),
        "diloco": _diloco_raw(),
    }


def test_the_section_holds_each_target_at_the_rates_it_is_set_for() -> None:
    section = bench_links.section_from(
        {"1gbit": _results(), "10gbit": _results()},
        {"1gbit": 100.0, "10gbit": 60.0},
        no_delay="this kernel has no TUN devices",
    )
    at_1 = [h for h in section.headlines if h.benchmark.startswith("link 1 Gbit/s")]
    at_10 = [h for h in section.headlines if h.benchmark.startswith("link 10 Gbit/s")]
    assert len(at_1) == len(at_10) > 0
    targets_1 = {h.measure: h.target for h in at_1 if h.target}
    assert targets_1 == {
        "step time: zerofn exact / PyTorch": "<= 1.0",
        "step time: zerofn int8 / PyTorch": "<= 0.3",
        "step time: zerofn int4 / PyTorch": "<= 0.2",
        "iteration time: overlapped / PyTorch's DDP + separate ZeRO step": "<= 0.75",
        "iteration time: gather behind the next forward / zerofn's separate step": "<= 1.0",
        "iteration time: overlapped + gathered / overlapped": "<= 1.0",
        "iteration time: overlapped + gathered / max(compute, bytes / rate)": "<= 1.15",
        "iteration time: zerofn PowerSGD / DDP all-reduce": "<= 0.3",
        f"time per inner step: {links_setup.covering_name(2)} / no communication": "<= 1.05",
        f"time per inner step: {links_setup.streaming_name(1)} / no communication": "<= 1.1",
    }
    # At 10 Gbit/s DiLoCo's (its delay is computed for the rate) and the
    # overlapped step's floor (the rate where compute and bytes are matched).
    assert {h.target for h in at_10 if h.target} == {"<= 1.05", "<= 1.1", "<= 1.15"}
    # int8 0.50 and the overlap 0.83 miss, each with its why; PowerSGD 0.28 meets.
    missed = {h.measure for h in at_1 if h.met is False}
    assert "step time: zerofn int8 / PyTorch" in missed
    assert "iteration time: overlapped / PyTorch's DDP + separate ZeRO step" in missed
    assert "iteration time: zerofn PowerSGD / DDP all-reduce" not in missed
    assert all(h.why for h in section.headlines if h.met is False)
    assert all(not h.why for h in section.headlines if h.met is not False)
    assert "### 1 Gbit/s" in section.body and "### 10 Gbit/s" in section.body
    assert "half duplex" in section.body and "delay = ceil(B x 8 / R / t)" in section.body
    assert "cannot be made here (`unavailable_reason(delay=True)` says: this kernel has no TUN" in (
        section.body
    )
    headline_table(section.headlines)  # every row renders


def test_the_section_says_when_pytorchs_hook_aborted() -> None:
    said = "process 1 terminated with signal SIGABRT"
    section = bench_links.section_from({"1gbit": _results(aborted=said)}, {"1gbit": 1.0})
    assert "PyTorch's hook aborted" in section.body and said in section.body
    assert not any("powerSGD_hook" in h.measure for h in section.headlines)


def test_when_delay_1_covers_the_link_one_run_serves_both_targets() -> None:
    results = _results() | {"diloco": _diloco_raw(delay=1)}
    section = bench_links.section_from({"1gbit": results}, {"1gbit": 1.0})
    diloco = [h for h in section.headlines if "inner step" in h.measure and h.target]
    assert [h.target for h in diloco] == ["<= 1.05", "<= 1.1"]
    assert diloco[0].value == diloco[1].value
    assert "Delay 1 already covers the link here" in section.body


def test_readme_picks_the_1_gbit_rows_and_no_other_rate() -> None:
    section = bench_links.section_from(
        {"1gbit": _results(), "10gbit": _results()}, {"1gbit": 1.0, "10gbit": 10.0}
    )
    rows = [generated_blocks.Row.of(h) for h in section.headlines]
    picked = [row for row in rows if any(p.matches(row) for p in generated_blocks.README_ROWS)]
    assert [row.measure for row in picked] == [
        "step time: zerofn int8 / PyTorch",
        "iteration time: overlapped / PyTorch's DDP + separate ZeRO step",
        "iteration time: zerofn PowerSGD / DDP all-reduce",
    ]
    assert all(row.benchmark.startswith("link 1 Gbit/s") for row in picked)


# ----- where namespaces cannot be made -------------------------------------------------


def test_without_namespaces_the_section_says_why_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reason = "creating network namespaces needs root; this process runs as uid 1000"
    monkeypatch.setattr(bench_links.links, "unavailable_reason", lambda **_: reason)

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run without a link")

    monkeypatch.setattr(bench_links, "run_in_namespace", refuse)
    for quick in (True, False):
        section = bench_links.bench_links(quick)
        assert "Not measured" in section.body and reason in section.body
        (headline,) = section.headlines
        assert reason in headline.measure and headline.value.fmt() == "-"
        assert headline.met is None and math.isnan(headline.value.median)
        table = headline_table(section.headlines)
        assert "| - | - | - |" in table  # no number, no target, no verdict


def test_the_loopbacks_counter_is_read() -> None:
    assert links_ranks.lo_tx_bytes() >= 0


# ----- where each feature starts to pay ------------------------------------------------


def test_the_crossover_is_where_the_bytes_take_as_long_as_the_seconds() -> None:
    assert links_payoffs.crossover_rate(125_000_000, 1.0) == pytest.approx(GBIT)
    assert links_payoffs.crossover_rate(1_000, 0.0) == links_payoffs.EVERY_RATE
    assert links_payoffs.crossover_rate(0, 1.0) == 0.0
    assert links_payoffs.crossover_rate(-5, 0.0) == 0.0  # nothing saved: never
    assert links_payoffs.rate_phrase(links_payoffs.EVERY_RATE) == "at every rate"
    assert links_payoffs.rate_phrase(0.0) == "at no rate"
    assert links_payoffs.rate_phrase(1.6e9) == "below 1.6 Gbit/s"


@given(
    st.floats(0.0, 1.0),  # update
    st.floats(1e-4, 2.0),  # codec
    st.floats(1e6, 1e9),  # fp32 bytes
    st.floats(0.01, 0.99),  # compressed / fp32 bytes
    st.floats(1e7, 1e11),  # rate
)
def test_a_compressed_step_beats_pytorchs_exactly_below_the_crossover(
    update: float, codec: float, fp32: float, share: float, rate: float
) -> None:
    r_star = links_payoffs.compressed_pays_below(fp32, codec)
    assert r_star == pytest.approx(8 * fp32 / codec)
    mine = links_setup.compressed_step_model(update, codec, share * fp32, rate)
    theirs = links_setup.pytorch_step_model(update, fp32, rate)
    if not math.isclose(rate, r_star, rel_tol=1e-6):
        assert (mine < theirs) == (rate < r_star)


def test_a_codec_slower_than_the_link_at_every_rate_pays_below_all_of_them() -> None:
    # 10 s of codec against 82.7 MB: R* = 66 Mbit/s, under every rate drawn;
    # the codec is the larger term at each of them, so the step is u + c.
    fp32, int8, codec, update = 82.7e6, 21.3e6, 10.0, 0.02
    r_star = links_payoffs.compressed_pays_below(fp32, codec)
    assert r_star == pytest.approx(66.16e6)
    assert links_payoffs.rate_phrase(links_payoffs._sig(r_star)) == "below 66 Mbit/s"
    for rate in map(bench_links.links.parse_rate, links_curves.CURVE_RATES):
        assert links_setup.link_seconds(int8, rate) < codec
        mine = links_setup.compressed_step_model(update, codec, int8, rate)
        assert mine == pytest.approx(update + codec)
        assert mine > links_setup.pytorch_step_model(update, fp32, rate)
    # ... and at a rate below R* it pays.
    assert links_setup.compressed_step_model(
        update, codec, int8, 50e6
    ) < links_setup.pytorch_step_model(update, fp32, 50e6)


def test_the_int8_and_int4_exchange_pay_below_8_fp32_bytes_over_their_codec() -> None:
    int8, int4 = links_payoffs.compressed_payoffs(_zero_raw(), GBIT)
    # PyTorch's 83 MB on the link; the int8 codec 100 ms, int4 40 ms.
    assert int8.rate == pytest.approx(8 * 83e6 / 0.10)
    assert int4.rate == pytest.approx(8 * 83e6 / 0.04)
    assert int8.row()[2] == "below 6.6 Gbit/s" and int4.row()[2] == "below 17 Gbit/s"
    assert "R* = 8 x 83.0 MB / 100 ms" in int8.how
    # Its own 21.4 MB hide behind the 60 ms update and the 100 ms codec
    # above 8 x 21.4 MB / 160 ms.
    assert "hide behind the update and the codec above 1.1 Gbit/s" in int8.how


def test_powersgd_pays_below_the_bytes_it_saves_over_its_extra_arithmetic() -> None:
    payoff = links_payoffs.powersgd_payoff(_powersgd_raw(), GBIT)
    # zerofn 80 ms - 1.2 ms of link = 78.8 ms; DDP 290 ms - 268.8 ms = 21.2 ms:
    # 57.6 ms of compression against 33.45 MB saved.
    arithmetic = (0.08 - 150_000 * 8 / GBIT) - (0.29 - 33_600_000 * 8 / GBIT)
    assert payoff.rate == pytest.approx(8 * (33_600_000 - 150_000) / arithmetic)
    assert payoff.row()[2] == "below 4.6 Gbit/s"
    assert "a = what its iteration spends beside its bytes' link time (79 ms)" in payoff.how
    # An iteration that spends no more than DDP's beside its bytes pays everywhere.
    fast = _powersgd_raw() | {"times": {"zerofn": _flat(0.01), bench_hooks.BUILTIN: _flat(0.29)}}
    assert links_payoffs.powersgd_payoff(fast, GBIT).rate == links_payoffs.EVERY_RATE


def test_the_overlapped_step_pays_at_every_rate_it_saves_bytes() -> None:
    raw = _overlap_raw()
    payoff = links_payoffs.overlap_payoff(raw, GBIT)
    assert payoff.rate == links_payoffs.EVERY_RATE and payoff.row()[2] == "at every rate"
    assert "42.0 MB on the link per iteration against 50.4 MB (0.83 of the bytes)" in payoff.how
    assert "8 x 8.4 MB / R a step, 67 ms at 1 Gbit/s" in payoff.how
    more = raw | {"on_link": {"overlapped": 50.4e6, "pytorch": 50.4e6}}
    never = links_payoffs.overlap_payoff(more, GBIT)
    assert never.rate == 0.0 and "no fewer bytes" in never.how


def test_diloco_pays_from_its_bytes_per_inner_step_and_its_syncs_arithmetic() -> None:
    raw = _diloco_raw()
    h10, h50, streaming = links_payoffs.diloco_payoffs(raw, GBIT)
    assert h10.rate == h50.rate == links_payoffs.EVERY_RATE
    assert "1.9 MB on the link per inner step against DDP's 19.2 MB per step" in h10.how
    # 19.2 MB - 1 MB saved per inner step, 15 ms of arithmetic a sync every 5 steps.
    assert streaming.rate == pytest.approx(8 * (19.2e6 - 1e6) / (0.015 / 5))
    # The sync's 4.33 MB hides behind one 20 ms step from 1.7 Gbit/s, two from 0.87.
    assert "1.7 Gbit/s at delay 1, 870 Mbit/s at the delay used here (2)" in streaming.how
    section = bench_links.section_from({"1gbit": _results()}, {"1gbit": 1.0})
    assert set(section.blocks) == set(links_payoffs.PAYS_AT.values())
    assert "DiLoCo blocking, H=10" in section.blocks["pays-at-diloco"]
    assert "int8 exchange" not in section.blocks["pays-at-diloco"]
    assert "**Where each feature starts to pay**" in section.body


def test_the_pay_off_blocks_are_quoted_on_the_features_pages(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = os.path.dirname(os.path.dirname(__file__))
    pages = {
        page: tuple(n for n in names if n.startswith("pays-at-"))
        for page, names in generated_blocks.QUOTED.items()
    }
    pages = {page: names for page, names in pages.items() if names}
    assert sorted(n for names in pages.values() for n in names) == sorted(
        links_payoffs.PAYS_AT.values()
    )
    for page in pages:
        (tmp_path / "docs").mkdir(exist_ok=True)
        with open(os.path.join(root, page), encoding="utf-8") as f:
            (tmp_path / page).write_text(f.read(), encoding="utf-8")
    monkeypatch.setattr(generated_blocks, "QUOTED", pages)
    section = bench_links.section_from({"1gbit": _results()}, {"1gbit": 1.0})
    generated_blocks.quote_everywhere(str(tmp_path), {"links": section}, "today.")
    overlap = (tmp_path / "docs/overlap.md").read_text(encoding="utf-8")
    assert "| overlapped DDP + ZeRO step | DDP + PyTorch's separate ZeRO step | at every rate" in (
        overlap
    )
    # Where links cannot be made, the blocks say so instead.
    unavailable = bench_links.unavailable_section("no root", ["1gbit"])
    assert all("no root" in text for text in unavailable.blocks.values())


# ----- DiLoCo's compute utilization against the rate -----------------------------------


def test_the_papers_sync_time_is_a_ring_all_reduce() -> None:
    # 2 N (W - 1) / W bytes: N bytes on 2 ranks, 1.75 N on 8.
    assert links_curves.model_sync_seconds(125e6, 2, GBIT) == pytest.approx(1.0)
    assert links_curves.model_sync_seconds(125e6, 8, GBIT) == pytest.approx(1.75)
    assert links_curves.model_utilization(0.1, 1.0, 10) == pytest.approx(0.5)
    assert links_curves.model_utilization(0.1, 1.0, 1) == pytest.approx(0.1 / 1.1)
    assert links_curves.model_utilization(0.1, 1.0, 5, hidden=2.0) == 1.0


def test_the_model_curves_rise_with_the_rate_and_with_h() -> None:
    raw = _diloco_raw()
    rates = [float(bench_links.links.parse_rate(r)) for r in links_curves.CURVE_RATES]
    curves = links_curves.model_curves(raw, rates)
    ddp, h10, h50 = (curves[k] for k in (links_setup.DDP_NAME, "blocking, H=10", "blocking, H=50"))
    for curve in (ddp, h10, h50):
        assert curve == sorted(curve) and all(0 < u <= 1 for u in curve)
    assert all(a < b < c for a, b, c in zip(ddp, h10, h50, strict=True))
    # DDP at 1 Gbit/s: 9.6 MB of fp32 parameters, 2 x 9.6 MB / 2 x 8 / 1 Gbit/s = 76.8 ms
    # against a 20 ms step.
    assert ddp[2] == pytest.approx(0.020 / (0.020 + 8 * 4 * 2_400_000 / GBIT))
    # Streaming at the delay that covers the link hides its sync entirely.
    assert curves[f"streaming int8, P={links_setup.FRAGMENTS}"] == [1.0] * len(rates)


def test_the_utilization_panel_draws_the_model_and_what_was_measured() -> None:
    raw = _diloco_raw()
    section = bench_links.section_from({"1gbit": _results()}, {"1gbit": 1.0})
    (panel,) = section.panels
    assert all(c.label.endswith("(model)") for c in panel.curves) and len(panel.curves) == 4
    assert panel.log_x and panel.curves[0].x == (0.1, 0.3, 1.0, 3.0, 10.0)
    assert "not measured in the quick run, which draws the model" in section.body
    curve = {"100mbit": raw, "1gbit": raw}
    section = bench_links.section_from(
        {"1gbit": _results()}, {"1gbit": 1.0, "100mbit": 7.0}, curve=curve
    )
    (panel,) = section.panels
    measured = {c.label: c for c in panel.curves if c.label.endswith("(measured)")}
    ddp = measured[f"{links_setup.DDP_NAME} (measured)"]
    assert ddp.x == (0.1, 1.0) and ddp.y == pytest.approx((0.2, 0.2))  # 1 / 5 steps' time
    assert measured["blocking, H=10 (measured)"].y == pytest.approx((1 / 3, 1 / 3))
    assert "DiLoCo alone at the figure's other rates took 100 Mbit/s 7 s" in section.body


# ----- held-out loss against training time (bench_loss_time) --------------------------


def _demo_run(step_s: list[float], held_out: list[tuple[int, float]]) -> dict[str, Any]:
    return {"title": "made up", "step_s": step_s, "held_out": [list(p) for p in held_out]}


def test_an_evaluation_sits_at_the_training_time_of_the_steps_before_it() -> None:
    run = _demo_run([0.5, 0.5, 1.0, 1.0], [(2, 4.0), (4, 3.5)])
    assert bench_loss_time.curve_points(run) == ([1.0, 3.0], [4.0, 3.5])


def test_the_loss_time_part_says_who_reached_a_common_loss_first() -> None:
    raw = {
        "runs": {
            "ddp": _demo_run([1.0] * 4, [(2, 4.0), (4, 3.0)]),
            "diloco": _demo_run([0.25] * 4, [(2, 2.9), (4, 2.5)]),
            "zero": _demo_run([2.0] * 4, [(2, 4.1), (4, 3.1)]),
        },
        "steps": 4,
        "world_size": 2,
        "eval_every": 2,
        "rate": "100mbit",
        "delay": "20ms",
        "link_bytes": 3_000_000,
    }
    assert bench_loss_time.fastest_to(raw["runs"], 3.0) == [("diloco", 0.5), ("ddp", 4.0)]
    body, panel = bench_loss_time.loss_time_part(raw, "100 Mbit/s + 20 ms")
    assert "held 20 ms one way, a 40 ms round trip" in body and "3 MB crossed the link" in body
    assert "| diloco | 250 | 1.0 | 2.500 |" in body
    assert bench_loss_time.common_loss(raw["runs"]) == 3.1  # zero's best; all reached it
    assert "reached 3.100, the lowest every run reached (evaluations every 2 steps): " in body
    assert "diloco 0.5 s, ddp 4.0 s, zero 8.0 s." in body
    assert [c.label for c in panel.curves] == ["ddp", "diloco", "zero"]
    assert panel.curves[1].x == (0.5, 1.0)


def test_the_codec_part_times_each_codec_to_int8_diloco_s_final_loss() -> None:
    raw = {
        "runs": {
            "diloco+int8": _demo_run([1.0, 3.0, 1.0, 3.0], [(2, 4.0), (4, 3.0)]),
            "diloco+int2": _demo_run([1.0, 1.5, 1.0, 1.5], [(2, 3.5), (4, 2.9)]),
            "diloco+topk": _demo_run([1.0, 1.1, 1.0, 1.1], [(2, 4.5), (4, 3.2)]),
            "ddp": _demo_run([2.0] * 4, [(2, 3.0), (4, 2.0)]),
        },
        "sync_every": {"diloco+int8": 2, "diloco+int2": 2, "diloco+topk": 2},
    }
    body, headlines = bench_loss_time.codec_part(raw, "100 Mbit/s + 20 ms")
    assert "reached 3.000, where int8 DiLoCo ends" in body
    assert "| diloco+int2 | 2.900 | 5.0 | 1.00 | 2.0 |" in body
    assert "| diloco+topk | 3.200 | never |" in body and "ddp" not in body
    int2, topk = headlines
    assert int2.met and int2.value.median == pytest.approx(5.0 / 8.0)
    assert topk.met is False and topk.why.startswith("loss: its held-out loss never reached")
    assert bench_loss_time.codec_part({"runs": {"ddp": raw["runs"]["ddp"]}}, "x") == ("", [])


def test_a_failed_rank_ends_the_other_instead_of_leaving_it_waiting() -> None:
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    codes = bench_loss_time._wait_all([failing, waiting], timeout_s=60)
    assert codes[0] == 3 and codes[1] < 0  # killed by a signal
    assert time.monotonic() - started < 10
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert bench_loss_time._wait_all([late], timeout_s=0.5)[0] < 0  # out of time: killed
