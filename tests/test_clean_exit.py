"""Exiting cleanly: nothing of zerofn keeps a process group alive
once the work it described is done, and every multi-rank flow exits with
code 0 on every rank, without ``terminate called``.

The aborts this guards against, both SIGABRT on a gloo worker thread:

* a completion callback runs, and is freed, on one of a gloo group's own
  worker threads; if it holds the group's last reference (the program
  destroyed the group, or is tearing down), the group's destructor runs there
  and joins its own thread: ``std::system_error`` (resource deadlock
  avoided), ``terminate``;
* a worker thread asks for the GIL after the interpreter has begun to
  finalize (to go on with, or let go of, a callback still running when the
  main thread's wait ended; or to release a finished collective's tensors);
  CPython ends it with ``pthread_exit``, whose unwinding through PyTorch's C++
  frames calls ``terminate`` (``terminate called without an active
  exception``), as a PyTorch Lightning run could at exit.

Two kinds of test:

* in one process, deterministic: a request is left in flight (awaiting a
  future the test completes later), the group is destroyed and dropped, and
  the group must be collected while the request is still pending; the exit
  waits for a callback still running and for what it holds, not for one
  that never ran; a tensor handed to a collective keeps a second reference
  until nothing else holds it;
* in a fresh process, deterministic (``tests/_exit_held.py``): the interpreter
  ends while zerofn's callbacks are still running on the gloo worker thread
  and the main thread keeps the GIL; the same with PyTorch's own
  ``Future.then`` aborts (the control);
* in fresh processes (``tests/_exit_flows.py``): every multi-rank flow on 2, 3
  and 4 ranks, next to a process that keeps one core busy, each run ending
  through normal interpreter teardown, half of them after
  ``destroy_process_group()`` (as PyTorch's test harness and many training
  scripts end); then many groups per process, each destroyed right after
  zerofn's work on it (the most sensitive probe: without the exit's wait it
  aborts every run). PyTorch's own DDP, Join and optimizer run the same way as the
  control.

``ZEROFN_EXIT_RUNS=N`` runs every batch N times per world size (a soak).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from zerofn_torch.checkpoint.background import save_group
from zerofn_torch.runtime.driver import PolledProgram, ProgramPipeline, drive, finish_polled
from zerofn_torch.runtime.foreign_hooks import Await, foreign_hook
from zerofn_torch.runtime.futures import _counted, on_done, settle
from zerofn_torch.runtime.hook_cells import HookCell
from zerofn_torch.runtime.issue import _GIVEN, issue

from zerofn.comm import AllReduce, Broadcast
from zerofn.hooks.hook import BucketInfo, init_hook_state

HERE = os.path.dirname(os.path.abspath(__file__))

# ----- in one process: no zerofn record or callback holds a finished group -----------


@pytest.fixture
def holder(single_rank_group: None) -> Iterator[list[Any]]:
    """A fresh one-rank gloo group, in a list the test empties when it
    destroys the group (a fixture's value stays referenced by pytest, so the
    group itself must not be one)."""
    box = [dist.new_group([0], backend="gloo")]
    yield box
    for made in box:  # the test failed before destroying it
        dist.destroy_process_group(made)


def _destroy_and_drop(holder: list[Any]) -> weakref.ref[Any]:
    """Destroy the group in ``holder`` and drop the test's reference to it.

    Returns:
        A weak reference to it, dead once nothing else holds the group.
    """
    gone = weakref.ref(holder[0])
    dist.destroy_process_group(holder.pop())
    gc.collect()
    return gone


def _holders(ref: weakref.ref[Any]) -> list[str]:
    """What still refers to the group ``ref`` points to, for a failure's message."""
    target = ref()
    return [] if target is None else [repr(r)[:300] for r in gc.get_referrers(target)]


def test_a_pending_request_does_not_hold_its_group(holder: list[Any]) -> None:
    pending: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    result = issue(Await(pending, "a hook"), holder[0], "a test")
    gone = _destroy_and_drop(holder)
    assert gone() is None, _holders(gone)
    pending.set_result(torch.ones(2))
    assert result.wait()[0].tolist() == [1.0, 1.0]


def _two_rounds(pending: torch.futures.Future[torch.Tensor]) -> Generator[Any, Any, list[float]]:
    """A real all-reduce, then an awaited future as the last request."""
    (total,) = yield AllReduce((torch.ones(3),))
    (awaited,) = yield Await(pending, "a hook")
    values: list[float] = (total + awaited).tolist()
    return values


def test_a_driven_program_does_not_hold_its_group(holder: list[Any]) -> None:
    pending: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    result = drive(_two_rounds(pending), holder[0], "a test")  # first round awaited
    gone = _destroy_and_drop(holder)
    assert gone() is None, _holders(gone)
    pending.set_result(torch.ones(3))
    assert result.wait() == [2.0, 2.0, 2.0]


def test_a_pipeline_lets_go_of_the_group_once_all_is_issued(holder: list[Any]) -> None:
    pending: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pipeline = ProgramPipeline()
    result = pipeline.run(_two_rounds(pending), holder[0], is_last=True, purpose="a test")
    gone = _destroy_and_drop(holder)
    assert gone() is None, _holders(gone)
    pending.set_result(torch.ones(3))
    assert result.wait() == [2.0, 2.0, 2.0]


def _failing(pending: torch.futures.Future[torch.Tensor]) -> Generator[Any, Any, None]:
    yield Await(pending, "a hook")
    raise ValueError("the program's own error")


def test_polled_programs_left_in_flight_are_finished_oldest_first(holder: list[Any]) -> None:
    """What the launcher and the interpreter's exit do before a group goes."""
    finish_polled()  # whatever earlier tests in this process left
    firsts: list[torch.futures.Future[torch.Tensor]] = [torch.futures.Future() for _ in range(3)]
    for pending in firsts:
        pending.set_result(torch.ones(3))
    older = PolledProgram(_failing(firsts[0]), holder[0], "an older program")
    newer = PolledProgram(_failing(firsts[1]), holder[0], "a newer program")
    waited = PolledProgram(_two_rounds(firsts[2]), holder[0], "a program its owner waited for")
    assert waited.wait() == [2.0, 2.0, 2.0]
    failed = finish_polled()
    assert [(purpose, str(error)) for purpose, error in failed] == [
        ("an older program", "the program's own error"),
        ("a newer program", "the program's own error"),
    ]
    assert finish_polled() == []  # each finished once
    with pytest.raises(ValueError, match="own error"):  # and its owner still sees the error
        older.wait()
    assert newer.purpose == "a newer program"


class _Bucket:
    """The part of DDP's ``GradBucket`` a cell reads."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def buffer(self) -> torch.Tensor:
        return self.grad


def test_a_hook_cell_does_not_hold_the_group_its_bucket_names(holder: list[Any]) -> None:
    """DDP may hand the hook a process group as its state; the bucket's
    handle then holds it, and the cell's callbacks must not."""
    pending: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    hook = foreign_hook(lambda state, bucket: pending)
    cell = HookCell(init_hook_state(hook))
    info = BucketInfo(index=0, shapes=((2,),), world_size=1, is_last=True, handle=(holder[0], 0))
    # The test keeps neither the info nor the bucket: DDP does not either.
    result = cell.start(hook, _Bucket(torch.zeros(2)), holder[0], info)[2]
    del info
    gone = _destroy_and_drop(holder)
    assert gone() is None, _holders(gone)
    pending.set_result(torch.full((2,), 3.0))
    assert result.wait().tolist() == [3.0, 3.0]
    assert [index for index, _ in cell.state.buckets] == [0]  # recorded by the callback


def test_the_background_save_group_is_remembered_weakly(single_rank_group: None) -> None:
    holder = [save_group(None)]
    assert save_group(None) is holder[0]  # reused while it lives
    gone = _destroy_and_drop(holder)
    assert gone() is None, _holders(gone)
    fresh = save_group(None)  # a destroyed one is replaced
    dist.destroy_process_group(fresh)


# ----- in one process: what the interpreter's exit waits for -----------------------


def test_the_exit_waits_for_a_callback_still_running_on_another_thread() -> None:
    assert settle(timeout=10)  # nothing earlier tests started is still running
    pending: torch.futures.Future[int] = torch.futures.Future()
    entered, release = threading.Event(), threading.Event()

    def slow(_: torch.futures.Future[int]) -> None:
        entered.set()
        release.wait(10)

    on_done(pending, slow)
    completing = threading.Thread(target=pending.set_result, args=(1,))
    completing.start()  # the callback runs on this thread, as on a gloo worker
    try:
        assert entered.wait(10)
        assert not settle(timeout=0.05)
    finally:
        release.set()
        completing.join(10)
    assert settle(timeout=10)


def test_a_callback_counts_until_pytorch_lets_go_of_it() -> None:
    """Returning is not the end: PyTorch releases the callback afterwards, on
    the thread that ran it, taking the GIL; and what the callback holds is
    released while it still counts (freeing it may take the GIL too)."""
    seen: list[bool] = []

    class Held:
        def __del__(self) -> None:
            seen.append(settle(timeout=0))

    def holding(held: Held) -> Any:
        return lambda _: held

    counted = _counted(holding(Held()))  # only the callback holds it
    counted(None)  # ran and returned; still held, as PyTorch holds it
    assert not settle(timeout=0)
    del counted  # let go of
    assert seen == [False]
    assert settle(timeout=0)


def test_a_traceback_kept_from_inside_a_callback_does_not_keep_it_counted() -> None:
    """A failed program's error, kept in its future, keeps every frame of its
    traceback and their callers': none of them may keep the count."""
    kept: list[BaseException] = []

    def failing(_: torch.futures.Future[int]) -> None:
        try:
            raise ValueError("the program's own error")
        except ValueError as error:
            kept.append(error)

    done: torch.futures.Future[int] = torch.futures.Future()
    done.set_result(1)
    on_done(done, failing)  # runs at once, and PyTorch lets go of it
    assert kept[0].__traceback__ is not None
    assert settle(timeout=0)


def test_a_callback_whose_future_never_completes_is_not_waited_for() -> None:
    never: torch.futures.Future[int] = torch.futures.Future()
    on_done(never, lambda _: None)
    assert settle(timeout=0)


def _until(condition: Any, what: str) -> None:
    """Wait (10 s at most) for ``condition()``: for a gloo worker thread to let go of a
    finished collective, a few microseconds after the collective's callbacks."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_tensor_handed_to_a_collective_keeps_a_second_reference_until_nothing_else_holds_it(
    holder: list[Any],
) -> None:
    """The worker thread that lets go of a finished collective must never drop
    a tensor's last C++ reference but its Python object's: PyTorch then
    releases the Python object on that thread, taking the GIL."""
    sent = torch.ones(4)
    issue(Broadcast(sent, 0), holder[0], "a test").wait()
    assert _GIVEN[id(sent)].tensor is sent
    view = sent[:2]  # something else still holds it after the collective
    _until(lambda: sent._use_count() == 3, "the collective was never let go of")
    issue(Broadcast(torch.zeros(1), 0), holder[0], "the next collective").wait()
    assert id(sent) in _GIVEN and sent._use_count() == 3  # itself, the reference, the view
    del view
    issue(Broadcast(torch.zeros(1), 0), holder[0], "the one after").wait()
    assert id(sent) not in _GIVEN
    assert sent._use_count() == 1  # its Python object alone: released here, by this thread


def test_a_collective_starts_without_the_context_backward_stashes(
    holder: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backward stashes a ``contextvars.Context`` in the thread's state while
    DDP hooks run; gloo keeps a copy of that state with each collective, and a
    worker thread releasing the last copy takes the GIL. zerofn's collectives
    start without it, and it is put back."""
    seen: list[bool] = []
    broadcast = dist.broadcast

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch._C._is_key_in_tls("context"))
        return broadcast(*args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", recording)
    stashed = object()
    torch._C._stash_obj_in_tls("context", stashed)
    try:
        issue(Broadcast(torch.ones(2), 0), holder[0], "a test").wait()
        assert torch._C._get_obj_in_tls("context") is stashed
    finally:
        torch._C._remove_obj_from_tls("context")
    assert seen == [False]


# ----- in a fresh process: an exit with callbacks still running ---------------------


def _held_exit(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "_exit_held.py"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_exit_while_zerofns_callbacks_run_on_the_worker_thread_is_clean() -> None:
    """Deterministic: without the exit's wait, 8 runs in 8 aborted."""
    done = _held_exit("zerofn")
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]


def test_the_same_exit_aborts_where_nothing_waits_for_the_callbacks() -> None:
    """The control: PyTorch's own ``Future.then`` in the same place; nothing
    waits for its callbacks, and CPython ends the worker thread mid-callback."""
    if sys.version_info >= (3, 14):
        pytest.skip("CPython 3.14 leaves such a thread hanging instead of ending it")
    done = _held_exit("torch")
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-3000:])


# ----- in fresh processes: every flow exits cleanly ------------------------------------

RUNS = int(os.environ.get("ZEROFN_EXIT_RUNS", "0"))  # >0: that many runs per world size


def _batches() -> list[str]:
    """What the test runs (``_exit_flows.py``'s ``--batch``): about 70 s of
    CPU, most of it interpreter teardown (about 1 s per rank)."""
    from _exit_flows import CONTROL_FLOWS, ZEROFN_FLOWS

    ours, theirs = ",".join(ZEROFN_FLOWS), ",".join(CONTROL_FLOWS)
    return [
        # Every flow in every run, rotated so each ends some run: 5 runs of
        # ours (4 ranks cost the most), 3 of PyTorch's.
        f"2,3:{RUNS or 2}:{ours}:busy,churn=12",
        f"4:{RUNS or 1}:{ours}:busy,churn=12",
        f"2,3,4:{RUNS or 1}:{theirs}:busy,churn=12",
        # Many groups destroyed right after zerofn's work on them: before the
        # fix, 6 runs in 6 aborted, with or without the busy process.
        f"2,3,4:{RUNS or 1}:group_churn:busy,churn=60",
        f"2:{RUNS or 1}:torch_group_churn:busy,churn=60",
    ]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Every run's record (``_exit_flows.py`` prints one JSON line per run),
    destroying the group before exit in every other run."""
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "_exit_flows.py"),
            *(f"--batch={batch}" for batch in _batches()),
            "--destroy=alternate",
        ],
        capture_output=True,
        text=True,
        timeout=200,  # fail here, with a message, before pytest's 240 s limit ends the run
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _failures(records: list[dict[str, Any]]) -> str:
    """Every rank that did not exit with 0, or whose stderr says ``terminate called``."""
    bad = []
    for record in records:
        for rank, outcome in enumerate(record["ranks"]):
            if outcome["exit"] != 0 or outcome["terminate"]:
                bad.append(
                    f"{record['world_size']} ranks, flows {record['flows']}, destroy "
                    f"{record['destroy']}: rank {rank} exit {outcome['exit']}\n{outcome['stderr']}"
                )
    return "\n".join(bad)


def _theirs(record: dict[str, Any]) -> bool:
    return all(flow.startswith("torch_") for flow in record["flows"])


@pytest.mark.slow
def test_every_flow_exits_cleanly_on_a_loaded_machine(runs: list[dict[str, Any]]) -> None:
    from _exit_flows import ZEROFN_FLOWS

    ours = [r for r in runs if len(r["flows"]) > 1 and not _theirs(r)]
    assert len(ours) == 2 * (RUNS or 2) + (RUNS or 1)
    assert {r["world_size"] for r in ours} == {2, 3, 4}
    assert all(sorted(r["flows"]) == sorted(ZEROFN_FLOWS) for r in ours)
    assert not _failures(ours), _failures(ours)


@pytest.mark.slow
def test_groups_destroyed_right_after_their_work_go_cleanly(runs: list[dict[str, Any]]) -> None:
    ours = [r for r in runs if r["flows"] == ["group_churn"]]
    assert {r["world_size"] for r in ours} == {2, 3, 4}
    assert not _failures(ours), _failures(ours)


@pytest.mark.slow
def test_pytorchs_own_flows_exit_cleanly_the_same_way(runs: list[dict[str, Any]]) -> None:
    """The control: had it failed, an abort left would be PyTorch's own."""
    theirs = [r for r in runs if _theirs(r)]
    assert {r["world_size"] for r in theirs} == {2, 3, 4}
    assert not _failures(theirs), _failures(theirs)
