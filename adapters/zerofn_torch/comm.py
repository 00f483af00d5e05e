"""Driving zerofn's communication programs with ``torch.distributed``.

A program (see :mod:`zerofn.comm`) yields requests; :func:`drive` issues each
as a collective on a process group. Every request but the program's last is
awaited before the next one is computed, so all collectives are issued from
the caller's thread in program order: ranks that call hooks in bucket order
issue identical sequences, whatever order futures complete in. The last
request is left in flight and the program is finished in the future's
callback, so DDP overlaps it with the rest of the backward pass.

:class:`ProgramPipeline` keeps that guarantee for multi-round programs without
blocking backward on their early rounds: a bucket's next round is issued at
the next hook call.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from zerofn import hook as core
from zerofn.comm import AllGather, AllReduce, Program, Request, Response
from zerofn.hook import BucketInfo, CommHook, HookState

__all__ = ["HookCell", "ProgramPipeline", "bucket_info", "drive", "issue"]

R = TypeVar("R")
G = TypeVar("G")
B = TypeVar("B")


def bucket_info(bucket: Any, group: Any) -> BucketInfo:
    """What the core needs to know of a DDP ``GradBucket``."""
    return BucketInfo(
        index=bucket.index(),
        shapes=tuple(tuple(g.shape) for g in bucket.gradients()),
        world_size=dist.get_world_size(group),
        is_last=bucket.is_last(),
    )


def _flatten(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # A request hands its tensors over, so a lone contiguous one is reduced in place.
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _split(flat: torch.Tensor, like: tuple[torch.Tensor, ...]) -> Response:
    out = []
    offset = 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return tuple(out)


def issue(request: Request, group: Any) -> torch.futures.Future[Response]:
    """Start the collective ``request`` asks for; the future yields its response.

    The tensors of an :class:`AllReduce` travel in one message when they share
    a dtype (one collective, one round trip), else one message per dtype.
    """
    if isinstance(request, AllGather):
        size = dist.get_world_size(group)
        outputs = [torch.empty_like(request.tensor) for _ in range(size)]
        work = dist.all_gather(outputs, request.tensor.contiguous(), group=group, async_op=True)
        assert work is not None
        gathered: torch.futures.Future[Response] = work.get_future().then(lambda _: tuple(outputs))
        return gathered
    assert isinstance(request, AllReduce)
    dtypes = list(dict.fromkeys(t.dtype for t in request.tensors))
    if len(dtypes) == 1:
        flat = _flatten(request.tensors)
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        world = dist.get_world_size(group)

        def unpack(_: Any) -> Response:
            if request.op == "avg":
                flat.div_(world)
            return _split(flat, request.tensors)

        reduced: torch.futures.Future[Response] = work.get_future().then(unpack)
        return reduced
    # Mixed dtypes: one collective per dtype, awaited together.
    parts = [tuple(t for t in request.tensors if t.dtype == d) for d in dtypes]
    futures = [issue(AllReduce(p, request.op), group) for p in parts]
    combined = torch.futures.collect_all(futures)

    def merge(_: Any) -> Response:
        by_dtype = {d: list(f.value()) for d, f in zip(dtypes, futures, strict=True)}
        return tuple(by_dtype[t.dtype].pop(0) for t in request.tensors)

    return combined.then(merge)


def drive(program: Program[R], group: Any) -> torch.futures.Future[R]:
    """Run ``program`` against ``group``; the future yields its return value.

    Raises:
        RuntimeError: (through the future) if the program makes a request
            after one it marked ``last``.
    """
    try:
        request = next(program)
        while not request.last:
            request = program.send(issue(request, group).wait())
    except StopIteration as stop:
        done: torch.futures.Future[R] = torch.futures.Future()
        done.set_result(stop.value)
        return done

    def finish(fut: torch.futures.Future[Response]) -> R:
        try:
            program.send(fut.value())
        except StopIteration as stop:
            result: R = stop.value
            return result
        raise RuntimeError("a communication program made a request after its last one")

    return issue(request, group).then(finish)


class _Running(Generic[R]):
    """One bucket's program inside a :class:`ProgramPipeline`."""

    def __init__(self, program: Program[R], group: Any) -> None:
        self.program = program
        self.group = group
        self.result: torch.futures.Future[R] = torch.futures.Future()
        self.issued_last = False
        self.pending: torch.futures.Future[Response] | None = None
        try:
            self._issue(next(program))
        except StopIteration as stop:
            self._finish(stop.value)

    def _finish(self, value: R) -> None:
        self.issued_last = True
        self.result.set_result(value)

    def _issue(self, request: Request) -> None:
        self.pending = issue(request, self.group)
        if request.last:
            self.issued_last = True
            self.pending.then(self._complete)

    def _complete(self, fut: torch.futures.Future[Response]) -> None:
        try:
            self.program.send(fut.value())
        except StopIteration as stop:
            self.result.set_result(stop.value)
            return
        except Exception as e:  # surface it through the bucket's future
            self.result.set_exception(e)  # type: ignore[arg-type]
            return
        self.result.set_exception(
            RuntimeError("a communication program made a request after its last one")  # type: ignore[arg-type]
        )

    def advance(self) -> None:
        """Wait for the pending request, then issue the program's next one."""
        if self.issued_last:
            return
        assert self.pending is not None
        try:
            self._issue(self.program.send(self.pending.wait()))
        except StopIteration as stop:
            self._finish(stop.value)


class ProgramPipeline:
    """Runs the programs of several buckets at once, from the caller's thread.

    Each hook call starts its bucket's program (its first request goes out at
    once) and then moves every older program one request on. So a multi-round
    program's next round waits for the next hook call instead of blocking
    backward, while every request is still issued by the caller, in an order
    fixed by bucket and round: the same on every rank. The last bucket of an
    iteration drains all programs.
    """

    def __init__(self) -> None:
        self._running: list[_Running[Any]] = []

    def run(self, program: Program[R], group: Any, is_last: bool) -> torch.futures.Future[R]:
        """Start ``program``; the future yields its return value.

        Args:
            program: the bucket's program.
            group: the process group to communicate in.
            is_last: the iteration's last bucket: finish issuing everything.
        """
        older = self._running
        started = _Running(program, group)
        for running in older:
            running.advance()
        self._running = [r for r in [*older, started] if not r.issued_last]
        while is_last and self._running:
            for running in self._running:
                running.advance()
            self._running = [r for r in self._running if not r.issued_last]
        return started.result


class HookCell(Generic[G, B]):
    """A hook's state between calls, and what it takes to advance it safely.

    The adapter's shells (:class:`zerofn_torch.hooks.HookRunner`,
    :class:`zerofn_torch.powersgd.PowerSGDState`) keep one cell each: every
    bucket call reads :attr:`state`, asks the core for the bucket's program,
    runs it in the cell's :class:`ProgramPipeline` and assigns the new state.
    The lock guards the assignments, because programs finish in future
    callbacks, possibly on other threads.

    Args:
        state: the hook's initial state.
    """

    def __init__(self, state: HookState[G, B]) -> None:
        self.state = state
        self.lock = threading.Lock()
        self.pipeline = ProgramPipeline()

    def run(
        self, hook: CommHook[G, B], bucket: Any, group: Any
    ) -> tuple[HookState[G, B], BucketInfo, torch.futures.Future[torch.Tensor]]:
        """Start ``hook``'s program for DDP's ``bucket`` in ``group``.

        Returns:
            The state before this call, the bucket's :class:`BucketInfo`, and a
            future of the bucket's reduced flat gradient (the cell's state takes
            the bucket's result when it completes).
        """
        info = bucket_info(bucket, group)
        with self.lock:
            before = self.state
            state, program = core.begin_bucket(hook, before, bucket.buffer(), info)
            if info.is_last:
                state = core.finish_iteration(hook, state)
            self.state = state

        def record(fut: torch.futures.Future[tuple[torch.Tensor, B]]) -> torch.Tensor:
            grad, bucket_state = fut.value()
            with self.lock:
                self.state = core.finish_bucket(self.state, info.index, bucket_state)
            return grad

        return before, info, self.pipeline.run(program, group, info.is_last).then(record)
