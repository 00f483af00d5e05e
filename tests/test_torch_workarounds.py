"""Each workaround of ``zerofn_torch.runtime.torch_workarounds``, with and
without it.

A test runs its scenario in fresh processes, two gloo ranks (this file run
as a script, ``python tests/test_torch_workarounds.py SCENARIO``, or
``tests/_exit_held.py``; rank 1 is forked from rank 0): once with every
workaround, and then with ``ZEROFN_WITHOUT_WORKAROUND`` naming the one under
test. With it the process exits with 0; without it, it dies of SIGABRT at the
interpreter's exit, at most two runs being allowed for that (every run
aborted so far). ``kept_for_good``'s failure is not reproduced: its test
says why, and checks what it does instead.

A worker thread's release of a Python object aborts only when it starts
just before finalization begins and waits for a GIL that the main thread
keeps until then (PyTorch gives such an object back only while
``Py_IsInitialized()`` is true). At a real exit that is a race, lost or won
by the machine's load; so the scenarios stage it: the last exit handler lets
rank 1 complete a collective that was still pending, and keeps the GIL (with
a switch interval of 1000 s no waiting thread asks for it) until
finalization begins. The pending collective is one of PyTorch's own, started
through the workaround under test as zerofn's ``issue`` starts its
collectives: one of zerofn's would run its callbacks that late, and they
need the GIL whatever the workaround.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENVIRONMENT = "ZEROFN_WITHOUT_WORKAROUND"
ABORTED = -signal.SIGABRT


# ----- the tests --------------------------------------------------------------------


def _run(argv: list[str], without: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``python argv`` from the repository's root, the workaround
    ``without`` switched off (none if empty)."""
    env = {k: v for k, v in os.environ.items() if k != ENVIRONMENT}
    if without:
        env[ENVIRONMENT] = without
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _scenario(name: str, without: str = "") -> subprocess.CompletedProcess[str]:
    return _run([os.path.abspath(__file__), name], without)


def _clean(done: subprocess.CompletedProcess[str]) -> bool:
    return done.returncode == 0 and "terminate called" not in done.stderr


def _aborts(run: Any, tries: int) -> tuple[int, str]:
    """Call ``run()`` until its process dies of SIGABRT, at most ``tries``
    times; how many runs that took (0: none aborted), and the last stderr."""
    stderr = ""
    for attempt in range(1, tries + 1):
        done = run()
        stderr = done.stderr[-3000:]
        if done.returncode == ABORTED:
            return attempt, stderr
        # Any other failure is the scenario's own.
        assert done.returncode == 0, (done.returncode, stderr)
    return 0, stderr


@pytest.mark.slow
def test_second_references_keep_a_late_release_off_the_gil() -> None:
    """``second_references``: a tensor handed to zerofn's broadcast is also
    handed to an all-reduce, which its worker thread lets go of as the
    interpreter begins to finalize. Without the second reference that
    release gives the tensor's Python object back, and the process aborts
    (8 runs of 8 before this test)."""
    assert _clean(done := _scenario("late_release")), done.stderr[-3000:]
    aborted, stderr = _aborts(lambda: _scenario("late_release", "second_references"), tries=2)
    assert aborted, f"never aborted without the second reference:\n{stderr}"


@pytest.mark.slow
def test_a_collective_started_inside_backward_leaves_the_context_behind() -> None:
    """``no_backward_context``: an all-reduce started from a tensor hook
    inside backward, its tensor given its second reference, so that only the
    ``contextvars.Context`` backward stashed in the thread's state is left
    for the worker thread to give back. Without the workaround the process
    aborts (8 runs of 8 before this test)."""
    assert _clean(done := _scenario("late_release_in_backward")), done.stderr[-3000:]
    aborted, stderr = _aborts(
        lambda: _scenario("late_release_in_backward", "no_backward_context"), tries=2
    )
    assert aborted, f"never aborted with the context left in:\n{stderr}"


@pytest.mark.slow
def test_the_exit_waits_for_the_callbacks_on_the_worker_thread() -> None:
    """``settled_callbacks``: ``tests/_exit_held.py zerofn`` ends the
    interpreter while zerofn's callbacks still run on the gloo worker thread
    (no staging needed: a callback takes the GIL unconditionally). Without
    the exit's wait the process aborts (8 runs of 8 before this test, with
    CPython's ``Fatal Python error: PyEval_SaveThread``)."""
    held = [os.path.join(HERE, "_exit_held.py"), "zerofn"]
    assert _clean(done := _run(held)), done.stderr[-3000:]
    aborted, stderr = _aborts(lambda: _run(held, "settled_callbacks"), tries=2)
    assert aborted, f"never aborted without the exit's wait:\n{stderr}"


def test_what_is_held_at_exit_is_kept_for_good(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kept_for_good``: at exit, what nothing else holds any more is let go
    of, and the rest is kept with one more reference to the dictionary,
    never released; switched off, nothing is done.

    Its failure is not reproduced. On PyTorch 2.13.0 and CPython 3.11 a
    worker thread's release of a tensor after finalization began skips the
    Python object without taking the GIL (``Py_IsInitialized()`` is false by
    then): a late release staged after finalization began, with no second
    reference at all, exited with 0 in 3 runs of 3. And the teardown did not
    release the dictionary anyway: read at the very end of the teardown,
    without this workaround, the held tensor still had its second reference.
    """
    import torch
    import torch.distributed as dist
    from zerofn_torch.runtime import torch_workarounds
    from zerofn_torch.runtime.issue import issue

    from zerofn.comm import Broadcast

    kept, free = torch.ones(4), torch.ones(4)
    view = kept[:2]  # something else holds it: its second reference stays
    for tensor in (kept, free):
        issue(Broadcast(tensor, 0), dist.group.WORLD, "a test").wait()
    deadline = time.monotonic() + 10
    while kept._use_count() != 3 or free._use_count() != 2:  # the worker lets go of both
        assert time.monotonic() < deadline, (kept._use_count(), free._use_count())
        time.sleep(0.001)
    held = torch_workarounds.HELD

    monkeypatch.setattr(torch_workarounds, "_OFF", frozenset({"kept_for_good"}))
    references = sys.getrefcount(held)
    torch_workarounds.keep_held_for_good()
    assert sys.getrefcount(held) == references and id(free) in held

    monkeypatch.setattr(torch_workarounds, "_OFF", frozenset())
    torch_workarounds.keep_held_for_good()  # the dictionary is never freed: harmless here
    assert sys.getrefcount(held) == references + 1
    assert id(kept) in held and id(free) not in held
    assert free._use_count() == 1  # its Python object alone
    del view


def test_the_switch_reads_only_names_of_workarounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerofn_torch.runtime import torch_workarounds

    monkeypatch.setenv(ENVIRONMENT, " second_references,,settled_callbacks ")
    assert torch_workarounds._switched_off() == {"second_references", "settled_callbacks"}
    monkeypatch.setenv(ENVIRONMENT, "second_reference")
    with pytest.raises(ValueError, match="second_reference"):
        torch_workarounds._switched_off()
    monkeypatch.delenv(ENVIRONMENT)
    assert torch_workarounds._switched_off() == frozenset()
    assert all(torch_workarounds.is_on(name) for name in torch_workarounds.WORKAROUNDS)
    with pytest.raises(ValueError, match="no workaround"):
        torch_workarounds.is_on("backward_context")


# ----- the scenarios (this file run as a script) ------------------------------------
#
# torch and zerofn are imported only once the scenario has registered its own
# exit handler: handlers run in the reverse order of registration, so it runs
# after every one of theirs, the last before finalization begins.


def _rank_one(store: str, go: int, first: str) -> None:
    """Rank 1 (forked): take part in rank 0's ``first`` collective, then, once
    rank 0 writes to ``go``, in its pending all-reduce; then leave."""
    code = 1
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
        if first == "broadcast":
            dist.broadcast(torch.zeros(4), src=0)
        os.read(go, 1)
        dist.all_reduce(torch.ones(4))
        code = 0
    finally:
        os._exit(code)  # no teardown of its own: only rank 0's exit is under test


def _two_ranks(first: str) -> int:
    """Fork rank 1 and join the group as rank 0; the descriptor that lets
    rank 1 join the pending all-reduce."""
    import torch.distributed as dist

    store = os.path.join(tempfile.mkdtemp(prefix="zerofn-workarounds-"), "store")
    go_read, go_write = os.pipe()
    if os.fork() == 0:
        _rank_one(store, go_read, first)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=2)
    return go_write


def _release_late(go: int) -> None:
    """Rank 1 completes the pending all-reduce now; its worker thread lets go
    of it while this thread keeps the GIL, until finalization begins."""
    sys.setswitchinterval(1000.0)  # a thread waiting for the GIL never asks for it
    os.write(go, b"x")
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # the GIL kept
        pass


def _late_release() -> None:
    """A tensor handed to zerofn's broadcast, then to an all-reduce that rank
    1 completes at the end of the exit."""
    go: list[int] = []
    import atexit

    atexit.register(lambda: _release_late(go[0]))
    import torch
    import torch.distributed as dist
    from zerofn_torch.runtime.issue import issue

    from zerofn.comm import Broadcast

    go.append(_two_ranks("broadcast"))
    tensor = torch.ones(4)
    issue(Broadcast(tensor, 0), dist.group.WORLD, "a broadcast").wait()
    dist.all_reduce(tensor, async_op=True)
    KEPT.append(tensor)


def _late_release_in_backward() -> None:
    """An all-reduce started from a tensor hook inside backward, as zerofn's
    ``issue`` starts one, that rank 1 completes at the end of the exit."""
    go: list[int] = []
    import atexit

    atexit.register(lambda: _release_late(go[0]))
    import torch
    import torch.distributed as dist
    from zerofn_torch.runtime import torch_workarounds

    go.append(_two_ranks(""))

    def hook(grad: torch.Tensor) -> torch.Tensor:
        sent = grad.detach().clone()
        with torch_workarounds.without_backward_context():
            dist.all_reduce(sent, async_op=True)
        torch_workarounds.hold_second_references([sent])
        return grad

    x = torch.ones(4, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()


KEPT: list[Any] = []  # the scenarios' tensors, released by the teardown
SCENARIOS = {
    "late_release": _late_release,
    "late_release_in_backward": _late_release_in_backward,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
