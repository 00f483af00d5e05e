"""The demo (``examples/demo_*.py``): its text, model, runs, summaries, table
and figure, and one short two-rank training of every default run, which checks
what the demo claims: ZeRO's losses equal DDP's bitwise, every rank holds the
same parameters, ZeRO holds less per rank, PowerSGD and the compressed
exchanges send fewer bytes, DiLoCo (every 10 or 50 steps, and streaming) sends
fewer still, and every run shows in the table and in the figure's legends.

One spawned world trains every run (spawning costs seconds here); the other
tests are in-process."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from _world import run_world
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

import demo
from _draws import draws
from demo_data import (
    batch,
    known_word_share,
    load_corpus,
    printable,
    rank_slice,
    stdlib_sources,
    vocabulary,
)
from demo_model import ModelConfig, TinyGPT, generate, held_out_loss
from demo_report import findings, format_table, matches_plan, samples, table
from demo_runs import (
    CATALOGUE,
    DEFAULT_RUNS,
    DILOCO,
    DILOCO_H50,
    DILOCO_RUNS,
    DILOCO_STREAMING,
    RunSpec,
    Target,
    select,
)
from demo_summary import Measured, RunSummary, memory_kinds, summarize, time_split
from demo_train import Config, lr_schedule, train_rank, warmup_steps
from demo_trainer import tensor_bytes

TINY = ModelConfig(width=32, layers=1, heads=4, context=16)


def _module(doc: str, function_doc: str) -> bytes:
    return f'"""{doc}"""\n\ndef f():\n    """\n    {function_doc}\n    """\n    x = "no"\n'.encode()


def test_corpus_reads_docstrings_of_sorted_files_and_holds_out_the_tail(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(_module("b" * 6000, "B"))
    (tmp_path / "a.py").write_bytes(_module("a" * 6000, "A"))
    (tmp_path / "c.txt").write_bytes(b'"""x"""')
    (tmp_path / "d.py").write_bytes(b"def broken(:\n")  # skipped, not fatal
    corpus = load_corpus(max_bytes=10_000, held_out=0.1, root=str(tmp_path))
    text = bytes(torch.cat([corpus.train, corpus.held_out]).tolist())
    # Sorted, indentation cleaned, code left out, cut at max_bytes, no .txt:
    assert text == b"a" * 6000 + b"\n\nA\n\n" + b"b" * 3995
    assert (len(corpus.train), len(corpus.held_out), corpus.files) == (9000, 1000, 2)


def test_the_stdlib_ships_enough_docstrings() -> None:
    assert len(stdlib_sources()) > 50
    corpus = load_corpus(max_bytes=500_000)
    assert len(corpus.train) + len(corpus.held_out) == 500_000
    assert len(vocabulary(corpus.train)) > 3000


def test_known_word_share_counts_words_of_three_letters_or_more() -> None:
    known = vocabulary(
        torch.frombuffer(bytearray(b"Return the value, or None."), dtype=torch.uint8)
    )
    assert known == {b"return", b"the", b"value", b"none"}  # lower-cased, "or" too short
    assert known_word_share(b"RETURN the valeu (a b) or x", known) == pytest.approx(2 / 3)
    assert known_word_share(b"", known) == 0 and known_word_share(b"1 + 2", known) == 0


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
    assert warmup_steps(120) == 10 and warmup_steps(3000) == 100


@settings(max_examples=draws(60), deadline=None)
@given(
    st.lists(
        st.lists(
            st.text(
                st.characters(exclude_categories=("Cc", "Zl", "Zp"), exclude_characters="|"),
                max_size=8,
            ),
            min_size=3,
            max_size=3,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_format_table_is_a_rectangle_holding_every_cell(rows: list[list[str]]) -> None:
    lines = format_table(["a", "bb", "ccc"], rows).splitlines()
    assert len({len(line) for line in lines}) == 1
    assert len(lines) == len(rows) + 2
    for line, row in zip(lines[2:], rows, strict=True):
        assert [c.strip() for c in line[2:-2].split(" | ")] == [c.strip() for c in row]


@settings(max_examples=draws(60), deadline=None)
@given(st.lists(st.sampled_from([s.key for s in CATALOGUE]), min_size=1, max_size=4))
def test_select_adds_the_baselines_in_catalogue_order(keys: list[str]) -> None:
    runs = select(keys)
    chosen = [s.key for s in runs]
    assert set(keys) <= set(chosen)
    assert all(s.baseline in chosen for s in runs if s.baseline is not None)
    assert chosen == [s.key for s in CATALOGUE if s.key in chosen]


def test_select_names_the_known_runs_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match="known runs: ddp, zero"):
        select(["zero", "fp8"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"exchange_compression": "int8"}, "need 'zero'"),
        ({"optimizer": "diloco", "gradients": "none"}, "sync_every > 0"),
        ({"optimizer": "diloco", "sync_every": 10}, "gradients='none'"),
        ({"exact": True}, "needs a baseline"),
        ({"target": Target(0.01, "why")}, "needs a baseline"),
        ({"powersgd_rank": 0}, "rank >= 1"),
        ({"fragments": 2}, "need 'diloco'"),
        ({"optimizer": "diloco", "gradients": "none", "sync_every": 10, "fragments": 4}, "divide"),
        (
            {
                "optimizer": "diloco",
                "gradients": "none",
                "sync_every": 8,
                "fragments": 4,
                "delay": 2,
            },
            "delay=2",
        ),
    ],
)
def test_a_run_spec_that_does_not_fit_together_is_refused(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RunSpec("x", "x", **changes)


def test_the_counted_steps_must_cover_whole_diloco_periods() -> None:
    with pytest.raises(ValueError, match="count a multiple of that"):
        Config(model=TINY, runs=(DILOCO,), count_steps=15)
    assert Config(model=TINY, runs=(DILOCO,), count_steps=20).counted_steps == 20


def test_tensor_bytes_counts_a_shared_storage_once() -> None:
    t = torch.zeros(10)
    record = {"a": [t, t[2:5]], "b": (torch.zeros(3, dtype=torch.float64),), "c": 1}
    assert tensor_bytes(record) == 40 + 24


def measured(**changes: Any) -> Measured:
    """A rank's record of a 12-step run, 1 s steps, split twice."""
    base = Measured(
        losses=(3.0,) * 12,
        forward_backward=(0.3,) * 12,
        optimizer_step=(0.05,) * 12,
        local_step=(0.02,) * 12,
        compute=((5, 0.2), (10, 0.2)),
        backward_payload={"all_reduce": 4000},
        after_payload={"broadcast": 2000},
        counted_steps=2,
        memory={"parameters": 100, "gradients": 100, "optimizer_state": 200, "hook_state": 0},
        held_out=((6, 2.5), (12, 2.0)),
        fingerprints=(1, 2),
    )
    return attrs.evolve(base, **changes)


def test_time_split_adds_up_to_the_step() -> None:
    t = time_split(measured())
    assert t is not None
    assert t.compute == pytest.approx(200) and t.backward_communication == pytest.approx(100)
    assert t.step_communication == pytest.approx(30) and t.optimizer == pytest.approx(20)
    assert t.total == pytest.approx(350)
    assert time_split(measured(compute=())) is None


def test_summaries_compare_each_run_with_its_baseline() -> None:
    specs = select(["zero+int8", "diloco"])
    results = [
        {
            "ddp": measured(),
            "zero": measured(),
            "zero+int8": measured(losses=(3.0,) * 11 + (3.1,), held_out=((6, 2.5), (12, 2.1))),
            "diloco": measured(fingerprints=(1, rank)),
        }
        for rank in range(2)
    ]
    by_key = {s.spec.key: s for s in summarize(results, specs)}
    assert by_key["zero"].max_loss_difference == 0 and by_key["ddp"].gap is None
    int8 = by_key["zero+int8"]
    assert int8.max_loss_difference == pytest.approx(0.1)
    assert int8.gap is not None and int8.gap.relative == pytest.approx(0.05)
    assert int8.gap.met is False  # 5% against a 0.5% target
    assert "MISSED" in table(list(by_key.values()), {})
    assert any("lr/254" in line for line in findings(list(by_key.values())))
    # 4000 bytes all-reduced and 2000 broadcast over 2 steps, 2 ranks:
    assert (int8.sent.gradients, int8.sent.parameters) == (2000, 500)
    assert by_key["diloco"].sent.sync == 2500 and by_key["diloco"].sent.gradients == 0
    assert not by_key["diloco"].identical and by_key["zero"].identical


def test_samples_show_only_text_that_reads_as_text() -> None:
    summaries = list(summarize([{"ddp": measured(), "zero": measured()}], select(["zero"])))
    known = frozenset({b"return", b"the", b"value"})
    out = samples(summaries, {"ddp": b"value", "zero": b"value vxlue"}, b"Return the ", known)
    assert "ddp (100% of its words are words):\n    | Return the value" in out
    assert "zero: not shown, 50% of its words are words" in out and "--long" in out
    out = samples(summaries, {"ddp": b"value", "zero": b"value"}, b"Return the ", known)
    assert "not shown" not in out and "--long" not in out


def test_the_command_line_picks_runs_and_the_long_mode() -> None:
    cfg, world_size, _ = demo.parse(["--runs", "zero+int4", "--world-size", "3"])
    assert [s.key for s in cfg.runs] == ["ddp", "zero", "zero+int4"] and world_size == 3
    assert cfg.sample_bytes > 0  # sampled always, shown where it reads as text
    long, _, _ = demo.parse(["--long", "--runs", "ddp"])
    assert long.steps > cfg.steps and long.model.width > cfg.model.width
    for bad in (["--runs", "fp8"], ["--steps", "0"], ["--width", "30"], ["--lr", "-1"]):
        with pytest.raises(SystemExit):
            demo.parse(bad)


def test_the_diloco_flag_picks_ddp_and_the_diloco_runs_over_whole_periods() -> None:
    cfg, _, _ = demo.parse(["--diloco"])
    assert cfg.runs == DILOCO_RUNS
    periods = [s.sync_every for s in cfg.runs if s.sync_every]
    assert all(cfg.steps % p == 0 and cfg.counted_steps % p == 0 for p in periods)
    both, _, _ = demo.parse(["--diloco", "--runs", "zero"])
    assert [s.key for s in both.runs] == ["ddp", "zero", *(s.key for s in DILOCO_RUNS[1:])]
    with pytest.raises(SystemExit):  # fewer steps than one sync period
        demo.parse(["--diloco", "--steps", "30"])


# ---- one two-rank training of every default run and the other DiLoCo runs --------

# The DiLoCo runs' periods, shrunk to fit a few steps (each syncs in the counted ones).
TINY_DILOCO: dict[str, dict[str, Any]] = {
    DILOCO.key: {"sync_every": 2},
    DILOCO_H50.key: {"sync_every": 4},
    DILOCO_STREAMING.key: {"sync_every": 4, "fragments": 2, "delay": 1},
}
TRAINED = Config(
    model=TINY,
    runs=tuple(
        attrs.evolve(s, **TINY_DILOCO[s.key]) if s.sync_every else attrs.evolve(s, powersgd_start=2)
        for s in (*DEFAULT_RUNS, DILOCO_H50, DILOCO_STREAMING)
    ),
    steps=8,
    batch_size=2,
    data_bytes=200_000,
    eval_every=2,
    eval_windows=8,
    split_every=3,
    count_steps=4,
    sample_bytes=40,
)


@pytest.fixture(scope="module")
def trained() -> tuple[list[dict[str, Measured]], list[RunSummary]]:
    results = run_world(train_rank, 2, TRAINED)
    return results, list(summarize(results, TRAINED.runs))


Trained = tuple[list[dict[str, Measured]], list[RunSummary]]


def test_zero_trains_bitwise_as_ddp_does_and_the_compressed_runs_do_not(
    trained: Trained,
) -> None:
    results, summaries = trained
    for rank in results:
        assert rank["zero"].losses == rank["ddp"].losses
        assert rank["zero"].held_out == rank["ddp"].held_out
    by_key = {s.spec.key: s for s in summaries}
    assert by_key["zero"].max_loss_difference == 0
    for key in ("zero+powersgd", "zero+int8", "zero+int4"):
        assert (by_key[key].max_loss_difference or 0) > 0  # the check can tell them apart
    # Every rank holds the same parameters at each evaluation, but where a
    # DiLoCo run evaluates between its (fragments') syncs:
    apart = {"diloco-h50", "diloco-streaming"}
    assert all(s.identical != (s.spec.key in apart) for s in summaries)


def test_zero_holds_less_and_the_compressed_runs_send_less(trained: Trained) -> None:
    _, summaries = trained
    s = {x.spec.key: x for x in summaries}
    assert s["zero"].memory[0]["optimizer_state"] < s["ddp"].memory[0]["optimizer_state"]
    assert sum(s["zero"].memory[1].values()) < sum(s["ddp"].memory[1].values())
    assert 0 < s["zero+int4"].sent.parameters < s["zero+int8"].sent.parameters
    assert s["zero+int8"].sent.parameters < s["zero"].sent.parameters
    assert s["zero+int8"].sent.gradients == s["zero"].sent.gradients
    assert 0 < s["zero+powersgd"].sent.gradients < s["zero"].sent.gradients
    for key in TINY_DILOCO:
        assert 0 < s[key].sent.total < s["ddp"].sent.total
    # Over the same counted steps, a sync every 4 steps sends half of one every 2:
    assert s["diloco-h50"].sent.total == pytest.approx(s["diloco"].sent.total / 2)
    assert s["zero+powersgd"].memory[0]["hook_state"] > 0
    planned = demo.plans(TRAINED, 2)
    assert set(planned) == {"zero", "zero+powersgd"}  # the planner models no compression
    assert all(matches_plan(s[key], plan) for key, plan in planned.items())


def test_every_run_shows_in_the_table_and_the_figure(trained: Trained, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from demo_figure import figure, save

    results, summaries = trained
    texts = {s.spec.key: results[0][s.spec.key].sample for s in summaries}
    known = vocabulary(load_corpus(TRAINED.data_bytes).train)
    out = demo.report(summaries, demo.plans(TRAINED, 2), texts, known)
    head = out.splitlines()[0]
    assert all(f" {s.spec.key} " in head for s in summaries)
    assert "0 (bitwise equal)" in out
    # Eight steps of a tiny model write no words: every sample is named, none shown.
    assert all(f"  {s.spec.key}: not shown, " in out for s in summaries)
    fig = figure(summaries, "title")
    loss_axis = fig.axes[0]
    legend = [t.get_text() for t in loss_axis.get_legend().get_texts()]
    assert len(legend) == len(summaries)
    for s in summaries:
        assert any(text.startswith(f"{s.spec.key}: ") for text in legend)
    assert fig.axes[0].get_ylabel().startswith("held-out loss")
    memory_legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    kinds = [k.replace("_", " ") for k in memory_kinds(summaries)]
    # Every kind some rank holds bytes of, and no kind that is zero everywhere:
    assert sorted(memory_legend) == sorted([*kinds, "other ranks' totals"])
    assert "exchange buffers" in kinds and "master weights" in kinds  # the compressed runs'
    loss_bytes = fig.axes[-1]  # drawn with a DiLoCo run only
    assert loss_bytes.get_title() == "Final held-out loss against bytes sent"
    assert [t.get_text() for t in loss_bytes.get_legend().get_texts()] == [
        s.spec.key for s in summaries
    ]
    assert loss_bytes.get_xscale() == "log"
    points = {line.get_label(): line.get_xydata()[0] for line in loss_bytes.get_lines()}
    for s in summaries:
        assert tuple(points[s.spec.key]) == pytest.approx(
            (s.sent.total * TRAINED.steps / 2**20, s.final_held_out)
        )
    without = figure([x for x in summaries if x.spec.optimizer != "diloco"], "title")
    assert len(without.axes) == len(fig.axes) - 1
    path = tmp_path / "demo.png"
    save(fig, str(path))
    assert path.stat().st_size > 10_000
