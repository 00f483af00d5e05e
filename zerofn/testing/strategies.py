"""hypothesis strategies for testing sharding logic.

Every strategy here draws plain data (ints, lists, dicts of tensors), never a
process group, so a property over a partition, a bucket assignment or a state
dict runs in one process in milliseconds::

    from hypothesis import given
    from zerofn import greedy_partition
    from zerofn.testing import strategies as zst

    @given(zst.group_sizes(), zst.world_sizes())
    def test_loads_sum_to_total(groups, world_size):
        partition = greedy_partition(groups, world_size)
        assert sum(partition.loads()) == sum(map(sum, groups))

The size strategies favour the cases sharding code gets wrong: zero-element
parameters, many equal sizes (ties decide who owns what), and a few
"embedding-like" parameters far larger than the rest (one tensor heavier than
a rank's fair share).

Importing this module requires hypothesis (the ``test`` extra).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "TIE_PRONE_SIZES",
    "bucket_layouts",
    "bucketed_models",
    "element_counts",
    "group_sizes",
    "optimizer_states",
    "param_sizes",
    "shapes",
    "world_sizes",
]

TIE_PRONE_SIZES: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 64, 128, 256, 768, 1024, 3072)
"""Common parameter sizes (biases, layer norms, small matrices); drawing from a
short list makes equal sizes, and so ties, frequent."""


def _check_range(name: str, low: int, high: int, floor: int = 0) -> None:
    if low < floor or high < low:
        raise ValueError(f"need {floor} <= min <= max for {name}, got min={low}, max={high}")


def world_sizes(min_size: int = 1, max_size: int = 16) -> st.SearchStrategy[int]:
    """World sizes (numbers of ranks).

    Args:
        min_size: smallest world size; at least 1.
        max_size: largest world size.

    Returns:
        A strategy drawing ints in ``[min_size, max_size]``, shrinking to ``min_size``.

    Raises:
        ValueError: if ``1 <= min_size <= max_size`` does not hold.
    """
    _check_range("world sizes", min_size, max_size, floor=1)
    return st.integers(min_size, max_size)


def element_counts(max_numel: int = 4096, *, allow_zero: bool = True) -> st.SearchStrategy[int]:
    """Element counts of ordinary parameters.

    Args:
        max_numel: largest count drawn; at least 1.
        allow_zero: whether zero-element parameters may be drawn.

    Returns:
        A strategy drawing ``0`` (if allowed), a size from
        :data:`TIE_PRONE_SIZES`, or any count in ``[1, max_numel]``.

    Raises:
        ValueError: if ``max_numel < 1``.
    """
    if max_numel < 1:
        raise ValueError(f"max_numel must be at least 1, got {max_numel}")
    common = [n for n in TIE_PRONE_SIZES if n <= max_numel]
    options: list[st.SearchStrategy[int]] = []
    if allow_zero:
        options.append(st.just(0))
    options.append(st.sampled_from(common))
    options.append(st.integers(1, max_numel))
    return st.one_of(options)


def _large_counts(large_numel: int) -> st.SearchStrategy[int]:
    return st.integers(max(1, large_numel // 4), large_numel)


@st.composite
def _grouped_sizes(
    draw: st.DrawFn,
    min_groups: int,
    max_groups: int,
    min_per_group: int,
    max_per_group: int,
    max_numel: int,
    allow_zero: bool,
    max_large: int,
    large_numel: int,
    require_one: bool,
) -> list[list[int]]:
    """Lists of sizes; ``max_large`` large sizes at most over all lists."""
    count = draw(st.integers(min_groups, max_groups))
    ordinary = element_counts(max_numel, allow_zero=allow_zero)
    groups = [
        draw(st.lists(ordinary, min_size=min_per_group, max_size=max_per_group))
        for _ in range(count)
    ]
    if require_one and groups and not any(groups):
        groups[draw(st.integers(0, count - 1))].append(draw(ordinary))
    for _ in range(draw(st.integers(0, max_large))):
        roomy = [g for g, group in enumerate(groups) if len(group) < max_per_group]
        if not roomy:
            break
        group = groups[draw(st.sampled_from(roomy))]
        group.insert(draw(st.integers(0, len(group))), draw(_large_counts(large_numel)))
    return groups


def param_sizes(
    min_len: int = 0,
    max_len: int = 12,
    *,
    max_numel: int = 4096,
    allow_zero: bool = True,
    max_large: int = 2,
    large_numel: int = 1 << 22,
) -> st.SearchStrategy[list[int]]:
    """Element counts of a list of parameters (one param group).

    Args:
        min_len: fewest parameters.
        max_len: most parameters.
        max_numel: largest ordinary size (see :func:`element_counts`).
        allow_zero: whether zero-element parameters may be drawn.
        max_large: most "embedding-like" parameters inserted at random
            positions, each with between ``large_numel // 4`` and
            ``large_numel`` elements.
        large_numel: upper bound of the embedding-like sizes.

    Returns:
        A strategy drawing lists of ``min_len`` to ``max_len`` non-negative ints.

    Raises:
        ValueError: for inconsistent bounds.
    """
    _check_range("param_sizes lengths", min_len, max_len)
    _check_range("max_large", 0, max_large)
    return _grouped_sizes(
        1, 1, min_len, max_len, max_numel, allow_zero, max_large, large_numel, False
    ).map(lambda groups: groups[0])


def group_sizes(
    min_groups: int = 1,
    max_groups: int = 4,
    *,
    max_params_per_group: int = 8,
    allow_empty_groups: bool = True,
    max_numel: int = 4096,
    allow_zero: bool = True,
    max_large: int = 2,
    large_numel: int = 1 << 22,
) -> st.SearchStrategy[list[list[int]]]:
    """Element counts of an optimizer's parameters, per param group.

    There is always at least one parameter overall (an optimizer needs one),
    though a single group may be empty when ``allow_empty_groups``.

    Args:
        min_groups: fewest param groups; at least 1.
        max_groups: most param groups.
        max_params_per_group: most parameters in one group; at least 1.
        allow_empty_groups: whether a group may hold no parameter.
        max_numel: largest ordinary size (see :func:`element_counts`).
        allow_zero: whether zero-element parameters may be drawn.
        max_large: most embedding-like parameters over all groups (see
            :func:`param_sizes`).
        large_numel: upper bound of the embedding-like sizes.

    Returns:
        A strategy drawing ``[[size, ...], ...]``, one inner list per group.

    Raises:
        ValueError: for inconsistent bounds.
    """
    _check_range("group counts", min_groups, max_groups, floor=1)
    _check_range("params per group", 1, max_params_per_group, floor=1)
    _check_range("max_large", 0, max_large)
    return _grouped_sizes(
        min_groups,
        max_groups,
        0 if allow_empty_groups else 1,
        max_params_per_group,
        max_numel,
        allow_zero,
        max_large,
        large_numel,
        True,
    )


def bucket_layouts(
    min_buckets: int = 1,
    max_buckets: int = 6,
    *,
    max_params_per_bucket: int = 6,
    max_numel: int = 4096,
    allow_zero: bool = True,
    max_large: int = 1,
    large_numel: int = 1 << 20,
) -> st.SearchStrategy[list[list[int]]]:
    """Element counts of the parameters of DDP gradient buckets, one
    non-empty inner list per bucket in DDP's bucket order (DDP never makes an
    empty bucket): :func:`group_sizes` with buckets for groups and no empty
    one, its arguments and errors the same."""
    return group_sizes(
        min_buckets,
        max_buckets,
        max_params_per_group=max_params_per_bucket,
        allow_empty_groups=False,
        max_numel=max_numel,
        allow_zero=allow_zero,
        max_large=max_large,
        large_numel=large_numel,
    )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@st.composite
def _shapes_with_numel(
    draw: st.DrawFn, numel: int, min_dims: int, max_dims: int, max_side: int
) -> tuple[int, ...]:
    ndim = draw(st.integers(min_dims, max_dims))
    if numel == 0:
        dims = [draw(st.integers(0, max_side)) for _ in range(ndim)]
        dims[draw(st.integers(0, ndim - 1))] = 0
        return tuple(dims)
    dims = []
    remaining = numel
    for _ in range(ndim - 1):
        side = draw(st.sampled_from(_divisors(remaining)))
        dims.append(side)
        remaining //= side
    if ndim:
        dims.append(remaining)
    return tuple(dims)


def shapes(
    min_dims: int = 0,
    max_dims: int = 4,
    *,
    min_side: int = 0,
    max_side: int = 8,
    numel: int | None = None,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes.

    Args:
        min_dims: fewest dimensions (0 draws scalars too).
        max_dims: most dimensions.
        min_side: smallest length of a dimension (0 allows empty tensors).
        max_side: largest length of a dimension.
        numel: if given, only shapes with exactly this many elements: the
            count is factored over the dimensions, so a side may exceed
            ``max_side`` and ``min_side`` is ignored; a scalar shape ``()`` is
            drawn only for ``numel == 1``.

    Returns:
        A strategy drawing shape tuples.

    Raises:
        ValueError: for inconsistent bounds, or a ``numel`` no shape within
            the dimension bounds can have.
    """
    _check_range("dimensions", min_dims, max_dims)
    if numel is None:
        _check_range("sides", min_side, max_side)
        return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(
            tuple
        )
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    low = min_dims if numel == 1 else max(min_dims, 1)
    if low > max_dims:
        raise ValueError(f"no shape with at most {max_dims} dimensions has {numel} elements")
    return _shapes_with_numel(numel, low, max_dims, max_side)


@st.composite
def _optimizer_states(
    draw: st.DrawFn,
    sizes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype,
    partial: bool,
    max_step: int,
    zero_numel_state: bool,
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    start = 0
    for group in sizes:
        indices = list(range(start, start + len(group)))
        start += len(group)
        if draw(st.booleans()) if partial else True:
            step = float(draw(st.integers(1, max_step)))
            for index, numel in zip(indices, group, strict=True):
                if numel == 0 and not zero_numel_state:
                    continue
                state[index] = {
                    "step": torch.tensor(step),
                    "exp_avg": torch.randn(numel, generator=generator, dtype=dtype),
                    "exp_avg_sq": torch.rand(numel, generator=generator, dtype=dtype),
                }
        param_groups.append(
            {
                "lr": draw(st.sampled_from([1e-3, 1e-2, 0.1]) | st.floats(1e-6, 1.0)),
                "betas": draw(st.sampled_from([(0.9, 0.999), (0.8, 0.99)])),
                "eps": 1e-8,
                "weight_decay": draw(st.sampled_from([0.0, 0.01])),
                "amsgrad": False,
                "params": indices,
            }
        )
    return {"state": state, "param_groups": param_groups}


def optimizer_states(
    group_sizes: Sequence[Sequence[int]],
    *,
    dtype: torch.dtype = torch.float32,
    partial: bool = True,
    max_step: int = 1000,
    zero_numel_state: bool = True,
) -> st.SearchStrategy[dict[str, Any]]:
    """Global optimizer state dicts, in the format of PyTorch's
    ``Optimizer.state_dict()`` for Adam over parameters of the given sizes.

    The result is ``{"state": {index: {"step": tensor(float), "exp_avg":
    tensor(numel), "exp_avg_sq": tensor(numel)}}, "param_groups": [{"lr": ...,
    "betas": ..., "eps": ..., "weight_decay": ..., "amsgrad": False, "params":
    [global indices]}]}``, parameters numbered across groups in order. The
    ``step`` is the same for every parameter of a group (as when the whole
    group steps together), which a flat partition needs to carry it. Tensor
    values come from a seeded generator, so examples replay exactly.

    Args:
        group_sizes: element count of every parameter, per param group, for
            instance drawn from :func:`group_sizes`.
        dtype: dtype of the ``exp_avg`` / ``exp_avg_sq`` tensors.
        partial: whether some groups may have no state (as before their
            first step); a group has state for all its parameters or none.
        max_step: largest step count drawn.
        zero_numel_state: whether zero-element parameters of a group with
            state have (empty) state too, as PyTorch gives them when they
            receive a gradient.

    Returns:
        A strategy drawing state dicts.

    Raises:
        ValueError: for a negative size or ``max_step < 1``.
    """
    frozen = tuple(tuple(int(n) for n in group) for group in group_sizes)
    if any(n < 0 for group in frozen for n in group):
        raise ValueError("parameter sizes must be non-negative")
    if max_step < 1:
        raise ValueError(f"max_step must be at least 1, got {max_step}")
    return _optimizer_states(frozen, dtype, partial, max_step, zero_numel_state)


@st.composite
def _bucketed_models(
    draw: st.DrawFn, max_params: int, max_numel: int, max_buckets: int
) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    sizes = draw(st.lists(st.integers(0, max_numel), min_size=1, max_size=max_params))
    model_shapes = [draw(shapes(max_dims=3, numel=n)) for n in sizes]
    cuts: list[int] = []
    if len(sizes) > 1:
        drawn = st.sets(st.integers(1, len(sizes) - 1), max_size=max_buckets - 1)
        cuts = sorted(draw(drawn))
    bounds = [0, *cuts, len(sizes)]
    order = list(reversed(range(len(sizes))))  # DDP hands buckets over last layer first
    buckets = [order[a:b] for a, b in itertools.pairwise(bounds)]
    return buckets, model_shapes


def bucketed_models(
    max_params: int = 9, max_numel: int = 40, max_buckets: int = 4
) -> st.SearchStrategy[tuple[list[list[int]], list[tuple[int, ...]]]]:
    """A model's parameter shapes and DDP's buckets over them, for the
    overlapped step (:func:`zerofn.testing.overlap.simulate_overlapped_step`).

    Args:
        max_params: most parameters; at least 1.
        max_numel: largest parameter (zero-element ones are drawn too).
        max_buckets: most buckets; at least 1.

    Returns:
        A strategy drawing ``(buckets, shapes)``: each bucket the global
        indices of its parameters, in the order DDP hands them over (the
        last parameters first), every parameter in exactly one bucket.

    Raises:
        ValueError: for inconsistent bounds.
    """
    _check_range("params", 1, max_params, floor=1)
    _check_range("buckets", 1, max_buckets, floor=1)
    return _bucketed_models(max_params, max_numel, max_buckets)
