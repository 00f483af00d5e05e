"""The shipped hypothesis strategies draw what their docstrings promise."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.testing import strategies as zst

SETTINGS = settings(max_examples=draws(100), deadline=None)


def test_zerofn_does_not_import_hypothesis() -> None:
    code = "import sys, zerofn, zerofn.testing; print(sorted(m for m in sys.modules if m.split('.')[0] == 'hypothesis'))"
    child = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert child.stdout.strip() == "[]"


@SETTINGS
@given(zst.world_sizes(2, 5))
def test_world_sizes(world_size: int) -> None:
    assert 2 <= world_size <= 5


@SETTINGS
@given(zst.param_sizes(1, 5, max_numel=100, max_large=2, large_numel=10_000))
def test_param_sizes(sizes: list[int]) -> None:
    assert 1 <= len(sizes) <= 5
    assert all(0 <= n <= 10_000 for n in sizes)
    assert sum(n > 100 for n in sizes) <= 2


@SETTINGS
@given(zst.group_sizes(1, 3, max_params_per_group=4, max_large=1, large_numel=1 << 20))
def test_group_sizes(groups: list[list[int]]) -> None:
    assert 1 <= len(groups) <= 3
    assert all(len(g) <= 4 for g in groups)
    assert sum(map(len, groups)) >= 1
    assert sum(n > 4096 for g in groups for n in g) <= 1


@SETTINGS
@given(zst.group_sizes(allow_empty_groups=False, allow_zero=False))
def test_group_sizes_without_empties(groups: list[list[int]]) -> None:
    assert all(groups) and all(n > 0 for g in groups for n in g)


@SETTINGS
@given(zst.bucket_layouts(2, 4, max_params_per_bucket=3))
def test_bucket_layouts(buckets: list[list[int]]) -> None:
    assert 2 <= len(buckets) <= 4
    assert all(1 <= len(b) <= 3 for b in buckets)


@SETTINGS
@given(zst.shapes(1, 3, min_side=1, max_side=4))
def test_shapes(shape: tuple[int, ...]) -> None:
    assert 1 <= len(shape) <= 3 and all(1 <= s <= 4 for s in shape)


@SETTINGS
@given(
    st.integers(0, 5000).flatmap(lambda n: st.tuples(st.just(n), zst.shapes(max_dims=3, numel=n)))
)
def test_shapes_with_numel(case: tuple[int, tuple[int, ...]]) -> None:
    numel, shape = case
    assert math.prod(shape) == numel
    assert len(shape) <= 3
    assert shape != () or numel == 1


@SETTINGS
@given(
    zst.group_sizes(max_numel=32, large_numel=256).flatmap(
        lambda g: st.tuples(st.just(g), zst.optimizer_states(g))
    )
)
def test_optimizer_states(case: tuple[list[list[int]], dict[str, Any]]) -> None:
    groups, sd = case
    assert set(sd) == {"state", "param_groups"}
    start = 0
    for group, sizes in zip(sd["param_groups"], groups, strict=True):
        assert group["params"] == list(range(start, start + len(sizes)))
        start += len(sizes)
        with_state = [i for i in group["params"] if i in sd["state"]]
        assert with_state in ([], group["params"])  # all or none
        steps = {float(sd["state"][i]["step"]) for i in with_state}
        assert len(steps) <= 1  # uniform within the group
    sizes = [n for g in groups for n in g]
    for index, entry in sd["state"].items():
        assert entry["step"].dim() == 0
        for name in ("exp_avg", "exp_avg_sq"):
            assert entry[name].shape == (sizes[index],)
            assert entry[name].dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda: zst.world_sizes(0, 3),
        lambda: zst.world_sizes(4, 3),
        lambda: zst.element_counts(0),
        lambda: zst.param_sizes(3, 2),
        lambda: zst.group_sizes(0),
        lambda: zst.bucket_layouts(max_params_per_bucket=0),
        lambda: zst.shapes(max_dims=0, numel=4),
        lambda: zst.shapes(numel=-1),
        lambda: zst.optimizer_states([[1, -1]]),
        lambda: zst.optimizer_states([[1]], max_step=0),
    ],
)
def test_bad_arguments_raise_value_error(make: Any) -> None:
    with pytest.raises(ValueError):
        make()
