"""Count the collectives a piece of code issues, and estimate the bytes it sends.

For benchmarks, tests and the demo: wrap a training step in
:func:`collective_traffic` and read how many collectives of each kind went out
and how many payload bytes they carried. Only collectives called through the
``torch.distributed`` module are seen (DDP's built-in all-reduce, issued from
C++, is not: register a hook such as ``allreduce_hook`` to count it). A
collective the adapter carries by another one (on gloo, a reduce sent as an
all-to-all, :func:`counted_as`) is counted as what it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
import torch.distributed as dist

__all__ = ["Traffic", "collective_traffic", "counted_as"]

# Bytes a rank sends per payload byte under ring algorithms, N ranks.
_SEND_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_gather": lambda n: float(n - 1),  # the payload is one rank's share
    "all_to_all_single": lambda n: 1.0,  # the payload counted is what leaves the rank
}


@attrs.define
class Traffic:
    """What :func:`collective_traffic` saw.

    Attributes:
        calls: number of calls per collective kind.
        payload_bytes: bytes handed to each kind (one rank's input; for
            ``all_to_all_single``, the part of it that leaves the rank).
    """

    calls: dict[str, int] = attrs.field(factory=dict)
    payload_bytes: dict[str, int] = attrs.field(factory=dict)

    @property
    def total_calls(self) -> int:
        """All collectives counted."""
        return sum(self.calls.values())

    def sent_bytes(self, world_size: int) -> float:
        """Bytes one rank sends, estimated for ring algorithms on ``world_size`` ranks."""
        return sum(_SEND_FACTOR[k](world_size) * b for k, b in self.payload_bytes.items())


def _payload_bytes(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if kind == "all_to_all_single":
        return _leaving_bytes(*args, **kwargs)
    # all_gather(tensor_list, tensor); every other kind takes its tensor first.
    # Callers such as PyTorch's ZeroRedundancyOptimizer pass it as ``tensor=``.
    position = 1 if kind == "all_gather" else 0
    tensor: torch.Tensor = args[position] if len(args) > position else kwargs["tensor"]
    return tensor.numel() * tensor.element_size()


def _leaving_bytes(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    **_: Any,
) -> int:
    """The bytes of ``all_to_all_single``'s input that go to other ranks."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    row = input.numel() // max(1, input.shape[0]) if input.dim() else 1
    own = input_split_sizes[me] * row if input_split_sizes else input.numel() // world
    return (input.numel() - own) * input.element_size()


# Set by counted_as while the collective carrying another is called: what
# that call is counted as (its kind and payload bytes).
_carrying: list[tuple[str, int]] = []


@contextmanager
def counted_as(kind: str, payload_bytes: int) -> Iterator[None]:
    """The one collective called inside the block is counted as ``kind`` with
    ``payload_bytes``: for a collective the adapter carries by another (gloo's
    reduce sent as an all-to-all is still a reduce of the tensor handed over).

    Args:
        kind: the collective counted (a key such as ``"reduce"``).
        payload_bytes: its payload, as that collective's caller hands it.
    """
    _carrying.append((kind, payload_bytes))
    try:
        yield
    finally:
        _carrying.pop()


@contextmanager
def collective_traffic() -> Iterator[Traffic]:
    """Count ``torch.distributed`` collectives issued inside the ``with`` block."""
    traffic = Traffic()
    originals = {kind: getattr(dist, kind) for kind in _SEND_FACTOR}

    def counting(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            what, size = _carrying[-1] if _carrying else (kind, 0)
            if not _carrying:
                size = _payload_bytes(kind, args, kwargs)
            traffic.calls[what] = traffic.calls.get(what, 0) + 1
            traffic.payload_bytes[what] = traffic.payload_bytes.get(what, 0) + size
            return original(*args, **kwargs)

        return counted

    for kind, original in originals.items():
        setattr(dist, kind, counting(kind, original))
    try:
        yield traffic
    finally:
        for kind, original in originals.items():
            setattr(dist, kind, original)
