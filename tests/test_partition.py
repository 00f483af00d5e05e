"""Properties of the partitions (greedy, balanced, flat, manual), and parity of
greedy with PyTorch's own sorted-greedy partition."""

from __future__ import annotations

import bisect
import copy
import functools
import itertools
import types

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer

from zerofn import (
    FlatPartition,
    Partition,
    balanced_partition,
    flat_partition,
    greedy_partition,
    manual_partition,
    rank_loads,
)
from zerofn.testing import strategies as zst
from zerofn.zero.planning.plan import plan_shards, with_trainable

SETTINGS = settings(max_examples=draws(100), deadline=None)

# Small sizes drawn from a short list: many ties, which decide the assignment.
TIED_GROUPS = zst.group_sizes(
    max_groups=4, max_params_per_group=10, max_numel=8, max_large=1, large_numel=64
)


def _whole_partitions(groups: list[list[int]], world_size: int) -> dict[str, Partition]:
    return {
        "greedy": greedy_partition(groups, world_size),
        "balanced": balanced_partition(groups, world_size),
    }


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_whole_tensor_partitions_own_every_parameter_once(
    groups: list[list[int]], world_size: int
) -> None:
    sizes = [n for group in groups for n in group]
    offsets = [sum(len(g) for g in groups[:k]) for k in range(len(groups))]
    for name, partition in _whole_partitions(groups, world_size).items():
        owned = [i for r in range(world_size) for i in partition.params_of(r)]
        assert sorted(owned) == list(range(len(sizes))), name
        for r in range(world_size):
            assert partition.owners.count(r) == len(partition.params_of(r))
            for g, indices in enumerate(partition.assignment[r]):
                assert all(offsets[g] <= i < offsets[g] + len(groups[g]) for i in indices)
        assert all(
            partition.owners[i] == r for r in range(world_size) for i in partition.params_of(r)
        )
        assert sum(partition.loads()) == sum(sizes), name
        assert rank_loads(partition) == partition.loads()
        assert [p.param for p in partition.pieces_of(0)] == list(partition.params_of(0))


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_greedy_lpt_bound(groups: list[list[int]], world_size: int) -> None:
    partition = greedy_partition(groups, world_size)
    sizes = partition.sizes
    total = sum(sizes)
    # max load <= total / w + max size, in integers
    assert max(partition.loads()) * world_size <= total + world_size * max(sizes)


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_balanced_never_heavier_than_greedy(groups: list[list[int]], world_size: int) -> None:
    balanced = balanced_partition(groups, world_size)
    greedy = greedy_partition(groups, world_size)
    assert max(balanced.loads()) <= max(greedy.loads())
    # Balanced is greedy itself when it cannot beat it; otherwise it keeps
    # global order within each rank and group.
    if balanced != greedy:
        assert max(balanced.loads()) < max(greedy.loads())
        for rank in balanced.assignment:
            for indices in rank:
                assert list(indices) == sorted(indices)


@SETTINGS
@given(TIED_GROUPS, zst.world_sizes(max_size=6))
def test_balanced_never_heavier_than_greedy_on_ties(
    groups: list[list[int]], world_size: int
) -> None:
    balanced = balanced_partition(groups, world_size)
    assert max(balanced.loads()) <= max(greedy_partition(groups, world_size).loads())
    assert -1 not in balanced.owners


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_flat_loads_within_one_element(groups: list[list[int]], world_size: int) -> None:
    partition = flat_partition(groups, world_size)
    total = sum(n for group in groups for n in group)
    loads = partition.loads()
    assert sum(loads) == total
    assert rank_loads(partition) == loads
    low, high = total // world_size, -(-total // world_size)
    assert all(low <= load <= high for load in loads)


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_flat_pieces_tile_every_parameter_once(groups: list[list[int]], world_size: int) -> None:
    partition = flat_partition(groups, world_size)
    sizes = partition.sizes
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(sizes))}
    for rank in range(world_size):
        pieces = partition.pieces_of(rank)
        assert sum(p.numel for p in pieces) == partition.loads()[rank]
        assert all(p.numel > 0 for p in pieces)
        # global order within a rank
        assert [p.param for p in pieces] == sorted(p.param for p in pieces)
        # group pieces are the same pieces split by group
        by_group = partition.group_pieces_of(rank)
        assert len(by_group) == len(groups)
        assert tuple(p for g in by_group for p in g) == pieces
        for p in pieces:
            covered[p.param].append((p.start, p.stop))
    for index, spans in covered.items():
        position = 0
        for start, stop in sorted(spans):
            assert start == position
            position = stop
        assert position == sizes[index]
    # the concatenation of all ranks' pieces walks the flat model in order
    flat = [(p.param, p.start, p.stop) for r in range(world_size) for p in partition.pieces_of(r)]
    assert flat == sorted(flat)


# --- parity with PyTorch's sorted greedy ---------------------------------------------


def _pytorch_greedy(groups: list[list[int]], world_size: int) -> list[list[list[int]]]:
    """PyTorch's ZeroRedundancyOptimizer._partition_parameters, run without a
    process group, mapped back to global indices."""
    tensors = [[torch.empty(n, device="meta") for n in group] for group in groups]
    index_of = {id(t): i for i, t in enumerate(t for group in tensors for t in group)}
    fake = types.SimpleNamespace(
        param_groups=[{"params": group, "lr": 0.1} for group in tensors],
        world_size=world_size,
        _partition_parameters_cache=[],
    )
    fake._get_min_index = functools.partial(ZeroRedundancyOptimizer._get_min_index, fake)
    fake._partition_param_group = functools.partial(
        ZeroRedundancyOptimizer._partition_param_group, fake
    )
    per_rank = ZeroRedundancyOptimizer._partition_parameters(fake)  # type: ignore[arg-type]
    return [[[index_of[id(t)] for t in group["params"]] for group in rank] for rank in per_rank]


def _as_lists(partition: Partition) -> list[list[list[int]]]:
    return [[list(g) for g in rank] for rank in partition.assignment]


@settings(max_examples=draws(200), deadline=None)
@given(TIED_GROUPS, zst.world_sizes(max_size=8))
def test_greedy_equals_pytorch_on_ties(groups: list[list[int]], world_size: int) -> None:
    assert _as_lists(greedy_partition(groups, world_size)) == _pytorch_greedy(groups, world_size)


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_greedy_equals_pytorch(groups: list[list[int]], world_size: int) -> None:
    assert _as_lists(greedy_partition(groups, world_size)) == _pytorch_greedy(groups, world_size)


def test_greedy_equals_pytorch_all_equal_sizes() -> None:
    groups = [[4] * 7, [4] * 5, [0, 0, 4]]
    for world_size in range(1, 9):
        assert _as_lists(greedy_partition(groups, world_size)) == _pytorch_greedy(
            groups, world_size
        )


# --- manual partition ---------------------------------------------------------------


@st.composite
def _manual_case(draw: st.DrawFn) -> tuple[list[int], int, list[list[int]]]:
    sizes = draw(zst.param_sizes(min_len=1, max_len=10, max_large=0))
    world_size = draw(zst.world_sizes(max_size=5))
    owners = draw(
        st.lists(st.integers(-1, world_size - 1), min_size=len(sizes), max_size=len(sizes))
    )
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for i in draw(st.permutations(range(len(sizes)))):
        if owners[i] >= 0:
            per_rank[owners[i]].append(i)
    return sizes, world_size, per_rank


@SETTINGS
@given(_manual_case())
def test_manual_partition_keeps_given_order(case: tuple[list[int], int, list[list[int]]]) -> None:
    sizes, world_size, per_rank = case
    before = copy.deepcopy(per_rank)
    partition = manual_partition([sizes], world_size, per_rank)
    assert per_rank == before
    assert [list(partition.params_of(r)) for r in range(world_size)] == per_rank
    frozen = set(range(len(sizes))) - {i for ix in per_rank for i in ix}
    assert {i for i, r in enumerate(partition.owners) if r == -1} == frozen


@SETTINGS
@given(_manual_case(), st.data())
def test_manual_partition_errors_mutate_nothing(
    case: tuple[list[int], int, list[list[int]]], data: st.DataObject
) -> None:
    sizes, world_size, per_rank = case
    groups = [sizes]
    n = len(sizes)

    def check(exc: type[Exception], groups_: list[list[int]], ppr: list[list[int]]) -> None:
        g_before, p_before = copy.deepcopy(groups_), copy.deepcopy(ppr)
        with pytest.raises(exc):
            manual_partition(groups_, world_size, ppr)
        assert groups_ == g_before
        assert ppr == p_before

    # wrong number of ranks
    extra = data.draw(st.sampled_from([-1, 1, 2]))
    wrong_len = [list(ix) for ix in per_rank] + [[] for _ in range(max(extra, 0))]
    if extra < 0:
        wrong_len = wrong_len[:extra]
    check(ValueError, groups, wrong_len)
    # an index the optimizer never saw
    bad = data.draw(st.sampled_from([n, n + 5, -1]))
    unknown = [list(ix) for ix in per_rank]
    unknown[data.draw(st.integers(0, world_size - 1))].append(bad)
    check(ValueError, groups, unknown)
    # a parameter listed twice (same rank or another rank)
    index = data.draw(st.integers(0, n - 1))
    twice = [list(ix) for ix in per_rank]
    twice[data.draw(st.integers(0, world_size - 1))].append(index)
    if index not in {i for ix in per_rank for i in ix}:
        twice[data.draw(st.integers(0, world_size - 1))].append(index)
    check(ValueError, groups, twice)
    # more than one param group
    check(RuntimeError, [sizes, [1]], per_rank)


@SETTINGS
@given(_manual_case(), st.data())
def test_a_manual_plan_gives_every_trainable_parameter_an_owner(
    case: tuple[list[int], int, list[list[int]]], data: st.DataObject
) -> None:
    sizes, world_size, per_rank = case
    n = len(sizes)
    owned = {i for ix in per_rank for i in ix}
    keys = ["cpu/float32"] * n
    trainable = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    left_out = [i for i in range(n) if trainable[i] and i not in owned]
    if left_out:
        with pytest.raises(ValueError, match=rf"global index {', '.join(map(str, left_out))} \("):
            plan_shards([sizes], keys, trainable, world_size, params_per_rank=per_rank)
        return
    plan = plan_shards([sizes], keys, trainable, world_size, params_per_rank=per_rank)
    # The same holds when the mask changes later: a left-out parameter that
    # starts requiring grad is refused, a frozen one stays allowed.
    new_mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    now_left_out = [i for i in range(n) if new_mask[i] and i not in owned]
    if now_left_out:
        with pytest.raises(ValueError, match="now require grad"):
            with_trainable(plan, new_mask)
    else:
        assert with_trainable(plan, new_mask).trainable == tuple(new_mask)


def test_manual_partition_error_types_match_pytorch_order() -> None:
    # PyTorch checks the group count before the list: RuntimeError wins.
    with pytest.raises(RuntimeError):
        manual_partition([[1], [2]], 2, [[0], [1], [5]])
    with pytest.raises(ValueError, match="params_per_rank"):
        manual_partition([[1, 2]], 2, [[0, 1]])
    with pytest.raises(ValueError):
        manual_partition([[1, 2]], 2, [[0], [7]])


# --- record validation ---------------------------------------------------------------


@SETTINGS
@given(zst.group_sizes(max_large=0), zst.world_sizes(max_size=6), st.data())
def test_partition_rejects_double_assignment(
    groups: list[list[int]], world_size: int, data: st.DataObject
) -> None:
    good = greedy_partition(groups, world_size)
    index = data.draw(st.integers(0, len(good.sizes) - 1))
    owner = good.owners[index]
    group = next(g for g, ix in enumerate(good.assignment[owner]) if index in ix)
    other = data.draw(st.integers(0, world_size - 1))
    assignment = [[list(g) for g in rank] for rank in good.assignment]
    assignment[other][group].append(index)
    with pytest.raises(ValueError, match=r"both rank|exactly one owner"):
        Partition(
            world_size=world_size,
            group_sizes=good.group_sizes,
            assignment=tuple(tuple(tuple(g) for g in rank) for rank in assignment),
        )


def test_partition_rejects_bad_shapes() -> None:
    gs = ((1, 2), (3,))
    with pytest.raises(ValueError, match="ranks"):
        Partition(world_size=2, group_sizes=gs, assignment=(((0, 1), (2,)),))
    with pytest.raises(ValueError, match="param groups"):
        Partition(world_size=1, group_sizes=gs, assignment=(((0, 1, 2),),))
    with pytest.raises(ValueError, match="group 0"):
        Partition(world_size=1, group_sizes=gs, assignment=(((0, 2), (1,)),))
    with pytest.raises(ValueError, match="world_size"):
        Partition(world_size=0, group_sizes=gs, assignment=())


def test_flat_partition_rejects_bad_bounds() -> None:
    gs = ((3, 2),)
    FlatPartition(world_size=2, group_sizes=gs, bounds=(0, 5, 5))
    for bounds in [(0, 5), (0, 2, 4), (1, 2, 5), (0, 4, 3, 5)]:
        with pytest.raises(ValueError):
            FlatPartition(
                world_size=len(bounds) - 1 if len(bounds) == 4 else 2, group_sizes=gs, bounds=bounds
            )


@pytest.mark.parametrize("make", [greedy_partition, balanced_partition, flat_partition])
def test_bad_inputs_raise_value_error(make: object) -> None:
    assert callable(make)
    with pytest.raises(ValueError):
        make([[1, 2]], 0)
    with pytest.raises(ValueError):
        make([[1, -2]], 2)


def test_manual_partition_takes_world_size_second_like_the_others() -> None:
    assert manual_partition([[3, 4, 5]], 2, [[2], [0, 1]]).assignment == (((2,),), ((0, 1),))
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        manual_partition([[3, 4, 5]], [[2], [0, 1]], 2)  # type: ignore[arg-type]


@SETTINGS
@given(zst.group_sizes(), zst.world_sizes())
def test_local_tensors_hold_each_ranks_pieces_in_order_within_one_group(
    groups: list[list[int]], world_size: int
) -> None:
    # The one partition protocol the optimizer, consolidation and checkpoints read.
    partitions = [
        *_whole_partitions(groups, world_size).values(),
        flat_partition(groups, world_size),
    ]
    bounds = list(itertools.accumulate((len(g) for g in groups), initial=0))
    for partition in partitions:
        for rank in range(world_size):
            tensors = partition.local_tensors(rank)
            assert tuple(p for t in tensors for p in t) == partition.pieces_of(rank)
            for pieces in tensors:
                assert len({bisect.bisect_right(bounds, p.param) for p in pieces}) <= 1
