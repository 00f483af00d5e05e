"""Futures that keep their errors, and callbacks the interpreter's exit waits for.

``Future.then`` flattens an error raised in a callback into a string; the
adapter chains futures with :func:`then` instead, so a
:class:`zerofn.errors.CollectiveError` reaches whoever waits with its type and
cause intact. :func:`for_ddp` makes such a future one DDP's reducer reads as
failed.

Every callback the adapter attaches to a future goes through :func:`on_done`
(:func:`then`, :func:`all_of` and :func:`for_ddp` use it), which counts it
from the moment it starts running until PyTorch lets go of it, and the
interpreter's exit waits until none is counted (:func:`settle`). A
collective's callbacks run on one of the process group's worker threads, and
they go on after the future a caller waits for is complete: each
``set_result`` in a chain returns to Python, and PyTorch then releases each
callback, all of it needing the GIL. A worker thread that asks for the GIL
once the interpreter has begun to finalize is ended by CPython with
``pthread_exit``, whose unwinding through PyTorch's C++ frames calls
``std::terminate``: SIGABRT (``terminate called without an active
exception``), after a script whose last line ran. The worker thread's release
of the finished collective itself can take the GIL too; :mod:`zerofn_torch.runtime.issue`
sees to that for the collectives zerofn issues.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["all_of", "failed", "for_ddp", "on_done", "settle", "then"]

R = TypeVar("R")
T = TypeVar("T")
_LOG = logging.getLogger(__name__)

# Seconds the interpreter's exit waits for callbacks still running: far more
# than any of zerofn's takes, bounded so that one stuck in user code nested in
# it cannot hang the exit for ever.
EXIT_WAIT_S = 60.0


class _Running:
    """How many counted callbacks have started and are not yet let go of."""

    def __init__(self) -> None:
        # Reentrant: a callback may be let go of (and uncounted) by a
        # collection that happens while this thread holds the lock.
        self.changed = threading.Condition(threading.RLock())
        self.count = 0


_RUNNING = _Running()


class _Count:
    """One callback's place in :data:`_RUNNING`: taken when the callback
    starts, given back when this object is deallocated, which happens when
    PyTorch lets go of the callback (on the thread that ran it, with the GIL,
    after the future it completed has woken its waiters and the callbacks
    nested in it have returned; until then that thread still needs the GIL).
    The callback itself is released first, while still counted: freeing what
    it holds may take the GIL again."""

    __slots__ = ("_fn", "_in")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn: Callable[[Any], Any] | None = fn
        self._in: _Running | None = None  # where it was counted (a forked child counts anew)

    def take(self) -> Callable[[Any], Any]:
        """Count it (once); the callback."""
        fn = self._fn
        assert fn is not None
        if self._in is None:
            self._in = running = _RUNNING
            with running.changed:
                running.count += 1
        return fn

    def __del__(self) -> None:
        self._fn = None
        running = self._in
        if running is not None:
            try:
                with running.changed:
                    running.count -= 1
                    running.changed.notify_all()
            except Exception:  # the interpreter's own teardown: nothing waits any more
                pass


def _run_counted(count: _Count, fut: Any) -> Any:
    fn = count.take()
    # No frame may keep the count: a traceback kept with an error (a failed
    # program's, in its future) keeps every frame down to the caller's.
    del count
    return fn(fut)


def _counted(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` as a callback counted for :func:`settle`: the one reference to
    its :class:`_Count` is PyTorch's, through a ``functools.partial`` (C code,
    so no frame refers to it; hand it to ``torch._C.Future``'s methods, not
    to ``torch.futures.Future``'s Python ones, whose frames would)."""
    return functools.partial(_run_counted, _Count(fn))


def on_done(fut: torch.futures.Future[T], fn: Callable[[torch.futures.Future[T]], None]) -> None:
    """``fut.add_done_callback(fn)``, counted for :func:`settle`.

    A callback that never starts (its future never completes) is never
    counted, so nothing waits for it.
    """
    torch._C.Future.add_done_callback(fut, _counted(fn))


def settle(timeout: float | None = None) -> bool:
    """Wait until no callback attached through :func:`on_done` is running or
    still held by PyTorch, releasing the GIL meanwhile (so the threads that
    run them can finish). Called at the interpreter's exit; never from inside
    such a callback (it would wait for itself).

    Args:
        timeout: the most seconds to wait (``None``: as long as it takes).

    Returns:
        Whether none is left.
    """
    with _RUNNING.changed:
        return _RUNNING.changed.wait_for(lambda: _RUNNING.count == 0, timeout)


def _forget_in_child() -> None:
    # The threads that ran the counted callbacks do not exist in a forked child.
    global _RUNNING
    _RUNNING = _Running()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register  # registered before any module that may start callbacks at exit: runs after them
def _settle_at_exit() -> None:
    if not settle(EXIT_WAIT_S):
        _LOG.error(
            "%d future callback(s) still running after %.0f s at exit; a worker thread "
            "that takes the GIL once the interpreter finalizes aborts the process",
            _RUNNING.count,
            EXIT_WAIT_S,
        )


def failed(error: BaseException) -> torch.futures.Future[Any]:
    """A future already failed with ``error`` (its type and cause kept)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_exception(error)  # type: ignore[arg-type]
    return fut


def then(fut: torch.futures.Future[T], fn: Callable[[T], R]) -> torch.futures.Future[R]:
    """The future of ``fn(fut's value)``.

    Unlike ``Future.then``, an error in ``fut`` (or raised by ``fn``) reaches
    the new future as the same exception object, type and cause intact;
    ``fn`` never runs on a failed future.
    """
    out: torch.futures.Future[R] = torch.futures.Future()

    def done(f: torch.futures.Future[T]) -> None:
        try:
            value = fn(f.value())
        except Exception as e:
            out.set_exception(e)  # type: ignore[arg-type]
        else:
            out.set_result(value)

    on_done(fut, done)
    return out


def _value(fut: torch.futures.Future[T]) -> T:
    return fut.wait()


def for_ddp(fut: torch.futures.Future[T]) -> torch.futures.Future[T]:
    """The future to hand DDP for ``fut``.

    ``Future.set_exception`` (used by :func:`then` to keep an error's type)
    stores the error as the future's *value*, which DDP's C++ reducer would
    take for a result; chaining once with ``Future.then`` turns it into an
    error DDP sees, and raises from backward as a ``RuntimeError`` whose
    message holds the :class:`zerofn.errors.CollectiveError`'s.
    """
    return torch._C.Future.then(fut, _counted(_value))  # type: ignore[return-value]


def all_of(futures: Sequence[torch.futures.Future[Any]]) -> torch.futures.Future[list[Any]]:
    """The future of every value of ``futures``, or the first of their errors,
    once all of them are done."""
    out: torch.futures.Future[list[Any]] = torch.futures.Future()
    lock = threading.Lock()
    left = [len(futures)]

    def one(_: torch.futures.Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result([f.value() for f in futures])
        except Exception as e:
            out.set_exception(e)  # type: ignore[arg-type]

    if not futures:
        out.set_result([])
    for f in futures:
        on_done(f, one)
    return out
