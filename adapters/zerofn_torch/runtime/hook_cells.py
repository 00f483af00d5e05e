"""Core hooks run on DDP's buckets.

:func:`bucket_info` reads what the core needs of a DDP ``GradBucket``;
:class:`HookCell` keeps a hook's state between bucket calls and runs each
bucket's program in a :class:`~zerofn_torch.runtime.driver.ProgramPipeline`;
:func:`run_stateless` runs a hook without state, with no cell.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Generic, TypeVar

import attrs
import torch
import torch.distributed as dist

from zerofn.hooks import hook as core
from zerofn.hooks.hook import BucketInfo, CommHook, HookState
from zerofn_torch.runtime.driver import ProgramPipeline, drive
from zerofn_torch.runtime.futures import for_ddp, then
from zerofn_torch.runtime.heartbeat import interruptible

__all__ = ["HookCell", "bucket_info", "run_stateless"]

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


def run_stateless(
    hook: CommHook[None, None], group: Any, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """Run a hook without state on DDP's ``bucket`` in ``group`` (``None``:
    the world); the future, made for DDP (see
    :func:`zerofn_torch.runtime.futures.for_ddp`), yields the reduced flat gradient."""
    group = group if group is not None else dist.group.WORLD
    info = bucket_info(bucket, group)
    _, program = hook.start(bucket.buffer(), info, None, None)
    purpose = f"DDP bucket {info.index} (hook {hook.name!r})"
    return for_ddp(interruptible(then(drive(program, group, purpose), lambda result: result[0])))


class HookCell(Generic[G, B]):
    """A hook's state between calls, and what it takes to advance it safely.

    The adapter's shells (:class:`zerofn_torch.hooks.HookRunner`,
    :class:`zerofn_torch.hooks.powersgd.PowerSGDState`, and the overlapped step's
    runner in :mod:`zerofn_torch.hooks.overlap`) keep one cell each: every
    bucket call reads :attr:`state`, asks the core for the bucket's program,
    runs it in the cell's :class:`~zerofn_torch.runtime.driver.ProgramPipeline` and
    assigns the new state. The lock guards the assignments, because programs
    finish in future callbacks, possibly on other threads.

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
            :func:`zerofn_torch.runtime.futures.for_ddp`; the cell's state takes the
            bucket's result when it completes).
        """
        before, info, result = self.start(hook, bucket, group, bucket_info(bucket, group))
        return before, info, for_ddp(interruptible(result))

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
        # the last reference to a group (see collective_errors.describe_group).
        # A cell that is gone has no state left to record into.
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
