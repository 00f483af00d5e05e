"""Random-k sparsification: every rank sends its entries at the same random
positions, new ones each iteration.

:func:`random_k` keeps :func:`~zerofn.hooks.sparsify.kept_count` entries of
each bucket at positions drawn from the iteration's shared random stream
(:class:`~zerofn.hooks.gather.SharedStream`, seeded from the hook's seed, the
iteration and the bucket index), so every rank picks the same positions
without sending them: the payload is the values alone, half of top-k's for
float32 gradients (whose positions travel as ``int32``). Every rank adds up
the ranks' values at those positions and divides by the world size.

Alone, random-k drops most of every gradient. Wrapped in
:func:`zerofn.hooks.error_feedback.error_feedback`, each entry it skips is
carried over until its position comes up, and positions come up afresh every
iteration, so every entry is sent eventually::

    from zerofn.hooks.error_feedback import error_feedback
    from zerofn.hooks.random_k import random_k

    hook = error_feedback(random_k(0.01, seed=0))

The positions are stratified: the bucket is cut into ``k`` stretches of equal
length (up to one element) and one position is drawn uniformly in each. So
the ``k`` positions are distinct, every entry is chosen with probability
``1 / stretch length`` (about ``k_fraction``) in every iteration, and a draw
costs ``O(k)``, where a random permutation of the bucket would cost ``O(n)``
per bucket and iteration.
"""

from __future__ import annotations

import torch

from zerofn.hooks.gather import (
    SharedRandomCodec,
    StreamState,
    pack_bytes,
    shared_random_hook,
    unpack_bytes,
)
from zerofn.hooks.hook import CommHook
from zerofn.hooks.sparsify import kept_count

__all__ = ["random_k", "random_k_codec", "random_positions"]


def random_positions(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions in ``range(numel)``, one drawn uniformly from
    each of ``k`` consecutive stretches of (nearly) equal length.

    Args:
        numel: the length to draw positions in.
        k: how many positions, ``0 <= k <= numel``.
        generator: where the random numbers come from (a CPU generator).

    Returns:
        An ascending ``int64`` tensor of ``k`` positions, on the CPU.

    Raises:
        ValueError: unless ``0 <= k <= numel``.
    """
    if not 0 <= k <= numel:
        raise ValueError(f"cannot draw {k} distinct positions in {numel}")
    # Stretch j is [bounds[j], bounds[j + 1]): lengths floor or ceil of numel / k.
    bounds = torch.arange(k + 1, dtype=torch.int64) * numel // max(k, 1)
    lengths = bounds[1:] - bounds[:-1]
    uniform = torch.rand(k, generator=generator, dtype=torch.float64)
    # The clamp guards the float product against rounding up to the length.
    offsets = torch.minimum((uniform * lengths).to(torch.int64), lengths - 1)
    return bounds[:-1] + offsets


def random_k_codec(k_fraction: float) -> SharedRandomCodec[torch.Tensor]:
    """Encode a gradient as its values at :func:`random_positions`, drawn from
    the bucket's shared stream; :func:`~zerofn.hooks.sparsify.kept_count`
    of them. The positions are not sent: every rank draws them alike.

    Raises:
        ValueError: unless ``0 < k_fraction <= 1``.
    """
    if not 0.0 < k_fraction <= 1.0:
        raise ValueError(f"k_fraction must be in (0, 1], got {k_fraction!r}")

    def draw(numel: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
        return random_positions(numel, kept_count(numel, k_fraction), generator).to(device)

    def encode(grad: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return pack_bytes([grad.reshape(-1)[positions]])

    def decode(payload: torch.Tensor, grad: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        (values,) = unpack_bytes(payload, [(grad.dtype, positions.numel())])
        dense = torch.zeros(grad.numel(), dtype=grad.dtype, device=grad.device)
        return dense.index_put((positions,), values).view(grad.shape)

    return SharedRandomCodec(draw=draw, encode=encode, decode=decode)


def random_k(k_fraction: float, seed: int = 0) -> CommHook[StreamState, None]:
    """A hook that sends each bucket's entries at ``k_fraction`` of its
    positions, drawn anew every iteration and alike on every rank, and
    averages the ranks' sparse gradients. Wrap it in
    :func:`zerofn.hooks.error_feedback.error_feedback` to train with it.

    Args:
        k_fraction: the share of each bucket's entries sent.
        seed: seeds the positions; runs with the same seed (and the same
            hook state) draw the same positions.

    Raises:
        ValueError: unless ``0 < k_fraction <= 1``; a seed that is not a
            non-negative int.
    """
    return shared_random_hook(random_k_codec(k_fraction), seed, f"random_k({k_fraction})")
