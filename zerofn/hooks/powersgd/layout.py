"""Which gradients of a bucket PowerSGD compresses, and how they are grouped.

Pure functions of shapes and integers (:func:`bucket_layout` is also what
:mod:`zerofn.footprint` counts PowerSGD's payload with).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs

__all__ = [
    "BucketLayout",
    "MatrixPlan",
    "ShapeGroup",
    "bucket_layout",
    "matrix_view",
    "should_compress",
    "square_side",
]


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D shape a gradient is compressed as: first dimension x the rest.

    A 0-dim tensor counts as ``1 x 1`` (never compressed).
    """
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether a ``rows x cols`` matrix is worth sending as rank-``rank`` factors:
    the factors, times ``min_compression_rate``, are still smaller than the matrix."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


@attrs.frozen
class MatrixPlan:
    """How one gradient of a bucket travels.

    Attributes:
        offset: where the gradient starts in the bucket's flat buffer.
        rows: first dimension of its 2-D view.
        cols: product of the other dimensions.
        rank: the factors' rank: ``min(rows, cols, configured rank)``.
        compressed: whether it travels as factors (else as itself).
    """

    offset: int
    rows: int
    cols: int
    rank: int
    compressed: bool

    @property
    def numel(self) -> int:
        """Elements of the gradient."""
        return self.rows * self.cols

    @property
    def factor_numel(self) -> int:
        """Elements of its two factors: ``rank (rows + cols)``."""
        return (self.rows + self.cols) * self.rank

    @property
    def sent_numel(self) -> int:
        """Elements it costs in the all-reduces."""
        return self.factor_numel if self.compressed else self.numel


@attrs.frozen
class ShapeGroup:
    """Compressed matrices of one 2-D shape, computed on as one batch.

    Attributes:
        rows: their rows.
        cols: their columns.
        rank: their factors' rank.
        offsets: where each starts in the bucket's flat buffer, in bucket order.
    """

    rows: int
    cols: int
    rank: int
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of matrices in the group."""
        return len(self.offsets)

    @property
    def adjacent(self) -> bool:
        """Whether the matrices lie back to back in the buffer (then a view
        of the buffer is the batch, no copy needed)."""
        step = self.rows * self.cols
        return all(b - a == step for a, b in zip(self.offsets, self.offsets[1:], strict=False))


@attrs.frozen
class BucketLayout:
    """Where each gradient of a bucket goes.

    Attributes:
        matrices: one plan per gradient, in bucket order.
        groups: the compressed matrices grouped by 2-D shape, groups in order
            of each shape's first appearance. The factors of a bucket are laid
            out group after group, matrix after matrix (PyTorch's order).
    """

    matrices: tuple[MatrixPlan, ...]
    groups: tuple[ShapeGroup, ...]

    @property
    def uncompressed(self) -> tuple[MatrixPlan, ...]:
        """The gradients that travel as they are."""
        return tuple(m for m in self.matrices if not m.compressed)

    @property
    def numel(self) -> int:
        """Elements of the bucket."""
        return sum(m.numel for m in self.matrices)

    @property
    def sent_numel(self) -> int:
        """Elements the bucket costs when compressing."""
        return sum(m.sent_numel for m in self.matrices)

    @property
    def p_numel(self) -> int:
        """Elements of all ``P`` factors."""
        return sum(g.size * g.rows * g.rank for g in self.groups)

    @property
    def q_numel(self) -> int:
        """Elements of all ``Q`` factors."""
        return sum(g.size * g.cols * g.rank for g in self.groups)


@functools.lru_cache(maxsize=256)
def _cached_layout(
    shapes: tuple[tuple[int, ...], ...], rank: int, min_compression_rate: float
) -> BucketLayout:
    matrices = []
    by_shape: dict[tuple[int, int], list[int]] = {}
    offset = 0
    for shape in shapes:
        rows, cols = matrix_view(shape)
        effective_rank = min(rows, cols, rank)
        compressed = should_compress(rows, cols, effective_rank, min_compression_rate)
        matrices.append(MatrixPlan(offset, rows, cols, effective_rank, compressed))
        if compressed:
            by_shape.setdefault((rows, cols), []).append(offset)
        offset += rows * cols
    # Compressed matrices have the full rank (a clipped rank never pays off at
    # a compression rate of at least 1), so one rank serves every group.
    groups = tuple(
        ShapeGroup(rows, cols, min(rows, cols, rank), tuple(offsets))
        for (rows, cols), offsets in by_shape.items()
    )
    return BucketLayout(tuple(matrices), groups)


def bucket_layout(
    shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float
) -> BucketLayout:
    """Which of a bucket's gradients are compressed, and how they are grouped.

    Args:
        shapes: the bucket's gradient shapes, in bucket order.
        rank: the configured approximation rank.
        min_compression_rate: see :class:`PowerSGDConfig`.

    Returns:
        The bucket's :class:`BucketLayout` (cached: buckets repeat every step).
    """
    frozen = tuple(tuple(int(d) for d in s) for s in shapes)
    return _cached_layout(frozen, rank, float(min_compression_rate))


def square_side(numel: int) -> int:
    """The side of the smallest square holding ``numel`` elements
    (``ceil(sqrt(numel))``, exact for any size)."""
    return 0 if numel == 0 else math.isqrt(numel - 1) + 1
