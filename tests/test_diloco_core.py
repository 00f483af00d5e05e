"""DiLoCo's pure core: the configuration, the schedule and its state, fragments,
the sync programs on the simulated world (sharded against unsharded, against
plain averaging, quantized), their bytes, the merge, the outer-state bytes and
checkpoints' consolidation. No process group."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint_integrity import same

from zerofn.averaging import average_program
from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Request, recording_requests, request_bytes
from zerofn.diloco.checkpoint import check_layout, consolidate, rank_state_dict, shard
from zerofn.diloco.compressed_sync import compressed_sync_bytes, compressed_sync_program
from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.footprint import outer_state_bytes, outer_state_bytes_per_rank
from zerofn.diloco.fragments import FragmentPlan, plan_fragments, read_fragment, write_fragment
from zerofn.diloco.merge import merge
from zerofn.diloco.outer import (
    OuterStep,
    check_outer_optimizer,
    default_outer_optimizer,
    outer_step,
    pseudo_gradient,
)
from zerofn.diloco.schedule import applied_at, first_sync, fragment_synced_at
from zerofn.diloco.start import agree_program
from zerofn.diloco.state import (
    DiLoCoState,
    InFlight,
    check_state,
    state_from_dict,
    take_inner_step,
)
from zerofn.diloco.sync import run_sync, sync_bytes, sync_program
from zerofn.errors import CollectiveError
from zerofn.testing.world import Dropout, run_programs

SETTINGS = settings(max_examples=draws(40), deadline=None)


@st.composite
def configs(draw: st.DrawFn) -> DiLoCoConfig:
    fragments = draw(st.integers(1, 6))
    sync_every = fragments * draw(st.integers(1, 6))
    delay = draw(st.integers(0, sync_every // fragments - 1))
    return DiLoCoConfig(sync_every, fragments, delay, draw(st.sampled_from([0.0, 0.5, 1.0])))


sizes_lists = st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0)


# ----- the configuration -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync_every": 0}, ValueError, "sync_every must be at least 1"),
        ({"sync_every": 2.0}, TypeError, "sync_every must be an int"),
        ({"sync_every": True}, TypeError, "sync_every must be an int"),
        ({"sync_every": 4, "fragments": 0}, ValueError, "fragments must be at least 1"),
        ({"sync_every": 6, "fragments": 4}, ValueError, r"use one of \[1, 2, 3, 6\]"),
        ({"sync_every": 4, "delay": -1}, ValueError, "delay must be at least 0"),
        ({"sync_every": 8, "fragments": 4, "delay": 2}, ValueError, "use delay <= 1"),
        ({"sync_every": 4, "delay": 4}, ValueError, "sync_every // fragments = 4"),
        ({"sync_every": 4, "mixing": 1.5}, ValueError, r"in \[0, 1\]"),
        ({"sync_every": 4, "mixing": "half"}, TypeError, "mixing must be a number"),
        ({"sync_every": 4, "compression": "int3"}, ValueError, "unknown compression"),
        ({"sync_every": 4, "compression": 8}, TypeError, "compression must be None"),
    ],
)
def test_bad_configurations_are_refused_with_the_fix(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DiLoCoConfig(**kwargs)


def test_compression_names_become_quantizers() -> None:
    assert DiLoCoConfig(4, compression="int8").compression == BlockQuantizer(8)
    assert DiLoCoConfig(4, compression=BlockQuantizer(4, 64)).compression == BlockQuantizer(4, 64)
    assert DiLoCoConfig(4).compression is None


# ----- the schedule and the state ---------------------------------------------------


@SETTINGS
@given(configs(), st.integers(1, 4))
def test_every_fragment_syncs_exactly_once_per_sync_every_steps(
    config: DiLoCoConfig, rounds: int
) -> None:
    H = config.sync_every
    synced = [fragment_synced_at(config, t) for t in range(rounds * H + H)]
    assert synced[0] is None
    for start in range(1, rounds * H + 1):
        window = [f for f in synced[start : start + H] if f is not None]
        assert sorted(window) == list(range(config.fragments))
    starts = [t for t, f in enumerate(synced) if f is not None]
    assert all(b - a == config.stride for a, b in itertools.pairwise(starts))
    for fragment in range(config.fragments):
        assert synced[first_sync(config, fragment)] == fragment


@SETTINGS
@given(configs(), st.integers(1, 3))
def test_the_state_applies_every_sync_delay_steps_after_it_starts(
    config: DiLoCoConfig, rounds: int
) -> None:
    state = DiLoCoState()
    started: dict[int, int] = {}
    applied: dict[int, int] = {}
    for _ in range(rounds * config.sync_every + config.delay):
        before = state
        state, actions = take_inner_step(config, state)
        assert state.step == before.step + 1
        if actions.start is not None:
            started[state.step] = actions.start
            assert before.in_flight is None  # at most one sync in flight
        if actions.apply is not None:
            assert actions.apply.due == state.step
            applied[actions.apply.started] = actions.apply.fragment
        assert state_from_dict(config, state.state_dict()) == state
    assert started == applied
    assert all(applied_at(config, t) <= rounds * config.sync_every + config.delay for t in started)


def test_states_the_schedule_cannot_reach_are_refused() -> None:
    config = DiLoCoConfig(8, fragments=2, delay=2)
    good = DiLoCoState(5, InFlight(0, 4, 6))
    check_state(config, good)
    for bad in (
        DiLoCoState(5, InFlight(1, 4, 6)),  # fragment 1 does not sync at step 4
        DiLoCoState(5, InFlight(0, 4, 7)),  # due delay steps after the start
        DiLoCoState(6, InFlight(0, 4, 6)),  # already past due
    ):
        with pytest.raises(ValueError, match="resume with the configuration"):
            take_inner_step(config, bad)
    with pytest.raises(ValueError, match="needs"):
        state_from_dict(config, {"step": 3})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        DiLoCoState(-1)
    with pytest.raises(ValueError, match="inner step count"):
        fragment_synced_at(config, -1)
    with pytest.raises(ValueError, match="fragment 2 is not in 0..1"):
        first_sync(config, 2)


# ----- fragments --------------------------------------------------------------------


@SETTINGS
@given(sizes_lists, st.integers(1, 8), st.integers(1, 7))
def test_fragments_tile_the_parameters_and_owners_tile_each_fragment(
    sizes: list[int], fragments: int, world_size: int
) -> None:
    fragments = min(fragments, sum(sizes))
    plan = plan_fragments(sizes, fragments, world_size)
    numels = [f.numel for f in plan.fragments]
    assert sum(numels) == sum(sizes) and max(numels) - min(numels) <= 1
    assert [f.start for f in plan.fragments] == list(itertools.accumulate([0, *numels[:-1]]))
    for f in plan.fragments:
        assert sum(p.numel for p in f.pieces) == f.numel
        assert sum(f.lengths) == f.numel and max(f.lengths) - min(f.lengths) <= 1
    assert sum(plan.owned_numel(r) for r in range(world_size)) == sum(sizes)


@SETTINGS
@given(sizes_lists, st.integers(1, 5))
def test_reading_and_writing_a_fragment_round_trip(sizes: list[int], fragments: int) -> None:
    fragments = min(fragments, sum(sizes))
    dtypes = itertools.cycle([torch.float32, torch.float64, torch.bfloat16])
    params = [torch.randn(n).to(d) for n, d in zip(sizes, dtypes, strict=False)]
    plan = plan_fragments(sizes, fragments, 1)
    flat = torch.cat([read_fragment(f, params) for f in plan.fragments])
    assert torch.equal(flat, torch.cat([p.float() for p in params]))
    copies = [torch.zeros_like(p) for p in params]
    for f in plan.fragments:
        write_fragment(f, copies, read_fragment(f, params))
    assert all(torch.equal(a, b) for a, b in zip(copies, params, strict=True))


def test_fragments_that_cannot_be_cut_are_refused() -> None:
    with pytest.raises(ValueError, match="use fragments <= 5"):
        plan_fragments([2, 3], 6, 2)
    with pytest.raises(ValueError, match="at least one element"):
        plan_fragments([0, 0], 1, 2)
    with pytest.raises(ValueError, match="world_size"):
        plan_fragments([4], 1, 0)


# ----- the merge --------------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 30), st.floats(0.0, 1.0))
def test_merging_weighs_local_by_mixing(n: int, mixing: float) -> None:
    local, global_ = torch.randn(n), torch.randn(n)
    merged = merge(local, global_, mixing)
    assert torch.equal(merge(local, global_, 0.0), global_)
    assert torch.equal(merge(local, global_, 1.0), local)
    torch.testing.assert_close(merged, mixing * local + (1 - mixing) * global_)
    low, high = torch.minimum(local, global_), torch.maximum(local, global_)
    assert bool(((merged >= low - 1e-6) & (merged <= high + 1e-6)).all())


def test_bad_merges_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        merge(torch.zeros(2), torch.zeros(2), -0.5)
    with pytest.raises(ValueError, match="cannot merge"):
        merge(torch.zeros(2), torch.zeros(3), 0.5)


# ----- the sync on the simulated world ----------------------------------------------

Factory = Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]

OUTER: dict[str, Factory] = {
    "nesterov": default_outer_optimizer,
    "adam": lambda ts: torch.optim.Adam(list(ts), lr=0.05),
    "sgd lr 1": lambda ts: torch.optim.SGD(list(ts), lr=1.0),
}


class World:
    """W simulated DiLoCo workers: parameters, sharded anchors and outer
    optimizers, and (when compressed) replicas and residuals."""

    def __init__(
        self,
        plan: FragmentPlan,
        params: list[list[torch.Tensor]],
        factory: Factory,
        quantizer: BlockQuantizer | None = None,
    ) -> None:
        self.plan, self.params, self.quantizer = plan, params, quantizer
        flat = [torch.cat([p.reshape(-1) for p in ps]) for ps in params]
        self.anchors = [
            [flat[0][f.start : f.start + f.numel][f.owned(r)].clone() for f in plan.fragments]
            for r in range(plan.world_size)
        ]
        self.outers = [factory(a) for a in self.anchors]
        self.replicas = [flat[0].clone() for _ in params]
        self.residuals = [torch.zeros_like(flat[0]) for _ in params]
        self.requests: list[list[Request]] = [[] for _ in params]
        self.gradients: list[torch.Tensor] = []

    def answer(self, rank: int) -> Callable[[OuterStep], torch.Tensor]:
        def step(request: OuterStep) -> torch.Tensor:
            self.gradients.append(request.gradient.clone())
            return outer_step(self.outers[rank], self.anchors[rank], request)

        return step

    def program(self, rank: int, fragment: int) -> Any:
        f = self.plan.fragments[fragment]
        values = read_fragment(f, self.params[rank])
        span = slice(f.start, f.start + f.numel)
        if self.quantizer is None:
            program = sync_program(f, rank, values, self.anchors[rank][fragment])
        else:
            program = compressed_sync_program(
                f,
                rank,
                values,
                self.replicas[rank][span],
                self.residuals[rank][span],
                self.anchors[rank][fragment],
                self.quantizer,
            )
        return recording_requests(run_sync(program, self.answer(rank)), self.requests[rank].append)

    def sync(self, fragment: int, drop: Dropout | None = None) -> list[torch.Tensor]:
        programs = [self.program(r, fragment) for r in range(self.plan.world_size)]
        return run_programs(programs, drop, purpose=f"sync of fragment {fragment}")


def drift(params: list[list[torch.Tensor]], seed: int) -> None:
    """Every worker moves its parameters its own way (the inner steps)."""
    g = torch.Generator().manual_seed(seed)
    for ps in params:
        for p in ps:
            p.add_(torch.randn(p.shape, generator=g))


def replicated(sizes: list[int], world_size: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(n, generator=g) for n in sizes]
    return [[p.clone() for p in start] for _ in range(world_size)]


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from(sorted(OUTER)),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_the_sharded_outer_step_equals_the_unsharded_one(
    sizes: list[int], fragments: int, world_size: int, outer: str, rounds: int, seed: int
) -> None:
    fragments = min(fragments, sum(sizes))
    params = replicated(sizes, world_size, seed)
    world = World(plan_fragments(sizes, fragments, world_size), params, OUTER[outer])
    whole = World(plan_fragments(sizes, fragments, 1), [params[0]], OUTER[outer])
    for r in range(rounds):
        drift(params, seed + r)
        for fragment in range(fragments):
            results = world.sync(fragment)
            f = world.plan.fragments[fragment]
            # One rank holding the whole anchor, stepped with the same mean.
            mean = torch.stack([read_fragment(f, ps) for ps in params]).sum(0) / world_size
            anchor = whole.anchors[0][fragment]
            outer_step(whole.outers[0], whole.anchors[0], OuterStep(fragment, anchor - mean))
            for result in results:
                torch.testing.assert_close(result, anchor, rtol=1e-6, atol=1e-6)
            for ps, result in zip(params, results, strict=True):
                write_fragment(f, ps, result)
    for fragment in range(fragments):
        joined = torch.cat([world.anchors[r][fragment] for r in range(world_size)])
        torch.testing.assert_close(joined, whole.anchors[0][fragment], rtol=1e-6, atol=1e-6)


@SETTINGS
@given(sizes_lists, st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**16))
def test_outer_sgd_lr_1_every_step_is_averaging_every_step(
    sizes: list[int], world_size: int, steps: int, seed: int
) -> None:
    params = replicated(sizes, world_size, seed)
    averaged = copy.deepcopy(params)
    world = World(plan_fragments(sizes, 1, world_size), params, OUTER["sgd lr 1"])
    config = DiLoCoConfig(sync_every=1)
    state = DiLoCoState()
    for step in range(steps):
        drift(params, seed + step)
        drift(averaged, seed + step)
        state, actions = take_inner_step(config, state)
        assert actions.start == 0 and actions.apply is not None
        f = world.plan.fragments[0]
        for ps, result in zip(params, world.sync(0), strict=True):
            write_fragment(f, ps, merge(read_fragment(f, ps), result, config.mixing))
        means = run_programs([average_program(ps, world_size) for ps in averaged])
        for ps, mean in zip(averaged, means, strict=True):
            for p, m in zip(ps, mean, strict=True):
                p.copy_(m)
    for ours, theirs in zip(params, averaged, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(sizes_lists, st.integers(1, 3), st.integers(1, 5), st.sampled_from([None, 8, 4]))
def test_a_sync_hands_over_the_bytes_planned(
    sizes: list[int], fragments: int, world_size: int, bits: int | None
) -> None:
    fragments = min(fragments, sum(sizes))
    quantizer = None if bits is None else BlockQuantizer(bits, 16)  # type: ignore[arg-type]
    params = replicated(sizes, world_size, 0)
    world = World(
        plan_fragments(sizes, fragments, world_size), params, OUTER["nesterov"], quantizer
    )
    drift(params, 1)
    for fragment, f in enumerate(world.plan.fragments):
        world.requests = [[] for _ in range(world_size)]
        world.sync(fragment)
        for rank, requests in enumerate(world.requests):
            planned = (
                sync_bytes(f) if quantizer is None else compressed_sync_bytes(f, quantizer, rank)
            )
            assert sum(request_bytes(r) for r in requests) == planned


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_int8_syncs_hand_over_at_most_a_quarter_of_the_fp32_bytes_at_any_world_size(
    world_size: int,
) -> None:
    f = plan_fragments([100_000], 1, world_size).fragments[0]
    for rank in range(world_size):
        assert compressed_sync_bytes(f, BlockQuantizer(8), rank) <= 0.26 * sync_bytes(f)


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 5), st.integers(0, 2**16))
def test_compressed_syncs_keep_replicas_identical_and_carry_what_codes_drop(
    n: int, world_size: int, seed: int
) -> None:
    quantizer = BlockQuantizer(8, 16)
    params = replicated([n], world_size, seed)
    world = World(plan_fragments([n], 1, world_size), params, OUTER["sgd lr 1"], quantizer)
    exact = World(plan_fragments([n], 1, world_size), copy.deepcopy(params), OUTER["sgd lr 1"])
    drift(params, seed + 1)
    drift(exact.params, seed + 1)
    truth = [world.replicas[r] - params[r][0] for r in range(world_size)]
    results = world.sync(0)
    exact_result = exact.sync(0)[0]
    assert all(torch.equal(r, results[0]) for r in results)
    f = world.plan.fragments[0]
    # Each owner received a mean that, with the mean of what is still owed,
    # is the true mean pseudo-gradient.
    for owner, received in enumerate(world.gradients):
        owed = torch.stack([res[f.owned(owner)] for res in world.residuals]).mean(0)
        true = torch.stack([t[f.owned(owner)] for t in truth]).mean(0)
        torch.testing.assert_close(received + owed, true, rtol=1e-5, atol=1e-5)
    # And the result is within the codes' rounding of the fp32 sync's.
    step = 2 * max(float(t.abs().max()) for t in truth) / 127 + 1e-6
    assert float((results[0] - exact_result).abs().max()) <= 2 * step


def test_a_lost_rank_fails_every_sync_with_a_collective_error() -> None:
    params = replicated([10, 7], 3, 0)
    world = World(plan_fragments([10, 7], 1, 3), params, OUTER["nesterov"])
    with pytest.raises(CollectiveError, match="rank 2 was dropped"):
        world.sync(0, drop=Dropout(rank=2, at=1))


def test_the_start_gives_everyone_rank_0s_parameters() -> None:
    params = [[torch.randn(3), torch.randn(2).double()] for _ in range(3)]
    expected = copy.deepcopy(params[0])
    run_programs([agree_program(ps) for ps in params])
    for ps in params:
        assert all(
            torch.equal(p, e) and p.dtype == e.dtype for p, e in zip(ps, expected, strict=True)
        )


# ----- the outer optimizer ----------------------------------------------------------


def test_outer_optimizers_that_cannot_step_slices_are_refused() -> None:
    anchors = [torch.zeros(3), torch.zeros(2)]
    assert check_outer_optimizer(default_outer_optimizer(anchors), anchors)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        check_outer_optimizer(object(), anchors)
    with pytest.raises(ValueError, match="exactly the tensors"):
        check_outer_optimizer(torch.optim.SGD([torch.zeros(3)], lr=1), anchors)
    with pytest.raises(ValueError, match="in that order"):
        check_outer_optimizer(torch.optim.SGD(anchors[::-1], lr=1), anchors)
    with pytest.raises(ValueError, match="element-wise"):
        check_outer_optimizer(torch.optim.LBFGS(anchors), anchors)
    before = anchors[0].clone()
    with pytest.raises(ValueError, match="pseudo-gradient of shape"):
        outer_step(default_outer_optimizer(anchors), anchors, OuterStep(0, torch.zeros(2)))
    assert torch.equal(anchors[0], before) and anchors[0].grad is None


def test_the_pseudo_gradient_points_from_the_mean_to_the_anchor() -> None:
    anchor, mean = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    assert torch.equal(pseudo_gradient(anchor, mean), torch.tensor([0.5, -1.0]))


# ----- bytes of outer state ---------------------------------------------------------


@SETTINGS
@given(st.integers(1, 10**7), st.integers(1, 64), st.integers(1, 8), st.booleans())
def test_outer_state_is_about_8_over_w_bytes_per_parameter(
    numel: int, world_size: int, fragments: int, compressed: bool
) -> None:
    fragments = min(fragments, numel)
    most = outer_state_bytes_per_rank(numel, world_size, fragments, compressed)
    extra = 8 * numel if compressed else 0
    # Each fragment's slices differ by at most one element.
    assert most - extra <= 8 * (numel / world_size + fragments)
    assert most - extra >= 8 * numel / world_size
    plan = plan_fragments([numel], fragments, world_size)
    total = sum(outer_state_bytes(plan, r, compressed=False) for r in range(world_size))
    assert total == 8 * numel
    with pytest.raises(ValueError, match="state_tensors"):
        outer_state_bytes(plan, 0, False, state_tensors=-1)
    with pytest.raises(ValueError, match="outside"):
        outer_state_bytes(plan, world_size, False)


# ----- checkpoints ------------------------------------------------------------------


def per_rank_dicts(world: World, state: DiLoCoState) -> list[dict[str, Any]]:
    compressed = world.quantizer is not None
    return [
        rank_state_dict(
            world.plan,
            rank,
            state,
            None,
            world.anchors[rank],
            world.outers[rank].state_dict(),
            world.replicas[rank] if compressed else None,
            world.residuals[rank] if compressed else None,
        )
        for rank in range(world.plan.world_size)
    ]


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from(["nesterov", "adam"]),
    st.booleans(),
)
def test_consolidated_state_reshards_to_any_world_size(
    sizes: list[int], fragments: int, world_size: int, other: int, outer: str, compressed: bool
) -> None:
    fragments = min(fragments, sum(sizes))
    quantizer = BlockQuantizer(8, 16) if compressed else None
    params = replicated(sizes, world_size, 3)
    world = World(plan_fragments(sizes, fragments, world_size), params, OUTER[outer], quantizer)
    drift(params, 4)
    for fragment in range(fragments):
        world.sync(fragment)
    saved = per_rank_dicts(world, DiLoCoState(7))
    whole = consolidate(world.plan, saved)
    if not compressed:
        assert all(same(shard(world.plan, whole, r), saved[r]) for r in range(world_size))
    elsewhere = plan_fragments(sizes, fragments, other)
    again = consolidate(elsewhere, [shard(elsewhere, whole, r) for r in range(other)])
    if compressed:  # the mean of equal residuals, up to rounding
        torch.testing.assert_close(again.pop("residual"), whole.pop("residual"))
    assert same(again, whole)


def test_state_dicts_that_do_not_fit_are_refused_with_the_fix() -> None:
    world = World(plan_fragments([6, 4], 2, 2), replicated([6, 4], 2, 0), OUTER["nesterov"])
    saved = per_rank_dicts(world, DiLoCoState())
    plan = world.plan
    with pytest.raises(ValueError, match="rank 0's of an outer group of 2 ranks; load it there"):
        check_layout(plan, saved[0], 1, compressed=False)
    with pytest.raises(ValueError, match="consolidated_state_dict"):
        shard(plan, saved[0], 0)
    with pytest.raises(ValueError, match="same fragments"):
        check_layout(plan_fragments([6, 4], 1, 2), saved[0], 0, compressed=False)
    with pytest.raises(ValueError, match="compression it was saved with"):
        check_layout(plan, saved[0], 0, compressed=True)
    with pytest.raises(ValueError, match="not a DiLoCo state dict"):
        check_layout(plan, {**saved[0], "format": "other"}, 0, compressed=False)
    with pytest.raises(ValueError, match="2 state dicts for an outer group of 3"):
        consolidate(plan_fragments([6, 4], 2, 3), saved)
