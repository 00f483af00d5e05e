"""PowerSGD gradient compression as pure functions over explicit records.

PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) replaces the
all-reduce of a gradient matrix ``M`` (``n x m``) by the all-reduce of two thin
factors: ``P = M Q`` (``n x r``) and ``Q = M^T P`` (``m x r``), one power
iteration per training step, so each rank sends ``r (n + m)`` numbers instead
of ``n m``. The rounding error is kept locally and added to the next step's
gradient (*error feedback*), and ``Q`` is carried from step to step (*warm
start*), so the approximation tracks the gradients' dominant subspace.

This module expresses PyTorch's ``powerSGD_hook`` and ``batched_powerSGD_hook``
(same configuration, same random draws, the same numbers up to rounding) as
:class:`zerofn.hook.CommHook` records:

* :class:`PowerSGDConfig`: the hyperparameters, validated once;
* :class:`PowerSGDGlobalState`: what all buckets share: the iteration count,
  the position of the seed generator, the compression statistics;
* :class:`PowerSGDBucketState`: what one bucket carries between steps: its
  error-feedback tensor and its warm-start factors;
* :func:`layerwise` and :func:`batched`: the two hooks.

A compressing bucket costs two collectives, not PyTorch's three: the
uncompressed gradients (biases, small matrices) travel in the same all-reduce
as the ``P`` factors, then the ``Q`` factors follow. Same-shape matrices are
multiplied and orthogonalised together, one batched operation per shape.

Checkpoints: :func:`to_state_dict` and :func:`from_state_dict` convert the
state to and from plain tensors, numbers and strings, which
``torch.load(..., weights_only=True)`` accepts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np
import torch

from zerofn.comm import AllReduce, Program
from zerofn.hook import BucketInfo, CommHook, HookState

__all__ = [
    "STATE_DICT_FORMAT",
    "BucketLayout",
    "BucketResult",
    "MatrixPlan",
    "PowerSGDBucketState",
    "PowerSGDConfig",
    "PowerSGDGlobalState",
    "PowerSGDHook",
    "SeedStream",
    "ShapeGroup",
    "batched",
    "bucket_layout",
    "compression_stats",
    "draw_seed",
    "fits_bucket",
    "from_state_dict",
    "init_global_state",
    "layerwise",
    "matrix_view",
    "orthogonalize",
    "random_factors",
    "record_compression",
    "should_compress",
    "square_side",
    "to_state_dict",
]

STATE_DICT_FORMAT = "zerofn.powersgd/1"
"""The ``"format"`` entry of a PowerSGD state dict (bumped on incompatible changes)."""

_SEED_BOUND = 1_000_000_000  # PyTorch draws each step's seed from [0, 1e9)


# ----- configuration -----------------------------------------------------------------


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be non-negative, got {value}")


def _real(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{attribute.name} must be a number, got {value!r}")


def _seed(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _non_negative_int(instance, attribute, value)
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

    matrix_approximation_rank: int = attrs.field(default=1, validator=_positive_int)
    start_powerSGD_iter: int = attrs.field(default=1_000, validator=_non_negative_int)
    min_compression_rate: float = attrs.field(default=2, validator=_real)
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = attrs.field(default=0, validator=_real)
    random_seed: int = attrs.field(default=0, validator=_seed)
    compression_stats_logging_frequency: int = attrs.field(default=10_000, converter=_at_least_one)
    batch_tensors_with_same_shape: bool = False

    def __attrs_post_init__(self) -> None:
        if self.min_compression_rate < 1:
            raise ValueError(
                f"min_compression_rate must be at least 1, got {self.min_compression_rate}: "
                "below 1 a compressed matrix may cost more bytes than the matrix itself"
            )
        if self.orthogonalization_epsilon < 0:
            raise ValueError(
                "orthogonalization_epsilon must be non-negative, "
                f"got {self.orthogonalization_epsilon}"
            )
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(
                "start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on "
                f"(got {self.start_powerSGD_iter}): DDP rebuilds its buckets after the first "
                "iteration, which would invalidate the error and factors kept before"
            )


# ----- state records ------------------------------------------------------------------


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

    def _to_numpy(self) -> np.random.RandomState:
        generator = np.random.RandomState()
        keys = self.keys.numpy().astype(np.uint32)
        generator.set_state(("MT19937", keys, self.pos, self.has_gauss, self.cached_gaussian))
        return generator


def draw_seed(stream: SeedStream) -> tuple[int, SeedStream]:
    """The next seed PyTorch's PowerSGD would draw, and the stream after it."""
    generator = stream._to_numpy()
    seed = int(generator.randint(_SEED_BOUND))
    return seed, SeedStream._from_numpy(generator)


@attrs.frozen(eq=False)
class PowerSGDGlobalState:
    """What all buckets share.

    Attributes:
        iteration: completed training iterations (PyTorch's ``state.iter``).
        seeds: where the seed generator stands.
        numel_before_compression: elements the compressing iterations would
            have sent uncompressed, summed over buckets and iterations.
        numel_after_compression: elements they actually sent.
        next_stats_report: the iteration from which the next statistics
            report is due (moved forward when one is made).
        restored: loaded from a checkpoint, and no iteration has run since.
            A fresh DDP model runs its first iteration on provisional buckets
            and rebuilds them in gradient order afterwards, so a restored
            bucket state may not fit the first iteration's bucket at its
            index: such a bucket is then averaged plainly and keeps its
            state for the rebuilt buckets, instead of being refused.
    """

    iteration: int
    seeds: SeedStream
    numel_before_compression: int = 0
    numel_after_compression: int = 0
    next_stats_report: int = 0
    restored: bool = False


def init_global_state(config: PowerSGDConfig) -> PowerSGDGlobalState:
    """The global state before the first iteration."""
    return PowerSGDGlobalState(iteration=0, seeds=SeedStream.from_seed(config.random_seed))


@attrs.frozen(eq=False)
class PowerSGDBucketState:
    """What one bucket carries from one iteration to the next.

    Attributes:
        shapes: the bucket's gradient shapes when the state was made; a
            bucket with other shapes at the same index cannot use it.
        batched: made by :func:`batched` (whole bucket as one matrix) rather
            than :func:`layerwise`; the two lay out their factors differently.
        error: the local compression error to add to the next gradient (flat;
            for :func:`batched`, padded to a square), or ``None`` without
            error feedback.
        p: the last orthogonalised ``P`` factors, or ``None`` without warm start.
        q: the last averaged ``Q`` factors (the next iteration's starting
            point), or ``None`` without warm start. :func:`layerwise` keeps
            each as one flat tensor, matrices grouped by shape (PyTorch's
            layout); :func:`batched` as a ``side x rank`` matrix.
    """

    shapes: tuple[tuple[int, ...], ...]
    batched: bool
    error: torch.Tensor | None = None
    p: torch.Tensor | None = None
    q: torch.Tensor | None = None


PowerSGDHook: TypeAlias = CommHook[PowerSGDGlobalState, PowerSGDBucketState | None]
"""The type of the hooks :func:`layerwise` and :func:`batched` make."""

BucketResult: TypeAlias = tuple[torch.Tensor, PowerSGDBucketState | None]
"""What a PowerSGD bucket program returns: the averaged flat gradient and the
bucket's new state."""


# ----- which matrices are compressed -------------------------------------------------


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


# ----- statistics ----------------------------------------------------------------------


def record_compression(
    state: PowerSGDGlobalState,
    numel_before: int,
    numel_after: int,
    is_last_bucket: bool,
    config: PowerSGDConfig,
) -> PowerSGDGlobalState:
    """Add one compressed bucket to the statistics.

    After the iteration's last bucket, once a report is due, the next report
    is scheduled ``compression_stats_logging_frequency`` iterations later; a
    driver reports whenever ``next_stats_report`` moves.
    """
    next_report = state.next_stats_report
    if is_last_bucket and state.iteration >= next_report:
        next_report = state.iteration + config.compression_stats_logging_frequency
    return attrs.evolve(
        state,
        numel_before_compression=state.numel_before_compression + numel_before,
        numel_after_compression=state.numel_after_compression + numel_after,
        next_stats_report=next_report,
    )


def compression_stats(state: PowerSGDGlobalState) -> tuple[float, int, int]:
    """``(rate, numel_before, numel_after)`` as PyTorch's ``compression_stats()``:
    the rate is before / after, or 0 before anything was compressed."""
    before, after = state.numel_before_compression, state.numel_after_compression
    rate = before / after if after > 0 else 0.0
    return rate, before, after


# ----- the linear algebra ---------------------------------------------------------------


def _gram_schmidt(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    out = matrices.clone()
    for i in range(out.shape[2]):
        column = out[:, :, i : i + 1]
        # With epsilon 0 an all-zero column gives NaNs, as in PyTorch.
        column /= torch.linalg.vector_norm(column, dim=1, keepdim=True) + epsilon
        if i + 1 < out.shape[2]:
            rest = out[:, :, i + 1 :]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
    return out


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of each matrix in a batch.

    Gram-Schmidt, run on the whole batch at once; for rank above 2 in single
    or double precision, a QR decomposition instead (usually faster there, and
    PyTorch's choice, so the factors match its hook's).

    Args:
        matrices: ``(batch, rows, cols)`` with ``cols <= rows``.
        epsilon: added to each column's norm (Gram-Schmidt only).

    Returns:
        A new tensor of the same shape; the input is left as it is.

    Raises:
        ValueError: if ``matrices`` is not a batch of tall matrices.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"expected a (batch, rows, cols) tensor with cols <= rows, got {tuple(matrices.shape)}"
        )
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        return _gram_schmidt(matrices, epsilon)
    # LAPACK hands Q back column-major; every factor here is row-major (the
    # layout that is flattened, all-reduced and checkpointed).
    q: torch.Tensor = torch.linalg.qr(matrices).Q.contiguous()
    return q


def random_factors(
    layout: BucketLayout,
    seed: int,
    batch_same_shape: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """The random starting ``Q`` of each shape group, as PyTorch draws them.

    PyTorch seeds its CPU generator with ``seed`` and draws one normal tensor
    per matrix, or per shape group when ``batch_same_shape``; the two give
    different numbers, so both orders are reproduced. A private generator
    stands in for the global one, which stays untouched.

    Returns:
        One ``(group size, cols, rank)`` tensor per group, in layout order.
    """
    generator = torch.Generator().manual_seed(seed)
    factors = []
    for group in layout.groups:
        if batch_same_shape:
            draws = [
                torch.randn(group.size, group.cols, group.rank, generator=generator, dtype=dtype)
            ]
        else:
            draws = [
                torch.randn(1, group.cols, group.rank, generator=generator, dtype=dtype)
                for _ in range(group.size)
            ]
        factors.append(torch.cat(draws).to(device))
    return factors


def _project(matrices: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``matrices @ factors`` for a batch of wide-by-thin products (``P = M Q``).

    Computed as ``(factors^T matrices^T)^T``: the same sums, but CPU BLAS
    kernels run this orientation 2 to 4 times faster for a thin ``factors``
    (measured on one MKL thread at rank 4: 0.42 ms instead of 1.3 ms for
    1024 x 1024). The result is a transposed view; reshaping it copies.
    """
    return torch.bmm(factors.transpose(1, 2), matrices.transpose(1, 2)).transpose(1, 2)


def _project_transposed(matrices: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``matrices^T @ factors`` (``Q = M^T P``) as ``(factors^T matrices)^T``,
    4 to 12 times faster on CPU than the product as written."""
    return torch.bmm(factors.transpose(1, 2), matrices).transpose(1, 2)


def _split_factors(
    flat: torch.Tensor, layout: BucketLayout, side: Literal["p", "q"]
) -> list[torch.Tensor]:
    """Cut a flat ``P`` (``side="p"``) or ``Q`` (``side="q"``) into per-group batches."""
    out = []
    offset = 0
    for group in layout.groups:
        length = group.rows if side == "p" else group.cols
        numel = group.size * length * group.rank
        out.append(flat[offset : offset + numel].view(group.size, length, group.rank))
        offset += numel
    return out


def _flat(batches: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not batches:
        return like.new_empty(0)
    return torch.cat([b.reshape(-1) for b in batches])


def _gather_group(flat: torch.Tensor, group: ShapeGroup) -> torch.Tensor:
    numel = group.rows * group.cols
    if group.adjacent:
        start = group.offsets[0]
        return flat[start : start + group.size * numel].view(group.size, group.rows, group.cols)
    return torch.stack([flat[o : o + numel].view(group.rows, group.cols) for o in group.offsets])


def _gather_uncompressed(flat: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    parts = [flat[m.offset : m.offset + m.numel] for m in layout.uncompressed]
    return torch.cat(parts) if parts else flat.new_empty(0)


def _assemble(
    layout: BucketLayout,
    uncompressed: torch.Tensor,
    ps: Sequence[torch.Tensor],
    qs: Sequence[torch.Tensor],
    like: torch.Tensor,
) -> torch.Tensor:
    """The bucket's flat result: the averaged uncompressed gradients, and each
    compressed matrix decoded as ``P Q^T``."""
    out = torch.empty_like(like)
    offset = 0
    for matrix in layout.uncompressed:
        out[matrix.offset : matrix.offset + matrix.numel] = uncompressed[
            offset : offset + matrix.numel
        ]
        offset += matrix.numel
    for group, p, q in zip(layout.groups, ps, qs, strict=True):
        numel = group.rows * group.cols
        if group.adjacent:
            # Decode straight into the result: the products are the bucket's
            # largest tensors, not worth a second copy.
            start = group.offsets[0]
            target = out[start : start + group.size * numel]
            torch.bmm(p, q.transpose(1, 2), out=target.view(group.size, group.rows, group.cols))
        else:
            decoded = torch.bmm(p, q.transpose(1, 2))
            for offset_in_bucket, matrix in zip(group.offsets, decoded, strict=True):
                out[offset_in_bucket : offset_in_bucket + numel] = matrix.reshape(-1)
    return out


# ----- the hooks --------------------------------------------------------------------------


def fits_bucket(state: PowerSGDBucketState | None, bucket: BucketInfo) -> bool:
    """Whether a bucket state was made for a bucket of these gradient shapes."""
    return state is None or state.shapes == bucket.shapes


def _check_bucket_state(
    state: PowerSGDBucketState | None, bucket: BucketInfo, batched: bool
) -> None:
    if state is None:
        return
    if not fits_bucket(state, bucket):
        raise ValueError(
            f"PowerSGD state for bucket {bucket.index} was made for gradients of shapes "
            f"{list(state.shapes)}, but this bucket holds {list(bucket.shapes)}: is one "
            "PowerSGDState shared by models with different buckets? Give each model its own"
        )
    if state.batched != batched:
        made_by, used_by = ("batched", "layer-wise") if state.batched else ("layer-wise", "batched")
        raise ValueError(
            f"PowerSGD state for bucket {bucket.index} was made by the {made_by} hook and "
            f"cannot be used by the {used_by} one"
        )


def _awaits_rebuilt_buckets(
    state: PowerSGDGlobalState, bucket_state: PowerSGDBucketState | None, bucket: BucketInfo
) -> bool:
    # See PowerSGDGlobalState.restored: a checkpointed state meets DDP's
    # provisional buckets in a fresh model's first iteration.
    return state.restored and not fits_bucket(bucket_state, bucket)


def _averaging(
    grad: torch.Tensor, world_size: int, bucket_state: PowerSGDBucketState | None
) -> Program[BucketResult]:
    """Plain averaging (before compression starts), as PyTorch's default hook:
    divide, then sum. The bucket's state passes through untouched."""
    (total,) = yield AllReduce((grad / world_size,), "sum", last=True)
    return total, bucket_state


def _error_corrected(
    grad: torch.Tensor, state: PowerSGDBucketState | None, config: PowerSGDConfig, owned: bool
) -> torch.Tensor:
    """The matrix to compress: ``grad`` plus the remembered error.

    With error feedback the result is always a tensor of the program's own
    (``grad`` itself only if ``owned``), because the program turns it into the
    new error in place: a bucket-sized allocation fewer per step.
    """
    if not config.use_error_feedback:
        return grad
    if state is not None and state.error is not None:
        return grad.add_(state.error) if owned else grad + state.error
    return grad if owned else grad.clone()


def _uncompressed_this_iteration(
    grad: torch.Tensor,
    bucket: BucketInfo,
    state: PowerSGDGlobalState,
    bucket_state: PowerSGDBucketState | None,
    config: PowerSGDConfig,
    batched: bool,
) -> Program[BucketResult] | None:
    """The plain-averaging program when this bucket is not compressed in this
    iteration (before ``start_powerSGD_iter``, or while a restored state waits
    for DDP's rebuilt buckets); ``None`` when it is.

    Raises:
        ValueError: if ``bucket_state`` does not fit the bucket (see
            :func:`_check_bucket_state`).
    """
    if _awaits_rebuilt_buckets(state, bucket_state, bucket):
        return _averaging(grad, bucket.world_size, bucket_state)
    _check_bucket_state(bucket_state, bucket, batched=batched)
    if state.iteration < config.start_powerSGD_iter:
        return _averaging(grad, bucket.world_size, bucket_state)
    return None


def _needs_random_start(state: PowerSGDBucketState | None, config: PowerSGDConfig) -> bool:
    return not config.warm_start or state is None or state.q is None


def _next_bucket_state(
    bucket: BucketInfo,
    batched: bool,
    config: PowerSGDConfig,
    signal: torch.Tensor,
    result: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
) -> PowerSGDBucketState | None:
    """What the bucket keeps: the error (what ``result`` missed of ``signal``,
    PyTorch's definition: measured against the averaged result) and the factors.

    With error feedback, ``signal`` (the program's own, see
    :func:`_error_corrected`) becomes the error in place; it must not be used
    afterwards.
    """
    if not (config.use_error_feedback or config.warm_start):
        return None
    return PowerSGDBucketState(
        shapes=bucket.shapes,
        batched=batched,
        error=signal.sub_(result) if config.use_error_feedback else None,
        p=p if config.warm_start else None,
        q=q if config.warm_start else None,
    )


def _layerwise_program(
    signal: torch.Tensor,
    layout: BucketLayout,
    initial_qs: list[torch.Tensor],
    bucket: BucketInfo,
    config: PowerSGDConfig,
) -> Program[BucketResult]:
    eps = config.orthogonalization_epsilon
    world_size = bucket.world_size
    matrices = [_gather_group(signal, group) for group in layout.groups]
    qs = [orthogonalize(q, eps) for q in initial_qs]
    ps = [_project(m, q) for m, q in zip(matrices, qs, strict=True)]
    uncompressed = _gather_uncompressed(signal, layout)
    if not layout.groups:
        # Nothing worth compressing: one round trip is enough.
        (summed,) = yield AllReduce((uncompressed,), "sum", last=True)
        out = _assemble(layout, summed / world_size, [], [], signal)
        empty = signal.new_empty(0)
        return out, _next_bucket_state(bucket, False, config, signal, out, empty, empty)
    # Round 1: the uncompressed gradients ride along with the P factors.
    # P is not averaged: orthogonalisation removes the scale anyway.
    summed, p_sum = yield AllReduce((uncompressed, _flat(ps, signal)), "sum")
    ps = [orthogonalize(p, eps) for p in _split_factors(p_sum, layout, "p")]
    qs = [_project_transposed(m, p) for m, p in zip(matrices, ps, strict=True)]
    # Round 2: the Q factors.
    (q_sum,) = yield AllReduce((_flat(qs, signal),), "sum", last=True)
    q_mean = q_sum / world_size
    qs = _split_factors(q_mean, layout, "q")
    out = _assemble(layout, summed / world_size, ps, qs, signal)
    return out, _next_bucket_state(bucket, False, config, signal, out, _flat(ps, signal), q_mean)


def layerwise(config: PowerSGDConfig) -> PowerSGDHook:
    """PowerSGD compressing each gradient matrix on its own (PyTorch's ``powerSGD_hook``).

    Before ``config.start_powerSGD_iter`` iterations have completed, a bucket
    is averaged plainly (one all-reduce). After, its gradients worth
    compressing (see :func:`should_compress`) travel as factors and the rest
    as they are: two all-reduces per bucket, the first carrying the
    uncompressed gradients with the ``P`` factors, the second the ``Q``
    factors (one, if nothing in the bucket is worth compressing).

    Given the same configuration, it draws the same random numbers as
    PyTorch's hook, in the same order, and so computes the same factors, up
    to rounding: the products run in the orientation CPU BLAS is fastest at
    (see :func:`_project`), and same-shape matrices as one batch.

    Args:
        config: the hyperparameters.

    Returns:
        A hook whose programs return the averaged flat gradient and the
        bucket's new :class:`PowerSGDBucketState` (``None`` when neither error
        feedback nor warm start keeps anything).

    Raises:
        ValueError: (from ``start``) if the bucket's state was made for other
            gradient shapes (except in the first iteration after a restore,
            see :attr:`PowerSGDGlobalState.restored`) or by :func:`batched`.
    """

    def start(
        grad: torch.Tensor,
        bucket: BucketInfo,
        state: PowerSGDGlobalState,
        bucket_state: PowerSGDBucketState | None,
    ) -> tuple[PowerSGDGlobalState, Program[BucketResult]]:
        plain = _uncompressed_this_iteration(grad, bucket, state, bucket_state, config, False)
        if plain is not None:
            return state, plain
        layout = bucket_layout(
            bucket.shapes, config.matrix_approximation_rank, config.min_compression_rate
        )
        state = record_compression(state, layout.numel, layout.sent_numel, bucket.is_last, config)
        if _needs_random_start(bucket_state, config):
            # PyTorch draws a seed even for a bucket with nothing to compress.
            seed, seeds = draw_seed(state.seeds)
            state = attrs.evolve(state, seeds=seeds)
            qs = random_factors(
                layout, seed, config.batch_tensors_with_same_shape, grad.dtype, grad.device
            )
        else:
            assert bucket_state is not None and bucket_state.q is not None
            qs = _split_factors(bucket_state.q, layout, "q")
        signal = _error_corrected(grad, bucket_state, config, owned=False)
        return state, _layerwise_program(signal, layout, qs, bucket, config)

    return CommHook(
        init=lambda: init_global_state(config),
        start=start,
        end_iteration=_advance_iteration,
        name="powersgd",
    )


def _advance_iteration(state: PowerSGDGlobalState) -> PowerSGDGlobalState:
    return attrs.evolve(state, iteration=state.iteration + 1, restored=False)


def _batched_program(
    signal: torch.Tensor,
    numel: int,
    initial_q: torch.Tensor,
    bucket: BucketInfo,
    config: PowerSGDConfig,
) -> Program[BucketResult]:
    eps = config.orthogonalization_epsilon
    side = initial_q.shape[0]
    matrix = signal.view(1, side, side)
    q = orthogonalize(initial_q.unsqueeze(0), eps)
    (p_sum,) = yield AllReduce((_project(matrix, q).contiguous(),), "sum")
    p = orthogonalize(p_sum, eps)
    (q_sum,) = yield AllReduce((_project_transposed(matrix, p).contiguous(),), "sum", last=True)
    q_mean = q_sum / bucket.world_size
    decoded = torch.bmm(p, q_mean.transpose(1, 2)).view(-1)
    # The error covers the padding too, as in PyTorch; the result drops it.
    state = _next_bucket_state(bucket, True, config, signal, decoded, p[0], q_mean[0])
    return decoded[:numel], state


def batched(config: PowerSGDConfig) -> PowerSGDHook:
    """PowerSGD on the whole bucket as one matrix (PyTorch's ``batched_powerSGD_hook``).

    The flat bucket, padded with zeros to ``side * side`` elements (``side =
    ceil(sqrt(numel))``), is compressed as one square matrix: faster than
    :func:`layerwise`, usually less accurate beyond rank 1. Two all-reduces
    per bucket (``P``, then ``Q``). The rank is clipped to ``side`` for tiny
    buckets, where PyTorch's would fail.

    The numbers are those PyTorch's hook was written to compute (PyTorch 2.13's
    own fails on every call: it passes a 2-D ``Q`` to an orthogonalisation that
    only accepts batches), except that ``config.orthogonalization_epsilon`` is
    honoured (PyTorch's batched hook ignores it; with the default 0 they agree).

    Args:
        config: the hyperparameters.

    Returns:
        A hook like :func:`layerwise`'s; its bucket states keep the error
        padded and the factors as ``side x rank`` matrices.

    Raises:
        ValueError: (from ``start``) if the bucket's state was made for other
            gradient shapes (except in the first iteration after a restore,
            see :attr:`PowerSGDGlobalState.restored`) or by :func:`layerwise`.
    """

    def start(
        grad: torch.Tensor,
        bucket: BucketInfo,
        state: PowerSGDGlobalState,
        bucket_state: PowerSGDBucketState | None,
    ) -> tuple[PowerSGDGlobalState, Program[BucketResult]]:
        plain = _uncompressed_this_iteration(grad, bucket, state, bucket_state, config, True)
        if plain is not None:
            return state, plain
        numel = grad.numel()
        side = square_side(numel)
        rank = min(side, config.matrix_approximation_rank)
        state = record_compression(state, numel, 2 * side * rank, bucket.is_last, config)
        if _needs_random_start(bucket_state, config):
            seed, seeds = draw_seed(state.seeds)
            state = attrs.evolve(state, seeds=seeds)
            generator = torch.Generator().manual_seed(seed)
            q = torch.randn(side, rank, generator=generator, dtype=grad.dtype).to(grad.device)
        else:
            assert bucket_state is not None and bucket_state.q is not None
            q = bucket_state.q
        padded = torch.zeros(side * side, dtype=grad.dtype, device=grad.device)
        padded[:numel] = grad
        signal = _error_corrected(padded, bucket_state, config, owned=True)
        return state, _batched_program(signal, numel, q, bucket, config)

    return CommHook(
        init=lambda: init_global_state(config),
        start=start,
        end_iteration=_advance_iteration,
        name="batched_powersgd",
    )


# ----- checkpoints --------------------------------------------------------------------------

_CONFIG_FIELDS = tuple(f.name for f in attrs.fields(PowerSGDConfig))


def to_state_dict(
    config: PowerSGDConfig,
    state: HookState[PowerSGDGlobalState, PowerSGDBucketState | None],
) -> dict[str, Any]:
    """Config and state as tensors, numbers, strings, lists and dicts only
    (loadable with ``torch.load(..., weights_only=True)``).

    Tensors are shared with ``state``, which never changes them in place. The
    seed generator's words are a ``torch.uint32`` tensor, which ``torch.save``
    handles but plain ``pickle`` cannot in PyTorch 2.13; a pickler converts
    them to ``torch.int64`` first (:func:`from_state_dict` takes both).
    """
    g = state.global_state
    buckets: dict[int, dict[str, Any]] = {}
    for index, bucket_state in state.buckets:
        if bucket_state is None:
            continue
        entry: dict[str, Any] = {
            "shapes": [list(s) for s in bucket_state.shapes],
            "batched": bucket_state.batched,
        }
        for name in ("error", "p", "q"):
            value = getattr(bucket_state, name)
            if value is not None:
                entry[name] = value
        buckets[index] = entry
    return {
        "format": STATE_DICT_FORMAT,
        "config": {name: getattr(config, name) for name in _CONFIG_FIELDS},
        "iteration": g.iteration,
        "seeds": {
            "keys": g.seeds.keys,
            "pos": g.seeds.pos,
            "has_gauss": g.seeds.has_gauss,
            "cached_gaussian": g.seeds.cached_gaussian,
        },
        "numel_before_compression": g.numel_before_compression,
        "numel_after_compression": g.numel_after_compression,
        "next_stats_report": g.next_stats_report,
        "buckets": buckets,
    }


def _entry(mapping: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in mapping:
        raise ValueError(f"PowerSGD state dict: {where} lacks {key!r}")
    value = mapping[key]
    if not isinstance(value, kind):
        raise ValueError(f"PowerSGD state dict: {where}{key!r} is a {type(value).__name__}")
    return value


def _optional_tensor(entry: Mapping[str, Any], key: str, where: str) -> torch.Tensor | None:
    if key not in entry:
        return None
    value = _entry(entry, key, torch.Tensor, where)
    assert isinstance(value, torch.Tensor)
    return value.detach().clone()


def _seed_stream(entry: Mapping[str, Any]) -> SeedStream:
    keys = _entry(entry, "keys", torch.Tensor, "seeds ")
    if keys.shape != (624,) or keys.dtype not in (torch.uint32, torch.int64):
        raise ValueError(
            "PowerSGD state dict: seeds 'keys' must be 624 uint32 (or int64) words, "
            f"got {keys.dtype} of shape {tuple(keys.shape)}"
        )
    if keys.dtype == torch.int64 and not bool(((keys >= 0) & (keys < 2**32)).all()):
        raise ValueError("PowerSGD state dict: seeds 'keys' hold values outside 32 bits")
    return SeedStream(
        # int64 words come from pickles (see to_state_dict), stored as uint32 again.
        keys=keys.detach().to(torch.uint32, copy=True),
        pos=int(_entry(entry, "pos", int, "seeds ")),
        has_gauss=int(_entry(entry, "has_gauss", int, "seeds ")),
        cached_gaussian=float(_entry(entry, "cached_gaussian", (int, float), "seeds ")),
    )


def _bucket_state(index: int, entry: Mapping[str, Any]) -> PowerSGDBucketState:
    where = f"bucket {index} "
    shapes = _entry(entry, "shapes", (list, tuple), where)
    return PowerSGDBucketState(
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        batched=bool(_entry(entry, "batched", bool, where)),
        error=_optional_tensor(entry, "error", where),
        p=_optional_tensor(entry, "p", where),
        q=_optional_tensor(entry, "q", where),
    )


def from_state_dict(
    state_dict: Mapping[str, Any],
) -> tuple[PowerSGDConfig, HookState[PowerSGDGlobalState, PowerSGDBucketState | None]]:
    """Config and state from a :func:`to_state_dict` result (tensors are copied).

    Raises:
        ValueError: if the dict is not a PowerSGD state dict of this format,
            lacks an entry, or holds an invalid configuration.
    """
    found = state_dict.get("format") if isinstance(state_dict, Mapping) else None
    if found != STATE_DICT_FORMAT:
        raise ValueError(
            f"not a PowerSGD state dict: format {found!r}, expected {STATE_DICT_FORMAT!r}"
        )
    config_entry = _entry(state_dict, "config", Mapping, "")
    unknown = set(config_entry) - set(_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"PowerSGD state dict: unknown config entries {sorted(unknown)}")
    try:
        config = PowerSGDConfig(**config_entry)
    except TypeError as error:
        raise ValueError(f"PowerSGD state dict: invalid config: {error}") from error
    global_state = PowerSGDGlobalState(
        iteration=int(_entry(state_dict, "iteration", int, "")),
        seeds=_seed_stream(_entry(state_dict, "seeds", Mapping, "")),
        numel_before_compression=int(_entry(state_dict, "numel_before_compression", int, "")),
        numel_after_compression=int(_entry(state_dict, "numel_after_compression", int, "")),
        next_stats_report=int(_entry(state_dict, "next_stats_report", int, "")),
        restored=True,
    )
    buckets_entry = _entry(state_dict, "buckets", Mapping, "")
    buckets = tuple(
        (int(index), _bucket_state(int(index), entry))
        for index, entry in sorted(buckets_entry.items())
    )
    return config, HookState(global_state, buckets)
