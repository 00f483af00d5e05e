"""``run_local_world``: its wall (a world that hangs fails within it, each
rank still running having written where it stood) and its store (served by
the launching process, so no rank's death at any moment can leave it
unusable)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from zerofn_torch.runtime import launch
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


def test_a_client_dying_halfway_through_a_request_leaves_the_store_answering() -> None:
    store = launch._job_store(10.0)
    torn = socket.create_connection((launch._HOST, store.port))
    torn.sendall(b"\x00\x01")  # the first bytes of a request, never finished
    torn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    torn.close()  # a reset, as a killed process leaves
    other = dist.TCPStore(launch._HOST, store.port, is_master=False, timeout=timedelta(seconds=10))
    assert other.add("beat", 1) == 1
    assert other.check(["beat"])


_TORN_READER = """
import struct, sys
import torch.distributed as dist
path = sys.argv[1]
dist.FileStore(path, -1).set("a", "1")
with open(path, "ab") as f:  # a key's record, its value never written: a writer killed there
    f.write(struct.pack("I", 5) + b"/beat")
print("torn", flush=True)
print(dist.FileStore(path, -1).check(["a"]), flush=True)
"""


def test_a_file_store_with_a_torn_record_holds_every_reader(tmp_path: Path) -> None:
    """Why the launcher serves a TCP store: the control. PyTorch's
    ``FileStore`` writes a record in four writes and reads one by its
    length, waiting for bytes that never come (torch 2.13); if a later torch
    ends the read instead, this fails and the launcher may reconsider."""
    reader = subprocess.Popen(
        [sys.executable, "-c", _TORN_READER, str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "torn"
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(timeout=5)
    finally:
        reader.kill()
        reader.wait()
