"""Top-k sparsification: each rank sends only its largest gradient entries.

:func:`top_k` keeps, on each rank, the ``k_fraction`` of the bucket's entries
with the largest magnitudes, and all-gathers their values and positions (one
``uint8`` payload, see :mod:`zerofn.hooks.gather`); every rank adds up the ranks'
sparse contributions and divides by the world size. The entries a rank drops
are lost unless the hook is wrapped in
:func:`zerofn.hooks.error_feedback.error_feedback`, which sends them once they
have grown large enough. The usual composition, in half precision::

    from zerofn.hooks.error_feedback import error_feedback
    from zerofn.hooks.hook import cast
    from zerofn.hooks.sparsify import top_k

    hook = cast(error_feedback(top_k(0.01)), torch.float16)

:mod:`zerofn.hooks.random_k` sends entries at random positions instead, which
every rank draws alike, so only the values travel.
"""

from __future__ import annotations

import math

import torch

from zerofn.hooks.gather import GatherCodec, gather_hook, pack_bytes, unpack_bytes
from zerofn.hooks.hook import CommHook

__all__ = ["kept_count", "top_k", "top_k_codec"]


def kept_count(numel: int, k_fraction: float) -> int:
    """How many of ``numel`` entries :func:`top_k` keeps: ``ceil(k_fraction *
    numel)``, at least one (none of none)."""
    return min(numel, max(1, math.ceil(k_fraction * numel)))


def top_k_codec(k_fraction: float) -> GatherCodec:
    """Encode a gradient as its :func:`kept_count` largest-magnitude entries:
    their values (the gradient's dtype), then their positions (``int32``, or
    ``int64`` for buckets too long for ``int32`` positions).

    Raises:
        ValueError: unless ``0 < k_fraction <= 1``.
    """
    if not 0.0 < k_fraction <= 1.0:
        raise ValueError(f"k_fraction must be in (0, 1], got {k_fraction!r}")

    def encode(grad: torch.Tensor) -> torch.Tensor:
        flat = grad.reshape(-1)
        indices = torch.topk(flat.abs(), kept_count(flat.numel(), k_fraction)).indices
        return pack_bytes([flat[indices], indices.to(_index_dtype(flat.numel()))])

    def decode(payload: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        k = kept_count(grad.numel(), k_fraction)
        index_dtype = _index_dtype(grad.numel())
        values, indices = unpack_bytes(payload, [(grad.dtype, k), (index_dtype, k)])
        dense = torch.zeros(grad.numel(), dtype=grad.dtype, device=grad.device)
        return dense.index_put((indices.long(),), values).view(grad.shape)

    return GatherCodec(encode=encode, decode=decode)


def _index_dtype(numel: int) -> torch.dtype:
    # Half the bytes of int64 for any bucket that int32 can address.
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def top_k(k_fraction: float) -> CommHook[None, None]:
    """A hook that sends the ``k_fraction`` largest-magnitude entries of each
    bucket (values and positions) and averages the ranks' sparse gradients.

    Raises:
        ValueError: unless ``0 < k_fraction <= 1``.
    """
    return gather_hook(top_k_codec(k_fraction), f"top_k({k_fraction})")
