"""Round trips of optimizer state through shard / consolidate, across partitions
and world sizes, and the errors for state dicts that do not fit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn import (
    FlatPartition,
    Partition,
    balanced_partition,
    consolidate,
    flat_partition,
    greedy_partition,
    shard,
)
from zerofn.testing import strategies as zst

SETTINGS = settings(max_examples=draws(100), deadline=None)

MAKERS = {"greedy": greedy_partition, "balanced": balanced_partition, "flat": flat_partition}
GROUPS = zst.group_sizes(max_groups=3, max_params_per_group=6, max_numel=24, large_numel=200)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Structural equality of nested dicts / lists / tuples, tensors by torch.equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b) or set(a) == set(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _partition(mode: str, groups: list[list[int]], world_size: int) -> Partition | FlatPartition:
    return MAKERS[mode](groups, world_size)


def _expected(x: dict[str, Any], partition: Partition | FlatPartition) -> dict[str, Any]:
    """What a round trip through ``partition`` must give back: ``x`` itself,
    except that a flat partition has no piece for a zero-element parameter and
    so cannot carry its (empty) state."""
    if not isinstance(partition, FlatPartition):
        return x
    sizes = partition.sizes
    return {
        "state": {i: e for i, e in x["state"].items() if sizes[i] > 0},
        "param_groups": x["param_groups"],
    }


@st.composite
def _case(draw: st.DrawFn) -> tuple[list[list[int]], dict[str, Any]]:
    groups = draw(GROUPS)
    return groups, draw(zst.optimizer_states(groups))


@SETTINGS
@given(
    _case(),
    st.sampled_from(sorted(MAKERS)),
    zst.world_sizes(max_size=6),
)
def test_consolidate_of_shards_is_identity(
    case: tuple[list[list[int]], dict[str, Any]], mode: str, world_size: int
) -> None:
    groups, x = case
    before = copy.deepcopy(x)
    partition = _partition(mode, groups, world_size)
    shards = [shard(partition, x, r) for r in range(world_size)]
    assert_same(x, before)  # shard does not mutate its input
    for sd in shards:
        assert len(sd["param_groups"]) == len(groups)
    assert_same(consolidate(partition, shards), _expected(x, partition))


@SETTINGS
@given(
    _case(),
    st.sampled_from(sorted(MAKERS)),
    st.sampled_from(sorted(MAKERS)),
    zst.world_sizes(max_size=6),
    zst.world_sizes(max_size=6),
)
def test_reshard_between_world_sizes(
    case: tuple[list[list[int]], dict[str, Any]],
    mode_a: str,
    mode_b: str,
    world_a: int,
    world_b: int,
) -> None:
    groups, x = case
    pa = _partition(mode_a, groups, world_a)
    pb = _partition(mode_b, groups, world_b)
    at_a = [shard(pa, x, r) for r in range(world_a)]
    at_b = [shard(pb, consolidate(pa, at_a), r) for r in range(world_b)]
    expected = _expected(_expected(x, pa), pb)
    assert_same(consolidate(pb, at_b), expected)


@SETTINGS
@given(zst.group_sizes(max_groups=3, max_params_per_group=6, max_numel=24, max_large=0), st.data())
def test_flat_consolidate_restores_shapes(groups: list[list[int]], data: st.DataObject) -> None:
    x = data.draw(zst.optimizer_states(groups, partial=False))
    sizes = [n for g in groups for n in g]
    shapes = [data.draw(zst.shapes(max_dims=3, numel=n)) for n in sizes]
    for entry_index, entry in x["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            entry[name] = entry[name].reshape(shapes[entry_index])
    world_size = data.draw(zst.world_sizes(max_size=5))
    partition = flat_partition(groups, world_size)
    shards = [shard(partition, x, r) for r in range(world_size)]
    assert_same(consolidate(partition, shards, shapes=shapes), _expected(x, partition))


# --- bad input ---------------------------------------------------------------------


@st.composite
def _bad_case(draw: st.DrawFn) -> tuple[Partition | FlatPartition, dict[str, Any]]:
    groups, x = draw(_case())
    partition = _partition(
        draw(st.sampled_from(sorted(MAKERS))), groups, draw(zst.world_sizes(max_size=4))
    )
    bad = copy.deepcopy(x)
    kind = draw(
        st.sampled_from(
            ["groups+", "groups-", "params+", "params-", "index", "key", "numel", "missing"]
        )
    )
    num_params = len(partition.sizes)
    if kind == "groups+":
        bad["param_groups"].append({"lr": 0.1, "params": [num_params]})
    elif kind == "groups-":
        bad["param_groups"].pop(draw(st.integers(0, len(groups) - 1)))
    elif kind == "params+":
        bad["param_groups"][draw(st.integers(0, len(groups) - 1))]["params"].append(num_params)
    elif kind == "params-":
        nonempty = [g for g, group in enumerate(groups) if group]
        bad["param_groups"][draw(st.sampled_from(nonempty))]["params"].pop()
    elif kind == "index":
        bad["state"][draw(st.sampled_from([num_params, num_params + 3, -1]))] = {
            "step": torch.tensor(1.0)
        }
    elif kind == "key":
        bad["state"]["0"] = {"step": torch.tensor(1.0)}
    elif kind == "numel":
        index = draw(st.integers(0, num_params - 1))
        bad["state"][index] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros(partition.sizes[index] + 1),
        }
    else:
        del bad["state" if draw(st.booleans()) else "param_groups"]
    return partition, bad


@SETTINGS
@given(_bad_case(), st.data())
def test_shard_rejects_foreign_state_dict_without_mutating(
    case: tuple[Partition | FlatPartition, dict[str, Any]], data: st.DataObject
) -> None:
    partition, bad = case
    before = copy.deepcopy(bad)
    rank = data.draw(st.integers(0, partition.world_size - 1))
    with pytest.raises(ValueError):
        shard(partition, bad, rank)
    assert_same(bad, before)


@SETTINGS
@given(_case(), st.sampled_from(sorted(MAKERS)), zst.world_sizes(max_size=6), st.data())
def test_consolidate_with_missing_rank_raises(
    case: tuple[list[list[int]], dict[str, Any]], mode: str, world_size: int, data: st.DataObject
) -> None:
    groups, x = case
    partition = _partition(mode, groups, world_size)
    shards = [shard(partition, x, r) for r in range(world_size)]
    missing = data.draw(st.integers(0, world_size - 1))
    before = copy.deepcopy(shards)
    with pytest.raises(ValueError, match="rank"):
        consolidate(partition, shards[:missing] + shards[missing + 1 :])
    assert_same(shards, before)


def test_shard_rejects_rank_outside_world() -> None:
    partition = greedy_partition([[2, 3]], 2)
    x = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    for rank in (-1, 2):
        with pytest.raises(ValueError, match="rank"):
            shard(partition, x, rank)


def test_consolidate_rejects_shard_of_other_partition() -> None:
    groups = [[5, 4, 3, 2]]
    x = {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.ones(n)}
            for i, n in enumerate(groups[0])
        },
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}],
    }
    greedy = greedy_partition(groups, 2)
    shards = [shard(greedy, x, r) for r in range(2)]
    with pytest.raises(ValueError):
        consolidate(greedy_partition([[5, 4, 3, 2, 1]], 2), shards)
    with pytest.raises(ValueError):
        consolidate(greedy_partition([[5, 4], [3, 2]], 2), shards)


@pytest.mark.parametrize(
    "cls", [torch.optim.Adam, torch.optim.NAdam, torch.optim.ASGD, torch.optim.Rprop]
)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_flat_round_trip_of_real_pytorch_state_with_scalar_parameters(
    cls: type[torch.optim.Optimizer], world_size: int
) -> None:
    # 0-dim parameters (a learnable temperature, say) have 0-dim exp_avg etc.,
    # which must be sliced like any element state, while 'step' / 'mu_product'
    # / 'eta' / 'mu' stay per-parameter scalars.
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(())),
        torch.nn.Parameter(torch.randn(3, 2)),
        torch.nn.Parameter(torch.randn(())),
    ]
    optimizer = cls(params, lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        sum((p * p).sum() for p in params).backward()  # type: ignore[union-attr]
        optimizer.step()
    x = optimizer.state_dict()
    groups = [[p.numel() for p in params]]
    partition = flat_partition(groups, world_size)
    shards = [shard(partition, x, r) for r in range(world_size)]
    back = consolidate(partition, shards, shapes=[p.shape for p in params])
    assert_same(back, x)
    # and it loads back into PyTorch's optimizer
    cls(params, lr=0.01).load_state_dict(back)
