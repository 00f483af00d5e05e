"""Faults at moments nobody chose (``examples/random_losses.py``): in each
run one random rank is ended or paused from a timer thread, wherever its
main thread is, and the survivors recover in-process. Every run is checked
by invariants that need no reference (every step completed once, one Adam
step count, identical parameters, one agreed point per recovery), the first
loss of each world also bit for bit against a reference. The seed is drawn
anew each run and named in any failure. ``make bench`` runs the long soak."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from random_losses import STEPS, Fault, diloco_soak, soak, train_with_fault
from train_elastic import CONFIGS, TIMEOUT_S
from zerofn_torch.runtime.launch import run_local_world


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("world_size", "config"),
    [
        (3, "plain"),
        (4, "plain"),
        (3, "masters"),
        (4, "masters"),
        (4, "flat"),
        (4, "int8"),
        (4, "overlap"),
        (4, "gather"),
        (3, "gather-int8"),
    ],
)
def test_faults_at_random_moments_leave_one_consistent_state(world_size: int, config: str) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown if the soak raises, to run it again
    result = soak(world_size, 5, seed, config=CONFIGS[config])
    assert result["losses"] >= 2, f"seed {seed}: only {result['losses']} of 5 runs lost a rank"
    assert result["referenced"] == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("world_size", "variant"),
    [(3, "diloco"), (4, "diloco"), (4, "diloco-streaming"), (3, "diloco-int8"), (6, "diloco-ddp")],
    ids=["3", "4", "4-streaming", "3-int8", "6-ranks-in-3-workers"],
)
def test_diloco_workers_lost_at_random_moments_leave_one_consistent_state(
    world_size: int, variant: str
) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown if the soak raises, to run it again
    result = diloco_soak(world_size, 5, seed, variant=variant)
    assert result["losses"] >= 2, f"seed {seed}: only {result['losses']} of 5 runs lost a rank"
    assert result["referenced"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_paused_rank_that_comes_back_late_fails_alone() -> None:
    """Paused 14 s half-way (past the group's timeout and the roll call):
    the others go on without it, and once resumed it fails alone."""
    quiet = run_local_world(train_with_fault, 3, Fault(0, 1e9), STEPS, timeout_s=TIMEOUT_S)
    half = quiet[1]["seconds"] / 2
    results = run_local_world(
        train_with_fault, 3, Fault(1, half, 14.0), STEPS, timeout_s=TIMEOUT_S, may_exit=[1]
    )
    assert results[1] is not None and "left behind" in (results[1]["fenced"] or "")
    for survivor in (results[0], results[2]):
        assert survivor["fenced"] is None and survivor["done"] == STEPS
        assert survivor["world_size"] == 2
