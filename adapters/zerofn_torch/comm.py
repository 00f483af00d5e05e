"""Driving zerofn's communication programs with ``torch.distributed``.

A program (see :mod:`zerofn.comm`) yields requests; :func:`drive` issues each
as a collective on a process group. Every request but the program's last is
awaited before the next one is computed, so all collectives are issued from
the caller's thread in program order: ranks that call hooks in bucket order
issue identical sequences, whatever order futures complete in. The last
request is left in flight and the program is finished in the future's
callback, so DDP overlaps it with the rest of the backward pass.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zerofn.comm import AllGather, AllReduce, Program, Request, Response

__all__ = ["drive", "issue"]

R = TypeVar("R")


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
