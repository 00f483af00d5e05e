"""A simulated world: run communication programs for N ranks in one process.

Each collective is a pure reduction over the ranks' payloads, so a hook's
logic (including multi-round ones such as PowerSGD) is testable without
processes, sockets or a process group::

    from zerofn.hook import allreduce_mean
    from zerofn.testing.world import simulate_iteration

    grads = [[torch.ones(4)], [3 * torch.ones(4)]]      # [rank][bucket]
    outs, states = simulate_iteration(allreduce_mean(), grads)
    # every rank's bucket 0 is now torch.full((4,), 2.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from zerofn.comm import AllGather, AllReduce, Program, Request, Response
from zerofn.hook import (
    BucketInfo,
    CommHook,
    HookState,
    begin_bucket,
    finish_bucket,
    finish_iteration,
    init_hook_state,
)

__all__ = ["CollectiveMismatch", "fulfil", "run_programs", "simulate_iteration"]

R = TypeVar("R")
G = TypeVar("G")
B = TypeVar("B")


class CollectiveMismatch(AssertionError):
    """Ranks asked for different collectives at the same point: on a real
    process group this would hang or corrupt data."""


def fulfil(requests: Sequence[Request]) -> list[Response]:
    """The response each rank would get for its request.

    Raises:
        CollectiveMismatch: if the ranks' requests differ in kind, reduction,
            count, shape or dtype.
    """
    first = requests[0]
    for rank, request in enumerate(requests):
        if type(request) is not type(first):
            raise CollectiveMismatch(f"rank {rank} asks for {type(request).__name__}")
    if isinstance(first, AllReduce):
        reduces = [r for r in requests if isinstance(r, AllReduce)]
        for rank, request in enumerate(reduces):
            shapes = [(t.shape, t.dtype) for t in request.tensors]
            if request.op != first.op or shapes != [(t.shape, t.dtype) for t in first.tensors]:
                raise CollectiveMismatch(f"rank {rank}'s all-reduce differs from rank 0's")
        reduced = []
        for i in range(len(first.tensors)):
            total = torch.stack([r.tensors[i] for r in reduces]).sum(dim=0)
            reduced.append(total / len(reduces) if first.op == "avg" else total)
        return [tuple(t.clone() for t in reduced) for _ in reduces]
    gathers = [r for r in requests if isinstance(r, AllGather)]
    for rank, request in enumerate(gathers):
        if (request.tensor.shape, request.tensor.dtype) != (first.tensor.shape, first.tensor.dtype):
            raise CollectiveMismatch(f"rank {rank}'s all-gather differs from rank 0's")
    gathered = tuple(r.tensor.clone() for r in gathers)
    return [tuple(t.clone() for t in gathered) for _ in gathers]


def run_programs(programs: Sequence[Program[R]]) -> list[R]:
    """Drive one program per rank in lockstep until all return.

    Raises:
        CollectiveMismatch: if the ranks disagree on a request or on when to stop.
    """
    pending: list[Request | None] = []
    results: list[Any] = [None] * len(programs)
    for rank, program in enumerate(programs):
        try:
            pending.append(next(program))
        except StopIteration as stop:
            pending.append(None)
            results[rank] = stop.value
    while any(p is not None for p in pending):
        if any(p is None for p in pending):
            raise CollectiveMismatch("some ranks finished while others still communicate")
        responses = fulfil([p for p in pending if p is not None])
        for rank, program in enumerate(programs):
            try:
                pending[rank] = program.send(responses[rank])
            except StopIteration as stop:
                pending[rank] = None
                results[rank] = stop.value
    return results


def simulate_iteration(
    hook: CommHook[G, B],
    grads: Sequence[Sequence[torch.Tensor]],
    states: Sequence[HookState[G, B]] | None = None,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> tuple[list[list[torch.Tensor]], list[HookState[G, B]]]:
    """One training iteration of ``hook`` on every rank.

    Args:
        hook: the hook to run.
        grads: ``grads[rank][bucket]``: each rank's flat bucket gradients.
        states: each rank's hook state (fresh ones when omitted).
        shapes: ``shapes[bucket]``: the gradient shapes in each bucket
            (one flat gradient per bucket when omitted).

    Returns:
        ``(results[rank][bucket], new_states[rank])``.
    """
    world_size = len(grads)
    current = list(states) if states is not None else [init_hook_state(hook) for _ in grads]
    num_buckets = len(grads[0])
    results: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for index in range(num_buckets):
        bucket_shapes = (
            tuple(tuple(s) for s in shapes[index])
            if shapes is not None
            else ((grads[0][index].numel(),),)
        )
        info = BucketInfo(index, bucket_shapes, world_size, is_last=index == num_buckets - 1)
        programs = []
        for rank in range(world_size):
            current[rank], program = begin_bucket(hook, current[rank], grads[rank][index], info)
            programs.append(program)
        for rank, (out, bucket_state) in enumerate(run_programs(programs)):
            results[rank].append(out)
            current[rank] = finish_bucket(current[rank], index, bucket_state)
    current = [finish_iteration(hook, s) for s in current]
    return results, current
