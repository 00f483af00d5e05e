"""Communication statistics: how many collectives, how many bytes.

:func:`with_stats` wraps any hook and records, per bucket, each collective the
hook asks for and the bytes of this rank's tensors in it (the payload this rank
hands to the collective; what travels on the wire depends on the collective's
algorithm: a ring all-reduce sends about ``2 (N - 1) / N`` times its payload, an
all-gather ``N - 1`` times). :func:`comm_stats` sums the records of a
:class:`zerofn.hooks.hook.HookState` into bytes per iteration.

Why the counts live in the bucket states, not the global state: a request is
known only when the bucket's program makes it, and a program can change only its
own bucket's state (the global state advances in bucket order, in ``start``, so
that buckets finishing in any order never overwrite each other). Summing over
the buckets, as :func:`comm_stats` does, gives the iteration's totals.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import attrs
import torch

from zerofn.comm import (
    CollectiveKind,
    Program,
    Request,
    kind_of,
    recording_requests,
    request_bytes,
)
from zerofn.hooks.hook import BucketInfo, CommHook, HookState, WrappedCall, wrap

__all__ = [
    "CollectiveRecord",
    "CommStats",
    "StatsState",
    "comm_stats",
    "request_bytes",
    "with_stats",
]

G = TypeVar("G")
B = TypeVar("B")


@attrs.frozen
class CollectiveRecord:
    """One collective a hook asked for.

    Attributes:
        kind: the collective's name (see :data:`zerofn.comm.CollectiveKind`).
        nbytes: the bytes of this rank's tensors in the request.
    """

    kind: CollectiveKind
    nbytes: int


@attrs.frozen(eq=False)
class StatsState(Generic[B]):
    """One bucket's state under :func:`with_stats`.

    Attributes:
        collectives: the collectives of the bucket's latest run, in order.
        runs: how many times the bucket has run.
        total_bytes: the bytes requested over all runs.
        inner: the inner hook's state for this bucket.
    """

    collectives: tuple[CollectiveRecord, ...]
    runs: int
    total_bytes: int
    inner: B | None

    @property
    def nbytes(self) -> int:
        """The bytes requested in the latest run."""
        return sum(c.nbytes for c in self.collectives)


@attrs.frozen
class CommStats:
    """A summary of every bucket's :class:`StatsState`.

    Attributes:
        bytes_per_iteration: the bytes requested by the latest run of every
            bucket: one iteration's worth once every bucket has run.
        collectives_per_bucket: ``(bucket index, collectives in its latest run)``,
            by bucket index.
        total_bytes: the bytes requested since the hook state was made.
    """

    bytes_per_iteration: int
    collectives_per_bucket: tuple[tuple[int, int], ...]
    total_bytes: int


def _record(request: Request) -> CollectiveRecord:
    return CollectiveRecord(kind_of(request), request_bytes(request))


def with_stats(inner: CommHook[G, B]) -> CommHook[G, StatsState[B]]:
    """``inner``, recording each bucket's collectives and bytes in its bucket state.

    The requests pass through unchanged (same tensors, same ``last`` flags),
    so wrapping changes no number. Put ``with_stats`` outermost (or only
    inside :func:`zerofn.hooks.hook.cast`, which keeps bucket states as they are)
    for :func:`comm_stats` to find the records.
    """

    def enter(
        grad: torch.Tensor, bucket: BucketInfo, b: StatsState[B] | None
    ) -> tuple[torch.Tensor, B | None]:
        return grad, b.inner if b is not None else None

    def leave(
        inner_program: Program[tuple[torch.Tensor, B]], call: WrappedCall[G, B, StatsState[B]]
    ) -> Program[tuple[torch.Tensor, StatsState[B]]]:
        records: list[CollectiveRecord] = []
        seen = recording_requests(inner_program, lambda request: records.append(_record(request)))
        result, inner_state = yield from seen
        b = call.state
        runs, total = (b.runs, b.total_bytes) if b is not None else (0, 0)
        nbytes = sum(r.nbytes for r in records)
        return result, StatsState(tuple(records), runs + 1, total + nbytes, inner_state)

    return wrap(inner, f"with_stats({inner.name})", enter, leave)


def comm_stats(state: HookState[Any, StatsState[Any]]) -> CommStats:
    """Sum the records in ``state``, the state of a hook made by :func:`with_stats`.

    Raises:
        TypeError: if a bucket's state is not a :class:`StatsState` (the hook
            was not wrapped by :func:`with_stats`, or not outermost).
    """
    buckets = sorted(state.buckets, key=lambda pair: pair[0])
    for index, bucket_state in buckets:
        if not isinstance(bucket_state, StatsState):
            raise TypeError(
                f"bucket {index}'s state is a {type(bucket_state).__name__}, not a StatsState: "
                "wrap the hook in with_stats, outermost"
            )
    return CommStats(
        bytes_per_iteration=sum(s.nbytes for _, s in buckets),
        collectives_per_bucket=tuple((i, len(s.collectives)) for i, s in buckets),
        total_bytes=sum(s.total_bytes for _, s in buckets),
    )
