"""PowerSGD resumed in a fresh process continues exactly as the run that was
never interrupted (2 gloo ranks, layer-wise hook, warm start and error
feedback on and off, rank 1 and 4, one bucket and several), and a bucket
layout changed mid-run keeps training identical.

A "fresh process" is emulated inside the spawned rank: a brand-new module,
optimizer, ``PowerSGDState`` and DDP model, restored from files written by
``torch.save`` and read with ``torch.load(weights_only=True)``; a new DDP
model really does run its first iteration on provisional buckets (in reverse
parameter order), so the per-parameter keying is what is exercised."""

from __future__ import annotations

import copy
import itertools
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from test_powersgd_ddp import make_model
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks.powersgd import PowerSGDState, powerSGD_hook

START = 2
SAVE_AT = 5
MORE = 10
SEVERAL = 0.004  # bucket_cap_mb that cuts the model below into 3 buckets


def step(model: DDP, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()


def wrap(module: torch.nn.Module, state: PowerSGDState, cap: float | None) -> DDP:
    model = DDP(module) if cap is None else DDP(module, bucket_cap_mb=cap)
    model.register_comm_hook(state, powerSGD_hook)
    return model


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
        for x, y in zip(a, b, strict=True)
    )


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def resume_case(kwargs: dict[str, Any], cap: float | None, folder: str) -> dict[str, Any]:
    """Train SAVE_AT + MORE steps; save at SAVE_AT and resume from files in a
    brand-new model, optimizer and state; the largest relative difference."""
    state = PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
    model = wrap(make_model(3), state, cap)
    opt = sgd(model)
    for i in range(SAVE_AT):
        step(model, opt, i)
    path = os.path.join(folder, f"ckpt{dist.get_rank()}.pt")
    torch.save(
        {"model": model.module.state_dict(), "opt": opt.state_dict(), "psgd": state.state_dict()},
        path,
    )
    expected = []
    for i in range(SAVE_AT, SAVE_AT + MORE):
        step(model, opt, i)
        expected.append(params(model))
    buckets = len({index for index, _ in state.hook_state.buckets if index >= 0})

    saved = torch.load(path, weights_only=True)
    module = make_model(3)
    module.load_state_dict(saved["model"])
    fresh_state = PowerSGDState(None)
    fresh_state.load_state_dict(saved["psgd"])
    fresh = wrap(module, fresh_state, cap)
    fresh_opt = sgd(fresh)
    fresh_opt.load_state_dict(saved["opt"])
    diffs = []
    for i, want in zip(range(SAVE_AT, SAVE_AT + MORE), expected, strict=True):
        step(fresh, fresh_opt, i)
        diffs.append(max_rel(params(fresh), want))
    return {"diffs": diffs, "buckets": buckets, "iter": fresh_state.iter}


def layout_change_case() -> dict[str, Any]:
    """One state; after SAVE_AT steps the model moves to a new DDP wrapper (a
    copy of the module) with other buckets; compared with a run that never moved."""
    kwargs = {"matrix_approximation_rank": 2}
    steady_state = PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
    steady = wrap(make_model(3), steady_state, None)
    steady_opt = sgd(steady)
    state = PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
    moved = wrap(make_model(3), state, None)
    opt = sgd(moved)
    for i in range(SAVE_AT):
        step(steady, steady_opt, i)
        step(moved, opt, i)
    module = copy.deepcopy(moved.module)
    opt_state = opt.state_dict()
    moved = wrap(module, state, SEVERAL)
    opt = sgd(moved)
    opt.load_state_dict(opt_state)
    diffs = []
    for i in range(SAVE_AT, SAVE_AT + MORE):
        step(steady, steady_opt, i)
        step(moved, opt, i)
        diffs.append(max_rel(params(moved), params(steady)))
    return {"diffs": diffs, "buckets": len({i for i, _ in state.hook_state.buckets if i >= 0})}


CASES = [
    {"matrix_approximation_rank": rank, "warm_start": warm, "use_error_feedback": warm}
    for rank, warm in itertools.product((1, 4), (True, False))
]
CAPS = (None, SEVERAL)


def world(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for (i, kwargs), cap in itertools.product(enumerate(CASES), CAPS):
            out[(i, cap)] = resume_case(kwargs, cap, folder)
    out["layout"] = layout_change_case()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(world, 2)


@pytest.mark.timeout(240)
def test_fresh_process_resume_equals_uninterrupted(two_ranks: list[dict[str, Any]]) -> None:
    for rank_out in two_ranks:
        for (i, kwargs), cap in itertools.product(enumerate(CASES), CAPS):
            case = rank_out[(i, cap)]
            assert case["buckets"] == (1 if cap is None else 3), (kwargs, cap)
            assert max(case["diffs"]) <= 1e-6, (kwargs, cap, case["diffs"])
            assert case["iter"] == SAVE_AT + MORE


@pytest.mark.timeout(240)
def test_bucket_layout_change_keeps_training_identical(two_ranks: list[dict[str, Any]]) -> None:
    for rank_out in two_ranks:
        case = rank_out["layout"]
        assert case["buckets"] >= 3
        assert max(case["diffs"]) <= 1e-6, case["diffs"]
