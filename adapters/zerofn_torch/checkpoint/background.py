"""Sharded saves in the background: the handle a caller waits on, the one
save in flight per group of ranks, and the gloo group such saves talk on.

A background save runs the whole save protocol of :mod:`zerofn_torch.checkpoint.sharded`
in a thread, so its collectives must not share a process group with
training's (two threads issuing collectives on one group interleave them
differently on different ranks); they run on a gloo group of the same ranks.

That group is remembered weakly: ``torch.distributed`` keeps it, as it keeps
every group, until ``destroy_process_group`` or the interpreter's teardown, so
this module never holds a group past the saves that use it and is never
what keeps one alive at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerofn_torch.runtime import group_sockets

__all__ = ["SaveHandle", "in_flight", "save_group", "settle_in_flight"]

_LOG = logging.getLogger(__name__)


class SaveHandle:
    """A save under way (``save_sharded(..., blocking=False)``) or finished.

    :meth:`wait` returns once the checkpoint is committed, or raises what
    failed; a failure nobody waited for raises at the next
    :func:`save_sharded` or :func:`load_sharded` on the same ranks instead.
    """

    def __init__(
        self, path: str, work: Callable[[], None], *, background: bool, started: float
    ) -> None:
        """Run ``work`` (the save) in a thread, or now when not ``background``
        (then its failure raises here); ``started`` is the ``perf_counter()``
        of the call that asked for it."""
        self.path = path
        self._started = started
        self._seconds: float | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(work,), name=f"save_sharded {path}", daemon=True
            )
            self._thread.start()
        else:
            self._run(work)
            self.wait()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(): a thread has no caller to raise to
            self._error = e
        finally:
            self._seconds = time.perf_counter() - self._started

    @property
    def seconds(self) -> float | None:
        """How long the save took, from the call to its commit (or failure);
        ``None`` while it runs."""
        return self._seconds

    def done(self) -> bool:
        """Whether the save has ended (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save has ended.

        Args:
            timeout: seconds to wait at most (``None``: until it ends).

        Raises:
            TimeoutError: it is still running after ``timeout`` seconds.
            zerofn.errors.CollectiveError, RuntimeError, ValueError: what the
                save raised (on every rank: the save ends with an agreement).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"save_sharded to {self.path!r} still running")
        self._reported = True
        if self._error is not None:
            raise self._error

    def _settle(self) -> None:
        """Wait; raise a failure only if :meth:`wait` has not reported it yet."""
        if self._thread is not None:
            self._thread.join()
        if not self._reported:
            self.wait()


_IN_FLIGHT: dict[tuple[int, ...], SaveHandle] = {}
# Weak, so that a destroyed group goes with its world's other groups, not
# when this module's globals are cleared at the end of interpreter teardown.
_SAVE_GROUPS: dict[tuple[int, ...], weakref.ref[Any]] = {}


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def settle_in_flight(group: Any) -> None:
    """Wait for the save in flight on ``group``'s ranks, if any; raise its
    failure if nobody has waited for it yet."""
    handle = _IN_FLIGHT.pop(_ranks(group), None)
    if handle is not None:
        handle._settle()


def save_group(group: Any) -> Any:
    """The gloo group background saves of ``group``'s ranks run their
    collectives on, so that they never interleave with training's.

    Created by the first background save (``dist.new_group``: every rank of
    the default group must enter it) with ``group``'s timeout, then reused.
    """
    ranks = _ranks(group)
    remembered = _SAVE_GROUPS.get(ranks)
    known = remembered() if remembered is not None else None
    if known is not None and _alive(known):
        return known
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):  # no CPU backend (NCCL alone): gloo's default
        timeout = None
    # Its connections are shut when the alarm of the world over ``group``
    # rings: a save waiting on a lost rank fails at once (and writes nothing)
    # instead of at the timeout.
    created = group_sockets.opened(
        lambda: dist.new_group(list(ranks), timeout=timeout, backend="gloo"),
        part_of=group if group is not None else dist.group.WORLD,
    )
    _SAVE_GROUPS[ranks] = weakref.ref(created)
    return created


def _alive(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):  # destroyed with its world
        return False
    return True


def in_flight(group: Any, handle: SaveHandle) -> None:
    """Record ``handle`` as the save in flight on ``group``'s ranks."""
    _IN_FLIGHT[_ranks(group)] = handle


@atexit.register
def _finish_saves_at_exit() -> None:
    # A background save still writing when the program ends would otherwise
    # be cut off, leaving the previous checkpoint as the last.
    for handle in list(_IN_FLIGHT.values()):
        try:
            handle._settle()
        except BaseException as e:
            _LOG.error("save_sharded to %r failed at exit: %s", handle.path, e)
    _IN_FLIGHT.clear()
