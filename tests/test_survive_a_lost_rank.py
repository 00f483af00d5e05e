"""``examples/survive_a_lost_rank.py``: ranks lost on purpose (in a backward,
inside the ZeRO step's exchange, between steps; one after another), the
survivors going on in-process with ``redundancy=2``; their ``final.pt`` (the
model's state_dict and the consolidated optimizer state) equals, bit for bit,
the ``--reference`` run's, which never loses a rank but restarts on the
survivors' world size from the consolidated state at each loss with the same
batches. No step is lost (the Adam step counts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import diloco_survival as diloco
import survive_a_lost_rank as example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "survive_a_lost_rank.py")


def assert_bitwise_equal(a: Any, b: Any, where: str = "final.pt") -> None:
    """The same structure, every tensor ``torch.equal`` (and of the same dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_recoveries(
    result: dict[str, Any],
    world_size: int,
    kills: tuple[example.Kill, ...],
    behind_forward: bool = False,
) -> None:
    """One recovery per kill, at the step the survivors noticed it, the step
    finished only when the rank died in the exchange, no step lost. With
    the exchange ``behind_forward``, a death inside it fails the next
    step's forward, which is redone (the step it belongs to returned)."""
    assert result["world_size"] == world_size - len(kills)
    assert len(result["recoveries"]) == len(kills)
    for i, (kill, r) in enumerate(zip(kills, result["recoveries"], strict=True)):
        if behind_forward and kill.phase == "exchange":
            assert r["step"] == kill.step + 1 and not r["finished_step"]
        else:
            assert r["step"] == kill.failing_step
            assert r["finished_step"] == (kill.phase == "exchange")
        assert tuple(r["sizes"]) == (world_size - i, world_size - i - 1)
        assert len(r["lost"]) == 1 and r["seconds"] > 0
        assert r["steps_lost"] == 0


def _case(world_size: int, steps: int, kills: tuple[str, ...], config: str, slow: bool) -> Any:
    name = f"{config}, {world_size} ranks, {' then '.join(k.split(':')[1] for k in kills)}"
    return pytest.param(
        world_size, steps, kills, config, marks=[pytest.mark.slow] if slow else [], id=name
    )


@pytest.mark.parametrize(
    "world_size,steps,kills,config",
    [
        _case(3, 14, ("2@12:between",), "plain", slow=False),  # the unmarked one
        *(
            _case(3, 14, (f"1@12:{phase}",), config, slow=True)
            for config in sorted(example.CONFIGS)
            for phase in ("exchange", "backward")
        ),
        _case(4, 22, ("1@10:exchange", "2@20:between"), "plain", slow=True),
        _case(4, 22, ("1@10:exchange", "2@20:between"), "masters", slow=True),
        # Flat: the last rank's range joins its predecessor's, its update sent
        # by its carrier (rank 0), then rank 0 itself is lost.
        _case(4, 22, ("3@10:exchange", "0@20:between"), "flat", slow=True),
        _case(4, 22, ("1@10:exchange", "3@20:exchange"), "int8", slow=True),
        _case(4, 22, ("2@10:backward", "0@20:exchange"), "overlap", slow=True),
        _case(4, 22, ("1@10:exchange", "2@20:between"), "gather", slow=True),
        # Lost before the second forward: DDP's bucket rebuild fails in it
        # before any piece is waited for, the exchange still behind it.
        _case(3, 6, ("1@0:between",), "gather", slow=True),
    ],
)
def test_the_survivors_end_with_the_references_bits(
    tmp_path: Path, world_size: int, steps: int, kills: tuple[str, ...], config: str
) -> None:
    plan = tuple(example.parse_kill(k) for k in kills)
    chosen = example.CONFIGS[config]
    killed = example.run_killed(world_size, steps, plan, config=chosen)
    behind = dict(chosen.options).get("gather_during_forward", False)
    check_recoveries(killed, world_size, plan, behind_forward=behind)
    reference = example.run_reference(world_size, steps, plan, chosen)
    ours = torch.load(example.save_final(killed, str(tmp_path / "killed")), weights_only=False)
    theirs = torch.load(
        example.save_final(reference, str(tmp_path / "reference")), weights_only=False
    )
    assert ours.keys() == {"model", "optimizer"}
    assert example.adam_steps(ours["optimizer"]) == {steps}
    assert_bitwise_equal(ours, theirs)


def _cli(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


@pytest.mark.slow  # make test-slow: two runs of the command, each starting torch twice
def test_the_command_line_end_to_end(tmp_path: Path) -> None:
    """The smallest case through the command: 3 ranks, rank 2 lost between steps 1 and 2."""
    common = ["--world-size", "3", "--steps", "3", "--kill", "2@1:between"]
    killed = _cli(*common, "--out", str(tmp_path / "killed"))
    reference = _cli(*common, "--out", str(tmp_path / "reference"), "--reference")
    wrote = "final.pt: 2 of 3 ranks at the end, 3 steps done, Adam step count [3]"
    assert wrote in killed[-2] and wrote in reference[-3]
    assert re.fullmatch(
        r"rank 2 lost in step 1 \(between\): 3 -> 2 ranks at step 2, step redone; "
        r"recovered in \d+\.\d\d s; steps lost: 0",
        killed[-1],
    ), killed[-1]
    assert reference[-2:] == [
        "reference: steps 0 to 1 on 3 ranks",
        "reference: steps 2 to 2 on 2 ranks",
    ]
    ours, theirs = (
        torch.load(tmp_path / name / "final.pt", weights_only=False)
        for name in ("killed", "reference")
    )
    assert_bitwise_equal(ours, theirs)


@pytest.mark.parametrize(
    "world_size,steps,kills,why",
    [
        (3, 14, ("3@2:backward",), "each killed rank"),
        (3, 14, ("1@2:backward", "1@5:between"), "each killed rank"),
        (3, 14, ("1@2:backward", "2@5:between"), "2 survivors"),
        (3, 14, ("1@13:between",), "noticed within"),
        (4, 14, ("1@5:between", "2@6:backward"), "step order"),
        (4, 14, ("1@6:backward", "2@5:exchange"), "step order"),
    ],
)
def test_kills_it_cannot_honour_are_refused(
    world_size: int, steps: int, kills: tuple[str, ...], why: str
) -> None:
    plan = tuple(example.parse_kill(k) for k in kills)
    with pytest.raises(ValueError, match=why):
        example.check_kills(world_size, steps, plan)


@pytest.mark.parametrize("text", ["1@2", "x@2:exchange", "1@2:forward", "1:exchange@2"])
def test_a_kill_is_rank_at_step_colon_phase(text: str) -> None:
    with pytest.raises(Exception, match="RANK@STEP:PHASE|PHASE is one of"):
        example.parse_kill(text)
    assert example.parse_kill("2@12:between") == example.Kill(2, 12, "between")


@pytest.mark.slow  # make test-slow: the pause outlasts the group's timeout and the roll call
def test_a_paused_rank_fails_alone_and_the_survivors_equal_a_kill_between(
    tmp_path: Path,
) -> None:
    pause = example.parse_pause("1@4:12")
    killed = example.run_killed(3, 8, (), pauses=(pause,))
    reference = example.run_reference(3, 8, (pause.as_kill(),))
    (paused,) = killed["paused"]
    assert paused["paused"] == 1 and "left behind" in paused["error"]
    check_recoveries(killed, 3, (pause.as_kill(),))
    ours = torch.load(example.save_final(killed, str(tmp_path / "paused")), weights_only=False)
    theirs = torch.load(
        example.save_final(reference, str(tmp_path / "reference")), weights_only=False
    )
    assert_bitwise_equal(ours, theirs)


@pytest.mark.parametrize("text", ["1@2", "x@2:3", "1@2:0", "1@2:-1"])
def test_a_pause_is_rank_at_step_colon_seconds(text: str) -> None:
    with pytest.raises(Exception, match="RANK@STEP:SECONDS|must be positive"):
        example.parse_pause(text)
    assert example.parse_pause("2@12:15") == example.Pause(2, 12, 15.0)


@pytest.mark.slow  # each case: a killed run and its reference, 3 or 4 launches of ranks
@pytest.mark.parametrize(
    "variant,world_size,steps,kills",
    [
        ("diloco", 3, 8, ("1@4:exchange",)),
        ("diloco", 3, 8, ("0@3:exchange",)),
        ("diloco", 3, 8, ("2@4:backward",)),
        ("diloco", 3, 8, ("1@4:between",)),
        ("diloco", 4, 10, ("1@3:exchange", "3@6:between")),
        ("diloco", 4, 10, ("3@2:backward", "0@6:exchange")),
        ("diloco-int8", 3, 8, ("1@4:exchange",)),
        ("diloco-int8", 3, 8, ("2@4:backward",)),
        ("diloco-int8", 3, 8, ("0@3:between",)),
        ("diloco-int8", 4, 10, ("3@2:backward", "0@6:exchange")),
    ],
    ids=lambda v: str(v) if not isinstance(v, tuple) else " then ".join(v),
)
def test_diloco_workers_end_with_the_references_bits(
    tmp_path: Path, variant: str, world_size: int, steps: int, kills: tuple[str, ...]
) -> None:
    """``--config diloco`` and ``diloco-int8``: a sync finished forward (the
    lost worker died holding its sum) or run again without it, bitwise equal
    to the reference that restarts the survivors from every worker's saved
    state (compressed: with the mean of the survivors' residuals)."""
    plan = tuple(diloco.WorkerKill(k.rank, k.step, k.phase) for k in map(example.parse_kill, kills))
    killed = diloco.run_killed(world_size, steps, plan, variant=variant)
    assert killed["world_size"] == world_size - len(plan)
    assert killed["inner_steps"] == [steps]
    for kill, r in zip(plan, killed["recoveries"], strict=True):
        assert r["forward"] == (kill.phase == "exchange")
        assert r["finished_step"]  # every failing step was inside its sync
        assert r["step"] == kill.step + (kill.phase == "between")
        assert r["steps_lost"] == 0 and r["seconds"] > 0
    reference = diloco.run_reference(world_size, steps, plan, variant)
    ours = torch.load(example.save_final(killed, str(tmp_path / "killed")), weights_only=False)
    theirs = torch.load(
        example.save_final(reference, str(tmp_path / "reference")), weights_only=False
    )
    assert set(ours["model"]) == set(range(world_size)) - {k.rank for k in plan}
    assert_bitwise_equal(ours, theirs)


@pytest.mark.slow  # each case: 6 or 8 ranks, killed and reference
@pytest.mark.parametrize(
    "variant,workers,steps,kills",
    [
        ("diloco-ddp", 3, 8, ("1@4:exchange",)),
        ("diloco-ddp", 3, 8, ("2@4:backward",)),
        ("diloco-ddp", 3, 8, ("5@3:between",)),
        ("diloco-ddp", 4, 10, ("0@2:backward", "6@6:exchange")),
        ("diloco-ddp-int8", 3, 8, ("1@4:exchange",)),
    ],
    ids=lambda v: str(v) if not isinstance(v, tuple) else " then ".join(v),
)
def test_diloco_workers_of_two_ranks_end_with_the_references_bits(
    tmp_path: Path, variant: str, workers: int, steps: int, kills: tuple[str, ...]
) -> None:
    """``--config diloco-ddp``: a kill ends one rank, its worker goes whole
    (its other rank leaves), the other workers take their furthest rank's
    state and rebuild DDP; bitwise equal to the reference that restarts the
    surviving workers' ranks from their saved states."""
    plan = tuple(diloco.WorkerKill(k.rank, k.step, k.phase) for k in map(example.parse_kill, kills))
    killed = diloco.run_killed(workers, steps, plan, variant=variant)
    assert killed["world_size"] == workers - len(plan)
    assert killed["inner_steps"] == [steps]
    for kill, r in zip(plan, killed["recoveries"], strict=True):
        assert r["forward"] == (kill.phase == "exchange")
        assert r["steps_lost"] == 0 and r["seconds"] > 0
    gone = {k.rank // 2 for k in plan}
    assert set(killed["model"]) == {r for r in range(2 * workers) if r // 2 not in gone}
    reference = diloco.run_reference(workers, steps, plan, variant)
    assert_bitwise_equal(
        {"model": killed["model"], "optimizer": killed["optimizer"]},
        {"model": reference["model"], "optimizer": reference["optimizer"]},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,world_size,steps,kills",
    [
        ("diloco-streaming", 3, 10, ("1@3:exchange",)),
        ("diloco-streaming", 3, 10, ("2@4:between",)),
        ("diloco-streaming", 4, 12, ("1@3:exchange", "3@7:backward")),
        ("diloco-ddp-streaming", 3, 10, ("1@3:exchange",)),
    ],
    ids=lambda v: str(v) if not isinstance(v, tuple) else " then ".join(v),
)
def test_streaming_diloco_workers_end_with_the_references_bits(
    tmp_path: Path, variant: str, world_size: int, steps: int, kills: tuple[str, ...]
) -> None:
    """Streaming DiLoCo (a sync in flight across an inner step, merged half
    and half): where a loss lands among the syncs in flight depends on
    timing, so the reference takes over where the recoveries say the
    survivors went on from; bitwise equal."""
    plan = tuple(diloco.WorkerKill(k.rank, k.step, k.phase) for k in map(example.parse_kill, kills))
    killed = diloco.run_killed(world_size, steps, plan, variant=variant)
    assert killed["inner_steps"] == [steps]
    assert all(r["steps_lost"] == 0 for r in killed["recoveries"])
    for kill, r in zip(plan, killed["recoveries"], strict=True):
        if kill.phase == "exchange":  # it died holding the sum of the sync it started
            assert r["forward"] and r["sync"] == kill.step + 1
    seen = diloco.as_seen(plan, killed["recoveries"])
    reference = diloco.run_reference(world_size, steps, seen, variant)
    assert_bitwise_equal(
        {"model": killed["model"], "optimizer": killed["optimizer"]},
        {"model": reference["model"], "optimizer": reference["optimizer"]},
    )


@pytest.mark.slow
def test_the_diloco_command_line_end_to_end(tmp_path: Path) -> None:
    common = ["--world-size", "3", "--steps", "4", "--kill", "1@2:exchange", "--config", "diloco"]
    killed = _cli(*common, "--out", str(tmp_path / "killed"))
    reference = _cli(*common, "--out", str(tmp_path / "reference"), "--reference")
    wrote = "final.pt: 2 of 3 workers at the end, 4 steps done, inner step count [4]"
    assert wrote in killed[-2] and wrote in reference[-3]
    assert re.fullmatch(
        r"rank 1 lost in step 2 \(exchange\): 3 -> 2 workers at step 2, the sync finished "
        r"forward; recovered in \d+\.\d\d s; steps lost: 0",
        killed[-1],
    ), killed[-1]
    ours, theirs = (
        torch.load(tmp_path / name / "final.pt", weights_only=False)
        for name in ("killed", "reference")
    )
    assert_bitwise_equal(ours, theirs)
