"""The ZeRO step on N simulated ranks (no processes): the exchange program of
zerofn.exchange, driven by the simulated world, gives every rank the
unsharded optimizer's result, for every partition mode, with exactly one
exchange request per buffer per step carrying the buffer's bytes; the
overlapped step (zerofn.overlap_step) gives DDP-then-optimizer's result with
one all-reduce's worth of bytes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.comm import Broadcast, GatherSegments, Reduce, request_bytes
from zerofn.exchange import exchange_program, flat_grad, group_slots
from zerofn.partition import FlatPartition
from zerofn.plan import ShardPlan, plan_shards
from zerofn.testing import strategies as zst
from zerofn.testing.zero import simulate_overlapped_step, simulate_zero_steps

SETTINGS = settings(max_examples=200, deadline=None)
pytestmark = pytest.mark.timeout(120)

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


@st.composite
def plans(draw: st.DrawFn) -> tuple[ShardPlan, list[list[int]]]:
    sizes = draw(zst.group_sizes(max_groups=3, max_params_per_group=5, max_numel=64, max_large=0))
    world_size = draw(zst.world_sizes(1, 8))
    count = sum(len(g) for g in sizes)
    mode = draw(st.sampled_from(["greedy", "balanced", "flat", "manual"]))
    keys, trainable = ["cpu/float32"] * count, [True] * count
    if mode != "manual":
        return plan_shards(sizes, keys, trainable, world_size, mode), sizes
    if len(sizes) > 1:  # a manual partition has one param group
        sizes = [[n for g in sizes for n in g]]
    owners = draw(st.lists(st.integers(0, world_size - 1), min_size=count, max_size=count))
    manual = [[i for i, o in enumerate(owners) if o == r] for r in range(world_size)]
    return plan_shards(sizes, keys, trainable, world_size, params_per_rank=manual), sizes


def unsharded(
    params: list[torch.Tensor],
    sizes: list[list[int]],
    steps: list[list[torch.Tensor | None]],
    name: str,
) -> list[torch.Tensor]:
    optimizer_class, defaults = OPTIMIZERS[name]
    live = [p.clone() for p in params]
    it = iter(live)
    groups = [{"params": [next(it) for _ in g]} for g in sizes]
    optimizer = optimizer_class([g for g in groups if g["params"]], **defaults)
    for grads in steps:
        for p, g in zip(live, grads, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()
    return live


@SETTINGS
@given(planned=plans(), name=st.sampled_from(sorted(OPTIMIZERS)), data=st.data())
def test_zero_steps_on_n_ranks_equal_the_unsharded_optimizer(
    planned: tuple[ShardPlan, list[list[int]]], name: str, data: st.DataObject
) -> None:
    plan, sizes = planned
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    params = [torch.randn(n, generator=g) for group in sizes for n in group]
    # A flat shard treats a missing gradient as zero where others in the shard
    # have one (documented; see the next test), so only whole-tensor modes
    # draw parameters without a gradient here.
    allow_none = plan.mode != "flat"
    steps: list[list[torch.Tensor | None]] = [
        [
            None
            if allow_none and data.draw(st.integers(0, 5)) == 0
            else torch.randn(p.shape, generator=g)
            for p in params
        ]
        for _ in range(2)
    ]
    optimizer_class, defaults = OPTIMIZERS[name]
    ranks, requests = simulate_zero_steps(plan, params, steps, optimizer_class, **defaults)
    expected = unsharded(params, sizes, steps, name)
    for rank_params in ranks:
        for got, want in zip(rank_params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # The plan's accounting: one exchange per buffer per step, of the whole buffer.
    buffer_bytes = [layout.numel * 4 for layout in plan.layouts]
    for made in requests:
        assert all(isinstance(r, GatherSegments) for r in made)
        assert [request_bytes(r) for r in made] == buffer_bytes * len(steps)


@SETTINGS
@given(planned=plans(), via=st.sampled_from(["all_gather", "broadcasts"]))
def test_exchange_fills_each_segment_from_its_owner_only(
    planned: tuple[ShardPlan, list[list[int]]], via: Any
) -> None:
    plan, _ = planned
    # Rank r knows only its own segment (r + 1 everywhere in it); the rest is stale.
    buffers = []
    for rank in range(plan.world_size):
        mine = []
        for layout in plan.layouts:
            buffer = torch.full((layout.numel,), -1.0)
            segment = layout.segments[rank]
            buffer[segment.offset : segment.offset + segment.length] = rank + 1
            mine.append(buffer)
        buffers.append(mine)
    from zerofn.testing.world import run_programs

    run_programs(
        [exchange_program(plan.layouts, buffers[r], r, via) for r in range(plan.world_size)]
    )
    for rank_buffers in buffers:
        for layout, buffer in zip(plan.layouts, rank_buffers, strict=True):
            for segment in layout.segments:
                part = buffer[segment.offset : segment.offset + segment.length]
                assert torch.all(part == segment.rank + 1)


def test_flat_mode_treats_a_missing_gradient_in_a_shard_as_zero() -> None:
    # As docs/zero.md says: weight decay still moves a parameter without a
    # gradient when it shares a flat shard with one that has a gradient; a
    # whole-tensor partition skips it, as the unsharded optimizer does.
    params = [torch.ones(3), torch.ones(2)]
    grads: list[list[torch.Tensor | None]] = [[torch.ones(3), None]]
    keys, trainable = ["cpu"] * 2, [True, True]
    moved = {}
    for mode in ("flat", "greedy"):
        plan = plan_shards([[3, 2]], keys, trainable, 1, mode)
        (ranks, _) = simulate_zero_steps(
            plan, params, grads, torch.optim.SGD, lr=0.5, weight_decay=1.0
        )
        moved[mode] = ranks[0][1]
    assert torch.equal(moved["greedy"], torch.ones(2))
    assert torch.equal(moved["flat"], torch.full((2,), 0.5))


def test_exchange_program_refuses_a_buffer_of_the_wrong_size() -> None:
    plan = plan_shards([[3, 4]], ["cpu"] * 2, [True, True], 2, "flat")
    with pytest.raises(ValueError, match="needs 7"):
        next(exchange_program(plan.layouts, [torch.zeros(6)], 0))
    with pytest.raises(ValueError, match="1 layouts but 0 buffers"):
        next(exchange_program(plan.layouts, [], 0))


def test_flat_grad_lays_out_slices_and_zero_fills_missing_grads() -> None:
    plan = plan_shards([[5, 4]], ["cpu"] * 2, [True, True], 2, "flat")
    partition = plan.partition
    assert isinstance(partition, FlatPartition)
    # Rank 1 holds element 4 of parameter 0, then all of parameter 1.
    (slots,) = group_slots(plan.layouts[0], partition, 1)
    grads: list[torch.Tensor | None] = [torch.arange(5.0), None]
    flat = flat_grad(slots, grads, None)
    assert flat is not None and flat.tolist() == [4.0, 0.0, 0.0, 0.0, 0.0]
    assert flat_grad(slots, [None, None], None) is None


# ----- the overlapped step (hook_with_zero_step with plain averaging) ---------------


@st.composite
def bucketed_models(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """DDP buckets (global indices, in bucket order) over parameters of drawn sizes."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=9))
    cuts = (
        sorted(draw(st.sets(st.integers(1, len(sizes) - 1), max_size=3))) if len(sizes) > 1 else []
    )
    bounds = [0, *cuts, len(sizes)]
    order = list(reversed(range(len(sizes))))  # DDP buckets run in reverse order
    return [order[a:b] for a, b in itertools.pairwise(bounds)], sizes


@SETTINGS
@given(
    model=bucketed_models(),
    world_size=st.integers(1, 6),
    shard_buckets=st.booleans(),
    name=st.sampled_from(sorted(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_overlapped_step_equals_ddp_then_the_unsharded_optimizer(
    model: tuple[list[list[int]], list[int]],
    world_size: int,
    shard_buckets: bool,
    name: str,
    seed: int,
) -> None:
    buckets, sizes = model
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(world_size)]
    optimizer_class, defaults = OPTIMIZERS[name]
    ranks, requests = simulate_overlapped_step(
        buckets, params, grads, optimizer_class, shard_buckets, **defaults
    )
    # DDP's average, then the whole optimizer on every parameter.
    averaged = [
        torch.stack([grads[r][i] for r in range(world_size)]).mean(0) for i in range(len(sizes))
    ]
    expected = unsharded(params, [sizes], [list(averaged)], name)
    for rank_params in ranks:
        for got, want in zip(rank_params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Bytes: every rank hands over the model's bytes once to reduce and once to
    # broadcast: one all-reduce's worth, never the 1.5x of all-reduce + exchange.
    model_bytes = sum(sizes) * 4
    for made in requests:
        assert {type(r).__name__ for r in made} <= {"Reduce", "Broadcast"}
        assert sum(request_bytes(r) for r in made if isinstance(r, Reduce)) == model_bytes
        assert sum(request_bytes(r) for r in made if isinstance(r, Broadcast)) == model_bytes
