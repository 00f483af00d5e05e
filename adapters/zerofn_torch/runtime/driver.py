"""The driver: zerofn's communication programs run with ``torch.distributed``.

A program (see :mod:`zerofn.comm`) yields requests; the driver issues each
as a collective on a process group (:func:`zerofn_torch.runtime.issue.issue`). Every
request but the program's last is awaited before the next one is computed
(a posted one when the program collects it: meanwhile the program computes),
so all collectives are issued from the caller's thread in program order:
ranks that call hooks in bucket order issue identical sequences, whatever
order futures complete in. The last request is left in flight and the
program is finished in the future's callback, so DDP overlaps it with the
rest of the backward pass. A program whose request failed is closed, never
resumed with a result.

One loop steps every program (:class:`_Running`): :func:`drive` steps one
program to its last request at once; :class:`ProgramPipeline` steps several
buckets' programs a request at a time, so a multi-round program does not
block backward on its early rounds: a bucket's next round is issued at the
next hook call.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from zerofn.comm import Collect, Post, Program, ProgramStep, Response
from zerofn_torch.runtime.foreign_hooks import Await
from zerofn_torch.runtime.futures import on_done
from zerofn_torch.runtime.heartbeat import wait
from zerofn_torch.runtime.issue import Step, issue

__all__ = ["PolledProgram", "ProgramPipeline", "drive", "finish_polled"]

R = TypeVar("R")
_LOG = logging.getLogger(__name__)


class _Running(Generic[R]):
    """One program being stepped: by :func:`drive`, or inside a
    :class:`ProgramPipeline`.

    ``done`` once its last request is issued, or once it failed (a failed
    request, or the program's own error): then :attr:`result` fails with that
    error and the program is never resumed.

    The group is held only while requests remain to issue: once ``done``,
    the stepper lets go of this record and the last request's completion
    callback may hold it last, on the group's worker thread, where it must
    not be the group's last reference (see
    :func:`zerofn_torch.runtime.collective_errors.describe_group`).
    """

    def __init__(self, program: Program[R], group: Any, purpose: str) -> None:
        self.program = program
        self.group = group
        self.purpose = purpose
        self.result: torch.futures.Future[R] = torch.futures.Future()
        self.done = False
        self.number = 0
        self.pending: torch.futures.Future[Response] | None = None
        # Posted requests in flight, by the identity of the request record.
        self.posted: dict[int, torch.futures.Future[Response]] = {}
        # Collects whose response the program has taken in, and whether the
        # pending request is one.
        self.collected = 0
        self.collecting = False
        self._step(lambda: next(program))

    def _step(self, resume: Callable[[], ProgramStep | Await]) -> None:
        """Resume the program and issue the request it makes next (a posted
        one, and the program resumed at once, until it makes one to wait for)."""
        try:
            request = resume()
            while isinstance(request, Post):
                self.posted[id(request.request)] = self._issue(request.request)
                request = self.program.send(())
            self.collecting = isinstance(request, Collect)
            if isinstance(request, Collect):
                pending = self.posted.pop(id(request.request), None)
                if pending is None:
                    raise RuntimeError(
                        f"the communication program for {self.purpose} collected a request "
                        "it had not posted"
                    )
            else:
                pending = self._issue(request)
        except StopIteration as stop:
            if self.posted:
                self._fail(
                    RuntimeError(
                        f"the communication program for {self.purpose} returned with "
                        f"{len(self.posted)} posted request(s) never collected"
                    )
                )
                return
            self._issued_all()
            self.result.set_result(stop.value)
            return
        except Exception as e:  # a failed request, or the program's own error
            self._fail(e)
            return
        self.pending = pending
        if request.last:
            self._issued_all()
            on_done(self.pending, self._complete)

    def _issue(self, request: Step) -> torch.futures.Future[Response]:
        future = issue(request, self.group, f"{self.purpose}, collective #{self.number}")
        self.number += 1
        return future

    def _issued_all(self) -> None:
        """Nothing is left to issue: mark it, and let go of the group."""
        self.done = True
        self.group = None

    def _fail(self, error: Exception) -> None:
        self._issued_all()
        self.program.close()
        self.result.set_exception(error)  # type: ignore[arg-type]

    def _complete(self, fut: torch.futures.Future[Response]) -> None:
        try:
            self.program.send(fut.value())
        except StopIteration as stop:
            self.result.set_result(stop.value)
            return
        except Exception as e:
            self._fail(e)
            return
        self._fail(
            RuntimeError(
                f"the communication program for {self.purpose} made a request after its last one"
            )
        )

    def advance(self) -> None:
        """Wait for the pending request, then issue the program's next one."""
        if self.done:
            return
        pending, collecting = self.pending, self.collecting
        assert pending is not None
        self._step(lambda: self.program.send(wait(pending, self.purpose)))
        self.collected += collecting


def drive(
    program: Program[R], group: Any, purpose: str = "a communication program"
) -> torch.futures.Future[R]:
    """Run ``program`` against ``group``; the future yields its return value.

    Args:
        program: the communication program.
        group: the process group.
        purpose: what the program is for, for error messages.

    Returns:
        The future of the program's return value. It fails instead (``wait()``
        raises) with a :class:`zerofn.errors.CollectiveError` if one of the
        program's collectives failed (the program is closed, never resumed),
        with the program's own exception if it raised, and with
        ``RuntimeError`` if it made a request after one it marked ``last``.
    """
    running = _Running(program, group, purpose)
    while not running.done:
        running.advance()
    return running.result


class PolledProgram(Generic[R]):
    """A program moved on from the caller's thread without blocking: each
    :meth:`poll` issues the requests whose predecessors have completed, and
    :meth:`wait` runs it to its end. Every request is issued by the caller,
    in program order, so ranks issue identical sequences (DiLoCo's delayed
    syncs run this way, overlapped with inner steps)."""

    def __init__(self, program: Program[R], group: Any, purpose: str) -> None:
        self._running = _Running(program, group, purpose)
        self._key = next(_CREATED)
        _UNFINISHED[self._key] = self

    def poll(self) -> None:
        """Issue every request whose predecessor has completed; never waits."""
        running = self._running
        while not running.done and running.pending is not None and running.pending.done():
            running.advance()

    def wait(self) -> R:
        """Run the program to its end; its return value.

        Raises:
            zerofn.errors.CollectiveError: one of its collectives failed (or
                the program's own error).
        """
        _UNFINISHED.pop(self._key, None)
        while not self._running.done:
            self._running.advance()
        return wait(self._running.result, self._running.purpose)

    def advance_until(self, collected: int) -> None:
        """Run the program until it has taken in the responses of
        ``collected`` :class:`~zerofn.comm.Collect` requests, or to its end.

        Raises:
            zerofn.errors.CollectiveError: one of its collectives failed (or
                the program's own error).
        """
        running = self._running
        while not running.done and running.collected < collected:
            running.advance()
        if running.done:
            self.wait()

    def abandon(self) -> None:
        """Never run it to its end: its group failed and was left (a
        recovery goes on without it), so :func:`finish_polled` must not wait
        for it either."""
        _UNFINISHED.pop(self._key, None)

    @property
    def purpose(self) -> str:
        """What the program is for (named in its errors)."""
        return self._running.purpose

    @property
    def ended(self) -> bool:
        """Whether the program has ended (or failed): nothing is left to issue."""
        return self._running.done


# Polled programs not yet run to their end, in the order they were created:
# the same order on every rank, so finishing them in it issues the same
# requests everywhere. Weak: a program its owner dropped is nobody's to finish.
_UNFINISHED: weakref.WeakValueDictionary[int, PolledProgram[Any]] = weakref.WeakValueDictionary()
_CREATED = itertools.count()


def finish_polled() -> list[tuple[str, BaseException]]:
    """Run every polled program of this process still in flight to its end,
    oldest first, before its process group goes: one rank that has issued a
    request its peer has not would otherwise meet the peer's next collective
    (a barrier, the group's teardown) with it, and gloo aborts.

    :func:`zerofn_torch.runtime.launch.run_local_world` calls it when the function
    returns, and the interpreter at exit; a script that destroys the group
    itself calls it (or the owner's own ``drain()``) first.

    Returns:
        The programs that failed: their purpose and error (the owner sees
        the same error when it waits for its result).
    """
    failed: list[tuple[str, BaseException]] = []
    for key in sorted(_UNFINISHED.keys()):
        polled = _UNFINISHED.get(key)
        if polled is None:
            continue
        try:
            polled.wait()
        except Exception as error:  # the owner's wait raises it again
            failed.append((polled.purpose, error))
    return failed


@atexit.register
def _finish_polled_at_exit() -> None:
    for purpose, error in finish_polled():
        _LOG.error("%s was still in flight at exit and failed: %s", purpose, error)


class ProgramPipeline:
    """Runs the programs of several buckets at once, from the caller's thread.

    Each hook call starts its bucket's program (its first request goes out at
    once) and then moves every older program one request on. So a multi-round
    program's next round waits for the next hook call instead of blocking
    backward, while every request is still issued by the caller, in an order
    fixed by bucket and round: the same on every rank. The last bucket of an
    iteration drains all programs. A program whose request failed stops there
    and its future fails; the others go on (their own collectives fail in
    turn if the group is broken).
    """

    def __init__(self) -> None:
        self._running: list[_Running[Any]] = []

    def run(
        self, program: Program[R], group: Any, is_last: bool, purpose: str = "a DDP bucket"
    ) -> torch.futures.Future[R]:
        """Start ``program``; the future yields its return value.

        Args:
            program: the bucket's program.
            group: the process group to communicate in.
            is_last: the iteration's last bucket: finish issuing everything.
            purpose: what the program is for, for error messages.

        Returns:
            The future of the program's result, or of the
            :class:`zerofn.errors.CollectiveError` (or the program's own
            error) that stopped it.
        """
        older = self._running
        started = _Running(program, group, purpose)
        for running in older:
            running.advance()
        self._running = [r for r in [*older, started] if not r.done]
        if is_last:
            self.drain()
        return started.result

    def drain(self) -> None:
        """Issue every running program's remaining requests, oldest program
        first, round by round (the same order on every rank)."""
        while self._running:
            for running in self._running:
                running.advance()
            self._running = [r for r in self._running if not r.done]
