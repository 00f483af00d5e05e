"""Fault injection on real gloo ranks: for every hook, the ZeRO step, the
overlapped step, Join (its own count and DDP's join hook) and the averagers, a
peer that exits mid-iteration and a peer that hangs past the group timeout
make every survivor raise a CollectiveError naming what failed, within the
timeout plus a margin; the same run without a fault finishes. (The simulated
world's twin of these tests is tests/test_world_failures.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _faults import FAULT_STEP, SHORT_FROM, STEPS, Case, Outcome, Tick, run_family
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer, hooks
from zerofn_torch.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
from zerofn_torch.join import Join

from zerofn.hooks.error_feedback import error_feedback
from zerofn.hooks.hook import cast
from zerofn.hooks.sparsify import top_k

pytestmark = pytest.mark.slow  # make test-slow: real ranks killed and stalled past timeouts

TIMEOUT_S = 2.0
MARGIN_S = 5.0  # slack for a loaded 2-core CI machine


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))


def ddp_loop(rank: int, tick: Tick, register: Callable[[DDP], None]) -> None:
    """DDP with several buckets, the hook ``register`` installs, and SGD."""
    ddp = DDP(make_model(), bucket_cap_mb=0.004)
    register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        tick(step)
        ddp(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


# ----- hooks --------------------------------------------------------------------


def allreduce(rank: int, tick: Tick) -> None:
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(None, hooks.allreduce_hook))


def fp16(rank: int, tick: Tick) -> None:
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(None, hooks.fp16_compress_hook))


def bf16_wrapper(rank: int, tick: Tick) -> None:
    wrapped = hooks.bf16_compress_wrapper(hooks.allreduce_hook)
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(None, wrapped))


def quantization(rank: int, tick: Tick) -> None:
    ddp_loop(
        rank, tick, lambda ddp: ddp.register_comm_hook(None, hooks.quantization_pertensor_hook)
    )


def powersgd(rank: int, tick: Tick) -> None:
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(state, hooks.powerSGD_hook))


def batched_powersgd(rank: int, tick: Tick) -> None:
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(state, hooks.batched_powerSGD_hook))


def composed(rank: int, tick: Tick) -> None:
    runner = hooks.HookRunner(cast(error_feedback(top_k(0.25)), torch.float16))
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(runner, hooks.run_hook))


def post_local_sgd(rank: int, tick: Tick) -> None:
    state = hooks.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=2)
    ddp_loop(rank, tick, lambda ddp: ddp.register_comm_hook(state, hooks.post_localSGD_hook))


HOOK_CASES: dict[str, Case] = {
    "allreduce_hook": allreduce,
    "fp16_compress_hook": fp16,
    "bf16_compress_wrapper": bf16_wrapper,
    "quantization_pertensor_hook": quantization,
    "powerSGD_hook": powersgd,
    "batched_powerSGD_hook": batched_powersgd,
    "HookRunner(fp16+error feedback+top-k)": composed,
    "post_localSGD_hook": post_local_sgd,
}

# ----- the ZeRO step, the overlap, Join, averaging --------------------------------


def zero_loop(rank: int, tick: Tick, steps: int = STEPS, **options: Any) -> None:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, **options)
    for step in range(steps):
        tick(step)
        model(batch(rank, step)).square().mean().backward()
        zero.step()
        zero.zero_grad()


def zero_step(rank: int, tick: Tick) -> None:
    zero_loop(rank, tick)


def zero_flat_bucket_view(rank: int, tick: Tick) -> None:
    zero_loop(rank, tick, partition="flat", parameters_as_bucket_view=True)


def overlap_loop(
    rank: int, tick: Tick, wrap: Callable[[Any, DDP, Any], Any], state: Any, inner: Any = None
) -> None:
    ddp = DDP(make_model(), bucket_cap_mb=0.004)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    if inner is None:
        inner = hooks.allreduce_hook if state is None else hooks.powerSGD_hook
    ddp.register_comm_hook(state, wrap(inner, ddp, zero))
    for step in range(STEPS):
        tick(step)
        ddp(batch(rank, step)).square().mean().backward()


def overlap(rank: int, tick: Tick) -> None:
    overlap_loop(rank, tick, hooks.hook_with_zero_step, None)


def overlap_interleaved_powersgd(rank: int, tick: Tick) -> None:
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    overlap_loop(rank, tick, hooks.hook_with_zero_step_interleaved, state)


def overlap_around_pytorchs_hook(rank: int, tick: Tick) -> None:
    # PyTorch's own hook is opaque to the core: its failure must still come
    # out as a CollectiveError naming it.
    overlap_loop(rank, tick, hooks.hook_with_zero_step, None, torch_hooks.fp16_compress_hook)


def join_shadowing(rank: int, tick: Tick) -> None:
    # The survivor runs out of inputs first and shadows the victim's steps,
    # so the victim's fault strikes while the survivor is inside Join.
    ddp = DDP(make_model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    with Join([ddp, zero]):
        for step in range(SHORT_FROM + 1 if rank == 0 else STEPS):
            tick(step)
            ddp(batch(rank, step)).square().mean().backward()
            zero.step()
            zero.zero_grad()


def join_ddp_hook_shadowing(rank: int, tick: Tick) -> None:
    # The survivors run out of inputs first and DDP's join hook shadows the
    # victim's steps: DDP's built-in all-reduce, no comm hook. The buffer
    # makes every forward under Join start with a blocking all-reduce (which
    # rank's buffers to broadcast) that a joined rank answers from DDP's join
    # hook; ticking after the forward, the victim fails only once every
    # survivor is inside that hook, past Join's own count.
    model = make_model()
    model.register_buffer("seen", torch.zeros(1))
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    victim = dist.get_world_size() - 1
    with Join([ddp]):
        for step in range(STEPS if rank == victim else SHORT_FROM + 1):
            loss = ddp(batch(rank, step)).square().mean()
            tick(step)
            loss.backward()
            opt.step()
            opt.zero_grad()


def averager(rank: int, tick: Tick) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    averaging = PeriodicModelAverager(period=1, warmup_steps=0)
    for step in range(STEPS):
        tick(step)
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        averaging.average_parameters(model.parameters())


def post_local_sgd_optimizer(rank: int, tick: Tick) -> None:
    model = make_model()
    opt = PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), PeriodicModelAverager(1, warmup_steps=0)
    )
    for step in range(STEPS):
        tick(step)
        model(batch(rank, step)).square().mean().backward()
        opt.step()


STEP_CASES: dict[str, Case] = {
    "ZeroRedundancyOptimizer.step": zero_step,
    "ZeroRedundancyOptimizer.step (flat, bucket view)": zero_flat_bucket_view,
    "hook_with_zero_step(allreduce_hook)": overlap,
    "hook_with_zero_step_interleaved(powerSGD_hook)": overlap_interleaved_powersgd,
    "hook_with_zero_step(PyTorch's fp16_compress_hook)": overlap_around_pytorchs_hook,
    "Join (survivor shadowing)": join_shadowing,
    "Join (DDP's join hook shadowing)": join_ddp_hook_shadowing,
    "Join (DDP's join hook shadowing, 3 ranks)": join_ddp_hook_shadowing,
    "PeriodicModelAverager.average_parameters": averager,
    "PostLocalSGDOptimizer.step": post_local_sgd_optimizer,
}

# Cases on more than 2 ranks: two survivors must raise alike.
WORLD_SIZES = {"Join (DDP's join hook shadowing, 3 ranks)": 3}

# What each path's error must name: the purpose the driver was given.
PURPOSES = {
    **{name: "DDP bucket" for name in HOOK_CASES},
    "ZeroRedundancyOptimizer.step": "exchange of updated shards",
    "ZeroRedundancyOptimizer.step (flat, bucket view)": "exchange of updated shards",
    "hook_with_zero_step(allreduce_hook)": "overlapped ZeRO step",
    "hook_with_zero_step_interleaved(powerSGD_hook)": "DDP bucket",
    "hook_with_zero_step(PyTorch's fp16_compress_hook)": "the DDP hook 'fp16_compress_hook'",
    "Join (survivor shadowing)": "Join: rank {rank} counting the ranks still running",
    "Join (DDP's join hook shadowing)": "DDP's join hook (shadowing DDP's buffer broadcast",
    "Join (DDP's join hook shadowing, 3 ranks)": (
        "DDP's join hook (shadowing DDP's buffer broadcast"
    ),
    "PeriodicModelAverager.average_parameters": "averaging",
    "PostLocalSGDOptimizer.step": "averaging",
}


@pytest.fixture(scope="module")
def hook_outcomes() -> dict[tuple[str, str], Outcome]:
    return run_family(HOOK_CASES, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def step_outcomes() -> dict[tuple[str, str], Outcome]:
    return run_family(STEP_CASES, timeout_s=TIMEOUT_S, world_sizes=WORLD_SIZES)


def check_survivor(outcome: Outcome, fault: str) -> None:
    """One survivor's outcome: a finished control run, or the error it must raise."""
    if fault == "none":
        assert outcome.finished, f"the fault-free control run failed: {outcome.trace}"
        assert outcome.step == (SHORT_FROM if "Join" in outcome.case else STEPS - 1)
        return
    assert not outcome.finished, "the survivor trained on alone: a failed collective gave a result"
    assert "CollectiveError" in outcome.error_type + outcome.message, outcome.trace
    assert "No result was produced" in outcome.message, outcome.message
    group = f"gloo group of {outcome.world_size} ranks (this is rank {outcome.rank})"
    assert group in outcome.message, outcome.message
    assert PURPOSES[outcome.case].format(rank=outcome.rank) in outcome.message, outcome.message
    limit = (TIMEOUT_S if fault == "hang" else 0.0) + MARGIN_S
    assert outcome.seconds < limit, f"raised after {outcome.seconds:.1f} s"
    assert outcome.step <= FAULT_STEP


def check(outcome: Outcome, fault: str) -> None:
    """Every survivor's outcome; under a fault, all raised the same type."""
    assert len(outcome.survivors) == WORLD_SIZES.get(outcome.case, 2) - 1
    for survivor in outcome.survivors:
        check_survivor(survivor, fault)
    assert len({survivor.error_type for survivor in outcome.survivors}) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["none", "exit", "hang"])
@pytest.mark.parametrize("case", list(HOOK_CASES))
def test_hooks_raise_when_a_peer_fails(
    hook_outcomes: dict[tuple[str, str], Outcome], case: str, fault: str
) -> None:
    check(hook_outcomes[case, fault], fault)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["none", "exit", "hang"])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_steps_and_averaging_raise_when_a_peer_fails(
    step_outcomes: dict[tuple[str, str], Outcome], case: str, fault: str
) -> None:
    check(step_outcomes[case, fault], fault)
