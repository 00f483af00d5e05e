"""collective_traffic: counts collectives however their tensor is passed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from zerofn_torch.runtime.traffic import collective_traffic


@pytest.mark.usefixtures("single_rank_group")
def test_counts_positional_and_keyword_tensors() -> None:
    t = torch.zeros(10)  # 40 bytes
    with collective_traffic() as traffic:
        dist.all_reduce(t)
        dist.broadcast(tensor=t, src=0)  # how PyTorch's ZeroRedundancyOptimizer calls it
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(10)], tensor=t)
    assert traffic.calls == {"all_reduce": 1, "broadcast": 2, "all_gather": 1}
    assert traffic.payload_bytes == {"all_reduce": 40, "broadcast": 80, "all_gather": 40}
    assert traffic.total_calls == 4
    # Ring estimate on 4 ranks: all-reduce 2*3/4, broadcast 3/4, all-gather 3 per byte.
    assert traffic.sent_bytes(4) == pytest.approx(40 * 1.5 + 80 * 0.75 + 40 * 3)


@pytest.mark.usefixtures("single_rank_group")
def test_an_all_to_all_counts_only_what_leaves_the_rank() -> None:
    out = torch.zeros(5)
    with collective_traffic() as traffic:
        dist.all_to_all_single(out, torch.arange(5.0), [5], [5])
    assert torch.equal(out, torch.arange(5.0))
    # One rank: its whole input is its own part, which stays.
    assert traffic.calls == {"all_to_all_single": 1} and traffic.payload_bytes == {
        "all_to_all_single": 0
    }


@pytest.mark.usefixtures("single_rank_group")
def test_restores_the_collectives() -> None:
    before = dist.all_reduce
    with collective_traffic():
        assert dist.all_reduce is not before
    assert dist.all_reduce is before


def _reduce_on_three_ranks(rank: int, world_size: int) -> dict[str, object]:
    """Each rank reduces its own values onto each owner in turn, through the
    adapter's issuer; the owner's sums, and what the counter saw."""
    from zerofn_torch.runtime.issue import issue

    from zerofn.comm import Reduce

    sums = []
    with collective_traffic() as traffic:
        for owner in range(world_size):
            mine = torch.arange(6.0).reshape(2, 3) * (rank + 1) + owner
            (summed,) = issue(Reduce(mine, dst=owner), None).wait()
            sums.append(summed.clone() if rank == owner else None)
    return {"sums": sums, "calls": dict(traffic.calls), "bytes": dict(traffic.payload_bytes)}


def test_a_reduce_on_gloo_sums_onto_its_owner_and_counts_as_a_reduce() -> None:
    from _world import run_world

    world = 3
    results = run_world(_reduce_on_three_ranks, world)
    for owner in range(world):
        expected = sum(torch.arange(6.0).reshape(2, 3) * (r + 1) + owner for r in range(world))
        assert torch.equal(results[owner]["sums"][owner], expected)
    for out in results:
        # Carried by an all-to-all on gloo, counted as the reduce it is.
        assert out["calls"] == {"reduce": world} and out["bytes"] == {"reduce": world * 24}
