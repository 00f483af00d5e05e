"""Collectives as data: what a communication program asks the world to do.

A communication hook in zerofn is a *program*: a generator that yields
:data:`Request` records and receives each request's result. The core never
communicates; whoever drives the program fulfils the requests: the adapter
with ``torch.distributed`` collectives, :mod:`zerofn.testing.world` with a pure
reduction over simulated ranks. So one program serves real training and
property tests alike, and every rank issues the same requests in the same
order by construction.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal, TypeAlias, TypeVar

import attrs
import torch

__all__ = ["AllGather", "AllReduce", "Program", "Reduction", "Request", "Response"]

Reduction: TypeAlias = Literal["sum", "avg"]


def _tensors(value: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class AllReduce:
    """Reduce ``tensors`` element-wise across ranks.

    Attributes:
        tensors: this rank's contributions; every rank sends the same shapes
            and dtypes in the same order. They are handed over: the driver may
            reduce them in place, or pack them into one message (they travel
            together: one round trip).
        op: ``"sum"`` or ``"avg"``.
        last: the program's final request: the driver may hand the result to
            the program later (asynchronously) instead of waiting for it.

    The response is the reduced tensors, in order.
    """

    tensors: tuple[torch.Tensor, ...] = attrs.field(converter=_tensors)
    op: Reduction = "sum"
    last: bool = False


@attrs.frozen(eq=False)
class AllGather:
    """Collect ``tensor`` from every rank.

    Attributes:
        tensor: this rank's contribution; same shape and dtype on every rank.
        last: as for :class:`AllReduce`.

    The response is one tensor per rank, in rank order.
    """

    tensor: torch.Tensor
    last: bool = False


Request: TypeAlias = AllReduce | AllGather
"""Any collective a program may ask for."""

Response: TypeAlias = tuple[torch.Tensor, ...]
"""What a program receives back for a request."""

R = TypeVar("R")
Program: TypeAlias = Generator[Request, Response, R]
"""A communication program: yields requests, receives responses, returns ``R``."""
