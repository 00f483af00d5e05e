"""Communication hooks as pure functions over explicit state.

A :class:`CommHook` is a small record of functions, in the spirit of optax's
transformations:

* ``init()`` makes the hook's *global* state (shared by all buckets: an
  iteration count, a random generator's position, statistics);
* ``start(grad, bucket, global_state, bucket_state)`` does the work that must
  happen in bucket order on every rank (drawing random numbers, counting) and
  returns the new global state plus a *program* (see :mod:`zerofn.comm`) that
  communicates and finally returns the averaged gradient and the bucket's new
  state;
* ``end_iteration(global_state)`` runs once after the last bucket of an
  iteration.

Global state advances only in ``start`` and ``end_iteration``, which the
driver calls in bucket order; a bucket's own state only through its program's
result. So buckets whose programs finish in any order never overwrite each
other's updates. :class:`HookState` holds both kinds, and the functions
:func:`begin_bucket`, :func:`finish_bucket` and :func:`finish_iteration` are its
transitions.

Combinators build hooks from hooks, all through :func:`wrap`: :func:`cast`
runs any hook in a lower precision, and
:func:`zerofn.hooks.error_feedback.error_feedback` and
:func:`zerofn.stats.with_stats` are wrappers too. :func:`allreduce_mean` is
the plain averaging hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import torch

from zerofn.comm import AllReduce, Program

__all__ = [
    "BucketInfo",
    "CommHook",
    "HookState",
    "WrappedCall",
    "allreduce_mean",
    "averaged",
    "begin_bucket",
    "cast",
    "finish_bucket",
    "finish_iteration",
    "init_hook_state",
    "noop",
    "stateless",
    "wrap",
]

G = TypeVar("G")
B = TypeVar("B")
W = TypeVar("W")


@attrs.frozen
class BucketInfo:
    """What a hook knows of one DDP bucket besides its flat gradient.

    Attributes:
        index: the bucket's index (DDP's reduction order).
        shapes: shapes of the bucket's gradients, laid out flat in order.
        world_size: number of ranks reducing the bucket.
        is_last: whether this is the iteration's last bucket.
        params: global indices of the bucket's parameters, in bucket order,
            where the runner knows them (the overlapped ZeRO step needs them).
        final: whether the bucket layout is final (DDP rebuilds its buckets
            once, after the first iteration).
        handle: the runner's own object for the bucket (DDP's
            ``GradBucket``), for a hook that lives outside the core; not
            compared.
    """

    index: int
    shapes: tuple[tuple[int, ...], ...]
    world_size: int
    is_last: bool = False
    params: tuple[int, ...] = ()
    final: bool = True
    handle: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def numels(self) -> tuple[int, ...]:
        """Element count of each gradient in the bucket."""
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)


StartFn = Callable[
    [torch.Tensor, BucketInfo, G, B | None], tuple[G, Program[tuple[torch.Tensor, B]]]
]


def _unchanged(state: G) -> G:
    return state


@attrs.frozen
class CommHook(Generic[G, B]):
    """A communication hook: ``init``, ``start`` and ``end_iteration``.

    Attributes:
        init: makes the global state.
        start: ``(grad, bucket, global_state, bucket_state_or_None) ->
            (new_global_state, program)``; the program returns ``(averaged
            flat gradient, new bucket state)``. ``grad`` is the bucket's flat
            gradient; the hook must not write into it (unless it says it
            takes the buffer over, as the overlapped step's reduce-to-owner
            does: DDP's bucket buffer is then the result).
        end_iteration: advances the global state after an iteration's last bucket.
        name: a label for reports.
    """

    init: Callable[[], G]
    start: StartFn[G, B]
    end_iteration: Callable[[G], G] = _unchanged
    name: str = "hook"


@attrs.frozen
class HookState(Generic[G, B]):
    """A hook's whole state: global part plus one entry per bucket seen so far.

    Attributes:
        global_state: the hook's global state.
        buckets: bucket index -> that bucket's state (``None`` before its
            first run). Stored as a tuple of pairs to stay immutable.
    """

    global_state: G
    buckets: tuple[tuple[int, B], ...] = ()

    def bucket(self, index: int) -> B | None:
        """The state of bucket ``index``, or ``None`` if it never ran."""
        return next((state for i, state in self.buckets if i == index), None)


def init_hook_state(hook: CommHook[G, B]) -> HookState[G, B]:
    """A fresh :class:`HookState` for ``hook``."""
    return HookState(hook.init())


def begin_bucket(
    hook: CommHook[G, B], state: HookState[G, B], grad: torch.Tensor, bucket: BucketInfo
) -> tuple[HookState[G, B], Program[tuple[torch.Tensor, B]]]:
    """Start ``hook`` on one bucket: the new state and the bucket's program."""
    global_state, program = hook.start(grad, bucket, state.global_state, state.bucket(bucket.index))
    return attrs.evolve(state, global_state=global_state), program


def finish_bucket(state: HookState[G, B], index: int, bucket_state: B) -> HookState[G, B]:
    """Record bucket ``index``'s new state (from its program's result)."""
    others = tuple((i, s) for i, s in state.buckets if i != index)
    return attrs.evolve(state, buckets=(*others, (index, bucket_state)))


def finish_iteration(hook: CommHook[G, B], state: HookState[G, B]) -> HookState[G, B]:
    """Advance the global state after the iteration's last bucket."""
    return attrs.evolve(state, global_state=hook.end_iteration(state.global_state))


# ----- built-in hooks and combinators ---------------------------------------------


def stateless(
    name: str, program: Callable[[torch.Tensor, BucketInfo], Program[tuple[torch.Tensor, None]]]
) -> CommHook[None, None]:
    """A hook without state: bucket ``(grad, bucket)``'s program is ``program(grad, bucket)``."""

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: None, b: None
    ) -> tuple[None, Program[tuple[torch.Tensor, None]]]:
        return None, program(grad, bucket)

    return CommHook(init=lambda: None, start=start, name=name)


def averaged(grad: torch.Tensor, world_size: int, state: B) -> Program[tuple[torch.Tensor, B]]:
    """Divide by the world size, then sum across ranks (the order PyTorch's
    default hook uses, so the numbers match); ``state`` passes through."""
    (total,) = yield AllReduce((grad / world_size,), "sum", last=True)
    return total, state


def allreduce_mean() -> CommHook[None, None]:
    """Average gradients: divide by the world size, then sum across ranks
    (the order PyTorch's default hook uses, so the numbers match)."""
    return stateless("allreduce", lambda grad, bucket: averaged(grad, bucket.world_size, None))


def noop() -> CommHook[None, None]:
    """Skip communication: each rank keeps its local gradient (for measuring
    what communication costs, never for training)."""

    def program(grad: torch.Tensor, bucket: BucketInfo) -> Program[tuple[torch.Tensor, None]]:
        return grad, None
        yield  # a generator that makes no request

    return stateless("noop", program)


@attrs.frozen
class WrappedCall(Generic[G, B, W]):
    """One bucket's call of a hook made by :func:`wrap`, as the wrapper sees it.

    Attributes:
        grad: the bucket's flat gradient, as the wrapper received it.
        given: what the inner hook was given in its place.
        bucket: the bucket.
        global_state: the global state before the inner hook's ``start``.
        state: the wrapper's state for this bucket (``None`` before its first run).
        inner_state: the inner hook's state for this bucket, as ``enter`` took
            it out of ``state``.
    """

    grad: torch.Tensor
    given: torch.Tensor
    bucket: BucketInfo
    global_state: G
    state: W | None
    inner_state: B | None


def wrap(
    inner: CommHook[G, B],
    name: str,
    enter: Callable[[torch.Tensor, BucketInfo, W | None], tuple[torch.Tensor, B | None]],
    leave: Callable[
        [Program[tuple[torch.Tensor, B]], WrappedCall[G, B, W]], Program[tuple[torch.Tensor, W]]
    ],
) -> CommHook[G, W]:
    """``inner`` inside a wrapper that changes what it is given and what it returns.

    The inner hook keeps its global state, which the wrapper never sees
    change: ``start`` and ``end_iteration`` advance it as ``inner``'s do, in
    bucket order. Only each bucket's input, program and bucket state pass
    through the wrapper.

    Args:
        inner: the wrapped hook.
        name: the new hook's label.
        enter: ``(grad, bucket, wrapper_bucket_state_or_None) -> (given,
            inner_bucket_state_or_None)``, run in ``start``: the gradient
            ``inner`` is given, and its own bucket state taken out of the
            wrapper's.
        leave: ``(inner_program, call) -> program``: the wrapper's program
            around ``inner``'s (``call`` is a :class:`WrappedCall`); it returns
            the result and the wrapper's new bucket state.

    Returns:
        The wrapped hook.
    """

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: G, b: W | None
    ) -> tuple[G, Program[tuple[torch.Tensor, W]]]:
        given, inner_b = enter(grad, bucket, b)
        new_g, inner_program = inner.start(given, bucket, g, inner_b)
        return new_g, leave(inner_program, WrappedCall(grad, given, bucket, g, b, inner_b))

    return CommHook(init=inner.init, start=start, end_iteration=inner.end_iteration, name=name)


def cast(inner: CommHook[G, B], dtype: torch.dtype) -> CommHook[G, B]:
    """Run ``inner`` on the gradient cast to ``dtype``, and cast its result back.

    ``cast(allreduce_mean(), torch.float16)`` is PyTorch's fp16 compression
    hook; ``cast(any_hook, torch.bfloat16)`` is its bf16 wrapper.
    """

    def enter(grad: torch.Tensor, bucket: BucketInfo, b: B | None) -> tuple[torch.Tensor, B | None]:
        return grad.to(dtype), b

    def leave(
        inner_program: Program[tuple[torch.Tensor, B]], call: WrappedCall[G, B, B]
    ) -> Program[tuple[torch.Tensor, B]]:
        result, inner_state = yield from inner_program
        return result.to(call.grad.dtype), inner_state

    return wrap(inner, f"{inner.name}@{str(dtype).removeprefix('torch.')}", enter, leave)
