"""Obeying a step order: the overlapped step's part after a bucket, one program.

After each DDP bucket the overlap hook's state may carry a
:class:`~zerofn.overlap.hook.StepOrder`. :func:`obey_order` is everything a rank
does for it, written once: pick the averaged gradients the order names (all
of them before the plan is fixed, the owned shards after), ask the step's
global questions (a loss scaler's inf/nan check, clipping's norm:
:func:`zerofn.zero.mixed_precision.precision.step_factor_program`), step the local optimizer
(a :class:`StepGradients` handed to the :class:`OverlapBinding` of the
optimizer it drives), and hand back the programs that send the owners'
updates. The adapter's runner (``zerofn_torch.hooks.overlap``) and the
simulated world (:func:`zerofn.testing.overlap.simulate_overlapped_step`)
both run it; they
start the sends as they like (the adapter without waiting, so backward goes
on) and write what arrived with :func:`write_updates` after the last bucket;
or, given the forward's order (``gather_during_forward=True``), run the one
program that sends and writes every piece behind the next forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Program
from zerofn.overlap.ddp_buckets import BucketPlan, BucketShard
from zerofn.overlap.hook import OverlapConfig, OverlapHookState, StepOrder, gradients_to_step
from zerofn.overlap.step import (
    broadcast_differences_from_owners,
    broadcast_from_owners,
    broadcast_in_forward_order,
    send_pieces,
    write_flat,
)
from zerofn.zero.forward_gather import PIECE_NUMEL, ForwardGather, in_forward_order
from zerofn.zero.mixed_precision.masters import Masters
from zerofn.zero.mixed_precision.precision import step_factor_program

__all__ = [
    "Handed",
    "OrderObeyed",
    "OverlapBinding",
    "SendCompressed",
    "Sent",
    "StepChecks",
    "StepGradients",
    "obey_order",
    "step_with_gradients",
    "write_updates",
]

Sent = list[tuple[BucketShard, torch.Tensor]]
"""What an owners' broadcast program returns: each shard another rank owns,
with its parameters' updated values, flat."""

Handed = Mapping[int, tuple[tuple[int, ...], Sequence[torch.Tensor]]]
"""Buckets handed over and not stepped yet: bucket index -> its parameters'
global indices and their averaged gradients, in bucket order."""


@attrs.frozen(eq=False)
class StepGradients:
    """Step the local optimizer now with these gradients; not a collective.

    Attributes:
        grads: global parameter index -> its gradient (the parameters not
            named sit this step out).
        factor: multiply the gradients by this first (a loss scaler's
            unscaling times the clipping coefficient; 1.0 for neither).
        write_back: masters, when kept, are cast into the parameters after
            the step; ``False`` with a compressed exchange once the plan is
            fixed (the parameters move only by the differences sent).
    """

    grads: Mapping[int, torch.Tensor]
    factor: float = 1.0
    write_back: bool = True


@attrs.frozen(eq=False)
class SendCompressed:
    """Send the owners' updates as quantized differences of their masters.

    Attributes:
        quantizer: how differences are coded.
        masters: per global parameter, this rank's exact values of it, or
            ``None`` for one it does not hold; read when a send starts.
    """

    quantizer: BlockQuantizer
    masters: Sequence[torch.Tensor | None]


@attrs.frozen
class StepChecks:
    """The global questions asked before an overlapped step.

    Attributes:
        inv_scale: a loss scaler's ``1 / scale`` (``None``: no scaler).
        max_norm: clip the gradients' 2-norm to this (``None``: no clipping).
        device: where the questions' one-number tensors live.
    """

    inv_scale: float | None = None
    max_norm: float | None = None
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))


@attrs.frozen(eq=False)
class OrderObeyed:
    """What obeying an order left to do.

    Attributes:
        stepped: whether the step was taken (``False`` on every rank alike
            when a loss scaler found inf or nan on some rank).
        sends: per bucket whose owned shards were stepped: its parameters'
            global indices and the program sending its owners' updates
            (none when the binding took them behind the next forward).
        differences: the sends return every shard's decoded difference, to
            add (the rank's own shard too), not the others' values.
    """

    stepped: bool
    sends: tuple[tuple[tuple[int, ...], Program[Sent]], ...] = ()
    differences: bool = False


@attrs.frozen
class OverlapBinding:
    """What the overlap hook may do to the optimizer it drives
    (``zerofn_torch.ZeroRedundancyOptimizer.bind_overlap_hook``; also
    importable from :mod:`zerofn.zero.hook_driven`).

    Attributes:
        step: answer a :class:`StepGradients`: step the local optimizer with
            its gradients; the parameters not named sit out.
        adopt_owners: keep only this rank's parameters (global indices per
            rank) and their state from now on.
        compressed: what compressed sends read (``None``: no compression).
        step_whole: take the optimizer's whole step (its exchange included)
            with these averaged gradients, by global parameter index
            (``None`` with no whole step: ``redundancy=1``).
        forward_order: the forward's first use of each parameter when the
            owners' sends are to travel behind the next forward
            (``gather_during_forward=True``; agreed across ranks, a
            collective the first time), else ``None``.
        behind_forward: hand over those sends' pieces and the program that
            runs them, for the next forward (and every reader of
            parameters) to finish.
    """

    step: Callable[[StepGradients], None]
    adopt_owners: Callable[[Sequence[Sequence[int]]], None]
    compressed: Callable[[], SendCompressed | None]
    step_whole: Callable[[Mapping[int, torch.Tensor]], None] | None = None
    forward_order: Callable[[], Sequence[int | None] | None] = lambda: None
    behind_forward: Callable[[ForwardGather, Program[None]], None] | None = None


def obey_order(
    binding: OverlapBinding,
    state: OverlapHookState[Any],
    config: OverlapConfig,
    order: StepOrder,
    handed: Handed,
    params: Sequence[torch.Tensor],
    checks: StepChecks,
) -> Program[OrderObeyed]:
    """Everything rank ``config.rank`` does for ``order``, through the rank
    ``binding`` drives (the adapter's runner and each simulated rank alike).

    Args:
        binding: the optimizer's handles: its step answers the order's
            :class:`StepGradients`, its sends are compressed and ordered as
            it says, and once the plan is fixed it keeps the rank's share.
        state: the hook's global state when the order was given.
        config: the hook's config.
        order: the order.
        handed: at least the buckets the order names.
        params: every parameter, in the optimizer's order (read by the sends
            when they run: the updated values).
        checks: the loss scaler's and clipping's questions, if any.

    Returns:
        A program: the checks' collectives (none without checks, or while
        every rank holds every gradient; the forward's first uses agreed the
        first time owners send behind it), the local step taken through
        ``binding.step`` unless it is skipped or empty; it returns an
        :class:`OrderObeyed` whose sends are the caller's to run (in the
        order given, on every rank alike). Sends that travel behind the next
        forward are handed to ``binding.behind_forward`` instead, and an
        order's ``reshard`` to ``binding.adopt_owners``, when it ends.

    Raises:
        KeyError: the order names a bucket not in ``handed``.
        ValueError: an order to step owned shards before the plan is fixed.
    """
    # Asked only when owners send: the first time it is a collective.
    first_use = None if order.everywhere else binding.forward_order()
    compressed = binding.compressed()
    grads: dict[int, torch.Tensor] = {}
    for index in order.buckets:
        indices, averaged = handed[index]
        grads |= gradients_to_step(state, config, order, index, indices, averaged)
    skip, factor = yield from step_factor_program(
        list(grads.values()),
        inv_scale=checks.inv_scale,
        max_norm=checks.max_norm,
        device=checks.device,
        shared=order.everywhere,
    )
    if grads and not skip:
        # While every rank steps everything, nothing is sent: the masters'
        # values go into the parameters, the same on every rank.
        write_back = compressed is None or order.everywhere
        binding.step(StepGradients(grads, factor, write_back))
    sends: tuple[tuple[tuple[int, ...], Program[Sent]], ...] = ()
    owners_send = not (skip or order.everywhere)
    if owners_send:
        plan = state.overlap.plan
        assert plan is not None  # gradients_to_step refused an order without one
        buckets = {index: handed[index][0] for index in order.buckets}
        if first_use is not None:
            assert binding.behind_forward is not None
            behind = _sends_behind_forward(
                plan, config.rank, buckets, params, compressed, first_use
            )
            binding.behind_forward(*behind)
        else:
            sends = tuple(
                (indices, _owners_send(plan, config.rank, index, indices, params, compressed))
                for index, indices in buckets.items()
            )
    if order.reshard is not None:
        binding.adopt_owners(order.reshard)
    return OrderObeyed(not skip, sends, owners_send and compressed is not None)


def _sends_behind_forward(
    plan: BucketPlan,
    rank: int,
    buckets: Mapping[int, tuple[int, ...]],
    params: Sequence[torch.Tensor],
    compressed: SendCompressed | None,
    first_use: Sequence[int | None],
) -> tuple[ForwardGather, Program[None]]:
    """The sends of ``buckets`` (bucket index: its parameters' indices) as
    pieces in the forward's order, and the one program that sends them
    (whole shards when compressed: a quantization block spans the shard, so
    the bytes are those of the sends in turn)."""
    numel = None if compressed is not None else PIECE_NUMEL
    gather = in_forward_order(send_pieces(plan, tuple(buckets), buckets, numel), first_use)
    if compressed is None:
        return gather, broadcast_in_forward_order(gather, rank, params)
    codec = compressed.quantizer
    return gather, broadcast_in_forward_order(gather, rank, params, compressed.masters, codec)


def _owners_send(
    plan: BucketPlan,
    rank: int,
    index: int,
    indices: tuple[int, ...],
    params: Sequence[torch.Tensor],
    compressed: SendCompressed | None,
) -> Program[Sent]:
    """The program sending bucket ``index``'s (parameters ``indices``)
    owners' updates: values, or quantized differences of the masters."""
    bucket_params = [params[i] for i in indices]
    if compressed is None:
        return broadcast_from_owners(plan, rank, index, bucket_params)
    masters = [compressed.masters[i] for i in indices]
    return broadcast_differences_from_owners(
        plan, rank, index, bucket_params, masters, compressed.quantizer
    )


def step_with_gradients(
    request: StepGradients,
    params: Sequence[torch.Tensor],
    local: Sequence[torch.Tensor],
    masters: Masters | None,
    step: Callable[[], None],
) -> None:
    """Answer ``request``: run the local optimizer's ``step`` with its
    gradients (times its factor) on the tensors it names; the others sit out.

    With masters, the masters step (gradients upcast first, then multiplied)
    and, if the request writes back, the stepped ones are cast into their
    parameters; their gradients go either way. Without, the local tensors
    step, and the ``.grad`` each had before is put back afterwards.

    Args:
        request: the gradients by global parameter index, the factor, whether
            to write back.
        params: every parameter, by global index.
        local: the local optimizer's tensors, in its order (the parameters
            this rank holds; ignored with masters).
        masters: the master copies, when kept.
        step: the local optimizer's step.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    # Upcast first, then multiplied; out of place: the request's tensors may
    # be views of DDP's buckets.
    grads = {
        i: (g if masters is None else g.to(masters.dtype)) * request.factor
        if request.factor != 1.0
        else g
        for i, g in request.grads.items()
    }
    if masters is not None:
        masters.set_grads([grads.get(index_of[id(p)]) for p in masters.low])
        try:
            step()
        finally:
            if request.write_back:
                masters.write_back(only_stepped=True)
            else:
                masters.drop_grads()
        return
    saved = [p.grad for p in local]
    try:
        for p in local:
            p.grad = grads.get(index_of[id(p)])
        step()
    finally:
        for p, grad in zip(local, saved, strict=True):
            p.grad = grad


def write_updates(
    params: Sequence[torch.Tensor], indices: Sequence[int], sent: Sent, differences: bool = False
) -> None:
    """Write what an owners' broadcast brought into the parameters.

    Args:
        params: every parameter; handed over: written in place.
        indices: the bucket's parameters' global indices, in bucket order.
        sent: what the bucket's broadcast program returned.
        differences: ``sent`` holds decoded differences to add (see
            :class:`OrderObeyed`), not values to copy.
    """
    for shard, flat in sent:
        owned = indices[shard.offset : shard.offset + shard.count]
        write_flat([params[i] for i in owned], flat, differences)
