"""The pure decisions of mixed precision: which masters to keep, the global
norm and its clipping factor, the loss-scale schedule, and the bad inputs
the optimizer refuses before changing anything."""

from __future__ import annotations

import math

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.testing.world import run_programs
from zerofn.zero.mixed_precision.loss_scale import (
    LossScaleConfig,
    LossScaleState,
    init_loss_scale,
    update_loss_scale,
)
from zerofn.zero.mixed_precision.precision import (
    clip_coefficient,
    global_norm_program,
    local_norm_power,
    nonfinite_program,
    resolve_master_dtype,
)


def test_master_dtype_resolution() -> None:
    assert resolve_master_dtype(torch.bfloat16, torch.float32) == torch.float32
    assert resolve_master_dtype(torch.float16, torch.float64) == torch.float64
    assert resolve_master_dtype(torch.float32, torch.float32) is None
    assert resolve_master_dtype(torch.bfloat16, None) is None
    with pytest.raises(ValueError, match="narrower"):
        resolve_master_dtype(torch.float32, torch.bfloat16)
    with pytest.raises(TypeError, match="floating-point"):
        resolve_master_dtype(torch.float32, torch.int32)
    with pytest.raises(TypeError, match="floating-point"):
        resolve_master_dtype(torch.float32, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating-point parameters"):
        resolve_master_dtype(torch.int64, torch.float32)


shards = st.lists(
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=0, max_size=12), min_size=1, max_size=6
)


@settings(max_examples=draws(200), deadline=None)
@given(shards, st.sampled_from([1.0, 2.0, 3.0, math.inf]))
def test_global_norm_over_shards_equals_the_whole_norm(
    per_rank: list[list[float]], norm_type: float
) -> None:
    grads = [[torch.tensor(values, dtype=torch.float32)] for values in per_rank]
    programs = [
        global_norm_program(local_norm_power(g, norm_type), norm_type, torch.device("cpu"))
        for g in grads
    ]
    norms = run_programs(programs)
    whole = torch.cat([g[0] for g in grads])
    # The inf-norm of nothing is 0 here (torch.nn.utils.clip_grad_norm_ agrees).
    expected = float(torch.linalg.vector_norm(whole.double(), norm_type)) if whole.numel() else 0.0
    assert len(set(norms)) == 1  # every rank the same number
    assert norms[0] == pytest.approx(expected, rel=1e-5, abs=1e-5)


@settings(max_examples=draws(200), deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_any_rank_with_inf_makes_every_rank_skip(poisoned: list[bool]) -> None:
    grads = [
        [torch.tensor([1.0, math.inf if bad else 2.0]), torch.tensor([3.0])] for bad in poisoned
    ]
    verdicts = run_programs([nonfinite_program(g, torch.device("cpu")) for g in grads])
    assert verdicts == [any(poisoned)] * len(poisoned)


@given(st.floats(0, 1e6), st.floats(0, 1e3))
def test_clip_coefficient_caps_the_norm(total: float, max_norm: float) -> None:
    c = clip_coefficient(total, max_norm)
    assert 0.0 <= c <= 1.0
    assert total * c <= max_norm + 1e-9 * max(1.0, total)
    if total + 1e-6 <= max_norm:
        assert c == 1.0


def test_clip_coefficient_refuses_bad_max_norm_and_propagates_nan() -> None:
    with pytest.raises(ValueError, match="max_norm"):
        clip_coefficient(1.0, -1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_coefficient(1.0, math.inf)
    assert math.isnan(clip_coefficient(math.nan, 1.0))
    assert clip_coefficient(math.inf, 1.0) == 0.0


@settings(max_examples=draws(200), deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5))
def test_loss_scale_schedule(found: list[bool], interval: int) -> None:
    config = LossScaleConfig(init_scale=2.0**8, growth_interval=interval)
    state = init_loss_scale(config)
    good = 0
    for bad in found:
        new = update_loss_scale(config, state, bad)
        if bad:
            assert new == LossScaleState(state.scale / 2, 0)
            good = 0
        else:
            good += 1
            grown = good == interval
            assert new.scale == (state.scale * 2 if grown else state.scale)
            good = 0 if grown else good
            assert new.growth_tracker == good
        state = new


@pytest.mark.parametrize(
    "bad",
    [
        {"init_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
        {"growth_interval": True},
    ],
)
def test_loss_scale_config_refuses_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LossScaleConfig(**bad)


# ----- the optimizer's refusals (one rank) -------------------------------------------


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("master_dtype", "error", "match"),
    [(torch.int8, TypeError, "floating-point"), (torch.float16, ValueError, None)],
)
def test_bad_master_dtype_is_refused_before_anything_changes(
    master_dtype: torch.dtype, error: type[Exception], match: str | None
) -> None:
    from zerofn_torch import ZeroRedundancyOptimizer

    model = _bf16_model().to(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, lr=0.1, master_dtype=master_dtype
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.usefixtures("single_rank_group")
def test_misuse_of_master_gradients_is_refused() -> None:
    from zerofn_torch import LossScaler, ZeroRedundancyOptimizer

    model = _bf16_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=0.1, partition="flat", master_dtype=torch.float32
    )
    assert {p.dtype for g in opt.optim.param_groups for p in g["params"]} == {torch.float32}
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    scaler = LossScaler()
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="already unscaled or clipped"):
        scaler.unscale_(opt)
    opt.zero_grad()  # drops the masters' gradients too
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.usefixtures("single_rank_group")
def test_clipping_needs_the_whole_gradient_so_not_with_overlap() -> None:
    from zerofn_torch import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(
        _bf16_model().parameters(), torch.optim.Adam, lr=0.1, overlap_with_ddp=True
    )
    with pytest.raises(RuntimeError, match="overlap_with_ddp"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="overlap_with_ddp"):
        opt.unscale_gradients_(0.5)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("mode", ["greedy", "flat"])
def test_added_param_groups_get_masters_too(mode: str) -> None:
    from zerofn_torch import ZeroRedundancyOptimizer

    first, second = _bf16_model(), _bf16_model()
    opt = ZeroRedundancyOptimizer(
        first.parameters(), torch.optim.Adam, lr=1e-3, partition=mode, master_dtype=torch.float32
    )
    opt.add_param_group({"params": list(second.parameters()), "lr": 1e-2})
    assert {p.dtype for g in opt.optim.param_groups for p in g["params"]} == {torch.float32}
    before = [p.detach().clone() for p in second.parameters()]
    for model in (first, second):
        model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, second.parameters(), strict=True))
    numel = sum(p.numel() for m in (first, second) for p in m.parameters())
    assert opt.memory_bytes()["master_weights"] == 4 * numel
