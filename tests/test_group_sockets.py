"""The alarm frees a rank blocked in a collective PyTorch waits for in C++
(``zerofn_torch.runtime.group_sockets``), on 2 gloo ranks: rank 0 waits in
``dist.broadcast`` for a message rank 1 never sends (as a survivor waits in
DDP's bucket rebuild for a peer that went to the roll call); rank 1 raises
the alarm. Rank 0's broadcast fails with gloo's own error long before the
group's timeout, and a group opened outside zerofn keeps working. In one
process, over loopback pairs: an alarm shuts the connections noted for its
world's group, never another group's, a listener, a socket opened
elsewhere, or a descriptor number reused since."""

from __future__ import annotations

import os
import socket
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.group_sockets import noted_sockets
from zerofn_torch.runtime.heartbeat import abandon, start_heartbeat
from zerofn_torch.runtime.launch import run_local_world

GROUP_TIMEOUT_S = 60.0


def blocked_rank_is_freed(rank: int, world_size: int) -> dict[str, object]:
    # A group zerofn did not see open: its connections are not noted, so not shut.
    untouched = dist.new_group(list(range(world_size)))
    beat = start_heartbeat(0, rank, world_size, dist.group.WORLD)
    assert beat is not None
    noted = noted_sockets(dist.group.WORLD)  # the launcher's default group
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


# ----- which sockets are shut, in one process -------------------------------------


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's registry empty, every group counted as gloo, no store."""
    monkeypatch.setattr(group_sockets, "_NOTED", [])
    monkeypatch.setattr(group_sockets, "_SHUT", weakref.WeakSet())
    monkeypatch.setattr(group_sockets, "_gloo_only", lambda group: True)
    monkeypatch.setattr(group_sockets, "_store_ports", lambda: frozenset())
    yield


class Pairs:
    """Connected TCP pairs on loopback, to stand for a group's connections."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.made: list[tuple[socket.socket, socket.socket]] = []

    def connect(self, count: int) -> list[tuple[socket.socket, socket.socket]]:
        made = []
        for _ in range(count):
            near = socket.create_connection(self.listener.getsockname())
            far, _ = self.listener.accept()
            made.append((near, far))
        self.made.extend(made)
        return made

    def close(self) -> None:
        for near, far in self.made:
            near.close()
            far.close()
        self.listener.close()


def is_shut(near: socket.socket, far: socket.socket) -> bool:
    """Whether the pair was shut: the far end reads the end of the stream."""
    far.settimeout(2.0)
    try:
        near.sendall(b"x")
    except OSError:
        return True
    return far.recv(1) == b""


class World:
    """Stands for a world's process group."""


def test_an_alarm_shuts_its_worlds_connections_and_no_one_elses(fresh: None) -> None:
    pairs, failed, other = Pairs(), World(), World()
    try:
        mine = group_sockets.opened(lambda: pairs.connect(2), part_of=failed)
        theirs = group_sockets.opened(lambda: pairs.connect(1), part_of=other)
        (unnoted,) = pairs.connect(1)  # opened outside: a logger's, say
        # Each group's near and far ends were opened inside, and both are noted.
        assert group_sockets.noted_sockets(failed) == 4
        assert group_sockets.noted_sockets(other) == 2
        assert group_sockets.shut(failed) == 4
        assert all(is_shut(*pair) for pair in mine)
        assert not any(is_shut(*pair) for pair in theirs)  # another world's group
        assert not is_shut(*unnoted)
        pairs.connect(1)  # the listener still accepts
        assert group_sockets.shut(other) == 2
        assert all(is_shut(*pair) for pair in theirs)
        assert not is_shut(*unnoted)
    finally:
        pairs.close()


def test_a_group_made_for_a_world_that_failed_is_shut_at_once(fresh: None) -> None:
    pairs, failed, new = Pairs(), World(), World()
    try:
        group_sockets.shut(failed)
        (late,) = group_sockets.opened(lambda: pairs.connect(1), part_of=failed)
        assert is_shut(*late)
        (newer,) = group_sockets.opened(lambda: pairs.connect(1), part_of=new)
        assert not is_shut(*newer)
    finally:
        pairs.close()


def test_a_descriptor_reused_by_another_socket_is_left_alone(fresh: None) -> None:
    pairs, world = Pairs(), World()
    try:
        ((near, far),) = group_sockets.opened(lambda: pairs.connect(1), part_of=world)
        number = near.fileno()
        near.close()
        far.close()
        (reused,) = pairs.connect(1)
        duplicated = reused[0].fileno() != number
        if duplicated:  # the number went elsewhere: point it at the new socket
            os.dup2(reused[0].fileno(), number)
        assert group_sockets.shut(world) == 0
        assert not is_shut(*reused)
        if duplicated:
            os.close(number)
    finally:
        pairs.close()
