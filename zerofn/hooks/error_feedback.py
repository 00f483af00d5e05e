"""Error feedback: what a lossy hook dropped this iteration, it sends the next.

:func:`error_feedback` wraps any hook. Per bucket it remembers an *error*: the
part of its last input that this rank's contribution failed to carry. Before
the inner hook runs, the error is added to the gradient; afterwards the new
error is that sum minus what this rank's contribution decoded to. So a
compressor that rounds or drops small entries delays them instead of losing
them (as in "1-bit SGD" and "Sparsified SGD with memory").

*What this rank's contribution decoded to* is defined without any help from
the inner hook: it is the inner hook's result on this rank's input alone, in a
world of one rank. With one rank that is the hook's real result; with more,
the wrapper computes it by running the inner hook once more on this rank,
without communicating (pure functions make this a replay, not a side effect:
the replay's global state is discarded).

What it guarantees, writing ``g`` for a rank's gradient, ``e`` and ``e'`` for
its error before and after, and ``d`` for the hook's result:

* **One rank:** ``d + e' == g + e``, up to one rounding of the subtraction
  ``e' = (g + e) - d`` (exact when ``d`` and ``g + e`` are within a factor of
  two of each other, or either is zero).
* **Any number of ranks, for hooks that average independently decoded
  contributions** (every :func:`zerofn.hooks.gather.gather_hook`:
  :mod:`zerofn.hooks.quantization`, :func:`zerofn.hooks.sparsify.top_k`):
  ``d + mean(e') == mean(g + e)`` over the ranks, up to rounding: the average
  of what was sent plus what is still owed is the true average.
* **Other hooks** (a low-precision all-reduce, whose sum rounds again; hooks
  whose ranks' contributions interact before decoding): ``e'`` is measured
  against this rank's input decoded alone, so the identity above holds only
  approximately.

The error is kept per bucket in the bucket's state
(:class:`ErrorFeedbackState`), with the bucket's layout. DDP may rebuild its
buckets after the first iteration; a bucket whose layout changed starts again
from zero error (dropping at most one iteration's compression error), because
an error laid out for other gradients would corrupt the new ones.

Hooks that keep the error per parameter instead (PowerSGD, whose error
survives any change of bucket layout) use the two steps on their own:
:func:`compensate` adds each parameter's error to a bucket's gradient, and
:func:`split_residual` cuts the bucket's new error back into parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Generic, TypeVar

import attrs
import torch

from zerofn.comm import (
    AllGather,
    AllGatherObjects,
    AllReduce,
    BroadcastObject,
    Collect,
    GatherObjects,
    ObjectRequest,
    Post,
    Program,
    Request,
    Response,
)
from zerofn.hooks.hook import BucketInfo, CommHook, WrappedCall, wrap

__all__ = ["ErrorFeedbackState", "compensate", "error_feedback", "split_residual"]

G = TypeVar("G")
B = TypeVar("B")
R = TypeVar("R")


@attrs.frozen(eq=False)
class ErrorFeedbackState(Generic[B]):
    """One bucket's state under :func:`error_feedback`.

    Attributes:
        error: what this rank still owes: flat, the bucket gradient's shape and dtype.
        shapes: the layout of the bucket the error belongs to.
        inner: the inner hook's state for this bucket.
    """

    error: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    inner: B | None


def error_feedback(inner: CommHook[G, B]) -> CommHook[G, ErrorFeedbackState[B]]:
    """``inner`` with error feedback: each rank resends what ``inner`` dropped.

    See the module documentation for exactly what is guaranteed. With more
    than one rank, ``inner``'s computation (not its communication) runs twice
    per bucket.
    """

    def enter(
        grad: torch.Tensor, bucket: BucketInfo, b: ErrorFeedbackState[B] | None
    ) -> tuple[torch.Tensor, B | None]:
        return grad + remembered_error(b, grad, bucket), b.inner if b is not None else None

    def leave(
        inner_program: Program[tuple[torch.Tensor, B]],
        call: WrappedCall[G, B, ErrorFeedbackState[B]],
    ) -> Program[tuple[torch.Tensor, ErrorFeedbackState[B]]]:
        compensated, bucket = call.given, call.bucket
        # With more ranks, settle the error before the real run: the driver
        # may reduce that run's request tensors (``compensated`` among them)
        # in place. With one rank, the real run is the run alone.
        error = None
        if bucket.world_size > 1:
            alone = decoded_on_one_rank(
                inner, compensated, bucket, call.global_state, call.inner_state
            )
            error = compensated - alone
        result, inner_state = yield from inner_program
        if error is None:
            error = compensated - result
        return result, ErrorFeedbackState(error, bucket.shapes, inner_state)

    return wrap(inner, f"error_feedback({inner.name})", enter, leave)


def remembered_error(
    state: ErrorFeedbackState[B] | None, grad: torch.Tensor, bucket: BucketInfo
) -> torch.Tensor:
    """The error to add to ``grad``: zero for a new bucket or one whose layout changed."""
    if state is None or state.shapes != bucket.shapes or state.error.shape != grad.shape:
        return torch.zeros_like(grad)
    return state.error.to(grad.dtype)


def decoded_on_one_rank(
    hook: CommHook[G, B], x: torch.Tensor, bucket: BucketInfo, g: G, b: B | None
) -> torch.Tensor:
    """``hook``'s result for input ``x`` in a world of one rank: what ``x``
    decodes to on its own. Pure: no communication, no state kept."""
    _, program = hook.start(x, attrs.evolve(bucket, world_size=1), g, b)
    result, _ = run_alone(program)
    return result


def run_alone(program: Program[R]) -> R:
    """Run ``program`` as the only rank: each collective returns this rank's
    own tensors (copies, so the program may write into them)."""
    posted: dict[int, Response] = {}
    try:
        step = next(program)
        while True:
            if isinstance(step, Post):
                posted[id(step.request)] = _fulfil_alone(step.request)
                step = program.send(())
            elif isinstance(step, Collect):
                step = program.send(posted.pop(id(step.request)))
            else:
                step = program.send(_fulfil_alone(step))
    except StopIteration as stop:
        result: R = stop.value
        return result


def _fulfil_alone(request: Request | ObjectRequest) -> Response:
    # The sum, mean and gather over one rank are that rank's own tensors (values).
    if isinstance(request, AllGatherObjects | GatherObjects):
        return ([copy.deepcopy(request.value)],)
    if isinstance(request, BroadcastObject):
        return (copy.deepcopy(request.value),)
    if isinstance(request, AllGather):
        return (request.tensor.clone(),)
    assert isinstance(request, AllReduce)
    return tuple(t.clone() for t in request.tensors)


# ----- per-parameter error memory ---------------------------------------------------
# The same two steps, for hooks that keep the error per parameter rather than
# per bucket (PowerSGD): the memory then survives any change of bucket layout.


def compensate(
    grad: torch.Tensor,
    errors: Sequence[torch.Tensor | None],
    numels: Sequence[int],
    owned: bool,
) -> torch.Tensor:
    """``grad`` (a bucket's flat gradient) plus its parameters' remembered errors.

    Args:
        grad: the flat gradient, parameters laid out back to back (it may
            extend past them, e.g. padding; that part gets no error).
        errors: one flat error per parameter, in bucket order (``None``: none
            remembered, counts as zero).
        numels: each parameter's element count.
        owned: whether the caller owns ``grad`` (then it is added to in place).

    Returns:
        A tensor the caller owns (``grad`` itself only if ``owned``), so it
        may turn it into the next error in place.
    """
    if all(e is None for e in errors):
        return grad if owned else grad.clone()
    together = _back_to_back(errors, numels, grad)
    if together is not None:  # last step's residual, untouched: no gathering copy
        return grad.add_(together) if owned else grad + together
    parts = [
        e.reshape(-1).to(grad.dtype) if e is not None else grad.new_zeros(n)
        for e, n in zip(errors, numels, strict=True)
    ]
    tail = grad.numel() - sum(numels)
    flat = torch.cat([*parts, grad.new_zeros(tail)] if tail else parts)
    return grad.add_(flat) if owned else grad + flat


def _back_to_back(
    errors: Sequence[torch.Tensor | None], numels: Sequence[int], grad: torch.Tensor
) -> torch.Tensor | None:
    """The errors as one flat view, when they are consecutive slices of one
    tensor covering ``grad`` exactly (what :func:`split_residual` made last
    step, for the same bucket); else ``None``."""
    first = errors[0]
    if first is None or sum(numels) != grad.numel() or first.dtype != grad.dtype:
        return None
    storage, start = first.untyped_storage(), first.storage_offset()
    expected = start
    for e, n in zip(errors, numels, strict=True):
        if (
            e is None
            or e.numel() != n
            or not e.is_contiguous()
            or e.untyped_storage().data_ptr() != storage.data_ptr()
            or e.storage_offset() != expected
        ):
            return None
        expected += n
    return first.as_strided((grad.numel(),), (1,), start)


def split_residual(residual: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
    """Cut a bucket's flat residual (compensated input minus what was
    decoded) into each parameter's new error (views of ``residual``)."""
    return list(torch.split(residual[: sum(numels)], list(numels)))
