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

This module is where a failed collective becomes an error: :func:`issue`
reads every collective's own outcome, and a failure (a dead peer, a timeout,
a broken transport) fails the request's future with a
:class:`zerofn.errors.CollectiveError` naming the collective, its purpose and
the group, with the transport's error as its cause. A program whose request
failed is closed, never resumed with a result. Futures are chained with
:func:`then` rather than ``Future.then``, which would flatten errors into
strings.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import attrs
import torch
import torch.distributed as dist

from zerofn.comm import (
    AllGather,
    AllReduce,
    Broadcast,
    GatherSegments,
    Program,
    Reduce,
    Request,
    Response,
    describe,
    split_like,
)
from zerofn.errors import CollectiveError
from zerofn.hooks import hook as core
from zerofn.hooks.hook import BucketInfo, CommHook, HookState

__all__ = [
    "Await",
    "HookCell",
    "ProgramPipeline",
    "all_gather_objects",
    "broadcast_object",
    "bucket_info",
    "describe_group",
    "drive",
    "failed",
    "for_ddp",
    "foreign_hook",
    "gather_objects",
    "guarded",
    "issue",
    "run_stateless",
    "then",
]

R = TypeVar("R")
T = TypeVar("T")
G = TypeVar("G")
B = TypeVar("B")


@attrs.frozen(eq=False)
class Await:
    """A request the core does not know: the result of a DDP hook the core
    cannot see into (PyTorch's own, or yours), already started. The driver
    answers with the future's value; a failure fails the request with a
    :class:`~zerofn.errors.CollectiveError` naming the hook (one the hook
    raised itself passes through as it is).

    Attributes:
        future: the running hook's future of the reduced flat gradient.
        hook: the hook's name, for the error.
        last: always the program's final request.
    """

    future: torch.futures.Future[torch.Tensor]
    hook: str = "a DDP hook"
    last: bool = True


Step = Request | Await
"""What a program run by this driver may yield."""


def bucket_info(bucket: Any, group: Any) -> BucketInfo:
    """What the core needs to know of a DDP ``GradBucket``."""
    return BucketInfo(
        index=bucket.index(),
        shapes=tuple(tuple(g.shape) for g in bucket.gradients()),
        world_size=dist.get_world_size(group),
        is_last=bucket.is_last(),
    )


# ----- futures that keep their errors -------------------------------------------


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


def _all(futures: Sequence[torch.futures.Future[Any]]) -> torch.futures.Future[list[Any]]:
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


def _work_future(work: dist.Work | None) -> torch.futures.Future[Any]:
    if work is None:  # a rank outside the group takes no part
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done
    return work.get_future()


# ----- naming what failed ----------------------------------------------------------


def describe_group(group: Any) -> str:
    """The group for messages: backend, size and this rank's place in it.

    Callbacks that may report a failure close over this string, taken when
    the request is issued, never over the group: a callback runs, and is
    freed, on one of the group's own worker threads, and if it held the last
    reference the group's destructor would run there and join that very
    thread (``std::system_error``: resource deadlock avoided, then abort).

    Args:
        group: the process group.

    Returns:
        E.g. ``"gloo group of 2 ranks (this is rank 0)"``.
    """
    try:
        return (
            f"{dist.get_backend(group)} group of {dist.get_world_size(group)} ranks "
            f"(this is rank {dist.get_rank(group)})"
        )
    except Exception:  # a group torn down under us still gets named
        return "a process group that is no longer usable"


def _collective_error(
    collective: str, purpose: str, group_name: str, cause: BaseException
) -> CollectiveError:
    """The error for a failed collective.

    Args:
        collective: what was sent (e.g. ``"all_reduce (sum) of 1 tensor, 4 B"``).
        purpose: what it was for.
        group_name: the group, as :func:`describe_group` named it.
        cause: the transport's error, kept as ``__cause__``.

    Returns:
        The :class:`zerofn.errors.CollectiveError` to raise or fail a future with.
    """
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    error = CollectiveError(collective, purpose, group_name, reason)
    error.__cause__ = cause
    return error


@contextmanager
def guarded(collective: str, purpose: str, group: Any) -> Iterator[None]:
    """Turn an error raised by a blocking collective inside the block into a
    :class:`zerofn.errors.CollectiveError` naming ``collective`` and ``purpose``.

    For collectives the core does not express as requests (object
    collectives, ``torch.distributed.checkpoint``).
    """
    try:
        yield
    except (CollectiveError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    # BaseException: torch.distributed.checkpoint's CheckpointException is one.
    except BaseException as e:
        raise _collective_error(collective, purpose, describe_group(group), e) from e


# ----- object collectives ----------------------------------------------------------
# Picklable values (state dicts, file hashes, verdicts) rather than tensors:
# blocking, and only for bookkeeping, so the core does not express them as
# requests; they still fail the way every collective does.


def all_gather_objects(value: Any, group: Any, purpose: str) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with guarded("all_gather_object", purpose, group):
        dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_objects(value: Any, dst: int, group: Any, purpose: str) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on group rank ``dst``; ``None``
    on the other ranks.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    mine = dist.get_rank(group) == dst
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if mine else None
    with guarded("gather_object", purpose, group):
        dist.gather_object(value, gathered, dst=dist.get_global_rank(group, dst), group=group)
    return gathered


def broadcast_object(value: Any, src: int, group: Any, purpose: str) -> Any:
    """Group rank ``src``'s ``value``, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    box = [value]
    with guarded("broadcast_object_list", purpose, group):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]


# ----- issuing requests ------------------------------------------------------------


def _flatten(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # A request hands its tensors over, so a lone contiguous one is reduced in place.
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _all_reduce(request: AllReduce, group: Any) -> torch.futures.Future[Response]:
    dtypes = list(dict.fromkeys(t.dtype for t in request.tensors))
    if len(dtypes) > 1:  # one collective per dtype, awaited together
        parts = [tuple(t for t in request.tensors if t.dtype == d) for d in dtypes]
        futures = [_all_reduce(AllReduce(p, request.op), group) for p in parts]

        def merge(values: list[Response]) -> Response:
            by_dtype = {d: list(v) for d, v in zip(dtypes, values, strict=True)}
            return tuple(by_dtype[t.dtype].pop(0) for t in request.tensors)

        return then(_all(futures), merge)
    flat = _flatten(request.tensors)
    op = dist.ReduceOp.MAX if request.op == "max" else dist.ReduceOp.SUM
    work = dist.all_reduce(flat, op=op, group=group, async_op=True)
    world = dist.get_world_size(group)

    def unpack(_: Any) -> Response:
        if request.op == "avg":
            flat.div_(world)
        return split_like(flat, request.tensors)

    return then(_work_future(work), unpack)


def _gather_segments(request: GatherSegments, group: Any) -> torch.futures.Future[Response]:
    segments = request.segments
    if request.via == "all_gather":
        work = dist.all_gather(list(segments), segments[request.rank], group=group, async_op=True)
        return then(_work_future(work), lambda _: segments)
    futures = [
        _work_future(
            dist.broadcast(
                segment, src=dist.get_global_rank(group, owner), group=group, async_op=True
            )
        )
        for owner, segment in enumerate(segments)
        if segment.numel() > 0
    ]
    return then(_all(futures), lambda _: segments)


def _start(request: Step, group: Any) -> torch.futures.Future[Response]:
    if isinstance(request, Await):
        return then(request.future, lambda value: (value,))
    if isinstance(request, AllReduce):
        return _all_reduce(request, group)
    if isinstance(request, AllGather):
        outputs = [torch.empty_like(request.tensor) for _ in range(dist.get_world_size(group))]
        work = dist.all_gather(outputs, request.tensor.contiguous(), group=group, async_op=True)
        return then(_work_future(work), lambda _: tuple(outputs))
    if isinstance(request, Broadcast):
        src = dist.get_global_rank(group, request.src)
        work = dist.broadcast(request.tensor, src=src, group=group, async_op=True)
        return then(_work_future(work), lambda _: (request.tensor,))
    if isinstance(request, Reduce):
        dst = dist.get_global_rank(group, request.dst)
        work = dist.reduce(request.tensor, dst=dst, group=group, async_op=True)
        return then(_work_future(work), lambda _: (request.tensor,))
    return _gather_segments(request, group)


def issue(
    request: Step, group: Any, purpose: str = "a collective"
) -> torch.futures.Future[Response]:
    """Start the collective ``request`` asks for; the future yields its response.

    The tensors of an :class:`~zerofn.comm.AllReduce` travel in one message
    when they share a dtype (one collective, one round trip), else one
    message per dtype.

    Args:
        request: the collective, or an :class:`Await` of a running hook.
        group: the process group.
        purpose: what the collective is for, for the error message.

    Returns:
        The future of the response, or of a
        :class:`zerofn.errors.CollectiveError` if the collective failed on
        this rank (raised by ``wait()``; never a partial result).
    """
    what = f"the DDP hook {request.hook!r}" if isinstance(request, Await) else describe(request)
    # The callback below names the group by this string: holding the group
    # itself could make it the last reference (see describe_group).
    group_name = describe_group(group)
    try:
        started = _start(request, group)
    except Exception as e:  # a transport that fails at once, when posting
        return failed(_collective_error(what, purpose, group_name, e))
    out: torch.futures.Future[Response] = torch.futures.Future()

    def done(fut: torch.futures.Future[Response]) -> None:
        try:
            response = fut.value()
        except CollectiveError as e:  # an awaited hook's own: it names what failed
            out.set_exception(e)  # type: ignore[arg-type]
        except Exception as e:
            error = _collective_error(what, purpose, group_name, e)
            out.set_exception(error)  # type: ignore[arg-type]
        else:
            out.set_result(response)

    started.add_done_callback(done)
    return out


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
    number = 0
    try:
        request = next(program)
        while not request.last:
            response = issue(request, group, f"{purpose}, collective #{number}").wait()
            number += 1
            request = program.send(response)
    except StopIteration as stop:
        done: torch.futures.Future[R] = torch.futures.Future()
        done.set_result(stop.value)
        return done
    except Exception as e:
        program.close()
        return failed(e)

    def finish(response: Response) -> R:
        try:
            program.send(response)
        except StopIteration as stop:
            result: R = stop.value
            return result
        raise RuntimeError(
            f"the communication program for {purpose} made a request after its last one"
        )

    return then(issue(request, group, f"{purpose}, collective #{number}"), finish)


class _Running(Generic[R]):
    """One bucket's program inside a :class:`ProgramPipeline`.

    ``done`` once its last request is issued, or once it failed (a failed
    request, or the program's own error): then :attr:`result` fails with that
    error and the program is never resumed.

    The group is held only while requests remain to issue: once ``done``,
    the pipeline lets go of this record and the last request's completion
    callback may hold it last, on the group's worker thread, where it must
    not be the group's last reference (see :func:`describe_group`).
    """

    def __init__(self, program: Program[R], group: Any, purpose: str) -> None:
        self.program = program
        self.group = group
        self.purpose = purpose
        self.result: torch.futures.Future[R] = torch.futures.Future()
        self.done = False
        self.number = 0
        self.pending: torch.futures.Future[Response] | None = None
        self._step(lambda: next(program))

    def _step(self, resume: Callable[[], Step]) -> None:
        """Resume the program and issue the request it makes next."""
        try:
            request = resume()
        except StopIteration as stop:
            self._issued_all()
            self.result.set_result(stop.value)
            return
        except Exception as e:  # a failed request, or the program's own error
            self._fail(e)
            return
        self.pending = issue(request, self.group, f"{self.purpose}, collective #{self.number}")
        self.number += 1
        if request.last:
            self._issued_all()
            self.pending.add_done_callback(self._complete)

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
        pending = self.pending
        assert pending is not None
        self._step(lambda: self.program.send(pending.wait()))


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


def run_stateless(
    hook: CommHook[None, None], group: Any, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """Run a hook without state on DDP's ``bucket`` in ``group`` (``None``:
    the world); the future, made for DDP (see :func:`for_ddp`), yields the
    reduced flat gradient."""
    group = group if group is not None else dist.group.WORLD
    info = bucket_info(bucket, group)
    _, program = hook.start(bucket.buffer(), info, None, None)
    purpose = f"DDP bucket {info.index} (hook {hook.name!r})"
    return for_ddp(then(drive(program, group, purpose), lambda result: result[0]))


def foreign_hook(
    fn: Callable[[Any, Any], torch.futures.Future[torch.Tensor]],
) -> CommHook[None, None]:
    """A DDP hook the core cannot see into, ``fn(state, bucket)``, as a core
    hook, so combinators (the overlapped ZeRO step) can wrap it.

    The bucket's :attr:`~zerofn.hooks.hook.BucketInfo.handle` must be the pair
    ``(state, bucket)`` DDP passed; ``fn`` starts when the hook starts (in
    bucket order) and its program awaits ``fn``'s future (:class:`Await`).
    Only this module's driver runs such a program.
    """

    name = getattr(fn, "__name__", "hook")

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: None, b: None
    ) -> tuple[None, Program[tuple[torch.Tensor, None]]]:
        running = fn(*bucket.handle)

        def program() -> Program[tuple[torch.Tensor, None]]:
            (reduced,) = yield Await(running, name)  # type: ignore[misc]
            return reduced, None

        return None, program()

    return CommHook(init=lambda: None, start=start, name=name)


class HookCell(Generic[G, B]):
    """A hook's state between calls, and what it takes to advance it safely.

    The adapter's shells (:class:`zerofn_torch.hooks.HookRunner`,
    :class:`zerofn_torch.powersgd.PowerSGDState`, and the overlapped step's
    runner in :mod:`zerofn_torch.overlap`) keep one cell each: every
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
            future of the bucket's reduced flat gradient, made for DDP (see
            :func:`for_ddp`; the cell's state takes the bucket's result when it
            completes).
        """
        before, info, result = self.start(hook, bucket, group, bucket_info(bucket, group))
        return before, info, for_ddp(result)

    def start(
        self, hook: CommHook[G, B], bucket: Any, group: Any, info: BucketInfo
    ) -> tuple[HookState[G, B], BucketInfo, torch.futures.Future[torch.Tensor]]:
        """Like :meth:`run`, with the bucket described by ``info`` (for hooks
        that need more than :func:`bucket_info` reads: parameter indices,
        whether the layout is final), and the future not yet made for DDP:
        it fails with the :class:`zerofn.errors.CollectiveError` itself."""
        with self.lock:
            before = self.state
        # Not under the lock: starting a hook may start another (a DDP hook
        # wrapped by foreign_hook) that blocks on collectives whose callbacks
        # take this lock. Only this thread advances the global state, and
        # callbacks only the buckets' states, so assigning the global part
        # afterwards loses nothing.
        state, program = core.begin_bucket(hook, before, bucket.buffer(), info)
        if info.is_last:
            state = core.finish_iteration(hook, state)
        with self.lock:
            self.state = attrs.evolve(self.state, global_state=state.global_state)

        # The callback runs, and is freed, on the group's worker thread: it
        # holds the cell weakly and the bucket by its index (the bucket's
        # handle may hold DDP's hook state, a process group), so it is never
        # the last reference to a group (see describe_group). A cell that is
        # gone has no state left to record into.
        cell, index = weakref.ref(self), info.index

        def record(result: tuple[torch.Tensor, B]) -> torch.Tensor:
            grad, bucket_state = result
            alive = cell()
            if alive is not None:
                with alive.lock:
                    alive.state = core.finish_bucket(alive.state, index, bucket_state)
            return grad

        purpose = f"DDP bucket {info.index} (hook {hook.name!r})"
        return before, info, then(self.pipeline.run(program, group, info.is_last, purpose), record)
