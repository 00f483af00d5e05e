"""The capacity planner: the built-in models' published sizes, its pure
invariants, the command line, and (on 2 gloo ranks) its bytes against the
live tensors the adapter allocated and the collectives it issued."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _draws import draws
from _world import run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer, hooks
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.footprint import plan_footprint, shapes_of
from zerofn.footprint.cli import COLUMNS, Column, main, table
from zerofn.model_shapes import MODELS

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("gpt2-small", 124_439_808),
        ("bert-base", 109_482_240),
        ("resnet50", 25_557_032),
        ("llama-7b", 6_738_415_616),
    ],
)
def test_built_in_models_have_their_published_sizes(name: str, published: int) -> None:
    assert sum(math.prod(s) for s in MODELS[name]()) == published


@settings(max_examples=draws(60), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12),
    world_size=st.integers(1, 16),
    mode=st.sampled_from(["greedy", "balanced", "flat"]),
)
def test_the_shards_hold_the_whole_optimizer_state_once(
    sizes: list[int], world_size: int, mode: Any
) -> None:
    f = plan_footprint([[(n,) for n in sizes]], world_size, mode)
    total = sum(sizes)
    # Adam: two fp32 states per element, and a 4-byte step per stepped tensor:
    # each parameter, or (flat) each piece of a parameter a rank owns.
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    bounds = [r * total // world_size for r in range(world_size + 1)]
    pieces = [
        sum(
            min(starts[i + 1], bounds[r + 1]) > max(starts[i], bounds[r]) for i in range(len(sizes))
        )
        for r in range(world_size)
    ]
    stepped = sum(pieces) if mode == "flat" else len(sizes)
    assert sum(r.optimizer_state for r in f.ranks) == 8 * total + 4 * stepped
    assert all(r.parameters == r.gradients == 4 * total for r in f.ranks)
    if mode == "flat":  # every rank within one element (8 bytes) of its share
        states = [r.optimizer_state - 4 * n for r, n in zip(f.ranks, pieces, strict=True)]
        assert max(states) - min(states) <= 8


def test_bucket_view_saves_the_exchange_copy() -> None:
    shapes = [[(64, 32), (32,)]]
    assert plan_footprint(shapes, 2).ranks[0].exchange_buffers == 4 * (64 * 32 + 32)
    assert plan_footprint(shapes, 2, bucket_view=True).ranks[0].exchange_buffers == 0
    # Like the optimizer, flat defaults to bucket views and every other mode does not.
    assert plan_footprint(shapes, 2, "flat").ranks[0].exchange_buffers == 0
    assert plan_footprint(shapes, 2, "balanced").ranks[0].exchange_buffers > 0
    flat_copy = plan_footprint(shapes, 2, "flat", bucket_view=False)
    assert flat_copy.ranks[0].exchange_buffers == 4 * (64 * 32 + 32)


def test_meta_modules_cost_nothing_and_plan_like_their_shapes() -> None:
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8))
    shapes = shapes_of(module)
    assert shapes == [[(4096, 4096), (4096,), (8, 4096), (8,)]]
    assert plan_footprint(module, 8, "flat") == plan_footprint(shapes, 8, "flat")


def test_bad_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown optimizer"):
        plan_footprint([[(3,)]], 2, optimizer="lion")
    with pytest.raises(ValueError, match="unknown hook"):
        plan_footprint([[(3,)]], 2, hook="topk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trainable parameters"):
        plan_footprint([[]], 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="powersgd_rank must be an int of at least 1"):
            plan_footprint([[(3,)]], 2, hook="powersgd", powersgd_rank=bad)  # type: ignore[arg-type]


def test_command_line_prints_a_table_and_exact_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "gpt2-small", "--world-size", "8", "--partition", "flat"])
    assert "| 8 | flat |" in capsys.readouterr().out
    main(["--model", "resnet50", "--world-size", "2", "--json"])
    (record,) = json.loads(capsys.readouterr().out)
    assert record["numel"] == 25_557_032 and record["world_size"] == 2
    assert record["ranks"][0]["parameters"] == 4 * 25_557_032
    main(["--model", "gpt2-small", "--world-size", "8", "--partition", "flat", "--json",
          "--param-dtype", "bf16", "--master-dtype", "fp32"])  # fmt: skip
    (mixed,) = json.loads(capsys.readouterr().out)
    heaviest = mixed["ranks"][mixed["heaviest"]]
    numel = mixed["numel"]
    assert heaviest["parameters"] == heaviest["gradients"] == 2 * numel
    assert abs(heaviest["master_weights"] - 4 * numel / 8) <= 4
    assert heaviest["exchange_buffers"] == 0  # flat defaults to bucket views
    main(["--model", "gpt2-small", "--world-size", "8", "--partition", "flat", "--json",
          "--no-bucket-view"])  # fmt: skip
    (copied,) = json.loads(capsys.readouterr().out)
    assert copied["ranks"][0]["exchange_buffers"] == 4 * copied["numel"]


def _table_rows(out: str) -> list[dict[str, str]]:
    """The Markdown table the command printed: one dict per row, by header."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]
    return [dict(zip(header, row, strict=True)) for row in rows]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "powersgd"])
def test_the_table_shows_the_bytes_of_a_step(hook: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "gpt2-small", "--world-size", "8", "--world-size", "64",
            "--partition", "greedy", "--partition", "flat", "--hook", hook]  # fmt: skip
    main(argv)
    rows = _table_rows(capsys.readouterr().out)
    main([*argv, "--json"])
    records = json.loads(capsys.readouterr().out)
    assert [c.header for c in COLUMNS] == list(rows[0])
    assert len(rows) == len(records) == 4
    for row, record in zip(rows, records, strict=True):
        payload = record["payload_bytes"]
        assert row["all-reduce MiB/step"] == _mib(payload["all_reduce"])
        assert row["broadcast MiB/step"] == _mib(payload["broadcast"])
        assert (row["ranks"], row["partition"]) == (str(record["world_size"]), record["partition"])


def test_powersgd_rank_sets_the_bytes_of_the_factors(capsys: pytest.CaptureFixture[str]) -> None:
    # One 256 x 128 matrix, compressed at every rank drawn: r (256 + 128) float32 values.
    for rank in (1, 2, 4):
        plan = plan_footprint([[(256, 128)]], 2, hook="powersgd", powersgd_rank=rank)
        assert plan.payload("all_reduce") == 4 * rank * (256 + 128)
        assert plan.powersgd_rank == rank
    assert plan_footprint([[(256, 128)]], 2).powersgd_rank is None

    argv = [
        "--model",
        "gpt2-small",
        "--world-size",
        "8",
        "--partition",
        "flat",
        "--hook",
        "powersgd",
    ]
    sent = {}
    for rank in ("1", "4"):
        main([*argv, "--powersgd-rank", rank, "--json"])
        (record,) = json.loads(capsys.readouterr().out)
        assert record["powersgd_rank"] == int(rank)
        sent[rank] = record["payload_bytes"]["all_reduce"]
        main([*argv, "--powersgd-rank", rank])
        out = capsys.readouterr().out
        assert f"powersgd hook (rank {rank})" in out.splitlines()[0]
        assert _table_rows(out)[0]["all-reduce MiB/step"] == _mib(sent[rank])
    main([*argv, "--json"])
    (default,) = json.loads(capsys.readouterr().out)
    assert default["payload_bytes"]["all_reduce"] == sent["1"] < sent["4"]
    gpt2 = [list(MODELS["gpt2-small"]())]
    assert sent["4"] == plan_footprint(gpt2, 8, "flat", hook="powersgd", powersgd_rank=4).payload(
        "all_reduce"
    )


def test_the_table_takes_its_columns_from_a_list() -> None:
    footprints = [plan_footprint([[(64, 32)]], n) for n in (1, 2)]
    extra = Column("collectives", lambda f: str(sum(n for _, n in f.zero_collectives)))
    rows = _table_rows(table(footprints, (*COLUMNS, extra)))
    assert list(rows[0]) == [*(c.header for c in COLUMNS), "collectives"]
    assert [r["collectives"] for r in rows] == [
        str(sum(n for _, n in f.zero_collectives)) for f in footprints
    ]
    assert table(footprints).splitlines()[1].count("---") == len(COLUMNS)


# The page's tables, each with the command the page says printed it.
PAGE = Path(__file__).resolve().parents[1] / "docs" / "footprint.md"
MODES = ["--partition", "greedy", "--partition", "balanced", "--partition", "flat"]
WORLDS = ["--world-size", "8", "--world-size", "64", "--world-size", "1024"]
LLAMA_BF16 = ["--model", "llama-7b", *WORLDS, "--partition", "flat", "--param-dtype", "bf16"]
PAGE_TABLES = [
    *(["--model", name, *WORLDS, *MODES, "--no-bucket-view"] for name in sorted(MODELS)),
    [*LLAMA_BF16, "--bucket-view"],
    [*LLAMA_BF16, "--master-dtype", "fp32", "--bucket-view"],
    ["--model", "gpt2-small", "--world-size", "8", "--partition", "flat",
     "--hook", "powersgd", "--powersgd-rank", "4"],
    ["--model", "gpt2-small", "--world-size", "8", "--world-size", "64", "--partition", "flat",
     "--exchange-compression", "int8"],
]  # fmt: skip


def test_the_pages_tables_are_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    page = PAGE.read_text(encoding="utf-8")
    flat_page = " ".join(page.replace("\\\n", " ").split())
    for argv in PAGE_TABLES:
        main(argv)
        printed = capsys.readouterr().out.strip().splitlines()[1:]
        assert "\n".join(printed) in page, f"docs/footprint.md lacks the table of {argv}"
        command = " ".join(["python -m zerofn.footprint", *argv])
        generic = command.replace(f"--model {argv[1]} ", "--model NAME ")
        assert command in flat_page or generic in flat_page, command


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt3"], "neither one of"),
        (["--model", "no_such_module_for_zerofn:build"], "cannot import module"),
        (["--model", "torch.nn:NoSuchModel"], "has no attribute 'NoSuchModel'"),
        (["--model", "math:pi"], "'pi' is a float, not a function"),
        (["--model", "torch.nn:Linear"], "callable with no arguments"),
        (["--model", "builtins:dict"], "returned a dict, not an nn.Module"),
        (["--model", "gpt2-small", "--world-size", "0"], "--world-size must be at least 1"),
        (["--model", "gpt2-small", "--world-size", "-4"], "--world-size must be at least 1"),
        (["--model", "gpt2-small", "--master-dtype", "bf16"], "narrower than the parameters'"),
        (
            ["--model", "gpt2-small", "--hook", "powersgd", "--powersgd-rank", "0"],
            "--powersgd-rank must be at least 1, got 0",
        ),
        (
            ["--model", "gpt2-small", "--hook", "powersgd", "--powersgd-rank", "-2"],
            "--powersgd-rank must be at least 1, got -2",
        ),
        (
            ["--model", "gpt2-small", "--hook", "powersgd", "--powersgd-rank", "two"],
            "--powersgd-rank: invalid int value: 'two'",
        ),
        (
            ["--model", "gpt2-small", "--powersgd-rank", "2"],
            "--powersgd-rank applies only to --hook powersgd",
        ),
    ],
    ids=[
        "unknown-name",
        "not-importable",
        "no-attribute",
        "not-callable",
        "needs-arguments",
        "not-a-module",
        "zero-ranks",
        "negative-ranks",
        "narrow-masters",
        "zero-powersgd-rank",
        "negative-powersgd-rank",
        "non-integer-powersgd-rank",
        "powersgd-rank-without-powersgd",
    ],
)
def test_command_line_refuses_bad_arguments_as_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--world-size" not in argv:
        argv = [*argv, "--world-size", "8"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2  # argparse's status for a usage error
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: python -m zerofn.footprint")
    assert "Traceback" not in err
    assert message in err


# ----- against live tensors and counted collectives, on 2 gloo ranks -----------------

# (partition, bucket view (None: the default), hook, bf16 parameters with fp32 masters,
# exchange compression, redundancy=2 with the exchange behind the next forward)
CASES: list[tuple[str, bool | None, str, bool, str | None, bool]] = [
    ("greedy", False, "allreduce", False, None, False),
    ("greedy", True, "allreduce", False, None, False),
    ("balanced", False, "allreduce", False, None, False),
    ("flat", False, "allreduce", False, None, False),
    ("flat", None, "allreduce", False, None, False),
    ("flat", True, "powersgd", False, None, False),
    ("flat", True, "allreduce", True, None, False),
    ("greedy", False, "allreduce", True, None, False),
    ("greedy", False, "allreduce", False, "int8", False),
    ("flat", None, "allreduce", False, "int4", False),
    ("flat", True, "allreduce", True, "int8", False),
    ("greedy", False, "allreduce", False, None, True),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 600 x 600: each rank's flat shard spans two cache-sized chunks.
    return torch.nn.Sequential(
        torch.nn.Linear(24, 600),
        torch.nn.ReLU(),
        torch.nn.Linear(600, 600),
        torch.nn.Linear(600, 3),
    )


def _measure(
    rank: int,
    mode: str,
    bucket_view: bool | None,
    hook: str,
    bf16: bool,
    squeeze: str | None,
    kept: bool,
) -> dict[str, Any]:
    dtype = torch.bfloat16 if bf16 else torch.float32
    ddp = DDP(_model().to(dtype))
    if hook == "powersgd":
        state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, hooks.powerSGD_hook)
    else:
        ddp.register_comm_hook(None, hooks.allreduce_hook)
    view = {} if bucket_view is None else {"parameters_as_bucket_view": bucket_view}
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        partition=mode,
        **view,
        lr=0.01,
        master_dtype=torch.float32 if bf16 else None,
        exchange_compression=squeeze,
        redundancy=2 if kept else 1,
        gather_during_forward=kept,
    )
    for step in range(3):  # PowerSGD compresses from the third step
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(10 * rank + step))
        with collective_traffic() as traffic:
            ddp(x.to(dtype)).float().square().mean().backward()
            opt.step()
        opt.zero_grad(set_to_none=False)
    return {"memory": opt.memory_bytes(), "payload": dict(traffic.payload_bytes)}


def measure_world(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [_measure(rank, *case) for case in CASES]


@pytest.fixture(scope="module")
def measured() -> list[list[dict[str, Any]]]:
    return run_world(measure_world, 2)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_planner_equals_live_tensors_and_counted_traffic(
    measured: list[list[dict[str, Any]]], case: int
) -> None:
    mode, bucket_view, hook, bf16, squeeze, kept = CASES[case]
    plan = plan_footprint(
        shapes_of(_model()),
        2,
        mode,
        param_dtype=torch.bfloat16 if bf16 else torch.float32,
        master_dtype=torch.float32 if bf16 else None,
        bucket_view=bucket_view,
        hook=hook,  # type: ignore[arg-type]
        exchange_compression=squeeze,
        redundancy=2 if kept else 1,
        gather_during_forward=kept,
    )
    for rank in range(2):
        got = measured[rank][case]
        predicted = plan.ranks[rank]
        assert got["memory"] == {
            "parameters": predicted.parameters,
            "gradients": predicted.gradients,
            "master_weights": predicted.master_weights,
            "optimizer_state": predicted.optimizer_state,
            "exchange_buffers": predicted.exchange_buffers,
            "carried": predicted.carried,
            "kept_gradients": predicted.kept_gradients,
        }
        assert got["payload"] == dict(plan.payload_bytes)


@pytest.mark.parametrize("world", [2, 8, 64, 1024])
def test_bf16_with_fp32_masters_costs_two_plus_two_plus_twelve_over_d(world: int) -> None:
    gpt2 = [list(MODELS["gpt2-small"]())]
    plan = plan_footprint(
        gpt2, world, "flat", param_dtype=torch.bfloat16, master_dtype=torch.float32,
        bucket_view=True,
    )  # fmt: skip
    assert plan.bytes_per_parameter(plan.heaviest) == pytest.approx(2 + 2 + 12 / world, abs=1e-3)
    fp32 = plan_footprint(gpt2, world, "flat", bucket_view=True)
    assert fp32.bytes_per_parameter(fp32.heaviest) == pytest.approx(4 + 4 + 8 / world, abs=1e-3)


def test_diloco_fragments_add_the_outer_state_column(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofn.diloco.footprint import outer_state_bytes_per_rank

    main(["--model", "gpt2-small", "--world-size", "8", "--diloco-fragments", "4"])
    header, _, row = capsys.readouterr().out.strip().splitlines()[1:]
    assert header.split("|")[-2].strip() == "DiLoCo outer GiB (P=4)"
    expected = outer_state_bytes_per_rank(124_439_808, 8, 4) / 2**30
    assert row.split("|")[-2].strip() == f"{expected:.2f}"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "gpt2-small", "--world-size", "8", "--diloco-fragments", "0"])
    assert exit_info.value.code == 2
    assert "--diloco-fragments must be at least 1" in capsys.readouterr().err
