"""Kill-and-restart soak with the real elastic launcher (issue 18).

``examples/train_resumable.py`` runs under ``torchrun`` on 2 gloo ranks for
24 steps, saving in the background every 4 steps: once uninterrupted, once
with ``--max-restarts 5`` and a plan that has one worker ``SIGKILL`` itself on
each of the first 5 starts, each at another point (mid-step, inside a save,
just before and just after a save, at the final wait). Each start resumes
from the newest whole checkpoint; the killed job must end with the
uninterrupted one's parameters and optimizer state, bit for bit. The jobs
run through ``benchmarks/bench_soak_restart.py``, which also reports the
numbers on docs/resilience.md; the pure parts of it are tested first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

from bench_soak_restart import (
    BEGIN,
    END,
    ROOT,
    TEST,
    Job,
    Restart,
    SoakConfig,
    block,
    compare_states,
    replace_block,
    restart_table,
    restarts,
    run_job,
    starts,
)
from kill_plan import Kill, format_plan, parse_plan
from train_resumable import checkpoint_name

from zerofn.zero.checkpoint.run import temporaries

JOB_TIMEOUT_S = 150.0
# Whichever soak test runs first runs both jobs (a module fixture): each
# test's limit covers them.
SOAK_TIMEOUT = pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)

# ----- the pure parts --------------------------------------------------------------


def test_a_kill_plan_reads_back_as_written() -> None:
    plan = "1:7:step,0:12:save,1:16:before-save,0:20:after-save,1:24:wait"
    kills = parse_plan(plan)
    assert kills[1] == Kill(rank=0, step=12, point="save")
    assert format_plan(kills) == plan
    assert parse_plan("") == ()


@pytest.mark.parametrize("bad", ["1:7", "a:7:step", "1:7:lunch", "1:0:step"])
def test_a_bad_kill_plan_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_plan(bad)


def _log() -> list[dict[str, Any]]:
    """A made-up log: rank 1 killed inside the save of step 8, with 10
    steps done and the checkpoint of step 4 whole; the next start resumed
    from step 4 and found the cut-short save's staging directory."""
    return [
        {"event": "start", "restart": 0, "resumed_from": 0, "leftovers": [], "startup_s": 5.0, "at": 100.0},
        {"event": "kill", "restart": 0, "rank": 1, "point": "save", "step": 8, "trained": 10,
         "last_save": 8, "newest_complete": 4, "at": 101.0},
        {"event": "start", "restart": 1, "resumed_from": 4, "startup_s": 4.5, "at": 107.5,
         "leftovers": [".step-00000008.zerofn-staging-0123456789abcdef"]},
        {"event": "end", "restart": 1, "step": 24, "at": 110.0},
    ]  # fmt: skip


def test_each_kill_is_paired_with_the_start_after_it() -> None:
    (row,) = restarts(_log())
    assert (row.kill, row.trained, row.resumed_from, row.steps_lost) == (
        Kill(1, 8, "save"),
        10,
        4,
        6,
    )
    assert (row.newest_complete, row.last_save, row.restart_s, row.startup_s) == (4, 8, 6.5, 4.5)
    assert "| 0 | rank 1 | `save` | 8 | 10 | 4 | 4 | 6 | 6.5 | 4.5 | a staging directory |" in (
        restart_table([row])
    )
    with pytest.raises(ValueError, match="no start after"):
        restarts(_log()[:2])


def test_the_block_reports_every_kill_and_the_equality() -> None:
    state = {"params": {"w": torch.ones(2)}}
    reference = Job(0, (_log()[0], {**_log()[3], "restart": 0, "at": 102.0}), state, "", "", 9.0)
    killed = Job(0, tuple(_log()), state, "", "", 20.0)
    text = block(SoakConfig(24, 4, parse_plan("1:8:save")), reference, killed)
    assert "kill plan `1:8:save`" in text
    assert "then 2.0 s for the 24 steps" in text
    assert "| `save` | 8 | 10 |" in text
    assert "Steps lost per kill: 6 (6 to 6)" in text
    assert "**bitwise equal** to the uninterrupted run's (1 tensors compared)" in text


def test_states_compare_bitwise_down_to_every_tensor() -> None:
    a = {
        "params": {"w": torch.tensor([1.0, 2.0])},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1},
    }
    same = {
        "params": {"w": torch.tensor([1.0, 2.0])},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1},
    }
    assert compare_states(a, same) == (2, [])
    nudged = {
        **same,
        "params": {
            "w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()])
        },
    }
    assert compare_states(a, nudged)[1] == ["/params/w"]
    assert compare_states(a, {**same, "params": {"w": torch.tensor([1, 2])}})[1] == [
        "/params/w"
    ]  # dtype
    assert compare_states(a, {**same, "extra": 1})[1][0].startswith(": keys")


def test_the_block_between_the_markers_is_replaced_and_nothing_else() -> None:
    page = f"# Title\n\ntext\n\n{BEGIN}\nold table\n{END}\n\nmore\n"
    assert replace_block(page, "new") == f"# Title\n\ntext\n\n{BEGIN}\nnew\n{END}\n\nmore\n"
    with pytest.raises(ValueError, match="expected one"):
        replace_block("no markers", "new")
    with pytest.raises(ValueError, match="expected one"):
        replace_block(f"{END}\n{BEGIN}", "new")


def test_the_committed_page_has_its_markers_and_a_measured_table() -> None:
    with open(os.path.join(ROOT, "docs", "resilience.md"), encoding="utf-8") as f:
        page = f.read()
    table = page.split(BEGIN)[1].split(END)[0]
    assert "| start | victim | killed | at step |" in table
    assert "bitwise equal" in table


# ----- the soak under torchrun -----------------------------------------------------


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Job]]:
    """The uninterrupted job and the killed one (run one after the other:
    two at once would share 2 cores 4 ways)."""
    reference_dir = tmp_path_factory.mktemp("reference")
    killed_dir = tmp_path_factory.mktemp("killed")
    reference = run_job(TEST, str(reference_dir), killed=False, timeout_s=JOB_TIMEOUT_S)
    killed = run_job(TEST, str(killed_dir), killed=True, timeout_s=JOB_TIMEOUT_S)
    yield reference, killed


def _explain(job: Job) -> str:
    return f"log: {list(job.records)}\noutput:\n{job.output[-6000:]}"


@SOAK_TIMEOUT
@pytest.mark.slow
def test_both_jobs_finish_and_log_every_start(jobs: tuple[Job, Job]) -> None:
    reference, killed = jobs
    assert reference.returncode == 0, _explain(reference)
    assert killed.returncode == 0, _explain(killed)
    assert [s["restart"] for s in starts(reference.records)] == [0]
    # One start per kill and one more that finished: 6 starts, 5 kills.
    assert [s["restart"] for s in starts(killed.records)] == [0, 1, 2, 3, 4, 5], _explain(killed)
    done = [r for r in killed.records if r["event"] == "end"]
    assert [(r["restart"], r["step"]) for r in done] == [(5, TEST.steps)]


@SOAK_TIMEOUT
@pytest.mark.slow
def test_every_planned_kill_happened_where_planned(jobs: tuple[Job, Job]) -> None:
    _, killed = jobs
    rows = restarts(killed.records)
    assert [r.kill for r in rows] == list(TEST.kills), _explain(killed)
    assert [r.restart for r in rows] == [0, 1, 2, 3, 4]


def _check_resume(row: Restart, save_every: int) -> None:
    where = f"after the kill {row.kill} of start {row.restart}: {row}"
    assert row.resumed_from % save_every == 0, where
    # Never older than what was whole on disk when the victim died, never
    # newer than the last save begun (a save may commit after that look).
    assert row.newest_complete <= row.resumed_from <= row.last_save, where
    assert row.resumed_from <= row.trained, where
    # Which saves had begun is known by construction of each kill point.
    if row.kill.point in ("step", "before-save"):
        assert row.last_save < row.kill.step, where
    else:
        assert row.last_save == row.kill.step, where
    if row.kill.point == "save":
        # Killed while writing: that save never committed, and its staging
        # directory is all it left.
        assert row.resumed_from < row.kill.step, where
        staged = temporaries(row.leftovers, checkpoint_name(row.kill.step))
        assert staged and all(".zerofn-staging-" in n for n in staged), where


@SOAK_TIMEOUT
@pytest.mark.slow
def test_each_restart_resumes_from_the_newest_whole_checkpoint(jobs: tuple[Job, Job]) -> None:
    _, killed = jobs
    assert starts(killed.records)[0]["resumed_from"] == 0
    for row in restarts(killed.records):
        _check_resume(row, TEST.save_every)
    # Each start that resumed says so, naming the step and the checkpoint.
    for start in starts(killed.records):
        step = start["resumed_from"]
        if step:
            said = f"resumed from step {step} (checkpoint {killed.run_dir}"
            assert said in killed.output, _explain(killed)


@SOAK_TIMEOUT
@pytest.mark.slow
def test_the_run_ends_with_its_two_newest_checkpoints_and_no_temporaries(
    jobs: tuple[Job, Job],
) -> None:
    for job in jobs:
        names = sorted(os.listdir(job.run_dir))
        last = [checkpoint_name(TEST.steps - TEST.save_every), checkpoint_name(TEST.steps)]
        assert names == last, _explain(job)


@SOAK_TIMEOUT
@pytest.mark.slow
def test_the_killed_run_ends_bitwise_equal_to_the_uninterrupted_one(
    jobs: tuple[Job, Job],
) -> None:
    reference, killed = jobs
    assert reference.state is not None and killed.state is not None
    tensors, differences = compare_states(reference.state, killed.state)
    assert differences == []
    # The parameters and Adam's step, exp_avg and exp_avg_sq of every one.
    params = len(reference.state["params"])
    assert tensors == params + 3 * params
