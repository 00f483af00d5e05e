"""The seed stream of PowerSGD's random ``Q``: PyTorch draws each step's seed
from ``numpy.random.RandomState(random_seed)``; :class:`SeedStream` is that
generator's state as plain values (so a resumed run draws what the
uninterrupted one would have, through a weights-only checkpoint), and
:func:`draw_seed` its transition."""

from __future__ import annotations

import attrs
import numpy as np
import torch

__all__ = ["SeedStream", "draw_seed"]


_SEED_BOUND = 1_000_000_000  # PyTorch draws each step's seed from [0, 1e9)


@attrs.frozen(eq=False)
class SeedStream:
    """The position of the generator that draws each random ``Q``'s seed.

    PyTorch draws the seeds from ``numpy.random.RandomState(random_seed)``;
    this record is that generator's state (``RandomState.get_state()``) as
    plain values, so it round-trips through a weights-only checkpoint.

    Attributes:
        keys: the Mersenne Twister's 624 words (``torch.uint32``).
        pos: the position within ``keys``.
        has_gauss: whether a second Gaussian is cached (numpy's Box-Muller).
        cached_gaussian: that Gaussian.
    """

    keys: torch.Tensor
    pos: int
    has_gauss: int = 0
    cached_gaussian: float = 0.0

    @classmethod
    def from_seed(cls, seed: int) -> SeedStream:
        """The stream ``numpy.random.RandomState(seed)`` starts with."""
        return cls._from_numpy(np.random.RandomState(seed))

    @classmethod
    def _from_numpy(cls, generator: np.random.RandomState) -> SeedStream:
        _, keys, pos, has_gauss, cached = generator.get_state(legacy=True)
        keys_tensor = torch.from_numpy(np.array(keys, dtype=np.uint32, copy=True))
        return cls(keys_tensor, int(pos), int(has_gauss), float(cached))

    def to_numpy(self) -> np.random.RandomState:
        """A new ``numpy.random.RandomState`` at this position."""
        generator = np.random.RandomState()
        keys = self.keys.numpy().astype(np.uint32)
        generator.set_state(("MT19937", keys, self.pos, self.has_gauss, self.cached_gaussian))
        return generator


def draw_seed(stream: SeedStream) -> tuple[int, SeedStream]:
    """The next seed PyTorch's PowerSGD would draw, and the stream after it."""
    generator = stream.to_numpy()
    seed = int(generator.randint(_SEED_BOUND))
    return seed, SeedStream._from_numpy(generator)
