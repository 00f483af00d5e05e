"""A rank's heartbeat in the job's store, and the job's alarm: how ranks learn
that a peer died, or that a collective failed somewhere, without waiting for
a collective to time out (:mod:`zerofn.zero.elastic.liveness` says how a watcher
reads the heartbeats).

One daemon thread per process (started for an optimizer with
``redundancy=2``) does both, every :data:`BEAT_INTERVAL_S` seconds, on its
own connection to the store (a clone):

* it adds one to the counter ``zerofn/beat/<generation>/<rank>``;
* it looks for ``zerofn/alarm/<generation>``, which a rank sets once it
  knows a collective failed (:func:`raise_alarm`; ``recover`` does, first);
* it reads the next rank's counter (rank ``r`` watches ``r + 1``, around
  the ring), and raises the alarm itself once it has stood still for
  :data:`WATCH_SILENT_S` (a rank that hangs, or is paused, fails nobody's
  collective: only its silence tells). A rank that ends cleanly says so
  first (``.../done``), and is not watched after.
  Once set, every wait of zerofn's that has not completed ends
  (:func:`wait` raises, the futures DDP waits on fail, see
  :func:`interruptible`): a survivor that gloo left blocked in a collective
  whose peer gave up on it joins the roll call within a beat, rather than at
  the group's timeout (30 minutes by default).

The thread stops at exit, before the interpreter finalizes, and quietly when
the store goes away (the job is ending).

A wait the alarm ended leaves its collective pending in the old group, where
it may never complete (its peer gave up on it), and so may a rank left
behind. Destroying that group would wait for it, so ``recover`` keeps every
failed world's group for good (:func:`abandon`), and
:func:`destroy_process_groups` then leaves every group to the process's
exit, which closes their connections.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
import time
import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zerofn.errors import CollectiveError
from zerofn.zero.elastic.liveness import BeatView, seen_beats, silent_ranks
from zerofn_torch.runtime import group_sockets
from zerofn_torch.runtime.futures import on_done

__all__ = [
    "BEAT_INTERVAL_S",
    "WATCH_SILENT_S",
    "Heartbeat",
    "abandon",
    "abandoned",
    "beat_count",
    "beat_key",
    "destroy_process_groups",
    "interruptible",
    "next_generation",
    "raise_alarm",
    "running_heartbeat",
    "start_heartbeat",
    "wait",
]

T = TypeVar("T")

BEAT_INTERVAL_S = 0.1
"""How often a rank beats, looks for the alarm and reads the others' beats."""

WATCH_SILENT_S = 1.5
"""How long another rank's heartbeat may stand still before this rank raises
the alarm (the roll call, which runs once something failed, waits less)."""


def beat_key(generation: int, rank: int) -> str:
    """Where ``rank`` of the world's ``generation`` beats."""
    return f"zerofn/beat/{generation}/{rank}"


def done_key(generation: int, rank: int) -> str:
    """Where ``rank`` of the world's ``generation`` says it ended cleanly."""
    return f"zerofn/beat/{generation}/{rank}/done"


def alarm_key(generation: int) -> str:
    """Where a rank of the world's ``generation`` says a collective failed."""
    return f"zerofn/alarm/{generation}"


class Heartbeat:
    """Beats for one rank and watches its world's alarm until :meth:`stop`,
    from a daemon thread."""

    def __init__(
        self, store: Any, generation: int, rank: int, world_size: int, group: Any = None
    ) -> None:
        self._store = store.clone()  # the thread's own connection
        self._lock = threading.Lock()
        self._generation, self._rank, self._world_size = generation, rank, world_size
        self._group = group  # the world's process group (None: not known here)
        self._view: BeatView | None = None
        self._alarm: str | None = None
        self._woken: set[threading.Event] = set()
        self._failing: dict[int, torch.futures.Future[Any]] = {}
        self._stopped = threading.Event()
        self._wake = threading.Event()  # beat now, not at the next interval
        self._beaten = threading.Condition(self._lock)
        self._beat_in: tuple[int, int] | None = None  # the world and rank last beaten as
        self._thread = threading.Thread(target=self._run, name="zerofn-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        self._await_first_beat()

    @property
    def alarm(self) -> str | None:
        """Why this world's alarm was raised; ``None`` while it is not."""
        return self._alarm

    def view_of(self, generation: int) -> BeatView | None:
        """What this rank's watching has seen of the other ranks' beats in
        the world of ``generation`` (``None``: nothing yet, or another world)."""
        with self._lock:
            return self._view if generation == self._generation else None

    @property
    def generation(self) -> int:
        """The world this rank beats in."""
        return self._generation

    def beat_as(self, generation: int, rank: int, world_size: int, group: Any = None) -> None:
        """Beat as ``rank`` of the world's ``generation`` (of ``world_size``
        ranks, over ``group``) from now on, the world having changed, and
        watch that world; in the world left, this rank ended cleanly (nobody
        still there mistakes its moving on for silence)."""
        with self._lock:
            left = (self._generation, self._rank)
            self._generation, self._rank, self._world_size = generation, rank, world_size
            self._group = group
            self._alarm, self._view = None, None
        if left != (generation, rank):
            with contextlib.suppress(Exception):  # a store gone: nobody is watching
                self._store.set(done_key(*left), "")
        self._await_first_beat()

    def _await_first_beat(self) -> None:
        """Return once this rank has beaten in its current world (or the
        thread could not): a rank that died before its first beat there
        would never be silent, only missing until the roll call's deadline."""
        self._wake.set()
        with self._beaten:
            self._beaten.wait_for(
                lambda: (
                    self._beat_in == (self._generation, self._rank) or not self._thread.is_alive()
                ),
                timeout=1.0,
            )

    def raise_alarm(self, why: str) -> None:
        """Tell every rank of this world that a collective failed."""
        generation = self._generation
        with contextlib.suppress(Exception):  # a store gone: there is nobody left to tell
            self._store.compare_set(alarm_key(generation), "", why)
        self._ring(why, generation)

    def stop(self) -> None:
        """Say this rank ended cleanly, stop beating and wait for the thread
        to end."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * BEAT_INTERVAL_S + 1.0)
        with contextlib.suppress(Exception):  # a store gone: nobody is watching
            self._store.set(done_key(self._generation, self._rank), "")

    def _ring(self, why: str, generation: int) -> None:
        """End every wait in progress: the alarm of ``generation`` is up
        (nothing if the world changed since). The first ring also shuts the
        connections of that world's group (:func:`~zerofn_torch.runtime.group_sockets.shut`),
        which ends the collectives PyTorch waits for in C++, here and on
        every rank connected to this one."""
        with self._lock:
            if generation != self._generation:
                return
            first, group = self._alarm is None, self._group
            if first:
                self._alarm = why
            woken, self._woken = self._woken, set()
            failing, self._failing = self._failing, {}
        # DDP's futures fail before the waits wake: whoever a wait's error
        # reaches finds them failed already.
        for fut in failing.values():
            _fail(fut, self._alarm_error("a collective DDP waits for"))
        for event in woken:
            event.set()
        if first:
            group_sockets.shut(group)

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
            self._wake.clear()  # a wake from here on beats again at once
            with self._lock:
                generation, rank, world_size = self._generation, self._rank, self._world_size
            try:
                self._store.add(beat_key(generation, rank), 1)
                with self._beaten:
                    self._beat_in = (generation, rank)
                    self._beaten.notify_all()
                key = alarm_key(generation)
                if self._alarm is None and self._store.check([key]):
                    self._ring(self._store.get(key).decode(), generation)
                silent = self._silent_others(generation, rank, world_size)
                if silent and self._alarm is None:
                    self.raise_alarm(f"rank {silent[0]} silent for {WATCH_SILENT_S} s")
            except Exception:  # the store is gone: the job is ending
                return
            self._wake.wait(BEAT_INTERVAL_S)

    def _silent_others(self, generation: int, rank: int, world_size: int) -> tuple[int, ...]:
        """The next rank of this world's ring (each rank watches one, so the
        store serves two reads per rank and beat at any world size), if its
        heartbeat stood still for :data:`WATCH_SILENT_S` and it did not end
        cleanly."""
        store = self._store
        watched = (rank + 1) % world_size
        counts = [
            beat_count(store, beat_key(generation, r)) if r == watched != rank else None
            for r in range(world_size)
        ]
        with self._lock:
            if generation != self._generation:
                return ()
            # A thread that was not scheduled for a while (a starved
            # machine) starts timing again, rather than blame the watched rank.
            now = time.monotonic()
            self._view = view = seen_beats(self._view, counts, now, WATCH_SILENT_S / 3)
        silent = silent_ranks(view, now, WATCH_SILENT_S)
        return tuple(r for r in silent if not store.check([done_key(generation, r)]))

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


def beat_count(store: Any, key: str) -> int | None:
    """The heartbeat counter under ``key``; ``None`` if it never beat there."""
    return int(store.get(key)) if store.check([key]) else None


def next_generation() -> int:
    """The generation a new world of this process starts at (a new optimizer
    with ``redundancy=2``): one past the running heartbeat's, else 0. Every
    rank of the world went through the same worlds before it (a joiner takes
    the job's generation when it joins), so they agree without a word, and
    a new world never meets an old one's alarm, beats or roll call."""
    return _RUNNING[0].generation + 1 if _RUNNING else 0


def start_heartbeat(
    generation: int, rank: int, world_size: int, group: Any = None
) -> Heartbeat | None:
    """This process's heartbeat, beating as ``rank`` of ``generation`` (a
    world over ``group``) in the default process group's store (the job's
    store, where :func:`zerofn_torch.elastic.recover` holds its roll call):
    started on the first call. ``None`` without a default group."""
    if _RUNNING:
        _RUNNING[0].beat_as(generation, rank, world_size, group)
        return _RUNNING[0]
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        _RUNNING.append(Heartbeat(store, generation, rank, world_size, group))
    except (RuntimeError, ValueError, AttributeError):  # no store to clone
        return None
    _warn_if_torn_by_a_loss(store)
    return _RUNNING[0]


def _warn_if_torn_by_a_loss(store: Any) -> None:
    """Warn when the job's store is a ``FileStore``, which a loss can leave
    unusable for every rank (see docs/resilience.md, "The job's store")."""
    while store is not None:
        if isinstance(store, dist.FileStore):  # type: ignore[attr-defined]
            warnings.warn(
                "the job's store is a FileStore: a rank killed while it writes there leaves a "
                "torn record at which every other rank's next store call waits forever (torch "
                "2.13), so a loss can hang the job instead of being recovered from. Start the "
                "job with torchrun, or init_process_group with a TCPStore served by a process "
                "that outlives the ranks",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        store = getattr(store, "underlying_store", None)


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


_ABANDONED: list[Any] = []  # groups holding a collective a wait gave up on


def abandon(group: Any) -> None:
    """Keep ``group`` for good, never destroyed: a wait on one of its
    collectives was given up, and destroying it would wait for that."""
    _ABANDONED.append(group)


def abandoned(group: Any) -> bool:
    """Whether ``group`` was kept for good (:func:`abandon`): a failed world's,
    its connections shut by the alarm, so no collective of it can run."""
    return any(g is group for g in _ABANDONED)


def destroy_process_groups() -> None:
    """``torch.distributed.destroy_process_group()``, unless a group was
    abandoned (:func:`abandon`): then every group is left to the process's
    exit, which closes their connections without waiting."""
    if not _ABANDONED:
        dist.destroy_process_group()


@atexit.register
def _keep_abandoned_for_good() -> None:
    # The interpreter's teardown would release them, and a group's
    # destructor waits for its pending collectives: never released.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))
