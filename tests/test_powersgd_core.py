"""PowerSGD's pure core on the simulated world: error feedback conserves the
signal, ranks agree, the compression ratio and the request count are what the
design promises, the seed stream and random factors are PyTorch's, and the
state survives a weights-only checkpoint."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from _draws import draws
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize as torch_orthogonalize,
)

from zerofn.comm import AllReduce, Program, Request, Response
from zerofn.hooks import powersgd
from zerofn.hooks.hook import (
    BucketInfo,
    HookState,
    begin_bucket,
    finish_iteration,
    init_hook_state,
)
from zerofn.hooks.powersgd import (
    PowerSGDBucketState,
    PowerSGDConfig,
    PowerSGDGlobalState,
    PowerSGDHook,
)
from zerofn.hooks.powersgd.state import KeyFinder, tracked
from zerofn.testing import strategies as zst
from zerofn.testing.world import run_programs, simulate_iteration

SETTINGS = settings(max_examples=draws(40), deadline=None)
State = HookState[PowerSGDGlobalState, PowerSGDBucketState | None]
Shapes = list[tuple[int, ...]]

# Shapes of one bucket: matrices worth compressing, vectors, scalars, empties.
bucket_shapes = st.lists(zst.shapes(0, 3, min_side=0, max_side=12), min_size=1, max_size=5)
ranks = st.integers(1, 3)
VARIANTS = {"layerwise": powersgd.layerwise, "batched": powersgd.batched}


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def compressing(hook: PowerSGDHook, config: PowerSGDConfig) -> State:
    """A fresh state that compresses from its first iteration on."""
    state = init_hook_state(hook)
    global_state = attrs.evolve(state.global_state, iteration=config.start_powerSGD_iter)
    return attrs.evolve(state, global_state=global_state)


def random_grads(shapes: Sequence[Shapes], world_size: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(sum(map(numel, bucket)), generator=generator) for bucket in shapes]
        for _ in range(world_size)
    ]


def config(rank: int = 1, **overrides: Any) -> PowerSGDConfig:
    # Tiny padded buckets are rank-deficient: a Gram-Schmidt column can vanish
    # exactly, and 0 / 0 is NaN without an epsilon (in PyTorch's hook as well).
    overrides.setdefault("orthogonalization_epsilon", 1e-8)
    return PowerSGDConfig(matrix_approximation_rank=rank, start_powerSGD_iter=2, **overrides)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@SETTINGS
@given(shapes=bucket_shapes, rank=ranks, warm_start=st.booleans(), seed=st.integers(0, 99))
def test_one_rank_decoded_plus_new_error_is_gradient_plus_old_error(
    variant: str, shapes: Shapes, rank: int, warm_start: bool, seed: int
) -> None:
    assume(sum(map(numel, shapes)) > 0)
    cfg = config(rank, warm_start=warm_start)
    hook = VARIANTS[variant](cfg)
    state = compressing(hook, cfg)
    for step in range(3):  # the first step starts from no error, the others from some
        old = state.bucket(0)
        (grads,) = random_grads([shapes], 1, seed + step)
        (outs,), (state,) = simulate_iteration(hook, [grads], [state], [shapes])
        new = state.bucket(0)
        assert new is not None and new.error is not None
        length = grads[0].numel()
        old_error = old.error[:length] if old is not None and old.error is not None else 0
        torch.testing.assert_close(
            outs[0] + new.error[:length], grads[0] + old_error, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@SETTINGS
@given(
    buckets=st.lists(bucket_shapes, min_size=1, max_size=3),
    world_size=st.integers(2, 3),
    rank=ranks,
    batch=st.booleans(),
    seed=st.integers(0, 99),
)
def test_all_ranks_decode_the_same_gradient(
    variant: str, buckets: list[Shapes], world_size: int, rank: int, batch: bool, seed: int
) -> None:
    assume(all(sum(map(numel, b)) > 0 for b in buckets))
    cfg = config(rank, batch_tensors_with_same_shape=batch)
    hook = VARIANTS[variant](cfg)
    states = [compressing(hook, cfg) for _ in range(world_size)]
    for step in range(2):
        grads = random_grads(buckets, world_size, seed + step)
        outs, states = simulate_iteration(hook, grads, states, buckets)
        for rank_outs in outs[1:]:
            for ours, rank0s in zip(rank_outs, outs[0], strict=True):
                assert torch.equal(ours, rank0s)
    assert len({s.global_state.iteration for s in states}) == 1


@SETTINGS
@given(shapes=bucket_shapes, rank=ranks, rate=st.sampled_from([1, 1.5, 2, 4]))
def test_compression_ratio_is_rank_times_rows_plus_cols_over_size(
    shapes: Shapes, rank: int, rate: float
) -> None:
    layout = powersgd.bucket_layout(shapes, rank, rate)
    assert layout.numel == sum(map(numel, shapes))
    for plan, shape in zip(layout.matrices, shapes, strict=True):
        n, m = plan.rows, plan.cols
        assert n * m == numel(shape)
        assert plan.compressed == ((n + m) * plan.rank * rate < n * m)
        if plan.compressed:
            assert plan.rank == rank  # compression never pays off at a clipped rank
            assert plan.sent_numel / plan.numel == pytest.approx(rank * (n + m) / (n * m))
        else:
            assert plan.sent_numel == plan.numel
    assert layout.p_numel == sum(p.rows * p.rank for p in layout.matrices if p.compressed)
    assert layout.q_numel == sum(p.cols * p.rank for p in layout.matrices if p.compressed)


@SETTINGS
@given(buckets=st.lists(bucket_shapes, min_size=1, max_size=3), rank=ranks)
def test_statistics_count_every_compressing_bucket(buckets: list[Shapes], rank: int) -> None:
    assume(all(sum(map(numel, b)) > 0 for b in buckets))
    cfg = config(rank)
    hook = powersgd.layerwise(cfg)
    _, (state,) = simulate_iteration(
        hook, random_grads(buckets, 1, 0), [compressing(hook, cfg)], buckets
    )
    layouts = [powersgd.bucket_layout(b, rank, cfg.min_compression_rate) for b in buckets]
    before, after = sum(lay.numel for lay in layouts), sum(lay.sent_numel for lay in layouts)
    rate = before / after if after else 0.0
    assert powersgd.compression_stats(state.global_state) == (rate, before, after)


def counted(program: Program[Any], log: list[Request]) -> Program[Any]:
    """``program``, recording each request it makes."""
    try:
        request = next(program)
        while True:
            log.append(request)
            response: Response = yield request
            request = program.send(response)
    except StopIteration as stop:
        return stop.value


def bucket_requests(
    hook: PowerSGDHook, state: State, grad: torch.Tensor, shapes: Shapes
) -> tuple[list[Request], State]:
    info = BucketInfo(0, tuple(shapes), world_size=1, is_last=True)
    state, program = begin_bucket(hook, state, grad, info)
    log: list[Request] = []
    run_programs([counted(program, log)])
    return log, state


@SETTINGS
@given(shapes=bucket_shapes, rank=ranks)
def test_two_requests_per_compressing_bucket(shapes: Shapes, rank: int) -> None:
    assume(sum(map(numel, shapes)) > 0)
    cfg = config(rank)
    layout = powersgd.bucket_layout(shapes, rank, cfg.min_compression_rate)
    hook = powersgd.layerwise(cfg)
    (grad,) = random_grads([shapes], 1, 0)[0]
    log, _ = bucket_requests(hook, compressing(hook, cfg), grad, shapes)
    assert all(isinstance(r, AllReduce) and r.op == "sum" for r in log)
    assert [r.last for r in log] == [False] * (len(log) - 1) + [True]
    if not layout.groups:
        assert len(log) == 1  # nothing to compress: one plain round trip
        return
    assert len(log) == 2
    first, second = log
    assert isinstance(first, AllReduce) and isinstance(second, AllReduce)
    unc_numel = sum(p.numel for p in layout.uncompressed)
    # Round 1: uncompressed gradients and P factors together; round 2: Q factors.
    assert [t.numel() for t in first.tensors] == [unc_numel, layout.p_numel]
    assert [t.numel() for t in second.tensors] == [layout.q_numel]


@SETTINGS
@given(shapes=bucket_shapes, rank=ranks)
def test_batched_sends_two_square_side_factors(shapes: Shapes, rank: int) -> None:
    total = sum(map(numel, shapes))
    assume(total > 0)
    cfg = config(rank)
    hook = powersgd.batched(cfg)
    (grad,) = random_grads([shapes], 1, 0)[0]
    log, state = bucket_requests(hook, compressing(hook, cfg), grad, shapes)
    side = powersgd.square_side(total)
    assert side * side >= total > (side - 1) ** 2
    sizes = [[t.numel() for t in r.tensors] for r in log if isinstance(r, AllReduce)]
    assert sizes == [[side * min(side, rank)]] * 2
    assert powersgd.compression_stats(state.global_state)[1:] == (total, 2 * side * min(side, rank))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plain_average_before_start_then_compression(variant: str) -> None:
    cfg = config(1)
    hook = VARIANTS[variant](cfg)
    shapes = [(16, 16), (16,)]
    state = init_hook_state(hook)
    requests = []
    for step in range(4):
        (grad,) = random_grads([shapes], 1, step)[0]
        log, state = bucket_requests(hook, state, grad, shapes)
        state = attrs.evolve(state, global_state=hook.end_iteration(state.global_state))
        requests.append(len(log))
        if step < 2:
            # What PyTorch's default hook does: divide, then all-reduce.
            assert isinstance(log[0], AllReduce) and log[0].last
            assert state.bucket(0) is None
    assert requests == [1, 1, 2, 2]
    assert state.global_state.iteration == 4


def test_plain_average_is_the_mean_over_ranks() -> None:
    hook = powersgd.layerwise(config(1))
    grads = random_grads([[(8, 8)]], 3, 0)
    (outs, *_), _ = simulate_iteration(hook, grads, shapes=[[(8, 8)]])
    torch.testing.assert_close(outs[0], sum(g[0] for g in grads) / 3)


def test_warm_start_draws_one_seed_per_bucket_once() -> None:
    shapes = [[(16, 8)], [(8, 16), (4,)]]
    for warm_start, expected_draws in ((True, 2), (False, 6)):
        cfg = config(1, warm_start=warm_start)
        hook = powersgd.layerwise(cfg)
        state = compressing(hook, cfg)
        for step in range(3):
            _, (state,) = simulate_iteration(hook, random_grads(shapes, 1, step), [state], shapes)
        reference = np.random.RandomState(cfg.random_seed)
        for _ in range(expected_draws):
            reference.randint(1_000_000_000)
        assert state.global_state.seeds.pos == reference.get_state()[2], warm_start


def test_seed_stream_follows_numpy_and_survives_weights_only_load() -> None:
    stream = powersgd.SeedStream.from_seed(1234)
    reference = np.random.RandomState(1234)
    for _ in range(700):  # past one Mersenne Twister refill (624 words)
        seed, stream = powersgd.draw_seed(stream)
        assert seed == reference.randint(1_000_000_000)
    assert stream.keys.dtype == torch.uint32
    cfg = config()
    state = init_hook_state(powersgd.layerwise(cfg))
    state = attrs.evolve(state, global_state=attrs.evolve(state.global_state, seeds=stream))
    _, loaded = powersgd.from_state_dict(weights_only_copy(powersgd.to_state_dict(cfg, state)))
    stream = loaded.global_state.seeds
    for _ in range(10):
        seed, stream = powersgd.draw_seed(stream)
        assert seed == reference.randint(1_000_000_000)


@pytest.mark.parametrize("batch", [False, True])
def test_random_factors_are_pytorchs_draws(batch: bool) -> None:
    layout = powersgd.bucket_layout([(6, 5), (9, 4), (6, 5), (6, 5), (3,)], 2, 1)
    ours = powersgd.random_factors(layout, 77, batch, torch.float32, torch.device("cpu"))
    # PyTorch: seed the (forked) global generator, one randn per matrix or per shape.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(77)
        theirs = []
        for group in layout.groups:
            if batch:
                theirs.append(torch.randn(group.size, group.cols, group.rank))
            else:
                theirs.append(torch.cat([torch.randn(1, group.cols, 2) for _ in group.offsets]))
    assert [g.offsets for g in layout.groups] == [(0, 66, 96), (30,)]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@SETTINGS
@given(
    batch=st.integers(1, 4),
    rows=st.integers(1, 12),
    cols=st.integers(1, 5),
    epsilon=st.sampled_from([0.0, 1e-8]),
    seed=st.integers(0, 99),
)
def test_batched_orthogonalisation_equals_pytorchs_per_matrix_loop(
    batch: int, rows: int, cols: int, epsilon: float, seed: int
) -> None:
    assume(cols <= rows)
    generator = torch.Generator().manual_seed(seed)
    matrices = torch.randn(batch, rows, cols, generator=generator)
    ours = powersgd.orthogonalize(matrices, epsilon)
    for i in range(batch):
        theirs = matrices[i : i + 1].clone()
        torch_orthogonalize(theirs, epsilon)
        torch.testing.assert_close(ours[i : i + 1], theirs, rtol=1e-6, atol=1e-6)
    # Gram-Schmidt loses orthogonality in proportion to the matrix's condition
    # number (seed 69 draws a 2x2 of condition 345): allow float32's epsilon
    # times that, and never less than 1e-5.
    condition = torch.linalg.cond(matrices.double()).clamp(max=1e6)
    for i in range(batch):
        tolerance = max(1e-5, 8 * torch.finfo(torch.float32).eps * float(condition[i]))
        gram = ours[i].T @ ours[i]
        torch.testing.assert_close(gram, torch.eye(cols), rtol=0, atol=tolerance)


def test_orthogonalize_refuses_wide_or_unbatched_input() -> None:
    with pytest.raises(ValueError, match="cols <= rows"):
        powersgd.orthogonalize(torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="batch"):
        powersgd.orthogonalize(torch.randn(4, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"matrix_approximation_rank": 0}, ValueError, "matrix_approximation_rank"),
        ({"matrix_approximation_rank": -3}, ValueError, "matrix_approximation_rank"),
        ({"matrix_approximation_rank": 1.5}, TypeError, "matrix_approximation_rank"),
        ({"start_powerSGD_iter": -1}, ValueError, "start_powerSGD_iter"),
        ({"start_powerSGD_iter": 1}, ValueError, "start_powerSGD_iter must be > 1"),
        ({"min_compression_rate": 0.5}, ValueError, "min_compression_rate"),
        ({"min_compression_rate": "2"}, TypeError, "min_compression_rate"),
        ({"orthogonalization_epsilon": -1e-8}, ValueError, "orthogonalization_epsilon"),
        ({"random_seed": -1}, ValueError, "random_seed"),
        ({"random_seed": 2**32}, ValueError, "random_seed"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PowerSGDConfig(**kwargs)


def test_config_defaults_are_pytorchs() -> None:
    cfg = PowerSGDConfig()
    assert attrs.asdict(cfg) == {
        "matrix_approximation_rank": 1,
        "start_powerSGD_iter": 1_000,
        "min_compression_rate": 2,
        "use_error_feedback": True,
        "warm_start": True,
        "orthogonalization_epsilon": 0,
        "random_seed": 0,
        "compression_stats_logging_frequency": 10_000,
        "batch_tensors_with_same_shape": False,
    }
    # No state kept across steps: compression may start at once.
    PowerSGDConfig(start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    assert (
        PowerSGDConfig(compression_stats_logging_frequency=0).compression_stats_logging_frequency
        == 1
    )


def test_statistics_reports_are_scheduled_after_the_last_bucket() -> None:
    cfg = config(1, compression_stats_logging_frequency=3)
    state = powersgd.init_global_state(cfg)
    state = attrs.evolve(state, iteration=5)
    not_last = powersgd.record_compression(state, 100, 10, False, cfg)
    assert not_last.next_stats_report == 0
    last = powersgd.record_compression(not_last, 100, 10, True, cfg)
    assert last.next_stats_report == 8
    assert powersgd.compression_stats(last) == (10.0, 200, 20)
    assert powersgd.compression_stats(powersgd.init_global_state(cfg)) == (0.0, 0, 0)


def weights_only_copy(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("warm_start", [True, False])
def test_state_dict_resumes_exactly(variant: str, warm_start: bool) -> None:
    buckets = [[(12, 10), (10,)], [(7, 7, 2), (9, 9)]]
    cfg = config(2, warm_start=warm_start, random_seed=5)
    hook = VARIANTS[variant](cfg)
    steps = [random_grads(buckets, 2, step) for step in range(6)]
    through: list[State] = [init_hook_state(hook)] * 2
    for grads in steps[:3]:
        _, through = simulate_iteration(hook, grads, through, buckets)
    loaded = [
        powersgd.from_state_dict(weights_only_copy(powersgd.to_state_dict(cfg, s))) for s in through
    ]
    assert all(c == cfg for c, _ in loaded)
    resumed = [s for _, s in loaded]
    for grads in steps[3:]:
        outs_a, through = simulate_iteration(hook, grads, through, buckets)
        outs_b, resumed = simulate_iteration(hook, grads, resumed, buckets)
        for a, b in zip(outs_a[0] + outs_a[1], outs_b[0] + outs_b[1], strict=True):
            assert torch.equal(a, b)
    assert resumed[0].global_state.iteration == 6


def first_key(sd: dict[str, Any]) -> Any:
    return next(iter(sd["parameters"]))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda sd: sd.pop("format"), "not a PowerSGD state dict"),
        (lambda sd: sd.update(format="zerofn.powersgd/1"), r"upgrade_v1\(state_dict\)"),
        (lambda sd: sd.update(format="zerofn.hooks.powersgd/1"), "not a PowerSGD state dict"),
        (lambda sd: sd.update(format="zerofn.powersgd/3"), "not a PowerSGD state dict"),
        (lambda sd: sd.pop("seeds"), "lacks 'seeds'"),
        (lambda sd: sd.pop("parameters"), "lacks 'parameters'"),
        (lambda sd: sd["config"].update(matrix_approximation_rank=0), "matrix_approximation_rank"),
        (lambda sd: sd["config"].update(colour="blue"), "unknown config"),
        (lambda sd: sd["parameters"][first_key(sd)].update(error=[1.0]), "'error' is a list"),
        (
            lambda sd: sd["parameters"][first_key(sd)].update(error=torch.zeros(3)),
            r"'error' has 3 elements, its shape \[8, 8\] 64",
        ),
        (
            lambda sd: sd["parameters"][first_key(sd)].update(q=torch.zeros(5, 1)),
            r"'q' has shape \[5, 1\], expected \[8, rank\]",
        ),
        (lambda sd: sd["parameters"][first_key(sd)].pop("shape"), "lacks 'shape'"),
        (lambda sd: sd["previous_layout"][0].pop("shapes"), "previous_layout bucket 0 lacks"),
        (lambda sd: sd["seeds"].update(keys=torch.zeros(3, dtype=torch.uint32)), "keys"),
    ],
)
def test_from_state_dict_refuses_damaged_dicts(damage: Any, match: str) -> None:
    cfg = config(1)
    hook = powersgd.layerwise(cfg)
    _, (state,) = simulate_iteration(
        hook, random_grads([[(8, 8)]], 1, 0), [compressing(hook, cfg)], [[(8, 8)]]
    )
    state_dict = powersgd.to_state_dict(cfg, state)
    assert state_dict["format"] == powersgd.STATE_DICT_FORMAT
    damage(state_dict)
    with pytest.raises(ValueError, match=match):
        powersgd.from_state_dict(state_dict)


def test_upgrade_v1_keeps_the_run_but_not_the_bucket_memories() -> None:
    cfg = config(1)
    hook = powersgd.layerwise(cfg)
    _, (state,) = simulate_iteration(
        hook, random_grads([[(8, 8)]], 1, 0), [compressing(hook, cfg)], [[(8, 8)]]
    )
    current = powersgd.to_state_dict(cfg, state)
    old = {k: v for k, v in current.items() if k not in ("parameters", "squares")}
    old.update(format="zerofn.powersgd/1", buckets={0: {"error": torch.zeros(64)}})
    loaded_cfg, loaded = powersgd.from_state_dict(powersgd.upgrade_v1(old))
    assert loaded_cfg == cfg
    assert loaded.global_state.iteration == state.global_state.iteration
    assert powersgd.memories(loaded) == {}
    with pytest.raises(ValueError, match="format 'zerofn.powersgd/1'"):
        powersgd.upgrade_v1(current)


# Format 1 exactly as zerofn wrote it: bucket-keyed memories, no layouts.
V1_STATE_DICT: dict[str, Any] = {
    "format": "zerofn.powersgd/1",
    "config": {
        "matrix_approximation_rank": 1,
        "start_powerSGD_iter": 2,
        "min_compression_rate": 2.0,
        "use_error_feedback": True,
        "warm_start": True,
        "orthogonalization_epsilon": 0.0,
        "random_seed": 0,
        "compression_stats_logging_frequency": 10000,
        "batch_tensors_with_same_shape": False,
    },
    "iteration": 7,
    "seeds": {
        "keys": torch.arange(624, dtype=torch.int64),
        "pos": 624,
        "has_gauss": 0,
        "cached_gaussian": 0.0,
    },
    "numel_before_compression": 640,
    "numel_after_compression": 160,
    "next_stats_report": 10000,
    "buckets": {
        0: {"shapes": [[8, 8]], "batched": False, "error": torch.zeros(64), "p": torch.ones(8, 1)}
    },
}


@pytest.mark.parametrize("tag", ["zerofn.powersgd/2", "zerofn.hooks.powersgd/2"])
def test_every_tag_format_2_was_saved_under_loads(tag: str) -> None:
    cfg = config(1)
    hook = powersgd.layerwise(cfg)
    _, (state,) = simulate_iteration(
        hook, random_grads([[(8, 8)]], 1, 0), [compressing(hook, cfg)], [[(8, 8)]]
    )
    saved = {**powersgd.to_state_dict(cfg, state), "format": tag}
    loaded_cfg, loaded = powersgd.from_state_dict(saved)
    assert loaded_cfg == cfg
    assert loaded.global_state.iteration == state.global_state.iteration
    assert set(powersgd.memories(loaded)) == set(powersgd.memories(state))


def test_a_literal_format_1_dict_is_refused_then_upgraded() -> None:
    with pytest.raises(ValueError, match=r"format 'zerofn.powersgd/1'.*upgrade_v1"):
        powersgd.from_state_dict(V1_STATE_DICT)
    upgraded = powersgd.upgrade_v1(V1_STATE_DICT)
    assert upgraded["format"] == "zerofn.powersgd/2"
    loaded_cfg, loaded = powersgd.from_state_dict(upgraded)
    assert loaded_cfg.matrix_approximation_rank == 1
    assert loaded.global_state.iteration == 7
    assert loaded.global_state.numel_after_compression == 160
    assert powersgd.memories(loaded) == {}


def test_memory_for_another_shape_is_refused() -> None:
    """A parameter whose memory was made for another shape (one state shared
    by two models) is refused when its bucket claims it; so is a bucket state
    at an index whose gradients have other shapes, without a claim."""
    cfg = config(1)
    layer_hook = powersgd.layerwise(cfg)
    state = powersgd.claim(compressing(layer_hook, cfg), 0, [0], [(8, 8)])
    _, (state,) = simulate_iteration(
        layer_hook, random_grads([[(8, 8)]], 1, 0), [state], [[(8, 8)]]
    )
    with pytest.raises(ValueError, match=r"parameter 0 was made for shape \[8, 8\].*\[4, 16\]"):
        powersgd.claim(state, 0, [0], [(4, 16)])
    with pytest.raises(ValueError, match=r"parameter 0 .*shape \[8, 8\].*\[64\]"):
        powersgd.claim(state, 1, [5, 0], [(3,), (64,)])
    info = BucketInfo(0, ((4, 16),), world_size=1, is_last=True)
    with pytest.raises(ValueError, match=r"bucket 0 .* shapes \[\(8, 8\)\].*\[\(4, 16\)\]"):
        begin_bucket(layer_hook, state, torch.zeros(64), info)
    # The same shape under the other variant is defined: the batched hook
    # uses the per-parameter error and starts its square Q afresh.
    batched_hook = powersgd.batched(cfg)
    same_shape = BucketInfo(0, ((8, 8),), world_size=1, is_last=True)
    begin_bucket(batched_hook, state, torch.zeros(64), same_shape)


def test_hook_leaves_the_gradient_alone() -> None:
    cfg = config(2)
    for make in VARIANTS.values():
        hook = make(cfg)
        grads = random_grads([[(9, 7), (7,)]], 2, 0)
        before = [g[0].clone() for g in grads]
        state = [compressing(hook, cfg)] * 2
        for _ in range(2):
            _, state = simulate_iteration(hook, grads, state, [[(9, 7), (7,)]])
        for g, b in zip(grads, before, strict=True):
            assert torch.equal(g[0], b)


def claimed(state: State, layout: Sequence[tuple[Sequence[Any], Shapes]]) -> State:
    """``state`` with each bucket's parameters claimed, as a driver does."""
    for index, (keys, shapes) in enumerate(layout):
        state = powersgd.claim(state, index, keys, shapes)
    return state


def run_claimed(
    hook: PowerSGDHook,
    states: list[State],
    layout: Sequence[tuple[Sequence[Any], Shapes]],
    by_key: dict[Any, list[torch.Tensor]],
) -> tuple[list[dict[Any, torch.Tensor]], list[State]]:
    """One iteration on ``layout`` (buckets of parameter keys) with each
    rank's gradients given per key; each rank's results per key."""
    world_size = len(states)
    grads = [
        [torch.cat([by_key[k][r].reshape(-1) for k in keys]) for keys, _ in layout]
        for r in range(world_size)
    ]
    shapes = [list(s) for _, s in layout]
    states = [claimed(s, layout) for s in states]
    outs, states = simulate_iteration(hook, grads, states, shapes)
    per_key: list[dict[Any, torch.Tensor]] = [{} for _ in range(world_size)]
    for r in range(world_size):
        for (keys, bucket_shapes), out in zip(layout, outs[r], strict=True):
            numels = [numel(s) for s in bucket_shapes]
            for k, part in zip(keys, out.split(numels), strict=True):
                per_key[r][k] = part
    return per_key, states


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("warm_start", [True, False])
def test_restored_state_compresses_provisional_buckets_with_its_memories(
    variant: str, warm_start: bool
) -> None:
    """A fresh DDP model's first iteration runs on provisional buckets (one
    bucket, parameters reversed): a restored state compresses it with each
    parameter's memories (two collectives, not plain averaging) and continues
    exactly as the run that was never interrupted. (The batched hook: when the
    provisional bucket holds the same parameters as a saved one.)"""
    cfg = config(2, warm_start=warm_start, random_seed=3)
    hook = VARIANTS[variant](cfg)
    shapes = {0: (16, 12), 1: (16,), 2: (6, 4, 4), 3: (12, 16)}
    rebuilt = [((0, 1), [shapes[0], shapes[1]]), ((2, 3), [shapes[2], shapes[3]])]
    if variant == "batched":
        rebuilt = [((0, 1, 2, 3), list(shapes.values()))]
    provisional = [((3, 2, 1, 0), [shapes[k] for k in (3, 2, 1, 0)])]
    generator = torch.Generator().manual_seed(0)
    steps = [
        {k: [torch.randn(s, generator=generator) for _ in range(2)] for k, s in shapes.items()}
        for _ in range(6)
    ]
    through = [compressing(hook, cfg)] * 2
    for grads in steps[:2]:
        _, through = run_claimed(hook, through, rebuilt, grads)
    resumed = [
        powersgd.from_state_dict(weights_only_copy(powersgd.to_state_dict(cfg, s)))[1]
        for s in through
    ]
    log, _ = bucket_requests(
        hook,
        claimed(resumed[0], provisional),
        torch.cat([steps[2][k][0].reshape(-1) for k in (3, 2, 1, 0)]),
        provisional[0][1],
    )
    assert len(log) == 2  # compressing, not plain averaging
    for i, grads in enumerate(steps[2:]):
        want, through = run_claimed(hook, through, rebuilt, grads)
        got, resumed = run_claimed(hook, resumed, provisional if i == 0 else rebuilt, grads)
        for w, g in zip(want, got, strict=True):
            for k in shapes:
                torch.testing.assert_close(g[k], w[k], rtol=1e-6, atol=1e-7)
    assert resumed[0].global_state.iteration == through[0].global_state.iteration


def test_keys_are_looked_up_when_tracked_and_learned_from_the_provisional_buckets() -> None:
    from zerofn.hooks.powersgd.state import bucket_keys, finish_key_iteration

    finder, keys = bucket_keys(tracked([10, 11, 12, 13]), [13, 11], None)
    assert keys == (3, 1)
    # Untracked, count unknown: DDP's first iteration takes the parameters
    # from the model's end (each bucket in model order); their keys are known
    # once the iteration is over.
    finder, keys = bucket_keys(KeyFinder(), [12, 13], None)
    assert keys is None
    finder, keys = bucket_keys(finder, [10, 11], None)
    assert keys is None
    finder = finish_key_iteration(finder)
    assert bucket_keys(finder, [10, 11, 12, 13], None)[1] == (0, 1, 2, 3)
    assert finder.from_end == {}
    # Count known (a restored layout): keys at once.
    _, keys = bucket_keys(KeyFinder(), [12, 13], 4)
    assert keys == (2, 3)


@st.composite
def learning_cases(draw: st.DrawFn) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Parameter identities; DDP's provisional buckets of an untracked model
    (runs in model order, taken from the model's end); rebuilt buckets (any
    order, any cut)."""
    n = draw(st.integers(1, 6))
    identities = draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n, unique=True))

    def cut(order: Sequence[int]) -> list[list[int]]:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1)))) if n > 1 else []
        return [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]

    provisional = list(reversed(cut(range(n))))
    rebuilt = cut(draw(st.permutations(range(n))))
    return identities, provisional, rebuilt


def _memories_by_key(n: int) -> tuple[dict[int, tuple[int, ...]], PowerSGDBucketState]:
    """A shape per parameter and an unclaimed memory each, its error filled
    with its key (as a restored state holds them)."""
    shapes = {k: (k + 2, 3) for k in range(n)}
    params = tuple(
        powersgd.ParamMemory(shapes[k], error=torch.full((numel(shapes[k]),), float(k)))
        for k in range(n)
    )
    return shapes, PowerSGDBucketState(tuple(range(n)), tuple(shapes.values()), params)


@SETTINGS
@given(learning_cases())
def test_keys_are_learned_in_the_hook_state_then_claim_the_memories(
    case: tuple[list[int], list[list[int]], list[list[int]]],
) -> None:
    """Untracked, with no layout to count the parameters by: the provisional
    iteration claims nothing (its buckets are keyed by position) while the
    global state learns the keys; from the next iteration on, each bucket
    claims the memories of exactly its parameters."""
    identities, provisional, rebuilt = case
    shapes, unclaimed = _memories_by_key(len(identities))
    hook = powersgd.layerwise(config(1))
    state = attrs.evolve(init_hook_state(hook), buckets=((powersgd.UNCLAIMED, unclaimed),))
    for index, bucket in enumerate(provisional):
        ids, bucket_shapes = [identities[k] for k in bucket], [shapes[k] for k in bucket]
        state = powersgd.claim_parameters(state, index, ids, bucket_shapes)
        assert [i for i, _ in state.buckets] == [powersgd.UNCLAIMED]
    state = finish_iteration(hook, state)
    assert state.global_state.parameter_keys.from_end == {}
    for index, bucket in enumerate(rebuilt):
        ids, bucket_shapes = [identities[k] for k in bucket], [shapes[k] for k in bucket]
        state = powersgd.claim_parameters(state, index, ids, bucket_shapes)
        claimed = state.bucket(index)
        assert claimed is not None and claimed.keys == tuple(bucket)
        errors = [m.error for m in claimed.params if m is not None and m.error is not None]
        assert [int(e[0]) for e in errors] == bucket
    assert state.bucket(powersgd.UNCLAIMED) is None


@SETTINGS
@given(learning_cases())
def test_a_restored_layout_gives_the_keys_from_the_first_bucket(
    case: tuple[list[int], list[list[int]], list[list[int]]],
) -> None:
    """A restored state knows the parameter count from its layout, so the
    provisional iteration's buckets claim their parameters' memories at once."""
    identities, provisional, _ = case
    n = len(identities)
    shapes, unclaimed = _memories_by_key(n)
    hook = powersgd.layerwise(config(1))
    restored = init_hook_state(hook)
    layout = ((tuple(range(n)), tuple(shapes.values())),)
    restored = HookState(
        attrs.evolve(restored.global_state, reference=layout, previous=layout),
        ((powersgd.UNCLAIMED, unclaimed),),
    )
    for index, bucket in enumerate(provisional):
        ids, bucket_shapes = [identities[k] for k in bucket], [shapes[k] for k in bucket]
        restored = powersgd.claim_parameters(restored, index, ids, bucket_shapes)
        claimed = restored.bucket(index)
        assert claimed is not None and claimed.keys == tuple(bucket)


def _same(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same entries (tensors compared by value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and bool(a == b)


def test_the_state_dict_keeps_the_keys_never_the_drivers_identities() -> None:
    """Identities belong to the process that made them: a state dict is the
    same whatever the state knows of them, and a loaded state knows none,
    while its memories stay under their keys."""
    cfg = config(1)
    hook = powersgd.layerwise(cfg)
    shapes = [(8, 8), (8,), (6, 5)]
    identities = [701, 33, 512]
    state = powersgd.with_parameter_keys(compressing(hook, cfg), tracked(identities))
    state = powersgd.claim_parameters(state, 0, identities, shapes)
    _, (state,) = simulate_iteration(hook, random_grads([shapes], 1, 0), [state], [shapes])
    assert state.global_state.parameter_keys.known  # the run knows them
    saved = powersgd.to_state_dict(cfg, state)
    forgetful = powersgd.with_parameter_keys(state, KeyFinder())
    assert _same(saved, powersgd.to_state_dict(cfg, forgetful))
    _, loaded = powersgd.from_state_dict(weights_only_copy(saved))
    assert loaded.global_state.parameter_keys == KeyFinder()
    kept = set(powersgd.memories(state))
    assert kept and kept <= set(range(len(shapes)))  # keyed by index in the model
    assert set(powersgd.memories(loaded)) == kept
