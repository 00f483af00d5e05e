"""``run_local_world``'s wall: a world that hangs fails within it, each rank
still running having written where it stood."""

from __future__ import annotations

import time

import pytest
from zerofn_torch.runtime.launch import run_local_world


def _rank_one_waits_forever(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_world_past_its_wall_is_ended_naming_the_ranks_still_running(
    capfd: pytest.CaptureFixture[str],
) -> None:
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] still running"):
        run_local_world(_rank_one_waits_forever, 2, may_exit=[1], wall_s=3.0)
    assert time.monotonic() - began < 60
    assert "_rank_one_waits_forever" in capfd.readouterr().err


def test_a_world_within_its_wall_returns_what_each_rank_returned() -> None:
    assert run_local_world(_rank_one_waits_forever, 1, wall_s=60.0) == [0]
