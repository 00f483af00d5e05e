"""The ZeRO step as one program, the same for the optimizer and the simulated world.

:func:`zero_step` is the whole plain step of ZeRO stage 1 on one rank: bring
the local tensors up to date with the parameters, have the local optimizer
step this rank's shard (a :class:`LocalStep` request, answered by whoever
runs the program with its own optimizer), put the updated shard into the
exchange buffers, exchange every rank's segment
(:func:`zerofn.zero.exchange.exchange_program`), and write what arrived into
the parameters. ``ZeroRedundancyOptimizer.step`` drives it over a process
group, answering :class:`LocalStep` with its local ``torch.optim`` optimizer
(and fp32 masters); :func:`zerofn.testing.zero.simulate_zero_steps` runs the
very same program on simulated ranks, each answering with its own.

Where the parameters are views of the exchange buffers (``bucket_view``) the
packing and unpacking are no-ops of the mode's record
(:mod:`zerofn.zero.shards`); the program's order does not change. With a
compressed exchange (:class:`Compressed`) the local step moves only the
masters, and the exchange sends their quantized difference from the
parameters (:mod:`zerofn.zero.compressed.exchange`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from zerofn.comm import Program, answered_locally
from zerofn.zero.compressed.exchange import CompressedExchange, compressed_exchange_program
from zerofn.zero.exchange import ExchangeCollective, exchange_program
from zerofn.zero.forward_gather import Arrivals, ForwardGather, forward_gather_program
from zerofn.zero.local_step import LocalStep, StepProgram
from zerofn.zero.mixed_precision.masters import Masters
from zerofn.zero.shards import WholeTensorShards

__all__ = [
    "Compressed",
    "LocalStep",
    "StepProgram",
    "finish_masters",
    "run_zero_step",
    "zero_step",
]


@attrs.frozen(eq=False)
class Compressed:
    """What a compressed exchange needs besides the shards.

    Attributes:
        exchange: the payload buffers (:mod:`zerofn.zero.compressed.exchange`).
        masters: the exact values the local optimizer steps, in its order;
            the local step must leave the parameters (the replica) alone.
        in_parts: step the masters a few at a time, each part just before
            the first piece that sends it is encoded, so that the update too
            runs while earlier pieces are on the wire (only for an optimizer
            whose parts give the numbers one whole step gives:
            :func:`zerofn.zero.optimizers.steps_in_parts`).
    """

    exchange: CompressedExchange
    masters: Sequence[torch.Tensor]
    in_parts: bool = False


def finish_masters(masters: Masters | None, compressed: bool) -> None:
    """After the local step: cast the masters into what the exchange sends,
    or, with a compressed exchange, leave that to the exchange (the replica
    moves only by the differences every rank applies). Their gradients go."""
    if masters is None:
        return
    if compressed:
        masters.drop_grads()
    else:
        masters.write_back()


def zero_step(
    shards: WholeTensorShards,
    params: Sequence[torch.Tensor],
    collective: ExchangeCollective,
    compressed: Compressed | None = None,
    in_forward_order: Arrivals | None = None,
) -> StepProgram[Any]:
    """One plain ZeRO step on rank ``shards.rank``.

    Args:
        shards: how this rank holds its shard (the mode's record, with its
            exchange buffers, which are handed over).
        params: every parameter, in the optimizer's order; handed over: the
            other ranks' updates are written into them.
        collective: how the exchange moves its bytes.
        compressed: send quantized differences of the masters instead of the
            updated values (``None``: the exact exchange).
        in_forward_order: the exchange is to travel behind the next
            forward (:mod:`zerofn.zero.forward_gather`). With the exact
            exchange, a :class:`~zerofn.zero.forward_gather.ForwardGather`:
            the segments go piece by piece in its order, each written into
            the parameters as it arrives, instead of one request per buffer.
            With a compressed one, its
            :func:`~zerofn.zero.forward_gather.compressed_arrivals`: the
            pieces keep their own order, and the local step is taken whole
            first (never in parts), so that the step is over when the
            program first waits.

    Returns:
        A program: one :class:`LocalStep`, then one exchange request per
        buffer; it returns the local step's answer. With a compressed
        exchange ``in_parts``, the local steps come in parts between the
        exchange's requests instead, and it returns ``None``.

    Raises:
        ValueError: (from the exchange) buffers that do not fit the plan;
            an exact exchange given no order of pieces.
    """
    gather = in_forward_order if isinstance(in_forward_order, ForwardGather) else None
    if compressed is None and in_forward_order is not None and gather is None:
        raise ValueError("the exact exchange behind the forward needs its pieces' order")
    shards.refresh(params)
    # In parts, the exchange takes the local steps itself, between its requests
    # (they move only the masters: the replica is packed as it is).
    in_parts = compressed is not None and compressed.in_parts and in_forward_order is None
    loss = None if in_parts else (yield LocalStep(shards.rank))
    shards.pack_own(params)
    if compressed is not None:
        yield from compressed_exchange_program(
            shards, params, compressed.masters, compressed.exchange, collective, in_parts
        )
    elif gather is not None:
        yield from forward_gather_program(gather, shards.buffers, shards.rank, shards, params)
    else:
        yield from exchange_program(shards.plan.layouts, shards.buffers, shards.rank, collective)
        shards.unpack_arrived(params)
    return loss


def run_zero_step(
    shards: WholeTensorShards,
    params: Sequence[torch.Tensor],
    collective: ExchangeCollective,
    local_step: Callable[[LocalStep], Any],
    compressed: Compressed | None = None,
    in_forward_order: Arrivals | None = None,
) -> Program[Any]:
    """:func:`zero_step` with its local step answered by ``local_step``: a
    program of collectives only, for a driver or the simulated world."""
    program = zero_step(shards, params, collective, compressed, in_forward_order)
    return answered_locally(program, LocalStep, local_step)
