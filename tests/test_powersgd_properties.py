"""PowerSGD as a composition, on the simulated world, with memories kept per
parameter while the bucket layout changes from iteration to iteration (as DDP's
does between its provisional first iteration and its rebuilt buckets):

* error feedback conserves the signal *per parameter* and per rank: what the
  parameter received plus its new error equals its gradient plus its old error;
* each compressed ``n x m`` matrix costs ``r (n + m)`` elements (the batched
  hook's bucket is one ``side x side`` matrix), uncompressed gradients
  themselves;
* a compressing bucket costs two collectives (one, for a layer-wise bucket
  with nothing worth compressing).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.comm import AllReduce, Program, Request
from zerofn.hooks import powersgd
from zerofn.hooks.hook import BucketInfo, HookState, begin_bucket, finish_bucket, finish_iteration
from zerofn.hooks.powersgd import (
    PowerSGDBucketState,
    PowerSGDConfig,
    PowerSGDGlobalState,
    PowerSGDHook,
)
from zerofn.testing import strategies as zst
from zerofn.testing.world import run_programs

SETTINGS = settings(max_examples=draws(30), deadline=None)
State = HookState[PowerSGDGlobalState, PowerSGDBucketState | None]
Layout = list[list[int]]  # buckets of parameter keys
VARIANTS: dict[str, Callable[[PowerSGDConfig], PowerSGDHook]] = {
    "layerwise": powersgd.layerwise,
    "batched": powersgd.batched,
}


@attrs.frozen
class Bucket:
    """What one bucket of one iteration did."""

    layout: list[int]
    requests: list[Request]
    grads: list[dict[int, torch.Tensor]]  # per rank, per key
    results: list[dict[int, torch.Tensor]]  # per rank, per key
    before: list[dict[int, powersgd.ParamMemory]]  # per rank: memories before
    after: list[dict[int, powersgd.ParamMemory]]  # per rank: memories after


@st.composite
def layouts(draw: st.DrawFn, count: int) -> Layout:
    """The keys ``0 .. count - 1`` in some order, cut into non-empty buckets."""
    order = draw(st.permutations(range(count)))
    cuts = draw(st.sets(st.integers(1, count - 1), max_size=3)) if count > 1 else set()
    bounds = [0, *sorted(cuts), count]
    return [list(order[a:b]) for a, b in itertools.pairwise(bounds)]


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    shapes = draw(st.lists(zst.shapes(0, 3, min_side=1, max_side=12), min_size=1, max_size=6))
    first, second = draw(layouts(len(shapes))), draw(layouts(len(shapes)))
    return {
        "shapes": shapes,
        "schedule": draw(st.lists(st.sampled_from([first, second]), min_size=3, max_size=3)),
        "world_size": draw(st.integers(1, 3)),
        "rank": draw(st.integers(1, 3)),
        "warm_start": draw(st.booleans()),
        "seed": draw(st.integers(0, 99)),
    }


def counted(program: Program[Any], log: list[Request]) -> Program[Any]:
    """``program``, noting each request in ``log``."""
    response = None
    try:
        while True:
            request = program.send(response)
            log.append(request)
            response = yield request
    except StopIteration as stop:
        return stop.value


def run_bucket(
    hook: PowerSGDHook,
    states: list[State],
    index: int,
    info: tuple[list[int], Sequence[tuple[int, ...]], bool],
    grads: list[dict[int, torch.Tensor]],
) -> tuple[Bucket, list[State]]:
    """One bucket on every rank, its parameters claimed first (as a driver does)."""
    keys, shapes, last = info
    bucket_shapes = tuple(tuple(shapes[k]) for k in keys)
    states = [powersgd.claim(s, index, keys, bucket_shapes) for s in states]
    before = [powersgd.memories(s) for s in states]
    bucket = BucketInfo(index, bucket_shapes, len(states), is_last=last)
    programs, logs = [], []
    for rank, state in enumerate(states):
        flat = torch.cat([grads[rank][k].reshape(-1) for k in keys])
        states[rank], program = begin_bucket(hook, state, flat, bucket)
        logs.append([])
        programs.append(counted(program, logs[-1]))
    finished = run_programs(programs)
    results = []
    for rank, (out, bucket_state) in enumerate(finished):
        states[rank] = finish_bucket(states[rank], index, bucket_state)
        results.append(dict(zip(keys, out.split(list(bucket.numels)), strict=True)))
    after = [powersgd.memories(s) for s in states]
    return Bucket(keys, logs[0], grads, results, before, after), states


def run(variant: str, case: dict[str, Any]) -> tuple[PowerSGDConfig, list[Bucket]]:
    """Every iteration of ``case``'s schedule; what each bucket did."""
    cfg = PowerSGDConfig(
        matrix_approximation_rank=case["rank"],
        start_powerSGD_iter=2,
        warm_start=case["warm_start"],
        orthogonalization_epsilon=1e-8,
    )
    hook = VARIANTS[variant](cfg)
    state: State = HookState(hook.init())
    state = attrs.evolve(state, global_state=attrs.evolve(state.global_state, iteration=2))
    states = [state] * case["world_size"]
    generator = torch.Generator().manual_seed(case["seed"])
    done = []
    for layout in case["schedule"]:
        grads = [
            {k: torch.randn(s, generator=generator) for k, s in enumerate(case["shapes"])}
            for _ in states
        ]
        for index, keys in enumerate(layout):
            info = (keys, case["shapes"], index == len(layout) - 1)
            bucket, states = run_bucket(hook, states, index, info, grads)
            done.append(bucket)
        states = [finish_iteration(hook, s) for s in states]
    return cfg, done


def expected_numel(variant: str, shapes: list[tuple[int, ...]], rank: int) -> int:
    """Elements a compressing bucket sends: ``r (n + m)`` per compressed matrix."""
    if variant == "batched":
        side = powersgd.square_side(sum(math.prod(s) for s in shapes))
        return min(side, rank) * (side + side)
    total = 0
    for shape in shapes:
        n, m = powersgd.matrix_view(shape)
        r = min(n, m, rank)
        compressed = powersgd.should_compress(n, m, r, 2)
        total += r * (n + m) if compressed else n * m
    return total


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@SETTINGS
@given(case=runs())
def test_error_feedback_conserves_each_parameters_signal(
    variant: str, case: dict[str, Any]
) -> None:
    _, buckets = run(variant, case)
    for bucket in buckets:
        for rank, rank_results in enumerate(bucket.results):
            for key in bucket.layout:
                old = bucket.before[rank].get(key)
                new = bucket.after[rank][key]
                assert new.error is not None
                old_error = old.error if old is not None and old.error is not None else 0
                grad = bucket.grads[rank][key].reshape(-1)
                torch.testing.assert_close(
                    rank_results[key] + new.error, grad + old_error, rtol=1e-5, atol=1e-5
                )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@SETTINGS
@given(case=runs())
def test_each_compressed_matrix_costs_rank_times_rows_plus_cols(
    variant: str, case: dict[str, Any]
) -> None:
    _, buckets = run(variant, case)
    for bucket in buckets:
        shapes = [case["shapes"][k] for k in bucket.layout]
        sent = [t for r in bucket.requests if isinstance(r, AllReduce) for t in r.tensors]
        assert sum(t.numel() for t in sent) == expected_numel(variant, shapes, case["rank"])
        assert sum(t.numel() * t.element_size() for t in sent) == 4 * expected_numel(
            variant, shapes, case["rank"]
        )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@SETTINGS
@given(case=runs())
def test_two_collectives_per_compressed_bucket(variant: str, case: dict[str, Any]) -> None:
    cfg, buckets = run(variant, case)
    for bucket in buckets:
        shapes = [case["shapes"][k] for k in bucket.layout]
        layout = powersgd.bucket_layout(shapes, cfg.matrix_approximation_rank, 2)
        expected = 2 if variant == "batched" or layout.groups else 1
        assert len(bucket.requests) == expected
        assert all(isinstance(r, AllReduce) and r.op == "sum" for r in bucket.requests)
        assert [r.last for r in bucket.requests] == [False] * (expected - 1) + [True]
