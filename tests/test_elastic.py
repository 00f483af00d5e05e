"""Losing a rank without stopping, on 3 real gloo ranks: DDP and
``ZeroRedundancyOptimizer(redundancy=2)`` (``examples/train_elastic.py``);
rank 2 exits at step K, either before its forward (the survivors' DDP
backward fails: they redo the step on 2 ranks) or right after its local step
(the survivors' exchange fails: they finish the step from rank 2's carrier).
The survivors go on to the end on 2 ranks; their parameters and optimizer
state equal, bit for bit, a reference that runs 3 ranks to the loss and then
2 fresh ranks from the consolidated state with the same batches. The bytes a
step sends do not change with ``redundancy=2``."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import train_elastic as example
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import recover
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic


def reference_before(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """The first phase: ``steps`` steps on 3 ranks, then the state consolidated."""
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    ddp = DDP(model)
    for step in range(steps):
        example.train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if rank == 0 else None,
    }


def reference_after(rank: int, world_size: int, start: dict[str, Any], first: int) -> Any:
    """The second phase: 2 fresh ranks from the consolidated state, from step
    ``first`` on (their batches those of a world of 2, as the survivors')."""
    model = example.make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), start["params"], strict=True):
            p.copy_(value)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    zero.load_state_dict(start["state"])
    ddp = DDP(model)
    for step in range(first, example.STEPS):
        example.train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if rank == 0 else None,
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )


@pytest.mark.parametrize(
    "in_exchange",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # make test-slow: a second real kill
    ids=["lost before", "lost in exchange"],
)
def test_survivors_go_on_exactly_after_losing_a_rank(in_exchange: bool) -> None:
    lost, at = example.LOST, example.LOST_AT
    elastic = run_local_world(example.train, 3, in_exchange, timeout_s=30.0, may_exit=[lost])
    assert elastic[lost] is None
    done_before = at + 1 if in_exchange else at
    first = run_local_world(reference_before, 3, done_before)[0]
    reference = run_local_world(reference_after, 2, first, done_before)
    for rank in (0, 1):
        ours = elastic[rank]
        assert ours is not None and ours["world_size"] == 2
        (recovery,) = ours["recoveries"]
        assert (recovery["step"], recovery["lost"], recovery["finished_step"]) == (
            at,
            (lost,),
            in_exchange,
        )
        assert all(
            torch.equal(a, b)
            for a, b in zip(ours["params"], reference[rank]["params"], strict=True)
        )
    assert same_state(elastic[0]["state"], reference[0]["state"])  # type: ignore[index]


def step_bytes(rank: int, world_size: int, redundancy: int) -> dict[str, int]:
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, redundancy=redundancy, lr=0.01
    )
    ddp = DDP(model)
    example.train_step(ddp, zero, 0)
    with collective_traffic() as traffic:
        example.train_step(ddp, zero, 1)
    return dict(traffic.payload_bytes)


def test_redundant_shards_send_no_byte_more() -> None:
    one, two = run_local_world(step_bytes, 2, 1), run_local_world(step_bytes, 2, 2)
    assert one == two and one[0]


def test_recover_refuses_an_optimizer_with_one_copy_of_each_shard() -> None:
    run_local_world(_recover_without_redundancy, 2)


def _recover_without_redundancy(rank: int, world_size: int) -> None:
    zero = ZeroRedundancyOptimizer(example.make_model().parameters(), torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match="redundancy=2"):
        recover(zero, RuntimeError("a peer died"))


def test_a_failure_with_every_rank_alive_is_raised_again() -> None:
    run_local_world(_recover_with_everyone_alive, 2)


def _recover_with_everyone_alive(rank: int, world_size: int) -> None:
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    error = RuntimeError("a bug of the user's, not a lost rank")
    with pytest.raises(RuntimeError, match="a bug of the user's"):
        recover(zero, error, deadline_s=2.0)
    assert zero.world_size == 2 and zero.regroups == 0
