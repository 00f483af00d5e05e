"""The ZeRO step on N simulated ranks (no processes): the production program
(zerofn.zero.step.zero_step, which ZeroRedundancyOptimizer.step drives over a
process group) over the production mode records and local tensors
(zerofn.zero.shards), run by the simulated world, gives every rank the
unsharded optimizer's result, for every partition mode with and without
bucket views, with exactly one exchange request per buffer per step carrying
the buffer's bytes; the
overlapped step (the core hook zerofn.overlap.hook.zero_step_hook, obeyed
over several iterations as the adapter obeys it) gives DDP-then-optimizer's
result before and after DDP's buckets are final, with the collectives and
bytes its bucket plan accounts for."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zerofn.comm import AllReduce, Broadcast, GatherSegments, Reduce, request_bytes
from zerofn.hooks.hook import allreduce_mean, cast
from zerofn.overlap.ddp_buckets import assign_buckets
from zerofn.overlap.state import OverlapState, owned_params_per_rank
from zerofn.testing import strategies as zst
from zerofn.testing.overlap import simulate_overlapped_step
from zerofn.testing.zero import simulate_zero_steps
from zerofn.zero.exchange import exchange_program
from zerofn.zero.planning.plan import ShardPlan, plan_shards

SETTINGS = settings(max_examples=draws(200), deadline=None)
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
@given(
    planned=plans(),
    name=st.sampled_from(sorted(OPTIMIZERS)),
    bucket_view=st.sampled_from([None, False, True]),
    data=st.data(),
)
def test_zero_steps_on_n_ranks_equal_the_unsharded_optimizer(
    planned: tuple[ShardPlan, list[list[int]]],
    name: str,
    bucket_view: bool | None,
    data: st.DataObject,
) -> None:
    """The production step program, run by the simulated world."""
    plan, sizes = planned
    # The optimizer refuses a flat partition with nothing to train, as here.
    assume(plan.mode != "flat" or bool(plan.layouts))
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
    ranks, requests = simulate_zero_steps(
        plan, params, steps, optimizer_class, bucket_view=bucket_view, **defaults
    )
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
@given(planned=plans(), collective=st.sampled_from(["all_gather", "broadcasts"]))
def test_exchange_fills_each_segment_from_its_owner_only(
    planned: tuple[ShardPlan, list[list[int]]], collective: Any
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
        [exchange_program(plan.layouts, buffers[r], r, collective) for r in range(plan.world_size)]
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


# ----- the overlapped step (zero_step_hook, obeyed on simulated ranks) --------------

ITERATIONS = 3


@st.composite
def overlapped_runs(draw: st.DrawFn) -> dict[str, Any]:
    """A model, a world, every rank's gradients for ITERATIONS iterations,
    and the overlap's options."""
    buckets, shapes = draw(zst.bucketed_models())
    world_size = draw(zst.world_sizes(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [
        [[torch.randn(s, generator=g) for s in shapes] for _ in range(world_size)]
        for _ in range(ITERATIONS)
    ]
    return {
        "buckets": buckets,
        "params": params,
        "grads_per_iteration_per_rank": grads,
        "shard_buckets": draw(st.booleans()),
        "interleaved": draw(st.booleans()),
        # DDP's buckets final from iteration 0, 1 or 2 (it collects the
        # plan, the later ones overlap), or never in this run (3).
        "final_from": draw(st.integers(0, ITERATIONS)),
    }


def ddp_average(grads: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every parameter's average over ranks, as the averaging hook computes it
    (in ``dtype``): each rank's gradient cast, divided by the world size, then
    summed as the simulated AllReduce sums (zerofn.testing.world: a stack
    summed over the rank dimension), cast back."""
    world_size = len(grads)
    return [
        torch.stack([grads[r][i].to(dtype) / world_size for r in range(world_size)])
        .sum(0)
        .to(grads[0][i].dtype)
        for i in range(len(grads[0]))
    ]


def assert_every_rank_equals(
    ranks: list[list[torch.Tensor]], expected: list[torch.Tensor], rtol: float, atol: float
) -> None:
    for rank_params in ranks:
        for got, want in zip(rank_params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@settings(max_examples=draws(150), deadline=None)
@given(case=overlapped_runs(), name=st.sampled_from(sorted(OPTIMIZERS)))
def test_overlapped_step_equals_ddp_then_the_unsharded_optimizer(
    case: dict[str, Any], name: str
) -> None:
    # Plain averaging, reduced to the owners once the plan is fixed: before
    # that every rank steps everything, after it each its shards; either way
    # every rank ends with DDP's average stepped by the whole optimizer.
    optimizer_class, defaults = OPTIMIZERS[name]
    run = simulate_overlapped_step(
        **case, optimizer_class=optimizer_class, reduce_to_owner=True, **defaults
    )
    steps = [ddp_average(grads, torch.float32) for grads in case["grads_per_iteration_per_rank"]]
    expected = unsharded(case["params"], [[p.numel() for p in case["params"]]], steps, name)
    assert_every_rank_equals(run.params, expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=draws(60), deadline=None)
@given(case=overlapped_runs(), name=st.sampled_from(sorted(OPTIMIZERS)))
def test_overlapped_step_with_fp16_compression_steps_the_rounded_average(
    case: dict[str, Any], name: str
) -> None:
    # Any other hook runs as given (all-reduce) and the owners step from its
    # result. The reference rounds exactly as the hook does (ddp_average in
    # fp16), and the optimizers then run the same fp32 operations on the
    # same numbers, so the tolerance only covers the step's own arithmetic,
    # far below one fp16 ulp of a gradient (about 1e-3 relative).
    optimizer_class, defaults = OPTIMIZERS[name]
    run = simulate_overlapped_step(
        **case,
        optimizer_class=optimizer_class,
        inner=cast(allreduce_mean(), torch.float16),
        reduce_to_owner=False,
        **defaults,
    )
    steps = [ddp_average(grads, torch.float16) for grads in case["grads_per_iteration_per_rank"]]
    expected = unsharded(case["params"], [[p.numel() for p in case["params"]]], steps, name)
    assert_every_rank_equals(run.params, expected, rtol=1e-6, atol=1e-7)


def test_fp16_compression_reaches_the_step() -> None:
    # 1/3 is not an fp16 number: SGD with lr=1 moves the parameters by the
    # fp16-rounded average in all three iterations (collecting, then two
    # with the plan fixed), not by the fp32 one.
    params = [torch.zeros(2), torch.zeros(3)]
    per_rank = [[torch.full((2,), 1 / 3), torch.full((3,), 1 / 3)]] * 3
    rounded = ddp_average(per_rank, torch.float16)
    assert not torch.equal(rounded[0], ddp_average(per_rank, torch.float32)[0])
    run = simulate_overlapped_step(
        [[1], [0]],
        params,
        [per_rank] * 3,
        torch.optim.SGD,
        cast(allreduce_mean(), torch.float16),
        lr=1.0,
    )
    assert run.plan is not None
    for rank_params in run.params:
        for p, average in zip(rank_params, rounded, strict=True):
            assert torch.equal(p, -3 * average)


@settings(max_examples=draws(150), deadline=None)
@given(case=overlapped_runs(), reduce_to_owner=st.booleans())
def test_overlapped_step_makes_the_collectives_the_plan_accounts_for(
    case: dict[str, Any], reduce_to_owner: bool
) -> None:
    run = simulate_overlapped_step(
        **case, optimizer_class=torch.optim.SGD, reduce_to_owner=reduce_to_owner, lr=0.1
    )
    buckets, params = case["buckets"], case["params"]
    bucket_sizes = [[params[i].numel() for i in bucket] for bucket in buckets]
    bucket_bytes = [sum(sizes) * 4 for sizes in bucket_sizes]
    model_bytes = sum(bucket_bytes)
    final_from = case["final_from"]
    # The plan is fixed at the end of the first iteration with final buckets.
    fixed = final_from < ITERATIONS
    world_size = len(run.params)
    plan = assign_buckets(bucket_sizes, world_size, case["shard_buckets"])
    assert run.plan == (plan if fixed else None)
    # Every rank kept the state of exactly the parameters it owns.
    owned = owned_params_per_rank(
        OverlapState("initialized", buckets=tuple(map(tuple, buckets)), plan=plan)
    )
    assert run.held == ([tuple(mine) for mine in owned] if fixed else [None] * world_size)
    for iteration, per_rank in enumerate(run.requests):
        for made in per_rank:
            all_reduces = [r for r in made if isinstance(r, AllReduce)]
            reduces = [r for r in made if isinstance(r, Reduce)]
            broadcasts = [r for r in made if isinstance(r, Broadcast)]
            assert len(all_reduces) + len(reduces) + len(broadcasts) == len(made)
            if iteration <= final_from:  # DDP not rebuilt yet, or collecting
                assert [request_bytes(r) for r in made] == bucket_bytes
                assert len(all_reduces) == len(made)
                continue
            # Each shard is sent once from its owner: the model's bytes.
            assert len(broadcasts) == len(plan.shards)
            assert sum(request_bytes(r) for r in broadcasts) == model_bytes
            if reduce_to_owner:  # one all-reduce's bytes in all, not 1.5
                assert not all_reduces
                assert len(reduces) == len(plan.shards)
                assert sum(request_bytes(r) for r in reduces) == model_bytes
            else:
                assert not reduces
                assert [request_bytes(r) for r in all_reduces] == bucket_bytes


def test_simulate_overlapped_step_refuses_buckets_that_miss_a_parameter() -> None:
    params = [torch.zeros(2), torch.zeros(3)]
    grads = [[[torch.zeros(2), torch.zeros(3)]]]
    with pytest.raises(ValueError, match="each of 2 parameters once"):
        simulate_overlapped_step([[1]], params, grads, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="one gradient list per rank"):
        simulate_overlapped_step([[1, 0]], params, [], torch.optim.SGD, lr=0.1)
