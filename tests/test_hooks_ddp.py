"""zerofn's DDP communication hooks under PyTorch's DistributedDataParallel, on
2 gloo ranks, against PyTorch's own hooks in the same process group.

One spawned world runs every check (spawning is slow on 2 cores); the tests
read its results. The model is small but DDP is given a tiny bucket cap, so
from the second iteration on (DDP puts everything in one bucket until it has
seen an iteration) each backward pass runs several buckets.

PyTorch 2.13's quantization hooks fail on every call (they index the gathered
scales as ``fut.wait()[0][rank]`` while the future holds the gathered list
itself). The reference here is their code run unchanged, with an all-gather
whose result has the shape the code expects; the all-gather is also made
synchronous, since a hook that issues collectives from future callbacks
interleaves them differently on each gloo rank once there are several buckets.

DDP inspects a hook's annotations at registration (the bucket parameter must be
annotated ``GradBucket`` or not at all), so this module keeps them as real
objects: no ``from __future__ import annotations``.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from torch.distributed import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as torch_debugging
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_quant
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import hooks

from zerofn.hooks.error_feedback import error_feedback
from zerofn.hooks.hook import cast
from zerofn.hooks.sparsify import top_k
from zerofn.stats import comm_stats, with_stats

pytestmark = pytest.mark.timeout(120)

BUCKET_CAP_MB = 0.0005  # about 130 float32 gradients: four buckets
STEPS = 3
TRAIN_STEPS = 40
Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.Linear(32, 4),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def counting(hook: Hook, seen: list[int]) -> Hook:
    """``hook``, recording the index of every bucket it reduces."""

    def counted(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append(bucket.index())
        return hook(state, bucket)

    return counted


def grads_per_step(state: Any, hook: Hook) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Train ``STEPS`` SGD steps under ``hook``: the gradients of each step and
    the bucket indices the hook saw."""
    rank = dist.get_rank()
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    seen: list[int] = []
    ddp.register_comm_hook(state, counting(hook, seen))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        steps.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
    return steps, seen


def max_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max(
        (x - y).abs().max().item()
        for step_a, step_b in zip(a, b, strict=True)
        for x, y in zip(step_a, step_b, strict=True)
    )


class _Done:
    """A finished collective whose future holds ``value``."""

    def __init__(self, value: Any) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.future.set_result(value)

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future


class _GatherAsDesigned:
    """``torch.distributed`` as PyTorch's quantization hooks expect it: an
    all-gather that completes at once and whose future holds the gathered
    tensors stacked (``[rank]`` and ``[rank, ...]`` both index a rank's tensor)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor, **kwargs: Any) -> Any:
        kwargs.pop("async_op", None)
        dist.all_gather(outputs, tensor, **kwargs)
        return _Done([torch.stack(outputs)])


def torch_perchannel_64(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    return torch_quant.quantization_perchannel_hook(state, bucket, bucket_size=64)


def ours_perchannel_64(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    return hooks.quantization_perchannel_hook(state, bucket, bucket_size=64)


def torch_bf16(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's bf16 hook under another name (DDP refuses its own name without NCCL)."""
    return torch_default.bf16_compress_hook(state, bucket)


def torch_bf16_wrapper(hook: Hook) -> Hook:
    wrapped = torch_default.bf16_compress_wrapper(hook)
    wrapped.__name__ = "renamed_bf16_wrapper"  # same reason
    return wrapped


def parity_cases() -> dict[str, tuple[Hook, Hook]]:
    """Name -> (ours, PyTorch's)."""
    return {
        "allreduce": (hooks.allreduce_hook, torch_default.allreduce_hook),
        "fp16": (hooks.fp16_compress_hook, torch_default.fp16_compress_hook),
        "fp16_wrapper(allreduce)": (
            hooks.fp16_compress_wrapper(hooks.allreduce_hook),
            torch_default.fp16_compress_wrapper(torch_default.allreduce_hook),
        ),
        "bf16": (hooks.bf16_compress_hook, torch_bf16),
        "bf16_wrapper(allreduce)": (
            hooks.bf16_compress_wrapper(hooks.allreduce_hook),
            torch_bf16_wrapper(torch_default.allreduce_hook),
        ),
        "noop": (hooks.noop_hook, torch_debugging.noop_hook),
        "quantization_pertensor": (
            hooks.quantization_pertensor_hook,
            torch_quant.quantization_pertensor_hook,
        ),
        "quantization_perchannel": (
            hooks.quantization_perchannel_hook,
            torch_quant.quantization_perchannel_hook,
        ),
        "quantization_perchannel(64)": (ours_perchannel_64, torch_perchannel_64),
    }


def parity(out: dict[str, Any]) -> None:
    torch_quant.dist = _GatherAsDesigned()  # type: ignore[assignment]
    try:
        for name, (ours, theirs) in parity_cases().items():
            ours_grads, ours_seen = grads_per_step(None, ours)
            theirs_grads, _ = grads_per_step(None, theirs)
            out["parity"][name] = (max_diff(ours_grads, theirs_grads), ours_seen)
            out["grads"][name] = ours_grads
    finally:
        torch_quant.dist = dist


def pytorch_refusals(out: dict[str, Any]) -> None:
    """What PyTorch's DDP refuses: its bf16 hook on gloo, a second hook."""
    ddp = DDP(make_model())
    try:
        ddp.register_comm_hook(None, torch_default.bf16_compress_hook)
    except Exception as e:
        out["torch_bf16_on_gloo"] = type(e).__name__
    ddp.register_comm_hook(None, hooks.bf16_compress_hook)  # ours registers
    for second in (hooks.allreduce_hook, torch_default.allreduce_hook):
        try:
            ddp.register_comm_hook(None, second)
        except Exception as e:
            out.setdefault("twice", []).append((type(e).__name__, str(e)))
    runner = hooks.HookRunner(composed_hook())
    ddp = DDP(make_model())
    ddp.register_comm_hook(runner, hooks.run_hook)
    try:
        ddp.register_comm_hook(runner, hooks.run_hook)
    except Exception as e:
        out["twice"].append((type(e).__name__, str(e)))


def composed_hook() -> Any:
    return with_stats(cast(error_feedback(top_k(0.25)), torch.float16))


def train(ddp: DDP, steps: int) -> list[float]:
    """Full-batch SGD on a fixed regression problem (each rank its own half)."""
    x, y = batch(0, dist.get_rank())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def composed_training(out: dict[str, Any]) -> None:
    """cast(error_feedback(top_k)) through a HookRunner, beside plain DDP: it
    trains, and the ranks stay identical (they decode the same payloads)."""
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    runner = hooks.HookRunner(composed_hook())
    ddp.register_comm_hook(runner, hooks.run_hook)
    out["composed_losses"] = train(ddp, TRAIN_STEPS)
    out["plain_losses"] = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), TRAIN_STEPS)
    out["composed_params"] = [p.detach().clone() for p in ddp.parameters()]
    out["composed_stats"] = comm_stats(runner.state)
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in ddp.parameters())


def pytorch_quantization_as_is(out: dict[str, Any]) -> None:
    """PyTorch 2.13's own quantization hooks, unpatched: the first backward fails
    (on both ranks alike, after one all-gather, so nothing is left waiting)."""
    for name, hook in (
        ("pertensor", torch_quant.quantization_pertensor_hook),
        ("perchannel", torch_quant.quantization_perchannel_hook),
    ):
        ddp = DDP(make_model())
        ddp.register_comm_hook(None, hook)
        x, y = batch(0, dist.get_rank())
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            out["torch_quantization_as_is"][name] = "ran"
        except RuntimeError as e:
            out["torch_quantization_as_is"][name] = str(e)


def hooks_world(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"parity": {}, "grads": {}, "torch_quantization_as_is": {}}
    parity(out)
    pytorch_refusals(out)
    composed_training(out)
    pytorch_quantization_as_is(out)  # last: a failed backward ends its DDP
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_world(hooks_world, 2)


EXACT = ["allreduce", "fp16", "fp16_wrapper(allreduce)", "bf16", "bf16_wrapper(allreduce)", "noop"]
QUANTIZED = ["quantization_pertensor", "quantization_perchannel", "quantization_perchannel(64)"]


def test_every_parity_case_ran_with_several_buckets(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert sorted(out["parity"]) == sorted(EXACT + QUANTIZED)
        for name, (_, seen) in out["parity"].items():
            # One bucket in the first iteration, then DDP's rebuilt ones.
            assert seen[0] == 0 and max(seen) >= 3, name


@pytest.mark.parametrize("name", EXACT + QUANTIZED)
def test_gradients_are_pytorchs(ranks: list[dict[str, Any]], name: str) -> None:
    for out in ranks:
        diff, _ = out["parity"][name]
        assert diff == 0.0, (name, diff)


@pytest.mark.parametrize("name", [n for n in EXACT + QUANTIZED if n != "noop"])
def test_ranks_receive_the_same_gradients(ranks: list[dict[str, Any]], name: str) -> None:
    for mine, theirs in zip(ranks[0]["grads"][name], ranks[1]["grads"][name], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_noop_keeps_each_ranks_own_gradients(ranks: list[dict[str, Any]]) -> None:
    first_step = [out["grads"]["noop"][0] for out in ranks]
    assert not all(torch.equal(a, b) for a, b in zip(*first_step, strict=True))


def test_pytorchs_bf16_hook_is_refused_on_gloo_and_ours_is_not(
    ranks: list[dict[str, Any]],
) -> None:
    # Ours registered in the same world right after; a refusal would have failed it.
    assert ranks[0]["torch_bf16_on_gloo"] == "TypeError"


@pytest.mark.parametrize("name", ["fp16", "bf16", *QUANTIZED])
def test_lossy_hooks_are_lossy_but_close(ranks: list[dict[str, Any]], name: str) -> None:
    # The first step, where every run starts from the same parameters.
    lossy, exact = ranks[0]["grads"][name][0], ranks[0]["grads"]["allreduce"][0]
    diffs = [(a - b).abs().max().item() for a, b in zip(lossy, exact, strict=True)]
    largest = max(g.abs().max().item() for g in exact)
    assert 0 < max(diffs) <= 0.01 * largest


def test_a_second_hook_is_refused_with_pytorchs_runtime_error(
    ranks: list[dict[str, Any]],
) -> None:
    # DDP's reducer refuses any second registration, whichever hook and state.
    twice = ranks[0]["twice"]
    assert len(twice) == 3
    for kind, message in twice:
        assert kind == "RuntimeError"
        assert "can only be called once" in message


def test_pytorchs_quantization_hooks_fail_unpatched(ranks: list[dict[str, Any]]) -> None:
    # If this fails, PyTorch fixed its hooks: compare against them unpatched.
    for out in ranks:
        for name, outcome in out["torch_quantization_as_is"].items():
            assert "IndexError" in outcome, (name, outcome)


def test_composed_hook_trains_and_ranks_agree(ranks: list[dict[str, Any]]) -> None:
    losses, plain = ranks[0]["composed_losses"], ranks[0]["plain_losses"]
    assert losses[0] == plain[0]
    # A quarter of the entries, with error feedback, learns almost as fast as all of them.
    assert losses[0] - losses[-1] >= 0.9 * (plain[0] - plain[-1]) > 0.3
    for a, b in zip(ranks[0]["composed_params"], ranks[1]["composed_params"], strict=True):
        assert torch.equal(a, b)


def test_composed_hook_reports_bytes_per_iteration(ranks: list[dict[str, Any]]) -> None:
    stats = ranks[0]["composed_stats"]
    # A quarter of the entries, as fp16 values and int32 positions: 6 of the
    # 16 bytes per 4 float32 entries, rounded up per bucket.
    model_bytes = ranks[0]["model_bytes"]
    assert 0.37 * model_bytes <= stats.bytes_per_iteration <= 0.40 * model_bytes
    assert len(stats.collectives_per_bucket) >= 3
    assert all(count == 1 for _, count in stats.collectives_per_bucket)


# ----- one runner, one model (one rank, in process) ---------------------------------------


def mse(ddp: DDP) -> torch.Tensor:
    x, y = batch(0, dist.get_rank())
    return torch.nn.functional.mse_loss(ddp(x), y)


def test_one_hook_runner_serves_one_model(single_rank_group: None) -> None:
    """A runner's state is kept per bucket of one model, so a second model is
    refused: by ``register`` before anything is registered on it, and, for a
    runner registered by hand, at the second model's first bucket, before the
    runner's state changes."""
    first, second = (DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB) for _ in range(2))
    runner = hooks.HookRunner(composed_hook())
    runner.register(first)
    with pytest.raises(RuntimeError, match="already serves another DDP model") as refused:
        runner.register(second)
    assert "nothing was registered" in str(refused.value)
    assert second._comm_hooks == []
    hooks.HookRunner(composed_hook()).register(second)  # a runner of its own is fine
    for ddp in (first, second):
        mse(ddp).backward()

    by_hand = hooks.HookRunner(composed_hook())
    third, fourth = (DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB) for _ in range(2))
    third.register_comm_hook(by_hand, hooks.run_hook)
    fourth.register_comm_hook(by_hand, hooks.run_hook)
    mse(third).backward()
    state = by_hand.state
    with pytest.raises(RuntimeError, match="registered on two DDP models"):
        mse(fourth).backward()
    assert by_hand.state is state
    with pytest.raises(RuntimeError, match="already serves another DDP model"):
        by_hand.register(fourth)
    mse(third).backward()  # the model it serves trains on
    assert by_hand.state is not state
