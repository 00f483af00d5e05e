"""The alarm frees a rank blocked in a collective PyTorch waits for in C++
(``zerofn_torch.runtime.group_sockets``), on 2 gloo ranks: rank 0 waits in
``dist.broadcast`` for a message rank 1 never sends (as a survivor waits in
DDP's bucket rebuild for a peer that went to the roll call); rank 1 raises
the alarm. Rank 0's broadcast fails with gloo's own error long before the
group's timeout, and a group opened outside zerofn keeps working."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from zerofn_torch.runtime.group_sockets import noted_sockets
from zerofn_torch.runtime.heartbeat import abandon, start_heartbeat
from zerofn_torch.runtime.launch import run_local_world

GROUP_TIMEOUT_S = 60.0


def blocked_rank_is_freed(rank: int, world_size: int) -> dict[str, object]:
    # A group zerofn did not see open: its connections are not noted, so not shut.
    untouched = dist.new_group(list(range(world_size)))
    beat = start_heartbeat(0, rank, world_size)
    assert beat is not None
    noted = noted_sockets(0)  # the launcher's default group
    dist.barrier(untouched)
    result: dict[str, object] = {"noted": noted}
    if rank == 0:
        began = time.monotonic()
        try:
            dist.broadcast(torch.zeros(4), src=1)  # rank 1 never sends
            result["error"] = None
        except RuntimeError as error:
            result["error"] = str(error)
        result["blocked_s"] = time.monotonic() - began
    else:
        time.sleep(0.5)  # rank 0 is inside its broadcast by now
        beat.raise_alarm("rank 1 of 2: a test's alarm")
    # Rank 0's blocked wait ended: the untouched group still carries a sum.
    total = torch.ones(1)
    dist.all_reduce(total, group=untouched)
    result["untouched_sum"] = total.item()
    abandon(dist.group.WORLD)  # its connections are shut: leave it to the exit
    return result


@pytest.mark.timeout(120)
def test_the_alarm_frees_a_rank_blocked_in_a_collective_of_pytorchs_own() -> None:
    blocked, alarmed = run_local_world(
        blocked_rank_is_freed, 2, timeout_s=GROUP_TIMEOUT_S, may_exit=(0, 1)
    )
    assert blocked["noted"] and alarmed["noted"]  # type: ignore[index]
    assert blocked["error"] is not None and "gloo/transport" in str(blocked["error"])
    # Freed by the alarm, not by the group's timeout (a generous bound: a
    # starved machine beats late, it does not wait a minute).
    assert blocked["blocked_s"] < GROUP_TIMEOUT_S / 4  # type: ignore[operator]
    assert blocked["untouched_sum"] == alarmed["untouched_sum"] == 2.0
