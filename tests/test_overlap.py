"""Overlapping the ZeRO step with DDP's backward, on 2 gloo ranks.

Every iteration, from the first, must leave the same parameters as DDP with
the same inner hook followed by a separate (non-overlapped) ZeRO step; with
the plain averaging hook the bytes moved per step must be one all-reduce's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _world import run_world
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch import hooks as zhooks
from zerofn_torch.hooks.overlap import hook_with_zero_step, hook_with_zero_step_interleaved
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.comm import AllReduce
from zerofn.hooks.hook import (
    BucketInfo,
    allreduce_mean,
    begin_bucket,
    finish_iteration,
    init_hook_state,
)
from zerofn.overlap.hook import OverlapConfig, StepOrder, zero_step_hook
from zerofn.overlap.state import (
    OverlapState,
    finish_overlap_iteration,
    observe_bucket,
    owned_params_per_rank,
)

# ----- pure transitions -------------------------------------------------------------------


@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=4), min_size=1, max_size=6),
    st.integers(1, 4),
    st.booleans(),
)
def test_status_moves_uninitialized_collecting_initialized(
    buckets: list[list[int]], world: int, shard: bool
) -> None:
    sizes = [n for b in buckets for n in b]
    indices, start = [], 0
    for b in buckets:
        indices.append(list(range(start, start + len(b))))
        start += len(b)
    state = OverlapState(shard_buckets=shard)
    for i, ix in enumerate(indices):  # DDP has not rebuilt yet: nothing recorded
        state = observe_bucket(state, i, ix, ddp_rebuilt=False)
    assert finish_overlap_iteration(state, sizes, world) == state
    for i, ix in enumerate(indices):
        state = observe_bucket(state, i, ix, ddp_rebuilt=True)
        assert state.status == "collecting"
    state = finish_overlap_iteration(state, sizes, world)
    assert state.status == "initialized" and state.plan is not None
    owned = owned_params_per_rank(state)
    assert sorted(i for rank in owned for i in rank) == list(range(len(sizes)))
    assert observe_bucket(state, 0, indices[0], True) == state  # fixed from now on


@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=5),
    st.integers(2, 4),
    st.integers(0, 3),
    st.integers(1, 4),
)
def test_a_whole_step_hook_averages_every_bucket_and_orders_one_whole_step(
    bucket_lengths: list[int], world: int, rank: int, iterations: int
) -> None:
    """With ``whole_step`` (``redundancy=2``) every bucket runs the inner
    hook, in every iteration, before and after DDP's buckets are final; the
    last bucket orders one whole step of every bucket, and the hook never
    hands out a reshard: ownership stays the optimizer's own."""
    rank %= world
    indices, start = [], 0
    for n in bucket_lengths:
        indices.append(tuple(range(start, start + n)))
        start += n
    config = OverlapConfig(sizes=(2,) * start, world_size=world, rank=rank, whole_step=True)
    hook = zero_step_hook(allreduce_mean(), config)
    state = init_hook_state(hook)
    for iteration in range(iterations):
        for i, ix in enumerate(indices):
            info = BucketInfo(
                i, ((2,),) * len(ix), world, is_last=i == len(indices) - 1, params=ix,
                final=iteration > 0,
            )  # fmt: skip
            state, program = begin_bucket(hook, state, torch.ones(2 * len(ix)), info)
            assert isinstance(next(program), AllReduce)  # the inner hook's, on every rank
            if info.is_last:
                state = finish_iteration(hook, state)
                whole = StepOrder(tuple(range(len(indices))), whole=True)
                assert state.global_state.order == whole
            else:
                assert state.global_state.order is None
        assert state.global_state.waiting == ()


@pytest.mark.parametrize(
    "options", [{"shard_buckets": True}, {"interleaved": True}, {"reduce_to_owner": True}]
)
def test_a_whole_step_with_an_option_that_divides_it_by_buckets_is_refused(
    options: dict[str, bool],
) -> None:
    with pytest.raises(ValueError, match="whole_step"):
        OverlapConfig(sizes=(2,), world_size=2, rank=0, whole_step=True, **options)


# ----- on 2 ranks ---------------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(5)])


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}),  # no functional twin in PyTorch
}

INNER: dict[str, Callable[..., Any]] = {
    "zerofn-allreduce": zhooks.allreduce_hook,
    "torch-allreduce": torch_hooks.allreduce_hook,
    "fp16": zhooks.fp16_compress_hook,
}


def batches(rank: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(8, 24, generator=g) for _ in range(steps)]


def overlap_run(
    rank: int, wrap: Callable[..., Any], inner: Callable[..., Any], opt: str, shard: bool
) -> float:
    cls, kwargs = OPTIMIZERS[opt]
    ours = DDP(make_model(), bucket_cap_mb=0.003)
    zero = ZeroRedundancyOptimizer(ours.parameters(), cls, overlap_with_ddp=True, **kwargs)
    ours.register_comm_hook(None, wrap(inner, ours, zero, shard_buckets=shard))
    ref = DDP(make_model(), bucket_cap_mb=0.003)
    ref.register_comm_hook(None, inner)
    ref_zero = ZeroRedundancyOptimizer(ref.parameters(), cls, **kwargs)
    worst = 0.0
    for x in batches(rank, 6):
        zero.zero_grad()
        ours(x).square().mean().backward()
        ref_zero.zero_grad()
        ref(x).square().mean().backward()
        ref_zero.step()
        worst = max(
            worst,
            max(
                ((p - q).abs() / q.abs().clamp_min(1e-3)).max().item()
                for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
            ),
        )
    return worst


def wire_bytes(fn: Callable[[], None]) -> float:
    """Bytes this rank sends while ``fn`` runs (ring estimate, 2 ranks)."""
    with collective_traffic() as traffic:
        fn()
    return traffic.sent_bytes(2)


def bytes_world(rank: int) -> dict[str, float]:
    cls, kwargs = OPTIMIZERS["adam"]
    ours = DDP(make_model(), bucket_cap_mb=0.003)
    zero = ZeroRedundancyOptimizer(ours.parameters(), cls, overlap_with_ddp=True, **kwargs)
    ours.register_comm_hook(None, hook_with_zero_step(zhooks.allreduce_hook, ours, zero))
    ref = DDP(make_model(), bucket_cap_mb=0.003)
    ref.register_comm_hook(None, zhooks.allreduce_hook)  # so its all-reduces are counted
    ref_zero = ZeroRedundancyOptimizer(ref.parameters(), cls, **kwargs)
    xs = batches(rank, 4)
    for x in xs[:3]:  # past DDP's bucket rebuild
        zero.zero_grad()
        ours(x).sum().backward()
        ref_zero.zero_grad()
        ref(x).sum().backward()
        ref_zero.step()

    zero.zero_grad()
    ref_zero.zero_grad()

    def separate() -> None:
        ref(xs[3]).sum().backward()
        ref_zero.step()

    return {
        "overlap": wire_bytes(lambda: ours(xs[3]).sum().backward()),
        "separate": wire_bytes(separate),
        "model": sum(p.numel() * p.element_size() for p in ours.parameters()),
    }


def redundant_overlap_run(rank: int, inner: Callable[..., Any]) -> dict[str, Any]:
    """``redundancy=2`` with the overlap hook beside the plain step after
    DDP (``redundancy=1``), the same inner hook: whether parameters and
    consolidated state are bitwise equal, and the bytes of each step."""
    cls, kwargs = OPTIMIZERS["adam"]
    ours = DDP(make_model(), bucket_cap_mb=0.003)
    zero = ZeroRedundancyOptimizer(
        ours.parameters(), cls, overlap_with_ddp=True, redundancy=2, **kwargs
    )
    refused = []
    for options in ({"shard_buckets": True}, {"max_grad_norm": 1.0}):
        try:
            hook_with_zero_step(inner, ours, zero, **options)  # type: ignore[arg-type]
        except ValueError as e:
            refused.append(str(e))
    try:
        hook_with_zero_step_interleaved(inner, ours, zero)
    except ValueError as e:
        refused.append(str(e))
    ours.register_comm_hook(None, hook_with_zero_step(inner, ours, zero))  # still free
    ref = DDP(make_model(), bucket_cap_mb=0.003)
    ref.register_comm_hook(None, inner)
    ref_zero = ZeroRedundancyOptimizer(ref.parameters(), cls, **kwargs)
    equal, sent = True, {}
    for x in batches(rank, 5):
        zero.zero_grad()
        ref_zero.zero_grad()

        def separate(x: torch.Tensor = x) -> None:
            ref(x).square().mean().backward()
            ref_zero.step()

        sent = {
            "overlap": wire_bytes(lambda x=x: ours(x).square().mean().backward()),
            "separate": wire_bytes(separate),
        }
        equal &= all(
            torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
        )
    zero.consolidate_state_dict(to=0)
    ref_zero.consolidate_state_dict(to=0)
    if rank == 0:
        mine, theirs = zero.state_dict()["state"], ref_zero.state_dict()["state"]
        equal &= all(torch.equal(mine[i][k], theirs[i][k]) for i in theirs for k in theirs[i])
    return {"equal": equal, "sent": sent, "refused": refused}


def overlap_world(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for wrap_name, wrap in (
        ("step", hook_with_zero_step),
        ("interleaved", hook_with_zero_step_interleaved),
    ):
        for shard in (False, True):
            for inner_name in INNER:
                out[(wrap_name, shard, inner_name, "adam")] = overlap_run(
                    rank, wrap, INNER[inner_name], "adam", shard
                )
            for opt in ("sgd", "rmsprop"):
                out[(wrap_name, shard, "zerofn-allreduce", opt)] = overlap_run(
                    rank, wrap, zhooks.allreduce_hook, opt, shard
                )
    out["bytes"] = bytes_world(rank)
    out["redundant"] = {name: redundant_overlap_run(rank, INNER[name]) for name in INNER}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[Any, Any]]:
    return run_world(overlap_world, 2)


@pytest.mark.timeout(240)
def test_every_iteration_matches_ddp_then_zero(two_ranks: list[dict[Any, Any]]) -> None:
    for out in two_ranks:
        cases = {k: v for k, v in out.items() if k not in ("bytes", "redundant")}
        assert len(cases) == 2 * 2 * 5
        for case, diff in cases.items():
            assert diff <= 1e-5, case


def test_bytes_per_step_equal_one_allreduce(two_ranks: list[dict[Any, Any]]) -> None:
    for out in two_ranks:
        b = out["bytes"]
        one_allreduce = 1.0 * b["model"]  # 2(N-1)/N of the model, N = 2
        assert b["overlap"] == pytest.approx(one_allreduce)
        assert b["separate"] == pytest.approx(1.5 * one_allreduce)


def test_with_redundancy_the_hook_takes_the_plain_steps_bits_and_bytes(
    two_ranks: list[dict[Any, Any]],
) -> None:
    """``redundancy=2``: every bucket all-reduced (each carrier needs its
    owner's averages), the optimizer's whole step after the last: the plain
    step's parameters, state and bytes, for every inner hook."""
    for out in two_ranks:
        for inner, run in out["redundant"].items():
            assert run["equal"], inner
            assert run["sent"]["overlap"] == pytest.approx(run["sent"]["separate"]), inner
            assert len(run["refused"]) == 3, inner
            for text, option in zip(
                run["refused"],
                ("shard_buckets", "max_grad_norm", "hook_with_zero_step_interleaved"),
                strict=True,
            ):
                assert option in text and "redundancy=2" in text


def test_overlap_requires_overlap_mode(single_rank_group: None) -> None:
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="overlap_with_ddp=True"):
        hook_with_zero_step(zhooks.allreduce_hook, model, zero)


def test_step_without_an_overlap_hook_is_refused(
    single_rank_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    model(torch.randn(2, 24)).sum().backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="no such hook was made") as refused:
        zero.step()
    for name in ("hook_with_zero_step", "hook_with_zero_step_interleaved", "register_comm_hook"):
        assert name in str(refused.value)
    for p, (value, grad) in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value) and torch.equal(p.grad, grad)  # type: ignore[arg-type]
    # Once a hook drives it (before DDP's buckets are final too), step() is
    # PyTorch's no-op with a warning.
    hook_with_zero_step(zhooks.allreduce_hook, model, zero)
    assert zero.step() is None
    assert "does nothing" in caplog.text


def test_one_optimizer_is_driven_by_one_hook(single_rank_group: None) -> None:
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    hook_with_zero_step(zhooks.allreduce_hook, model, zero)
    with pytest.raises(RuntimeError, match="already driven by a DDP hook"):
        hook_with_zero_step_interleaved(zhooks.allreduce_hook, model, zero)


def test_an_overlap_state_no_transition_makes_is_refused_at_construction() -> None:
    plan = finish_overlap_iteration(
        OverlapState("collecting", buckets=((0,),)), sizes=[4], world_size=2
    ).plan
    assert plan is not None
    with pytest.raises(ValueError, match="exactly when it has a plan"):
        OverlapState("initialized")
    with pytest.raises(ValueError, match="exactly when it has a plan"):
        OverlapState("collecting", buckets=((0,),), plan=plan)
    with pytest.raises(ValueError, match="collected no buckets"):
        OverlapState("uninitialized", buckets=((0,),))
    with pytest.raises(ValueError):
        OverlapState("done")  # type: ignore[arg-type]
