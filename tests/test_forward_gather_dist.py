"""``gather_during_forward=True`` on 2 gloo ranks, beside the same optimizer
without it: the step returns with its exchange still in flight, the next
forward (under DDP or not) computes bitwise the same losses, and parameters
and optimizer state end bitwise equal, in every partition, with bucket views,
fp32 masters, and the int8 and int4 exchange, and for the
overlapped step (its owners' sends behind the forward: fp32, masters,
sharded buckets, int8); every zerofn reader of parameters waits first; a rank
lost while a gather is in flight fails the other's forward with a
CollectiveError. The interleaved overlap hook is refused, naming both options."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.averaging import average_parameters
from zerofn_torch.hooks import (
    allreduce_hook,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from zerofn_torch.replicas import verify_replicas
from zerofn_torch.runtime.launch import run_local_world

from zerofn.errors import CollectiveError

CONFIGS: dict[str, dict[str, Any]] = {
    "greedy under DDP": {"ddp": True},
    "balanced": {"partition": "balanced"},
    "flat (bucket views)": {"partition": "flat", "ddp": True},
    "flat, no bucket views": {"partition": "flat", "parameters_as_bucket_view": False},
    "greedy, bucket views": {"parameters_as_bucket_view": True, "ddp": True},
    "bf16 with fp32 masters": {"dtype": torch.bfloat16, "master_dtype": torch.float32},
    "int8 exchange under DDP": {"exchange_compression": "int8", "ddp": True},
    "int4 exchange, flat": {"exchange_compression": "int4", "partition": "flat"},
    "overlapped step": {"overlap": "plain"},
    "overlapped step, buckets sharded": {"overlap": "sharded"},
    "overlapped step, bf16 with fp32 masters": {
        "overlap": "plain",
        "dtype": torch.bfloat16,
        "master_dtype": torch.float32,
    },
    "overlapped step, int8 sends": {"overlap": "sharded", "exchange_compression": "int8"},
}
"""Each configuration's options; ``overlap``: DDP's hook steps the optimizer
(``hook_with_zero_step``, with ``shard_buckets`` when ``"sharded"``) on
buckets of a few parameters each, so the sends follow the forward's order."""


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(3)
    layers = [torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(24, 5)).to(dtype)


def run(config: dict[str, Any], gather: bool, rank: int) -> dict[str, Any]:
    """Five steps of Adam; each rank's own batches, gradients averaged by DDP
    or by hand. With ``gather``, whether each step returned with its
    exchange in flight, and whether the forward finished it."""
    options = dict(config)
    ddp, dtype = options.pop("ddp", False), options.pop("dtype", torch.float32)
    overlap = options.pop("overlap", None)
    model = make_model(dtype)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        lr=0.02,
        gather_during_forward=gather,
        overlap_with_ddp=overlap is not None,
        **options,
    )
    net: torch.nn.Module = model
    if overlap is not None:
        net = ddp_net = DDP(model, bucket_cap_mb=0.001)
        hook = hook_with_zero_step(allreduce_hook, ddp_net, opt, overlap == "sharded")
        ddp_net.register_comm_hook(None, hook)
        ddp = True
    elif ddp:
        net = DDP(model)
    losses, in_flight, finished = [], [], []
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(7, 12, generator=g).to(dtype)
        opt.zero_grad()
        loss = net(x).float().square().mean()
        finished.append(gather and opt._gathering.flight is None)  # type: ignore[union-attr]
        loss.backward()
        if not ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        losses.append(loss.detach())
        if overlap is None:
            opt.step()
        in_flight.append(gather and opt._gathering.flight is not None)  # type: ignore[union-attr]
    opt.consolidate_state_dict(0)  # waits for the last step's exchange
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": opt.state_dict() if rank == 0 else None,
        "in flight": in_flight,
        "finished by the forward": finished[1:],
    }


def readers(rank: int) -> dict[str, Any]:
    """Each reader of parameters right after a step, before any forward:
    what it read is the updated parameters."""
    out = {}
    for name in ("wait", "verify_replicas", "average_parameters", "consolidate_state_dict"):
        model = make_model(torch.float32)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.5, gather_during_forward=True
        )
        model(torch.ones(2, 12)).sum().backward()
        opt.step()
        pending = opt._gathering.flight is not None  # type: ignore[union-attr]
        if name == "wait":
            opt.wait()
        elif name == "verify_replicas":
            verify_replicas(model)
        elif name == "average_parameters":
            average_parameters(model.parameters(), None)
        else:
            opt.consolidate_state_dict(0)
        reference = make_model(torch.float32)
        plain = torch.optim.SGD(reference.parameters(), lr=0.5)
        reference(torch.ones(2, 12)).sum().backward()
        plain.step()
        same = all(
            torch.equal(a, b)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        out[name] = (pending, same)
    return out


def uneven(gather: bool, rank: int) -> list[torch.Tensor]:
    """Under PyTorch's Join with DDP, rank 1 with two more batches: the
    joined rank's shadow steps post the same pieces."""
    model = make_model(torch.float32)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=0.02, gather_during_forward=gather
    )
    net = DDP(model)
    with Join([net, opt]):
        for step in range(3 + 2 * rank):
            g = torch.Generator().manual_seed(100 * step + rank)
            opt.zero_grad()
            net(torch.randn(7, 12, generator=g)).square().mean().backward()
            opt.step()
    opt.wait()
    return [p.detach().clone() for p in model.parameters()]


def kept_gradients(rank: int) -> tuple[bool, bool, bool]:
    """With ``redundancy=2``: after the step, and the next iteration's
    ``zero_grad``, the optimizer still hands over the gradients its local
    step took (a survivor that missed that step takes it from them); once
    the forward landed the exchange, the parameters' own."""
    model = make_model(torch.float32)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=0.02, gather_during_forward=True, redundancy=2
    )
    net = DDP(model)
    g = torch.Generator().manual_seed(rank)
    net(torch.randn(7, 12, generator=g)).square().mean().backward()
    taken = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad()  # the next iteration begins
    kept = opt.step_gradients
    same = all(k is not None and torch.equal(k, t) for k, t in zip(kept, taken, strict=True))
    net(torch.randn(7, 12, generator=g))  # lands the exchange
    landed = all(k is None for k in opt.step_gradients)
    return opt._gathering.flight is None, same, landed  # type: ignore[union-attr]


def world(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: (run(config, False, rank), run(config, True, rank))
        for name, config in CONFIGS.items()
    }
    out["readers"] = readers(rank)
    out["join"] = (uneven(False, rank), uneven(True, rank))
    out["kept"] = kept_gradients(rank)
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_world(world, 2)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_forward_finds_every_update_and_the_run_ends_bitwise_as_without_it(
    two: list[dict[str, Any]], config: str
) -> None:
    # The overlapped step sends once DDP's buckets are final and its plan
    # fixed: from the third backward on.
    sending = slice(2, None) if "overlap" in CONFIGS[config] else slice(None)
    for out in two:
        plain, gathered = out[config]
        assert all(gathered["in flight"][sending]), "the step waited for its sends"
        assert all(gathered["finished by the forward"]), "the forward left pieces behind"
        assert all(
            torch.equal(a, b) for a, b in zip(plain["losses"], gathered["losses"], strict=True)
        )
        assert all(
            torch.equal(a, b) for a, b in zip(plain["params"], gathered["params"], strict=True)
        )
    plain, gathered = two[0][config]
    for index, entry in plain["state"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, gathered["state"]["state"][index][key]), (index, key)


def test_every_reader_of_parameters_waits_first(two: list[dict[str, Any]]) -> None:
    for out in two:
        for name, (pending, same) in out["readers"].items():
            assert pending, f"{name}: the exchange was not in flight to begin with"
            assert same, f"{name} read parameters before the exchange ended"


def test_uneven_inputs_under_join_end_bitwise_as_without_it(two: list[dict[str, Any]]) -> None:
    for out in two:
        plain, gathered = out["join"]
        assert all(torch.equal(a, b) for a, b in zip(plain, gathered, strict=True))


def test_with_redundancy_the_step_keeps_its_gradients_until_its_exchange_lands(
    two: list[dict[str, Any]],
) -> None:
    for out in two:
        landed, same, dropped = out["kept"]
        assert landed, "the forward did not land the exchange"
        assert same, "zero_grad took the gradients a survivor that missed the step needs"
        assert dropped, "the kept gradients outlived the exchange"


def lost_in_flight(rank: int, world_size: int) -> str:
    model = make_model(torch.float32)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, gather_during_forward=True
    )
    for step in range(2):
        opt.zero_grad()
        model(torch.ones(2, 12)).sum().backward()
        if step == 1 and rank == 1:
            os._exit(0)  # gone before it sends its pieces: rank 0's are in flight
        opt.step()
    try:
        model(torch.ones(2, 12))
    except CollectiveError as error:
        return str(error)
    return "the forward did not fail"


@pytest.mark.timeout(120)
def test_a_rank_lost_while_the_gather_is_in_flight_fails_the_forward() -> None:
    (error, _) = run_local_world(lost_in_flight, 2, timeout_s=60.0, may_exit=[1])
    assert "the ZeRO step's exchange of updated shards" in error, error


@pytest.mark.usefixtures("single_rank_group")
def test_the_interleaved_overlap_hook_is_refused_naming_both() -> None:
    model = make_model(torch.float32)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, overlap_with_ddp=True, gather_during_forward=True
    )
    ddp = DDP(model)
    with pytest.raises(ValueError, match="interleaved .* gather_during_forward=True"):
        hook_with_zero_step_interleaved(allreduce_hook, ddp, opt)
    hook_with_zero_step(allreduce_hook, ddp, opt)  # the hook that sends behind the forward
