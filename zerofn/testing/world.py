"""A simulated world: run communication programs for N ranks in one process.

Each collective is a pure reduction over the ranks' payloads, so a hook's
logic (including multi-round ones such as PowerSGD) is testable without
processes, sockets or a process group::

    from zerofn.hooks.hook import allreduce_mean
    from zerofn.testing.world import simulate_iteration

    grads = [[torch.ones(4)], [3 * torch.ones(4)]]      # [rank][bucket]
    outs, states = simulate_iteration(allreduce_mean(), grads)
    # every rank's bucket 0 is now torch.full((4,), 2.0)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import torch

from zerofn.comm import (
    AllGather,
    AllGatherObjects,
    AllReduce,
    AllToAll,
    Broadcast,
    BroadcastObject,
    Collect,
    GatherObjects,
    GatherSegments,
    ObjectRequest,
    Post,
    Program,
    ProgramStep,
    Reduce,
    Request,
    Response,
    describe,
    tensors_of,
)
from zerofn.errors import CollectiveError, PeerLost
from zerofn.hooks.hook import (
    BucketInfo,
    CommHook,
    HookState,
    begin_bucket,
    finish_bucket,
    finish_iteration,
    init_hook_state,
)

__all__ = [
    "CollectiveMismatch",
    "Dropout",
    "fulfil",
    "fulfil_objects",
    "run_programs",
    "simulate_iteration",
]

R = TypeVar("R")
G = TypeVar("G")
B = TypeVar("B")


class CollectiveMismatch(AssertionError):
    """Ranks asked for different collectives at the same point: on a real
    process group this would hang or corrupt data."""


@attrs.frozen
class Dropout:
    """A rank that disappears: rank ``rank`` never makes its request number
    ``at`` (counted from 0 over the whole run), as if its process died there.

    The ranks still running then fail at that collective with a
    :class:`zerofn.errors.CollectiveError` whose cause is a
    :class:`zerofn.errors.PeerLost`: a clear error, never a result.
    """

    rank: int = attrs.field(validator=attrs.validators.ge(0))
    at: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def _signature(request: Request) -> tuple[object, ...]:
    """What every rank's request must agree on at one point of the program."""
    shapes = tuple((t.shape, t.dtype) for t in tensors_of(request))
    if isinstance(request, AllReduce):
        return (AllReduce, request.op, shapes)
    if isinstance(request, Broadcast):
        return (Broadcast, request.src, shapes)
    if isinstance(request, Reduce):
        return (Reduce, request.dst, shapes)
    if isinstance(request, GatherSegments):
        return (GatherSegments, request.collective, shapes)
    if isinstance(request, AllToAll):  # parts may differ in size from rank to rank
        return (AllToAll, len(request.sends), request.sends[0].dtype)
    return (AllGather, shapes)


def _sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(tensors)).sum(dim=0)


def _max(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(tensors)).amax(dim=0)


def fulfil(requests: Sequence[Request]) -> list[Response]:
    """Carry out one collective, as a process group does: the tensors each
    rank handed over are written in place (reduced, received into), and each
    rank's response holds them (an all-gather's are new tensors).

    Raises:
        CollectiveMismatch: if the ranks' requests differ in kind, reduction,
            root, count, shape or dtype.
    """
    first = requests[0]
    for rank, request in enumerate(requests):
        if _signature(request) != _signature(first):
            raise CollectiveMismatch(
                f"rank {rank} asks for {describe(request)} where rank 0 asks for {describe(first)}"
            )
    world = len(requests)
    with torch.no_grad():
        if isinstance(first, AllReduce):
            return _all_reduce(requests, first.op)
        if isinstance(first, Broadcast):
            payload = tensors_of(requests[first.src])[0].clone()
            for request in requests:
                tensors_of(request)[0].copy_(payload)
            return [tensors_of(r) for r in requests]
        if isinstance(first, Reduce):
            total = _sum([tensors_of(r)[0] for r in requests])
            tensors_of(requests[first.dst])[0].copy_(total)
            return [tensors_of(r) for r in requests]
        if isinstance(first, AllToAll):
            return _all_to_all([r for r in requests if isinstance(r, AllToAll)])
        if isinstance(first, GatherSegments):
            filled = [tensors_of(requests[owner])[owner].clone() for owner in range(world)]
            for request in requests:
                for segment, value in zip(tensors_of(request), filled, strict=True):
                    segment.copy_(value)
            return [tensors_of(r) for r in requests]
        gathered = tuple(tensors_of(r)[0].clone() for r in requests)
        return [tuple(t.clone() for t in gathered) for _ in requests]


def _all_to_all(requests: Sequence[AllToAll]) -> list[Response]:
    # Every part read before any is written: a rank may receive into what it sends.
    parts = [[t.clone() for t in r.sends] for r in requests]
    for me, request in enumerate(requests):
        for src, buffer in enumerate(request.receives):
            sent = parts[src][me]
            if buffer.numel() != sent.numel():
                raise CollectiveMismatch(
                    f"rank {me} receives {buffer.numel()} elements from rank {src}, "
                    f"which sends it {sent.numel()}"
                )
    for me, request in enumerate(requests):
        for src, buffer in enumerate(request.receives):
            buffer.copy_(parts[src][me].view_as(buffer))
    return [r.receives for r in requests]


def _all_reduce(requests: Sequence[Request], op: str) -> list[Response]:
    combine = _max if op == "max" else _sum
    count = len(tensors_of(requests[0]))
    reduced = [combine([tensors_of(r)[i] for r in requests]) for i in range(count)]
    if op == "avg":
        reduced = [t / len(requests) for t in reduced]
    for request in requests:
        for tensor, value in zip(tensors_of(request), reduced, strict=True):
            tensor.copy_(value)
    return [tensors_of(r) for r in requests]


def _lost(
    requests: Sequence[ProgramStep | None], drop: Dropout, purpose: str, number: int
) -> CollectiveError:
    asked = next(r for r in requests if r is not None)
    if isinstance(asked, Post | Collect):
        asked = asked.request
    world = len(requests)
    error = CollectiveError(
        describe(asked),
        f"{purpose}, collective #{number}",
        f"the simulated world of {world} ranks",
        f"rank {drop.rank} was dropped before it joined",
    )
    error.__cause__ = PeerLost(f"rank {drop.rank} of {world} disappeared at request {drop.at}")
    return error


def _answer(pending: Sequence[ProgramStep], posted: list[dict[int, Response]]) -> list[Response]:
    """Every rank's response at one point of the programs: a collective is
    carried out (at once, when posted: the simulated bytes take no time),
    a collect answered from what its rank posted."""
    if all(isinstance(p, Collect) for p in pending):
        return [
            posted[rank].pop(id(p.request))
            for rank, p in enumerate(pending)
            if isinstance(p, Collect)
        ]
    if all(isinstance(p, Post) for p in pending):
        requests = [p.request for p in pending if isinstance(p, Post)]
        for rank, (request, response) in enumerate(zip(requests, fulfil(requests), strict=True)):
            posted[rank][id(request)] = response
        return [() for _ in pending]
    if any(isinstance(p, Post | Collect) for p in pending):
        kinds = sorted({type(p).__name__ for p in pending})
        raise CollectiveMismatch(f"at one point the ranks yield different steps: {kinds}")
    objects = [p for p in pending if isinstance(p, ObjectRequest)]
    if objects:
        if len(objects) != len(pending):
            kinds = sorted({type(p).__name__ for p in pending})
            raise CollectiveMismatch(f"at one point the ranks yield different steps: {kinds}")
        return fulfil_objects(objects)
    return fulfil([p for p in pending if not isinstance(p, Post | Collect | ObjectRequest)])


def fulfil_objects(requests: Sequence[ObjectRequest]) -> list[Response]:
    """Carry out one collective of objects: every rank receives copies, as
    pickling gives them (no rank's answer shares a tensor with another's).

    Raises:
        CollectiveMismatch: if the ranks' requests differ in kind or root.
    """
    first = requests[0]
    root = getattr(first, "dst", getattr(first, "src", None))
    for rank, request in enumerate(requests):
        if (
            type(request) is not type(first)
            or getattr(request, "dst", getattr(request, "src", None)) != root
        ):
            raise CollectiveMismatch(
                f"rank {rank} asks for {type(request).__name__} where rank 0 asks for "
                f"{type(first).__name__} (root {root})"
            )
    values = [r.value for r in requests]
    if isinstance(first, AllGatherObjects):
        return [(copy.deepcopy(values),) for _ in requests]
    if isinstance(first, GatherObjects):
        return [(copy.deepcopy(values) if r == first.dst else None,) for r in range(len(requests))]
    assert isinstance(first, BroadcastObject)
    return [(copy.deepcopy(values[first.src]),) for _ in requests]


def _run(
    programs: Sequence[Program[R]], drop: Dropout | None, purpose: str, first: int
) -> tuple[list[R], int]:
    """Drive ``programs`` in lockstep; their results and how many requests
    each rank made. ``first`` is the number of requests made before them."""
    pending: list[ProgramStep | None] = []
    posted: list[dict[int, Response]] = [{} for _ in programs]
    results: list[Any] = [None] * len(programs)

    def resume(rank: int, response: Response | None) -> None:
        program = programs[rank]
        try:
            pending[rank] = next(program) if response is None else program.send(response)
        except StopIteration as stop:
            pending[rank] = None
            results[rank] = stop.value
            if posted[rank]:
                raise CollectiveMismatch(
                    f"rank {rank}'s program returned with {len(posted[rank])} posted "
                    "request(s) never collected"
                ) from None

    for rank in range(len(programs)):
        pending.append(None)
        resume(rank, None)
    number = first
    while any(p is not None for p in pending):
        if any(p is None for p in pending):
            raise CollectiveMismatch("some ranks finished while others still communicate")
        steps = [p for p in pending if p is not None]
        collective = not isinstance(steps[0], Collect)
        if collective and drop is not None and drop.at == number:
            for program in programs:
                program.close()
            raise _lost(pending, drop, purpose, number)
        responses = _answer(steps, posted)
        for rank in range(len(programs)):
            resume(rank, responses[rank])
        number += collective
    return results, number - first


def run_programs(
    programs: Sequence[Program[R]],
    drop: Dropout | None = None,
    purpose: str = "a simulated program",
) -> list[R]:
    """Drive one program per rank in lockstep until all return.

    Args:
        programs: one program per rank.
        drop: a rank to lose at one of its requests (none by default).
        purpose: what the programs are for, for error messages.

    Returns:
        What each rank's program returned.

    Raises:
        CollectiveMismatch: if the ranks disagree on a request or on when to stop.
        zerofn.errors.CollectiveError: ``drop``'s rank disappeared while the
            others were still communicating; every program is closed.
        ValueError: ``drop`` names a rank outside the world.
    """
    _check_drop(drop, len(programs))
    return _run(programs, drop, purpose, 0)[0]


def _check_drop(drop: Dropout | None, world_size: int) -> None:
    if drop is not None and drop.rank >= world_size:
        raise ValueError(f"cannot drop rank {drop.rank} from a world of {world_size} ranks")


def simulate_iteration(
    hook: CommHook[G, B],
    grads: Sequence[Sequence[torch.Tensor]],
    states: Sequence[HookState[G, B]] | None = None,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
    drop: Dropout | None = None,
) -> tuple[list[list[torch.Tensor]], list[HookState[G, B]]]:
    """One training iteration of ``hook`` on every rank.

    Args:
        hook: the hook to run.
        grads: ``grads[rank][bucket]``: each rank's flat bucket gradients.
        states: each rank's hook state (fresh ones when omitted).
        shapes: ``shapes[bucket]``: the gradient shapes in each bucket
            (one flat gradient per bucket when omitted).
        drop: a rank to lose at one of its requests, counted over the whole
            iteration (none by default).

    Returns:
        ``(results[rank][bucket], new_states[rank])``.

    Raises:
        CollectiveMismatch: if the ranks disagree on a request.
        zerofn.errors.CollectiveError: ``drop``'s rank disappeared before the
            iteration's last collective; no rank gets a result.
    """
    _check_drop(drop, len(grads))
    world_size = len(grads)
    current = list(states) if states is not None else [init_hook_state(hook) for _ in grads]
    num_buckets = len(grads[0])
    results: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    made = 0
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
        purpose = f"bucket {index} (hook {hook.name!r})"
        finished, count = _run(programs, drop, purpose, made)
        made += count
        for rank, (out, bucket_state) in enumerate(finished):
            results[rank].append(out)
            current[rank] = finish_bucket(current[rank], index, bucket_state)
    current = [finish_iteration(hook, s) for s in current]
    return results, current
