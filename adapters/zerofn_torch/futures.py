"""Futures that keep their errors.

``Future.then`` flattens an error raised in a callback into a string; the
adapter chains futures with :func:`then` instead, so a
:class:`zerofn.errors.CollectiveError` reaches whoever waits with its type and
cause intact. :func:`for_ddp` makes such a future one DDP's reducer reads as
failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["all_of", "failed", "for_ddp", "then"]

R = TypeVar("R")
T = TypeVar("T")


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

    fut.add_done_callback(done)
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
    return fut.then(_value)


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
        f.add_done_callback(one)
    return out
