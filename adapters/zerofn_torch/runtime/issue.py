"""Issuing requests as ``torch.distributed`` collectives.

:func:`issue` starts the collective a request (see :mod:`zerofn.comm`) asks
for and reads its own outcome: a failure (a dead peer, a timeout, a broken
transport) fails the request's future with a
:class:`zerofn.errors.CollectiveError` naming the collective, its purpose and
the group, with the transport's error as its cause. Besides the core's
requests it answers an :class:`~zerofn_torch.runtime.foreign_hooks.Await` of a DDP
hook the core cannot see into.

The collectives it starts, and the callbacks it adds to their futures, go
through the workarounds of :mod:`zerofn_torch.runtime.torch_workarounds`: a
gloo worker thread that finishes a collective must never need the GIL once
the interpreter has begun to finalize (it would abort the process), so each
tensor handed to a collective keeps a second C++ reference (kept for good at
exit), and a collective starts without the Python object backward stashes in
the thread's state.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from zerofn.comm import (
    AllGather,
    AllGatherObjects,
    AllReduce,
    AllToAll,
    Broadcast,
    BroadcastObject,
    GatherObjects,
    GatherSegments,
    ObjectRequest,
    Reduce,
    Request,
    Response,
    describe,
    split_like,
)
from zerofn.errors import CollectiveError
from zerofn_torch.runtime import torch_workarounds
from zerofn_torch.runtime.collective_errors import collective_error, describe_group
from zerofn_torch.runtime.foreign_hooks import Await
from zerofn_torch.runtime.futures import all_of, failed, on_done, then
from zerofn_torch.runtime.traffic import counted_as

__all__ = ["Step", "issue"]


Step = Request | Await | ObjectRequest
"""What a program run by the adapter's driver may yield."""


# What the second references hold, by tensor identity (tests read it).
_GIVEN = torch_workarounds.HELD
atexit.register(torch_workarounds.keep_held_for_good)


def _work_future(
    work: dist.Work | None, given: Iterable[torch.Tensor]
) -> torch.futures.Future[Any]:
    """The future of ``work``, a collective handed the tensors ``given``
    (kept until nothing else holds them)."""
    if work is None:  # a rank outside the group takes no part
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done
    torch_workarounds.hold_second_references(given)
    return work.get_future()


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

        return then(all_of(futures), merge)
    flat = _flatten(request.tensors)
    op = dist.ReduceOp.MAX if request.op == "max" else dist.ReduceOp.SUM
    work = dist.all_reduce(flat, op=op, group=group, async_op=True)
    world = dist.get_world_size(group)

    def unpack(_: Any) -> Response:
        if request.op == "avg":
            flat.div_(world)
        return split_like(flat, request.tensors)

    return then(_work_future(work, (flat,)), unpack)


def _gather_segments(request: GatherSegments, group: Any) -> torch.futures.Future[Response]:
    segments = request.segments
    if request.collective == "all_gather":
        work = dist.all_gather(list(segments), segments[request.rank], group=group, async_op=True)
        return then(_work_future(work, segments), lambda _: segments)
    futures = [
        _work_future(
            dist.broadcast(
                segment, src=dist.get_global_rank(group, owner), group=group, async_op=True
            ),
            (segment,),
        )
        for owner, segment in enumerate(segments)
        if segment.numel() > 0
    ]
    return then(all_of(futures), lambda _: segments)


def _reduce(request: Reduce, group: Any) -> torch.futures.Future[Response]:
    if dist.get_backend(group) != "gloo":
        dst = dist.get_global_rank(group, request.dst)
        work = dist.reduce(request.tensor, dst=dst, group=group, async_op=True)
        return then(_work_future(work, (request.tensor,)), lambda _: (request.tensor,))
    # gloo's reduce moves 2.4 times the tensor's bytes between 2 ranks (more
    # than its all-reduce, 2.0; its reduce-scatter is an all-reduce too); an
    # all-to-all that sends each rank's contribution to the owner alone moves
    # one copy per sender, the least a reduce can move: counted on a loopback,
    # 1.0 times the tensor on 2 ranks. The owner sums what arrived in rank
    # order, the same order every run.
    tensor, owner = request.tensor, request.dst
    world, me = dist.get_world_size(group), dist.get_rank(group)
    numel = tensor.numel()
    sends = [numel if peer == owner and me != owner else 0 for peer in range(world)]
    receives = [numel if me == owner and peer != owner else 0 for peer in range(world)]
    flat = tensor.detach().reshape(-1)
    outgoing = (flat if me != owner else flat[:0]).contiguous()
    inbox = flat.new_empty(sum(receives))
    with counted_as("reduce", numel * tensor.element_size()):
        work = dist.all_to_all_single(
            inbox,
            outgoing,
            output_split_sizes=receives,
            input_split_sizes=sends,
            group=group,
            async_op=True,
        )

    def add(_: Any) -> Response:
        if me == owner and world > 1:
            with torch.no_grad():
                summed = inbox.view(world - 1, numel).sum(0) if world > 2 else inbox
                tensor.add_(summed.view_as(tensor))
        return (tensor,)

    return then(_work_future(work, (inbox, outgoing)), add)


def _all_to_all(request: AllToAll, group: Any) -> torch.futures.Future[Response]:
    sends, receives = request.sends, request.receives
    flat_in = torch.cat([t.detach().reshape(-1) for t in sends])
    flat_out = flat_in.new_empty(sum(t.numel() for t in receives))
    work = dist.all_to_all_single(
        flat_out,
        flat_in,
        output_split_sizes=[t.numel() for t in receives],
        input_split_sizes=[t.numel() for t in sends],
        group=group,
        async_op=True,
    )

    def unpack(_: Any) -> Response:
        with torch.no_grad():
            for buffer, part in zip(receives, split_like(flat_out, receives), strict=True):
                buffer.copy_(part)
        return receives

    return then(_work_future(work, (flat_out, flat_in)), unpack)


def _objects(request: ObjectRequest, group: Any) -> torch.futures.Future[Any]:
    """Run an object collective to completion (PyTorch's are blocking)."""
    out: Any
    if isinstance(request, AllGatherObjects):
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, request.value, group=group)
    elif isinstance(request, GatherObjects):
        mine = dist.get_rank(group) == request.dst
        out = [None] * dist.get_world_size(group) if mine else None
        dst = dist.get_global_rank(group, request.dst)
        dist.gather_object(request.value, out, dst=dst, group=group)
    else:
        box = [request.value]
        src = dist.get_global_rank(group, request.src)
        dist.broadcast_object_list(box, src=src, group=group)
        out = box[0]
    done: torch.futures.Future[Any] = torch.futures.Future()
    done.set_result((out,))
    return done


def _start(request: Step, group: Any) -> torch.futures.Future[Response]:
    if isinstance(request, Await):
        return then(request.future, lambda value: (value,))
    if isinstance(request, GatherObjects | AllGatherObjects | BroadcastObject):
        return _objects(request, group)
    if isinstance(request, AllReduce):
        return _all_reduce(request, group)
    if isinstance(request, AllGather):
        outputs = [torch.empty_like(request.tensor) for _ in range(dist.get_world_size(group))]
        sent = request.tensor.contiguous()
        work = dist.all_gather(outputs, sent, group=group, async_op=True)
        return then(_work_future(work, (*outputs, sent)), lambda _: tuple(outputs))
    if isinstance(request, Broadcast):
        src = dist.get_global_rank(group, request.src)
        work = dist.broadcast(request.tensor, src=src, group=group, async_op=True)
        return then(_work_future(work, (request.tensor,)), lambda _: (request.tensor,))
    if isinstance(request, Reduce):
        return _reduce(request, group)
    if isinstance(request, AllToAll):
        return _all_to_all(request, group)
    return _gather_segments(request, group)


def _describe(request: Step) -> str:
    if isinstance(request, Await):
        return f"the DDP hook {request.hook!r}"
    return describe(request)


def issue(
    request: Step, group: Any, purpose: str = "a collective"
) -> torch.futures.Future[Response]:
    """Start the collective ``request`` asks for; the future yields its response.

    The tensors of an :class:`~zerofn.comm.AllReduce` travel in one message
    when they share a dtype (one collective, one round trip), else one
    message per dtype.

    Args:
        request: the collective, an :class:`~zerofn_torch.runtime.foreign_hooks.Await`
            of a running hook, or a collective of picklable values.
        group: the process group.
        purpose: what the collective is for, for the error message.

    Returns:
        The future of the response, or of a
        :class:`zerofn.errors.CollectiveError` if the collective failed on
        this rank (raised by ``wait()``; never a partial result).
    """
    what = _describe(request)
    # The callback below names the group by this string: holding the group
    # itself could make it the last reference (see describe_group).
    group_name = describe_group(group)
    try:
        with torch_workarounds.without_backward_context():
            started = _start(request, group)
    except Exception as e:  # a transport that fails at once, when posting
        return failed(collective_error(what, purpose, group_name, e))
    out: torch.futures.Future[Response] = torch.futures.Future()

    def done(fut: torch.futures.Future[Response]) -> None:
        try:
            response = fut.value()
        except CollectiveError as e:  # an awaited hook's own: it names what failed
            out.set_exception(e)  # type: ignore[arg-type]
        except Exception as e:
            error = collective_error(what, purpose, group_name, e)
            out.set_exception(error)  # type: ignore[arg-type]
        else:
            out.set_result(response)

    on_done(started, done)
    return out
