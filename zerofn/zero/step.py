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
(:mod:`zerofn.zero.shards`); the program's order does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import attrs
import torch

from zerofn.comm import Program, Request, answering
from zerofn.zero.exchange import ExchangeVia, exchange_program
from zerofn.zero.shards import WholeTensorShards

__all__ = ["LocalStep", "StepProgram", "run_zero_step", "zero_step"]

R = TypeVar("R")


@attrs.frozen
class LocalStep:
    """Step the local optimizer on this rank's shard, now.

    Not a collective: the program's runner answers it itself (see
    :func:`zerofn.comm.answering`), with whatever the local step returned
    (the loss, when a closure was given).

    Attributes:
        rank: the rank whose shard to step (the simulated world runs many).
    """

    rank: int


StepProgram = Generator[Request | LocalStep, Any, R]
"""A program that asks for collectives and for local steps."""


def zero_step(
    shards: WholeTensorShards, params: Sequence[torch.Tensor], via: ExchangeVia
) -> StepProgram[Any]:
    """One plain ZeRO step on rank ``shards.rank``.

    Args:
        shards: how this rank holds its shard (the mode's record, with its
            exchange buffers, which are handed over).
        params: every parameter, in the optimizer's order; handed over: the
            other ranks' updates are written into them.
        via: how the exchange moves its bytes.

    Returns:
        A program: one :class:`LocalStep`, then one exchange request per
        buffer; it returns the local step's answer.

    Raises:
        ValueError: (from the exchange) buffers that do not fit the plan.
    """
    shards.refresh(params)
    loss = yield LocalStep(shards.rank)
    shards.pack_own(params)
    yield from exchange_program(shards.plan.layouts, shards.buffers, shards.rank, via)
    shards.unpack_arrived(params)
    return loss


def run_zero_step(
    shards: WholeTensorShards,
    params: Sequence[torch.Tensor],
    via: ExchangeVia,
    local_step: Callable[[LocalStep], Any],
) -> Program[Any]:
    """:func:`zero_step` with its local step answered by ``local_step``: a
    program of collectives only, for a driver or the simulated world."""
    return answering(zero_step(shards, params, via), LocalStep, local_step)
