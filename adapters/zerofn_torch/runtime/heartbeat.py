"""A rank's heartbeat in the job's store, and the job's alarm: how ranks learn
that a peer died, or that a collective failed somewhere, without waiting for
a collective to time out (:mod:`zerofn.zero.liveness` says how a watcher
reads the heartbeats).

One daemon thread per process (started for an optimizer with
``redundancy=2``) does both, every :data:`BEAT_INTERVAL_S` seconds, on its
own connection to the store (a clone):

* it adds one to the counter ``zerofn/beat/<generation>/<rank>``;
* it looks for ``zerofn/alarm/<generation>``, which a rank sets once it
  knows a collective failed (:func:`raise_alarm`; ``recover`` does, first).
  Once set, every wait of zerofn's that has not completed ends
  (:func:`wait` raises, the futures DDP waits on fail, see
  :func:`interruptible`): a survivor that gloo left blocked in a collective
  whose peer gave up on it joins the roll call within a beat, rather than at
  the group's timeout (30 minutes by default).

The thread stops at exit, before the interpreter finalizes, and quietly when
the store goes away (the job is ending).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zerofn.errors import CollectiveError
from zerofn_torch.runtime.futures import on_done

__all__ = [
    "BEAT_INTERVAL_S",
    "Heartbeat",
    "beat_key",
    "interruptible",
    "raise_alarm",
    "running_heartbeat",
    "start_heartbeat",
    "wait",
]

T = TypeVar("T")

BEAT_INTERVAL_S = 0.1
"""How often a rank beats and looks for the alarm."""


def beat_key(generation: int, rank: int) -> str:
    """Where ``rank`` of the world's ``generation`` beats."""
    return f"zerofn/beat/{generation}/{rank}"


def alarm_key(generation: int) -> str:
    """Where a rank of the world's ``generation`` says a collective failed."""
    return f"zerofn/alarm/{generation}"


class Heartbeat:
    """Beats for one rank and watches its world's alarm until :meth:`stop`,
    from a daemon thread."""

    def __init__(self, store: Any, generation: int, rank: int) -> None:
        self._store = store.clone()  # the thread's own connection
        self._lock = threading.Lock()
        self._generation, self._rank = generation, rank
        self._alarm: str | None = None
        self._woken: set[threading.Event] = set()
        self._failing: dict[int, torch.futures.Future[Any]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerofn-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    @property
    def key(self) -> str:
        """Where it beats now."""
        return beat_key(self._generation, self._rank)

    @property
    def alarm(self) -> str | None:
        """Why this world's alarm was raised; ``None`` while it is not."""
        return self._alarm

    def beat_as(self, generation: int, rank: int) -> None:
        """Beat as ``rank`` of the world's ``generation`` from now on (the
        world changed), and watch that world's alarm."""
        with self._lock:
            self._generation, self._rank, self._alarm = generation, rank, None

    def raise_alarm(self, why: str) -> None:
        """Tell every rank of this world that a collective failed."""
        with contextlib.suppress(Exception):  # a store gone: there is nobody left to tell
            self._store.compare_set(alarm_key(self._generation), "", why)
        self._ring(why)

    def stop(self) -> None:
        """Stop beating and wait for the thread to end."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * BEAT_INTERVAL_S + 1.0)

    def _ring(self, why: str) -> None:
        """End every wait in progress: the alarm is up."""
        with self._lock:
            if self._alarm is None:
                self._alarm = why
            woken, self._woken = self._woken, set()
            failing, self._failing = self._failing, {}
        for event in woken:
            event.set()
        for fut in failing.values():
            _fail(fut, self._alarm_error("a collective DDP waits for"))

    def _alarm_error(self, purpose: str) -> CollectiveError:
        return CollectiveError(
            "a wait",
            purpose,
            f"the world of generation {self._generation}",
            f"another rank raised the alarm ({self._alarm}): its collective failed, so this "
            "one cannot complete; recover() goes on without the lost ranks",
        )

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._store.add(self.key, 1)
                key = alarm_key(self._generation)
                if self._alarm is None and self._store.check([key]):
                    self._ring(self._store.get(key).decode())
            except Exception:  # the store is gone: the job is ending
                return
            self._stopped.wait(BEAT_INTERVAL_S)

    def wait(self, fut: torch.futures.Future[T], purpose: str) -> T:
        """``fut.wait()``, or a :class:`CollectiveError` once the alarm is up."""
        woke = threading.Event()
        on_done(fut, lambda _: woke.set())
        with self._lock:
            if self._alarm is None:
                self._woken.add(woke)
            else:
                woke.set()
        woke.wait()
        with self._lock:
            self._woken.discard(woke)
        if not fut.done():
            raise self._alarm_error(purpose)
        return fut.wait()

    def interruptible(self, fut: torch.futures.Future[T]) -> torch.futures.Future[T]:
        """A future completed as ``fut`` is, or failed once the alarm is up."""
        out: torch.futures.Future[T] = torch.futures.Future()
        with self._lock:
            if self._alarm is not None:
                _fail(out, self._alarm_error("a collective DDP waits for"))
                return out
            self._failing[id(out)] = out

        def forward(done: torch.futures.Future[T]) -> None:
            with self._lock:
                mine = self._failing.pop(id(out), None) is not None
            if not mine:  # the alarm failed it already
                return
            try:
                out.set_result(done.value())
            except Exception as error:
                _fail(out, error)

        on_done(fut, forward)
        return out


def _fail(fut: torch.futures.Future[Any], error: BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # completed meanwhile
        fut.set_exception(error)  # type: ignore[arg-type]


_RUNNING: list[Heartbeat] = []  # this process's heartbeat, once started


def start_heartbeat(generation: int, rank: int) -> Heartbeat | None:
    """This process's heartbeat, beating as ``rank`` of ``generation`` in the
    default process group's store (the job's store, where
    :func:`zerofn_torch.elastic.recover` holds its roll call): started on
    the first call. ``None`` without a default group."""
    if _RUNNING:
        _RUNNING[0].beat_as(generation, rank)
        return _RUNNING[0]
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        _RUNNING.append(Heartbeat(store, generation, rank))
    except (RuntimeError, ValueError, AttributeError):  # no store to clone
        return None
    return _RUNNING[0]


def running_heartbeat() -> Heartbeat | None:
    """This process's heartbeat, if one was started."""
    return _RUNNING[0] if _RUNNING else None


def raise_alarm(why: str) -> None:
    """Tell every rank of this world that a collective failed (nothing
    without a heartbeat)."""
    if _RUNNING:
        _RUNNING[0].raise_alarm(why)


def wait(fut: torch.futures.Future[T], purpose: str) -> T:
    """``fut.wait()``; with a heartbeat running, a
    :class:`~zerofn.errors.CollectiveError` instead once another rank raised
    the alarm."""
    return _RUNNING[0].wait(fut, purpose) if _RUNNING else fut.wait()


def interruptible(fut: torch.futures.Future[T]) -> torch.futures.Future[T]:
    """``fut``; with a heartbeat running, a future that also fails once
    another rank raised the alarm (what zerofn's hooks hand DDP)."""
    return _RUNNING[0].interruptible(fut) if _RUNNING else fut
