"""PowerSGD's hyperparameters: PyTorch's ``PowerSGDState`` arguments, validated once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["PowerSGDConfig"]

_COSTLIER = ": below 1 a compressed matrix may cost more bytes than the matrix itself"


def _at_least(
    low: int, kind: type[float] = int, why: str = ""
) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """A validator: an int (``kind=int``) or a number (``kind=float``), not
    below ``low`` (``why``: the reason, added to the message)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, kind)):
            noun = "an int" if kind is int else "a number"
            raise TypeError(f"{attribute.name} must be {noun}, got {value!r}")
        if value < low:
            raise ValueError(f"{attribute.name} must be at least {low}, got {value}{why}")

    return check


def _seed(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _at_least(0)(instance, attribute, value)
    if value >= 2**32:  # numpy's RandomState takes 32-bit seeds
        raise ValueError(f"{attribute.name} must be below 2**32, got {value}")


def _at_least_one(value: int) -> int:
    # PyTorch reports statistics at least every iteration, never "every 0".
    return max(1, value)


@attrs.frozen
class PowerSGDConfig:
    """PowerSGD's hyperparameters (PyTorch's ``PowerSGDState`` arguments and defaults).

    Attributes:
        matrix_approximation_rank: the rank ``r`` of the factors; lower
            compresses more. At least 1.
        start_powerSGD_iter: iterations of plain averaging before compression
            starts. At least 2 when error feedback or warm start is on: DDP
            rebuilds its buckets after the first iteration, which would
            invalidate state kept from before.
        min_compression_rate: a matrix is compressed only if this many times
            ``r (n + m)`` is still below ``n m``. At least 1.
        use_error_feedback: add each step's local compression error to the
            next step's gradient.
        warm_start: start each step's power iteration from the previous ``Q``
            instead of a fresh random one.
        orthogonalization_epsilon: added to each column norm while
            orthogonalising, to avoid dividing by zero for all-zero columns.
        random_seed: seed of the generator that draws each random ``Q``'s seed;
            the same on every rank, so the ranks' factors agree.
        compression_stats_logging_frequency: iterations between statistics
            reports (at least 1).
        batch_tensors_with_same_shape: draw the random initial ``Q`` of
            same-shape matrices in one call, as PyTorch does with this flag.
            The arithmetic is batched by shape either way; the flag only
            decides the random numbers, so that they match PyTorch's.

    Raises:
        ValueError: for a rank below 1, a negative start iteration, a start
            iteration below 2 with error feedback or warm start, a compression
            rate below 1, a negative epsilon or a seed outside ``[0, 2**32)``.
        TypeError: for a value of the wrong type.
    """

    matrix_approximation_rank: int = attrs.field(default=1, validator=_at_least(1))
    start_powerSGD_iter: int = attrs.field(default=1_000, validator=_at_least(0))
    min_compression_rate: float = attrs.field(default=2, validator=_at_least(1, float, _COSTLIER))
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = attrs.field(default=0, validator=_at_least(0, float))
    random_seed: int = attrs.field(default=0, validator=_seed)
    compression_stats_logging_frequency: int = attrs.field(default=10_000, converter=_at_least_one)
    batch_tensors_with_same_shape: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(
                "start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on "
                f"(got {self.start_powerSGD_iter}): DDP rebuilds its buckets after the first "
                "iteration, which would invalidate the error and factors kept before"
            )
