"""Pairs of features on real gloo ranks, each once silently wrong, hung or
refused late: DiLoCo over ZeRO with master copies or the int8 exchange, a
sharded round trip under ``redundancy=2``, DiLoCo's sharded checkpoint, an
overlapped optimizer resumed before its first iteration, and the refusals
that now come at construction (or at the first step), before anything
changes. Spawning is slow on 2 cores, so each world runs several checks."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import LossScaler, ZeroRedundancyOptimizer
from zerofn_torch.averaging import DiLoCoOptimizer, PeriodicModelAverager, PostLocalSGDOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.hooks import allreduce_hook, hook_with_zero_step
from zerofn_torch.join import Join
from zerofn_torch.runtime.object_collectives import all_gather_objects

pytestmark = pytest.mark.timeout(240)

LR = 1e-2


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # small values: a bf16 ulp stays well under the learning rate
    return model.to(dtype)


def backward(model: torch.nn.Module, step: int, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + seed)
    x = torch.randn(8, 6, generator=g).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone()


# ----- DiLoCo over ZeRO: 2 workers of 2 ranks ---------------------------------------


def worker_groups(rank: int) -> tuple[int, Any, Any]:
    """Workers {0, 1} and {2, 3}; DiLoCo syncs rank r with r + 2."""
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rank // 2, inner[rank // 2], outer[rank % 2]


def diloco_over_zero(
    rank: int, dtype: torch.dtype, inner: Any, outer: Any, worker: int, **zero_options: Any
) -> tuple[torch.nn.Module, DiLoCoOptimizer]:
    model = make_model(dtype)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, process_group=inner, lr=LR, **zero_options
    )
    outer_sgd = lambda ts: torch.optim.SGD(ts, lr=1.0)  # noqa: E731  plain averaging
    return model, DiLoCoOptimizer(
        zero, sync_every=4, outer_optimizer=outer_sgd, process_group=outer
    )


def syncs_reach_the_next_step(rank: int, options: dict[str, Any]) -> dict[str, float]:
    """After each sync every rank holds the average, and the next inner step
    moves no parameter further than Adam can (lr, plus a bf16 rounding)."""
    worker, inner, outer = worker_groups(rank)
    dtype = options.pop("dtype")
    model, opt = diloco_over_zero(rank, dtype, inner, outer, worker, **options)
    everywhere = dist.group.WORLD
    spread, moved = 0.0, 0.0
    for step in range(1, 13):
        before = flat(model)
        opt.zero_grad()
        backward(model, step, worker)  # one batch per worker: the workers drift apart
        opt.step()
        if step % 4 == 0:  # a sync: every rank holds the same values
            every = all_gather_objects(flat(model), everywhere, "test: parameters after a sync")
            spread = max(spread, max((v - every[0]).abs().max().item() for v in every))
        if step % 4 == 1 and step > 1:  # the step after a sync
            moved = max(moved, (flat(model) - before).abs().max().item())
    return {"spread": spread, "moved": moved}


def diloco_refusals(rank: int) -> dict[str, str]:
    worker, inner, outer = worker_groups(rank)
    refused: dict[str, str] = {}
    model, opt = diloco_over_zero(rank, torch.float32, inner, outer, worker)
    with pytest.raises(ValueError) as joined:
        Join([opt])
    refused["join"] = str(joined.value)
    extra = torch.nn.Linear(2, 2)
    opt.optim.add_param_group({"params": extra.parameters()})  # behind DiLoCo's back
    before = flat(model)
    backward(model, 0, worker)
    with pytest.raises(ValueError) as added:
        opt.step()
    assert torch.equal(flat(model), before)  # refused before the inner step
    refused["added"] = str(added.value)
    carried_zero = ZeroRedundancyOptimizer(
        make_model().parameters(), torch.optim.Adam, process_group=inner, lr=LR, redundancy=2
    )
    with pytest.raises(ValueError) as carried:
        DiLoCoOptimizer(carried_zero, sync_every=2, process_group=outer)
    refused["carried"] = str(carried.value)
    with pytest.raises(TypeError) as plain:
        save_sharded(torch.optim.SGD(model.parameters(), lr=0.1), "unused")
    refused["plain"] = str(plain.value)
    return refused


def diloco_workers_sharing_a_directory(rank: int, folder: str) -> str:
    """save_sharded and load_sharded of a DiLoCo whose workers would write
    their shards into one directory: refused on every rank, nothing written."""
    worker, inner, outer = worker_groups(rank)
    model, opt = diloco_over_zero(rank, torch.float32, inner, outer, worker)
    backward(model, 1, worker)
    opt.step()
    path = os.path.join(folder, "shared")
    refusals = []
    for call in (save_sharded, load_sharded):
        try:
            call(opt, path)
        except ValueError as e:
            refusals.append(str(e))
    assert not os.path.exists(path), "a refused save wrote something"
    return " | ".join(refusals)


def diloco_sharded_round_trip(rank: int, folder: str) -> bool:
    """save_sharded(diloco) mid-run, then a fresh model and optimizers resume
    from it and end bitwise where the uninterrupted run ends."""
    worker, inner, outer = worker_groups(rank)
    model, opt = diloco_over_zero(rank, torch.float32, inner, outer, worker)
    path = os.path.join(folder, f"worker{worker}")
    for step in range(1, 11):
        opt.zero_grad()
        backward(model, step, worker)
        opt.step()
        if step == 6:  # mid-way between syncs
            save_sharded(opt, path, extra={"model": model.state_dict(), "step": step})
    uninterrupted = flat(model)
    fresh, resumed = diloco_over_zero(rank, torch.float32, inner, outer, worker)
    extra = load_sharded(resumed, path)
    fresh.load_state_dict(extra["model"])
    for step in range(int(extra["step"]) + 1, 11):
        resumed.zero_grad()
        backward(fresh, step, worker)
        resumed.step()
    return torch.equal(flat(fresh), uninterrupted)


def four_ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    return {
        "masters": syncs_reach_the_next_step(
            rank, {"dtype": torch.bfloat16, "master_dtype": torch.float32}
        ),
        "int8": syncs_reach_the_next_step(
            rank, {"dtype": torch.float32, "exchange_compression": "int8"}
        ),
        "exact": syncs_reach_the_next_step(rank, {"dtype": torch.float32}),
        "refused": diloco_refusals(rank),
        "round_trip": diloco_sharded_round_trip(rank, folder),
        "shared": diloco_workers_sharing_a_directory(rank, folder),
    }


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(four_ranks, 4, str(tmp_path_factory.mktemp("diloco")))


@pytest.mark.parametrize("mode", ["masters", "int8", "exact"])
def test_a_diloco_sync_over_zero_reaches_the_next_inner_step(
    four: list[dict[str, Any]], mode: str
) -> None:
    bf16_ulp = 2.0**-9  # at the model's magnitudes (below 1)
    for result in four:
        assert result[mode]["spread"] == 0.0
        assert result[mode]["moved"] <= LR * 1.05 + (bf16_ulp if mode == "masters" else 0.0)


def test_diloco_refuses_join_and_a_group_added_behind_its_back(
    four: list[dict[str, Any]],
) -> None:
    for result in four:
        assert "Join" in result["refused"]["join"]
        assert "never be synced" in result["refused"]["added"]
        assert "ZeroRedundancyOptimizer" in result["refused"]["plain"]
        assert "redundancy=2" in result["refused"]["carried"]


def test_a_diloco_sharded_checkpoint_resumes_exactly(four: list[dict[str, Any]]) -> None:
    assert all(result["round_trip"] for result in four)


def test_diloco_workers_sharing_one_checkpoint_directory_are_refused(
    four: list[dict[str, Any]],
) -> None:
    for result in four:
        save, load = result["shared"].split(" | ")
        assert save.startswith("save_sharded") and load.startswith("load_sharded")
        assert "its own directory" in save and "2 DiLoCoOptimizer workers" in save


# ----- redundancy=2: a sharded round trip keeps the carried copies ---------------------


def carried_states(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR, redundancy=2)
    for step in range(1, 3):
        zero.zero_grad()
        backward(model, step, 0)  # the same gradients everywhere (DDP's average)
        zero.step()
    save_sharded(zero, folder)
    fresh = make_model(seed=1)
    loaded = ZeroRedundancyOptimizer(fresh.parameters(), torch.optim.Adam, lr=LR, redundancy=2)
    load_sharded(loaded, folder)
    carried = loaded.zero_rank.carried
    assert carried is not None
    owned = loaded.zero_rank.plan.partition.params_of(rank)
    local = loaded.optim.param_groups[0]["params"]
    mine = {i: loaded.optim.state[p] for i, p in zip(owned, local, strict=True)}
    copies = {
        i: carried.optim.state[t] for i, t in zip(carried.indices, carried.tensors(), strict=True)
    }
    every = all_gather_objects((mine, copies), dist.group.WORLD, "test: carried states")
    owner = every[carried.owner][0]
    same = all(
        owner[i].keys() == copies[i].keys()
        and all(torch.equal(copies[i][k], owner[i][k]) for k in owner[i])
        for i in carried.indices
    )
    with pytest.raises(ValueError) as refused:
        PostLocalSGDOptimizer(zero, PeriodicModelAverager(period=2))
    return {"same": bool(same), "post_local": str(refused.value)}


def test_a_sharded_round_trip_restores_every_carried_copy(tmp_path: Any) -> None:
    for result in run_world(carried_states, 3, str(tmp_path / "ckpt")):
        assert result["same"]
        assert "redundancy=2" in result["post_local"]


# ----- the overlapped step: resumed before its first iteration -------------------------


def overlapped(model: torch.nn.Module) -> tuple[DDP, ZeroRedundancyOptimizer]:
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=LR)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    return ddp, zero


def resumed_overlap(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    steps, saved_at = 8, 4
    plain_model = make_model()
    ddp = DDP(plain_model)
    plain = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=LR)
    for step in range(1, steps + 1):
        plain.zero_grad()
        backward(ddp, step, rank)
        plain.step()
        if step == saved_at:
            plain.consolidate_state_dict(to=0)
            full = plain.state_dict() if rank == 0 else None
            (full,) = all_gather_objects(full, dist.group.WORLD, "test: state")[:1]
            model_state = copy.deepcopy(plain_model.state_dict())
            save_sharded(plain, folder, extra={"model": model_state})
    results: dict[str, Any] = {}
    for how in ("consolidated", "sharded"):
        model = make_model(seed=1)
        model.load_state_dict(model_state)
        ddp_o, zero = overlapped(model)
        if how == "consolidated":
            zero.load_state_dict(full)  # before DDP fixed its buckets
        else:
            load_sharded(zero, folder)
        for step in range(saved_at + 1, steps + 1):
            zero.zero_grad()
            backward(ddp_o, step, rank)
        results[how] = torch.equal(flat(model), flat(plain_model))
    partial = make_model()
    ddp_p = DDP(partial)
    some = ZeroRedundancyOptimizer(
        partial[0].parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    with pytest.raises(ValueError) as uncovered:
        hook_with_zero_step(allreduce_hook, ddp_p, some)
    results["uncovered"] = str(uncovered.value)
    ddp_s = DDP(make_model())
    zero_s = ZeroRedundancyOptimizer(
        ddp_s.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    with pytest.raises(TypeError) as scaler:
        hook_with_zero_step(allreduce_hook, ddp_s, zero_s, loss_scaler=torch.amp.GradScaler("cpu"))
    results["scaler"] = str(scaler.value)
    hook_with_zero_step(allreduce_hook, ddp_s, zero_s, loss_scaler=LossScaler())  # still free
    return results


def resumed_on_one_rank(rank: int, world_size: int, folder: str) -> bool:
    """The 2-rank checkpoint resumed on 1 rank, overlapped and not: the same parameters."""
    finals = []
    for overlap in (False, True):
        model = make_model(seed=1)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=LR
        )
        model.load_state_dict(load_sharded(zero, folder)["model"])
        ddp = DDP(model)
        if overlap:
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        for step in range(5, 9):
            zero.zero_grad()
            backward(ddp, step, rank)
            if not overlap:
                zero.step()
        finals.append(flat(model))
    return torch.equal(finals[0], finals[1])


def test_an_overlapped_optimizer_resumes_before_its_first_iteration(tmp_path: Any) -> None:
    folder = str(tmp_path / "ckpt")
    for result in run_world(resumed_overlap, 2, folder):
        assert result["consolidated"] and result["sharded"]
        assert "leaves 2" in result["uncovered"]
        assert "LossScaler" in result["scaler"]
    assert run_world(resumed_on_one_rank, 1, folder) == [True]  # at another world size
