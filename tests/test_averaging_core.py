"""The averaging schedules against PyTorch's own classes, step by step.

PyTorch's averagers and post-local SGD hook run here on a one-rank group with
their collective replaced by a recorder, so each test sees exactly at which
steps, and with which group, PyTorch would communicate; zerofn's pure
schedules must agree for every step. Also: validation, counters and their
checkpoints, and the averaging program in the simulated world."""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_default_hooks
import torch.distributed.algorithms.model_averaging.utils as torch_averaging_utils
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState as TorchPostLocalSGDState,
)
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    post_localSGD_hook as torch_post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import (
    PeriodicModelAverager as TorchPeriodic,
)
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager as TorchHierarchical,
)
from zerofn_torch.averaging import HierarchicalModelAverager, PeriodicModelAverager
from zerofn_torch.hooks.post_local_sgd import PostLocalSGDState

from zerofn.averaging import (
    AveragerState,
    HierarchicalSchedule,
    Level,
    LocalSGDState,
    PeriodicSchedule,
    PostLocalSGDSchedule,
    average_program,
    averager_state_from_dict,
    local_sgd_state_from_dict,
    take_averaging_step,
    take_bucket,
)
from zerofn.comm import AllReduce
from zerofn.testing.world import run_programs

pytestmark = pytest.mark.usefixtures("single_rank_group")

STEPS = 64


@pytest.fixture(scope="module")
def recorded_groups() -> Iterator[list[Any]]:
    """Replace PyTorch's parameter averaging by a recorder of the group it
    would average over (one entry per averaging)."""
    calls: list[Any] = []
    original = torch_averaging_utils.average_parameters_or_parameter_groups
    torch_averaging_utils.average_parameters_or_parameter_groups = lambda params, group: (
        calls.append(group)
    )
    try:
        yield calls
    finally:
        torch_averaging_utils.average_parameters_or_parameter_groups = original


def torch_averaging_steps(averager: Any, calls: list[Any]) -> list[Any]:
    """For each step, the group PyTorch's ``averager`` averages over, or None."""
    seen = []
    for _ in range(STEPS):
        calls.clear()
        averager.average_parameters([])
        seen.append(calls[0] if calls else None)
    return seen


# ----- periodic -----------------------------------------------------------------


@settings(max_examples=draws(200), deadline=None)
@given(period=st.integers(1, 12), warmup=st.integers(0, 20))
def test_periodic_averages_at_pytorchs_steps(
    recorded_groups: list[Any], period: int, warmup: int
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = TorchPeriodic(period, warmup_steps=warmup)
    expected = [g is not None for g in torch_averaging_steps(theirs, recorded_groups)]
    schedule = PeriodicSchedule(period, warmup)
    assert [schedule.level_at(step) == 0 for step in range(STEPS)] == expected
    assert [schedule.level_at(step) is None for step in range(STEPS)] == [not e for e in expected]


@settings(deadline=None)
@given(period=st.integers(1, 12), warmup=st.integers(0, 20), step=st.integers(0, 500))
def test_periodic_averages_first_after_warmup_then_every_period(
    period: int, warmup: int, step: int
) -> None:
    averages = PeriodicSchedule(period, warmup).level_at(step) == 0
    assert averages == (step in range(warmup, step + 1, period))


# ----- hierarchical -------------------------------------------------------------

increasing_periods = st.lists(st.integers(1, 16), min_size=1, max_size=4, unique=True).map(sorted)


@settings(max_examples=draws(200), deadline=None)
@given(periods=increasing_periods, warmup=st.integers(0, 20))
def test_hierarchical_picks_pytorchs_level_at_every_step(
    recorded_groups: list[Any], periods: list[int], warmup: int
) -> None:
    # One rank: every level's group is the world; label each level's group by
    # its period to see which one PyTorch picks.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = TorchHierarchical(OrderedDict((p, 1) for p in periods), warmup_steps=warmup)
    theirs.period_process_group_dict = OrderedDict((p, p) for p in periods)
    expected = torch_averaging_steps(theirs, recorded_groups)

    schedule = HierarchicalSchedule({p: 1 for p in periods}, world_size=1, warmup_steps=warmup)
    levels = [schedule.level_at(step) for step in range(STEPS)]
    assert [None if lv is None else periods[lv] for lv in levels] == expected


@st.composite
def hierarchies(draw: st.DrawFn) -> tuple[list[Level], int]:
    """Levels over a world of 2**k ranks: increasing periods, group sizes that
    divide the world, the last one the whole world."""
    exponent = draw(st.integers(0, 4))
    periods = draw(increasing_periods)
    sizes = sorted(draw(st.lists(st.integers(0, exponent), min_size=len(periods) - 1)))
    sizes = [*sizes[: len(periods) - 1], exponent]
    return [Level(p, 2**s) for p, s in zip(periods, sizes, strict=True)], 2**exponent


@settings(deadline=None)
@given(hierarchy=hierarchies(), warmup=st.integers(0, 20), step=st.integers(0, 500))
def test_hierarchical_level_is_the_largest_period_dividing_the_step(
    hierarchy: tuple[list[Level], int], warmup: int, step: int
) -> None:
    levels, world = hierarchy
    level = HierarchicalSchedule(levels, world_size=world, warmup_steps=warmup).level_at(step)
    dividing = [i for i, lv in enumerate(levels) if step % lv.period == 0]
    if step < warmup or not dividing:
        assert level is None
    else:
        assert level == max(dividing)


def test_hierarchical_counts_periods_from_step_zero_not_from_warmup() -> None:
    # Unlike the periodic schedule: with warm-up 3 and period 2, step 3 is skipped.
    schedule = HierarchicalSchedule({2: 1}, world_size=1, warmup_steps=3)
    assert [schedule.level_at(s) for s in range(3, 7)] == [None, 0, None, 0]
    assert [PeriodicSchedule(2, 3).level_at(s) for s in range(3, 7)] == [0, None, 0, None]


# ----- counters and checkpoints -------------------------------------------------


@settings(deadline=None)
@given(period=st.integers(1, 6), warmup=st.integers(0, 8), split=st.integers(0, 30))
def test_resuming_from_a_saved_state_continues_the_same_schedule(
    period: int, warmup: int, split: int
) -> None:
    schedule = PeriodicSchedule(period, warmup)
    state, straight = AveragerState(), []
    for _ in range(40):
        state, level = take_averaging_step(schedule, state)
        straight.append(level)
    state, resumed = AveragerState(), []
    for step in range(40):
        if step == split:
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            buffer.seek(0)
            state = averager_state_from_dict(torch.load(buffer, weights_only=True))
        state, level = take_averaging_step(schedule, state)
        resumed.append(level)
    assert resumed == straight
    assert state == AveragerState(40)


def test_state_dicts_refuse_bad_counters() -> None:
    with pytest.raises(ValueError, match="step"):
        averager_state_from_dict({})
    with pytest.raises(ValueError, match="non-negative"):
        averager_state_from_dict({"step": -1})
    with pytest.raises(TypeError, match="int"):
        averager_state_from_dict({"step": 1.5})
    with pytest.raises(ValueError, match="iter"):
        local_sgd_state_from_dict({"step": 3})
    assert local_sgd_state_from_dict(LocalSGDState(4).state_dict()) == LocalSGDState(4)


# ----- validation: PyTorch's exception types -------------------------------------


def _raises_like(ours: Any, theirs: Any) -> None:
    with pytest.raises(Exception) as torch_error, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs()
    with pytest.raises(torch_error.type):
        ours()


@pytest.mark.parametrize(("period", "warmup"), [(0, 0), (-3, 0), (2, -1), (0, -1)])
def test_bad_periodic_arguments_raise_pytorchs_types(period: int, warmup: int) -> None:
    _raises_like(lambda: PeriodicSchedule(period, warmup), lambda: TorchPeriodic(period, warmup))
    _raises_like(
        lambda: PeriodicModelAverager(period, warmup), lambda: TorchPeriodic(period, warmup)
    )


@pytest.mark.parametrize(
    ("levels", "warmup"),
    [
        (None, 0),  # nothing to average at
        ({}, 0),
        ({0: 1}, 0),  # a period below 1
        ({2: 2}, 0),  # the last level is not the whole (one-rank) world
        ({2: 2, 4: 1}, 0),  # a group size that does not divide the world
        ({2: 1}, -1),  # negative warm-up
    ],
)
def test_bad_hierarchies_raise_pytorchs_types(levels: Any, warmup: int) -> None:
    _raises_like(
        lambda: HierarchicalSchedule(levels, world_size=1, warmup_steps=warmup),
        lambda: TorchHierarchical(levels, warmup_steps=warmup),
    )
    _raises_like(
        lambda: HierarchicalModelAverager(levels, warmup_steps=warmup),
        lambda: TorchHierarchical(levels, warmup_steps=warmup),
    )


def test_hierarchies_pytorch_would_misread_are_refused() -> None:
    # PyTorch searches from the last key down, so {4: .., 2: ..} would average
    # at period 2 on step 4; and a period of 0 after the first fails only later.
    with pytest.raises(ValueError, match="increasing"):
        HierarchicalSchedule({4: 1, 2: 1}, world_size=1)
    with pytest.raises(ValueError, match="positive"):
        HierarchicalSchedule({2: 1, 0: 1}, world_size=1)
    with pytest.raises(TypeError, match="int"):
        PeriodicSchedule(2.5)


def test_averaging_at_every_step_warns_like_pytorch() -> None:
    with pytest.warns(UserWarning, match="DistributedDataParallel"):
        PeriodicModelAverager(1)
    with pytest.warns(UserWarning, match="DistributedDataParallel"):
        HierarchicalModelAverager({1: 1})
    assert PeriodicSchedule(1).redundant_with_ddp
    assert not HierarchicalSchedule({1: 1, 2: 1}, world_size=1).redundant_with_ddp


# ----- post-local SGD: which group reduces each bucket ---------------------------


class FakeBucket:
    """What PyTorch's hook reads of a DDP bucket."""

    def __init__(self, index: int, is_last: bool) -> None:
        self._index, self._is_last = index, is_last
        self._buffer = torch.zeros(2)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]


def torch_hook_syncs(state: Any, buckets_per_iter: list[int]) -> list[str]:
    """Where PyTorch's hook averages each bucket: its process group is the
    string "global", its subgroup "subgroup"; "none" if it keeps the gradient."""
    seen: list[str] = []

    def record(group: Any, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        seen.append(group)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    original = torch_default_hooks._allreduce_fut
    torch_default_hooks._allreduce_fut = record
    try:
        for count in buckets_per_iter:
            for index in reversed(range(count)):  # DDP reduces bucket 0 last
                before = len(seen)
                torch_post_localSGD_hook(state, FakeBucket(index, index == 0))
                if len(seen) == before:
                    seen.append("none")
    finally:
        torch_default_hooks._allreduce_fut = original
    return seen


@settings(max_examples=draws(200), deadline=None)
@given(
    start=st.integers(0, 6),
    post_local=st.booleans(),
    buckets_per_iter=st.lists(st.integers(1, 4), max_size=10),
)
def test_hook_uses_pytorchs_group_for_every_bucket(
    start: int, post_local: bool, buckets_per_iter: list[int]
) -> None:
    theirs = TorchPostLocalSGDState("global", "subgroup", start, post_local)
    expected = torch_hook_syncs(theirs, buckets_per_iter)

    schedule, state, ours = PostLocalSGDSchedule(start, post_local), LocalSGDState(), []
    adapter_state = PostLocalSGDState(None, None, start, post_local)
    through_adapter = []
    for count in buckets_per_iter:
        for index in reversed(range(count)):
            state, sync = take_bucket(schedule, state, is_last=index == 0)
            ours.append(sync)
            through_adapter.append(adapter_state.take(FakeBucket(index, index == 0)))
    assert ours == expected
    assert through_adapter == expected
    assert state.iter == adapter_state.iter == theirs.iter


def test_hook_state_refuses_a_negative_start() -> None:
    with pytest.raises(ValueError, match="start_localSGD_iter"):
        PostLocalSGDSchedule(-1)


# ----- the averaging program ----------------------------------------------------


@settings(deadline=None)
@given(world=st.integers(1, 5), shapes=st.lists(st.sampled_from([(), (3,), (2, 2)]), max_size=4))
def test_averaging_program_is_one_allreduce_of_the_mean(
    world: int, shapes: list[tuple[int, ...]]
) -> None:
    tensors = [
        [torch.full(shape, float(rank + i), dtype=torch.float64) for i, shape in enumerate(shapes)]
        for rank in range(world)
    ]
    programs = [average_program(ts, world) for ts in tensors]
    results = run_programs(programs)
    for rank_result in results:
        assert len(rank_result) == len(shapes)
        for i, (value, shape) in enumerate(zip(rank_result, shapes, strict=True)):
            assert value.shape == shape
            torch.testing.assert_close(
                value, torch.full(shape, i + (world - 1) / 2, dtype=value.dtype)
            )


def test_averaging_program_keeps_each_dtype_and_asks_once() -> None:
    tensors = (torch.ones(2, dtype=torch.float16), torch.ones(3, dtype=torch.float64))
    program = average_program(tensors, 2)
    request = next(program)
    assert isinstance(request, AllReduce) and request.last
    assert request.tensors[0].dtype == torch.float64  # promoted, as torch.cat does
    with pytest.raises(StopIteration) as done:
        program.send((2 * request.tensors[0],))
    assert [t.dtype for t in done.value.value] == [torch.float16, torch.float64]
    assert [t.tolist() for t in done.value.value] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def test_averaging_nothing_communicates_nothing() -> None:
    assert run_programs([average_program([], 3) for _ in range(3)]) == [(), (), ()]
