"""The demo's pure pieces (``examples/demo_*.py``): its text, its model, its
table, and one short run of each trainer on a one-rank group. The two-rank
training itself runs in ``make demo``, not here."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

import demo
from demo_data import batch, load_corpus, printable, rank_slice, stdlib_sources
from demo_model import ModelConfig, TinyGPT, generate, held_out_loss
from demo_report import (
    dominant_line,
    format_table,
    matches_plan,
    moving_average,
    notes,
    planned_memory,
    samples,
    table,
    timings,
)
from demo_runs import KINDS, RUNS, HookConfig, Trainer, live_bytes, lr_schedule, plan

TINY = ModelConfig(width=32, layers=1, heads=4, context=8)


def test_corpus_reads_sorted_files_and_holds_out_the_tail(tmp_path: Path) -> None:
    for name, body in [("b.py", b"b" * 6000), ("a.py", b"a" * 6000), ("c.txt", b"x" * 9)]:
        (tmp_path / name).write_bytes(body)
    corpus = load_corpus(max_bytes=10_000, held_out=0.1, root=str(tmp_path))
    text = bytes(torch.cat([corpus.train, corpus.held_out]).tolist())
    assert text == b"a" * 6000 + b"b" * 4000  # sorted, cut at max_bytes, no .txt
    assert (len(corpus.train), len(corpus.held_out), corpus.files) == (9000, 1000, 2)


def test_the_stdlib_ships_enough_source() -> None:
    assert len(stdlib_sources()) > 50
    corpus = load_corpus(max_bytes=1_000_000)
    assert len(corpus.train) + len(corpus.held_out) == 1_000_000


def test_every_rank_draws_the_same_batch_and_trains_on_its_slice() -> None:
    text = torch.arange(1000, dtype=torch.int64) % 256
    x, y = batch(text, step=3, seed=0, global_batch=4, context=16)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert torch.equal(batch(text, 3, 0, 4, 16)[0], x)
    assert not torch.equal(batch(text, 4, 0, 4, 16)[0], x)
    slices = [rank_slice((x, y), r, 2)[0] for r in range(2)]
    assert torch.equal(torch.cat(slices), x)


def test_printable_replaces_what_a_terminal_should_not_see() -> None:
    assert printable(b"def f():\n\treturn 1") == "def f():\n\treturn 1"
    assert printable(b"a\x1b[2Jb\xff") == "a.[2Jb\ufffd"


def test_the_default_model_has_a_few_million_parameters() -> None:
    model = TinyGPT()
    assert sum(p.numel() for p in model.parameters()) == 3_307_264


def test_the_model_starts_near_uniform_and_samples_deterministically() -> None:
    torch.manual_seed(0)
    model = TinyGPT(TINY)
    text = torch.randint(0, 256, (500,))
    assert held_out_loss(model, text, TINY.context) == pytest.approx(math.log(256), abs=0.05)
    a, b = (generate(model, b"def ", 20, TINY.context, seed=1) for _ in range(2))
    assert a == b and len(a) == 20


def test_the_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    lr = lr_schedule(1.0, steps=100, warmup=10)
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0) and lr(100) == pytest.approx(0.1)


def test_format_table_pads_columns() -> None:
    out = format_table(["", "long header"], [["a", "1"], ["bbb", "22"]]).splitlines()
    assert out[0] == "|     | long header |"
    assert out[1] == "| --- | ----------- |"
    assert out[3] == "| bbb | 22          |"


def test_moving_average_smooths_over_the_window() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def fake_results(world_size: int = 2, steps: int = 12) -> tuple[list[dict[str, Any]], Any]:
    """Per-rank results shaped as ``demo.train_rank`` returns them, with zerofn's
    memory exactly as planned."""
    shapes = TinyGPT(TINY)
    hook = HookConfig()
    plans = [plan(spec, shapes, world_size, hook) for spec in RUNS]
    zplan = plans[1]
    assert zplan is not None
    results = []
    for rank in range(world_size):
        plain = planned_memory(zplan, rank) | {"optimizer_state": 999, "exchange_buffers": 0}
        results.append(
            {
                "losses": {"plain": [3.0] * steps, "zerofn": [3.1] * steps},
                "fb": {"plain": [0.2] * steps, "zerofn": [0.21] * steps},
                "opt": {"plain": [0.03] * steps, "zerofn": [0.02] * steps},
                "compute": {"plain": [(5, 0.18), (11, 0.18)], "zerofn": [(5, 0.18), (11, 0.18)]},
                "payload": {"plain": {"all_reduce": 1000}, "zerofn": dict(zplan.payload_bytes)},
                "calls": {"plain": {}, "zerofn": {"all_reduce": 2, "broadcast": 1}},
                "memory": {"plain": plain, "zerofn": planned_memory(zplan, rank)},
                "held_out": {"plain": 2.5, "zerofn": 2.6},
                "samples": {"plain": b"x = 1\n", "zerofn": b"y = 2\n"},
            }
        )
    return results, plans


def test_the_report_shows_every_run_and_the_planner() -> None:
    results, plans = fake_results()
    out = table(results, RUNS, plans)
    lines = out.splitlines()
    assert "planned (plan_footprint)" in lines[0]
    assert len({len(line) for line in lines}) == 1  # a rectangle
    assert any(line.startswith("| total memory, rank 1") for line in lines)
    assert matches_plan(results, "zerofn", plans[1])
    cfg = demo.Config(model=TINY, hook=HookConfig())
    text = "\n".join(notes(results, RUNS, plans, cfg))
    assert "equal the planner's prediction" in text and "-0.100" not in text
    assert "+0.100 nats/byte" in text
    assert "x = 1" in samples(results, RUNS, b"def ", seen=123_000)


def test_timings_split_the_step() -> None:
    results, _ = fake_results()
    t = timings(results[0], "plain")
    assert t["step"] == pytest.approx(230)
    assert t["compute"] == pytest.approx(180) and t["comm"] == pytest.approx(20)


def test_a_run_without_a_time_split_says_so() -> None:
    results, _ = fake_results()
    for r in results:
        r["compute"] = {"plain": [], "zerofn": []}
    assert math.isnan(timings(results[0], "plain")["compute"])
    assert "not split" in dominant_line(results, RUNS)
    assert "| -" in table(results, RUNS, fake_results()[1])


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from demo_report import plot

    results, plans = fake_results()
    path = tmp_path / "demo.png"
    plot(results, RUNS, plans, str(path))
    assert path.stat().st_size > 10_000


@pytest.mark.usefixtures("single_rank_group")
def test_both_trainers_step_and_count_their_bytes() -> None:
    torch.manual_seed(0)
    initial = TinyGPT(TINY)
    hook = HookConfig(powersgd_rank=2, start_iter=2)
    trainers = [Trainer(spec, TinyGPT(TINY), hook, lr=1e-3) for spec in RUNS]
    for t in trainers:
        t.module.load_state_dict(initial.state_dict())
    text = torch.randint(0, 256, (500,))
    for step in range(3):
        x, y = batch(text, step, 0, 2, TINY.context)
        losses = [t.step(x, y, 1e-3)[0] for t in trainers]
    assert all(math.isfinite(v) for v in losses)
    assert trainers[0].compute_seconds(x, y) > 0
    plain, zero = (t.memory_bytes() for t in trainers)
    params = sum(p.numel() * 4 for p in initial.parameters())
    assert plain["parameters"] == zero["parameters"] == params
    assert set(KINDS) <= set(zero)
    assert plain == live_bytes(list(trainers[0].module.parameters()), trainers[0].optimizer)
    assert plain["optimizer_state"] == 2 * params + 4 * len(list(initial.parameters()))
    zplan = plan(RUNS[1], initial, 1, hook)
    assert zplan is not None
    assert {k: zero[k] for k in KINDS} == planned_memory(zplan, 0)
