"""Futures that keep their errors, and callbacks the interpreter's exit waits for.

``Future.then`` flattens an error raised in a callback into a string; the
adapter chains futures with :func:`then` instead, so a
:class:`zerofn.errors.CollectiveError` reaches whoever waits with its type and
cause intact. :func:`for_ddp` makes such a future one DDP's reducer reads as
failed.

Every callback the adapter attaches to a future goes through :func:`on_done`
(:func:`then`, :func:`all_of` and :func:`for_ddp` use it), which counts it
from the moment it starts running until PyTorch lets go of it
(:func:`~zerofn_torch.runtime.torch_workarounds.counted`), and the
interpreter's exit waits until none is counted (:func:`settle`): a
collective's callbacks run on a worker thread of the process group and go on
after the future a caller waits for is complete, and a worker thread that
needs the GIL once the interpreter has begun to finalize aborts the process
(:mod:`zerofn_torch.runtime.torch_workarounds` says how).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from zerofn_torch.runtime.torch_workarounds import counted as _counted
from zerofn_torch.runtime.torch_workarounds import settle, settle_at_exit

__all__ = ["all_of", "failed", "for_ddp", "on_done", "settle", "then"]

R = TypeVar("R")
T = TypeVar("T")

# Registered before any module that may start callbacks at exit: runs after them.
atexit.register(settle_at_exit)


def on_done(fut: torch.futures.Future[T], fn: Callable[[torch.futures.Future[T]], None]) -> None:
    """``fut.add_done_callback(fn)``, counted for :func:`settle`.

    A callback that never starts (its future never completes) is never
    counted, so nothing waits for it.
    """
    torch._C.Future.add_done_callback(fut, _counted(fn))


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
