"""``run_local_world``: its wall (a world that hangs fails within it, each
rank still running having written where it stood) and its store (served by
the launching process, so no rank's death at any moment can leave it
unusable)."""

from __future__ import annotations

import os
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


_WALLED_WORLD = """
import sys
from test_launch import _rank_one_waits_forever
from zerofn_torch.runtime.launch import run_local_world

if __name__ == "__main__":
    try:
        run_local_world(_rank_one_waits_forever, 2, may_exit=[1], wall_s=3.0)
    except TimeoutError as error:
        print(error, flush=True)
"""


def test_a_world_past_its_wall_is_ended_naming_the_ranks_still_running(tmp_path: Path) -> None:
    # In a process of its own: the ranks write their stacks to the stderr of
    # the forkserver they are forked from, which a test's capture may not hold.
    script = tmp_path / "walled.py"
    script.write_text(_WALLED_WORLD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert time.monotonic() - began < 60
    assert "ranks [1] still running" in done.stdout, done.stderr[-2000:]
    assert "_rank_one_waits_forever" in done.stderr  # where rank 1 stood


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
