"""A process that ends while a gloo worker thread is still inside completion
callbacks, run by tests/test_clean_exit.py: ``python tests/_exit_held.py
zerofn|torch``; the process's exit status and stderr are what the test reads.

Two gloo ranks: this process (rank 0) and a forked child (rank 1). Rank 0
starts an all-reduce (``zerofn``: a program run by zerofn's driver, whose
last request is that all-reduce; ``torch``: PyTorch's own
``Future.then``), adds a callback to the future it would wait for, and only
then lets rank 1 join, so the callbacks run on rank 0's gloo worker thread.
The added callback holds that thread until the main thread has taken the GIL
for good (a switch interval of 1000 s: it hands the GIL over only when it
blocks) and ends the interpreter.

CPython ends a thread that asks for the GIL once the interpreter has begun to
finalize (``pthread_exit``), and unwinding PyTorch's C++ frames then calls
``std::terminate``: SIGABRT. The ``torch`` run ends so (the construction
reproduces the abort: nothing of PyTorch's waits); the ``zerofn`` run must
exit with 0, because zerofn waits at exit for the callbacks it started
(:func:`zerofn_torch.runtime.futures.settle`), and keeps the tensors it handed to the
collective, so that the worker thread's release of it frees no Python object
(:mod:`zerofn_torch.runtime.issue`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Any

import torch
import torch.distributed as dist


def _join_later(store: str, go: int) -> None:
    """Rank 1: join the all-reduce once rank 0 says so, then leave."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
    os.read(go, 1)
    dist.all_reduce(torch.ones(4))
    os._exit(0)  # no teardown of its own: only rank 0's exit is under test


def _started(mode: str) -> torch.futures.Future[Any]:
    """Rank 0's all-reduce, as the future a caller would wait for."""
    if mode == "zerofn":
        from zerofn_torch.runtime.driver import drive

        from zerofn.comm import AllReduce

        def program() -> Any:
            (total,) = yield AllReduce((torch.ones(4),), last=True)
            return total

        return drive(program(), dist.group.WORLD, "a held exit")
    return dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0])


def main(mode: str) -> None:
    store = os.path.join(tempfile.mkdtemp(prefix="zerofn-held-"), "store")
    go_read, go_write = os.pipe()
    if os.fork() == 0:
        _join_later(store, go_read)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=2)
    held, release = threading.Event(), threading.Event()

    def hold(_: Any) -> None:  # on the worker thread, inside the callbacks
        held.set()
        release.wait()

    result = _started(mode)
    result.add_done_callback(hold)  # before rank 1 joins: it cannot have completed
    os.write(go_write, b"x")
    if not held.wait(60):
        raise SystemExit("the callbacks never ran")
    sys.setswitchinterval(1000.0)
    release.set()
    # The interpreter's exit, the GIL kept until the main thread blocks.


if __name__ == "__main__":
    main(sys.argv[1])
