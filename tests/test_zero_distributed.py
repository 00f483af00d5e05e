"""ZeroRedundancyOptimizer on real gloo ranks, beside PyTorch's own, in the same
process group: parameter parity, consolidated state dicts both ways, the
coalesced exchange, checkpoints resharded from 2 ranks to 1 and 3 (consolidated
and through torch.distributed.checkpoint), and a failing rank that must not hang
the others. Spawning is slow on 2 cores, so each world runs many checks."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _world import run_world
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(9, 16), torch.nn.ReLU(), torch.nn.Linear(16, 11), torch.nn.Linear(11, 3)
    )


def train(model: torch.nn.Module, opt: Any, steps: int, first_step: int = 0) -> None:
    """Each rank draws its own batch per step; gradients are averaged as DDP would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        opt.zero_grad()
        model(torch.randn(6, 9, generator=g)).square().mean().backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        ((p - q).abs() / q.abs().clamp_min(1e-3)).max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def count_calls(names: list[str], fn: Callable[[], None]) -> int:
    """How many of the named torch.distributed collectives ``fn`` issues."""
    calls = 0
    originals = {n: getattr(dist, n) for n in names}

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        return wrapper

    for n, f in originals.items():
        setattr(dist, n, counting(f))
    try:
        fn()
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    return calls


def two_rank_world(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"parity": {}}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for bucket in (False, True):
            ours_m, torch_m, plain_m = make_model(), make_model(), make_model()
            ours = ZeroRedundancyOptimizer(
                ours_m.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs
            )
            theirs = TorchZero(
                torch_m.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs
            )
            plain = cls(plain_m.parameters(), **kwargs)
            for m, o in ((ours_m, ours), (torch_m, theirs), (plain_m, plain)):
                train(m, o, 4)
            out["parity"][(name, "greedy", bucket)] = (
                max_diff(ours_m, torch_m),
                max_diff(ours_m, plain_m),
            )
            for mode in ("balanced", "flat"):
                m = make_model()
                o = ZeroRedundancyOptimizer(
                    m.parameters(), cls, parameters_as_bucket_view=bucket, partition=mode, **kwargs
                )
                train(m, o, 4)
                out["parity"][(name, mode, bucket)] = (float("nan"), max_diff(m, plain_m))

    # Consolidated state dicts, against PyTorch's ZeRO, and loaded both ways.
    cls, kwargs = OPTIMIZERS["adam"]
    ours_m, torch_m = make_model(), make_model()
    ours = ZeroRedundancyOptimizer(ours_m.parameters(), cls, **kwargs)
    theirs = TorchZero(torch_m.parameters(), cls, **kwargs)
    train(ours_m, ours, 3)
    train(torch_m, theirs, 3)
    ours.consolidate_state_dict(to=0)
    theirs.consolidate_state_dict(to=0)
    sds: list[Any] = [ours.state_dict(), theirs.state_dict()] if rank == 0 else [None, None]
    dist.broadcast_object_list(sds, src=0)
    ours_sd, theirs_sd = sds
    model_at_3 = copy.deepcopy(ours_m.state_dict())  # the same on every rank
    out["ours_sd"], out["theirs_sd"], out["model"] = ours_sd, theirs_sd, model_at_3
    # PyTorch's consolidated state into our ZeRO, ours into a plain optimizer.
    a, b, c = copy.deepcopy(torch_m), copy.deepcopy(ours_m), copy.deepcopy(torch_m)
    zero_a = ZeroRedundancyOptimizer(a.parameters(), cls, partition="flat", **kwargs)
    zero_a.load_state_dict(copy.deepcopy(theirs_sd))
    plain_b = cls(b.parameters(), **kwargs)
    plain_b.load_state_dict(copy.deepcopy(ours_sd))
    plain_c = cls(c.parameters(), **kwargs)
    plain_c.load_state_dict(copy.deepcopy(theirs_sd))
    for m, o in ((a, zero_a), (b, plain_b), (c, plain_c), (ours_m, ours)):
        train(m, o, 3, first_step=3)
    out["loaded_theirs_vs_plain"] = max_diff(a, c)
    out["ours_vs_plain_loaded_ours"] = max_diff(ours_m, b)

    # A sharded checkpoint of the same moment, each rank writing its own part.
    m = make_model()
    m.load_state_dict(model_at_3)
    z = ZeroRedundancyOptimizer(m.parameters(), cls, partition="balanced", **kwargs)
    z.load_state_dict(copy.deepcopy(ours_sd))
    save_sharded(z, ckpt_dir)

    # Uneven inputs under PyTorch's Join with DDP: rank 1 has two more batches.
    joined = []
    for impl in (ZeroRedundancyOptimizer, TorchZero):
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        zero = impl(model.parameters(), cls, **kwargs)
        with Join([model, zero]):
            for step in range(3 + 2 * rank):
                g = torch.Generator().manual_seed(1000 * step + rank)
                zero.zero_grad()
                model(torch.randn(6, 9, generator=g)).square().mean().backward()
                zero.step()
        joined.append(model.module)
    out["join_vs_torch"] = max_diff(joined[0], joined[1])

    # The exchange: one message per rank and buffer, against PyTorch's one per parameter.
    collectives = ["broadcast", "all_gather", "all_gather_into_tensor"]
    for bucket in (False, True):
        mo, mt = make_model(), make_model()
        zo = ZeroRedundancyOptimizer(
            mo.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs
        )
        zt = TorchZero(mt.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs)
        for model in (mo, mt):
            model(torch.randn(2, 9)).sum().backward()
        out[("calls", bucket)] = (
            count_calls(collectives, zo.step),
            count_calls(collectives, zt.step),
        )
    return out


def resume_world(
    rank: int, world: int, sd: dict[str, Any], model_sd: Any, ckpt: str
) -> dict[str, float]:
    """Resume the 2-rank checkpoint here, at ``world`` ranks, beside the plain optimizer."""
    cls, kwargs = OPTIMIZERS["adam"]
    plain_m = make_model()
    plain_m.load_state_dict(model_sd)
    plain = cls(plain_m.parameters(), **kwargs)
    plain.load_state_dict(copy.deepcopy(sd))
    runs: dict[str, tuple[torch.nn.Module, Any]] = {}
    for mode in ("greedy", "balanced", "flat"):
        for source in ("consolidated", "sharded"):
            m = make_model()
            m.load_state_dict(model_sd)
            z = ZeroRedundancyOptimizer(m.parameters(), cls, partition=mode, **kwargs)
            if source == "consolidated":
                z.load_state_dict(copy.deepcopy(sd))
            else:
                load_sharded(z, ckpt)
            runs[f"{mode}/{source}"] = (m, z)
    train(plain_m, plain, 3, first_step=3)
    for m, z in runs.values():
        train(m, z, 3, first_step=3)
    return {k: max_diff(m, plain_m) for k, (m, _) in runs.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], pathlib.Path]:
    ckpt = tmp_path_factory.mktemp("sharded")
    results = run_world(two_rank_world, 2, str(ckpt))
    return results[0], ckpt


def test_parameters_match_pytorch_and_plain_optimizer(two_ranks: Any) -> None:
    out, _ = two_ranks
    assert len(out["parity"]) == 3 * 3 * 2
    # Bitwise: the same element-wise update on the same gradients, in every mode.
    for case, (vs_torch, vs_plain) in out["parity"].items():
        if case[1] == "greedy":
            assert vs_torch == 0.0, case
        assert vs_plain == 0.0, case


def test_consolidated_state_dict_equals_pytorchs(two_ranks: Any) -> None:
    out, _ = two_ranks
    ours, theirs = out["ours_sd"], out["theirs_sd"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][index].keys()
        for name, value in entry.items():
            assert torch.equal(ours["state"][index][name], value), (index, name)


def test_state_dicts_load_across_implementations(two_ranks: Any) -> None:
    out, _ = two_ranks
    assert out["loaded_theirs_vs_plain"] == 0.0
    assert out["ours_vs_plain_loaded_ours"] == 0.0


def test_uneven_inputs_under_join_match_pytorch(two_ranks: Any) -> None:
    out, _ = two_ranks
    assert out["join_vs_torch"] == 0.0


def test_exchange_is_one_message_per_rank_not_per_parameter(two_ranks: Any) -> None:
    out, _ = two_ranks
    num_params = len(list(make_model().parameters()))
    for bucket in (False, True):
        ours, theirs = out[("calls", bucket)]
        assert ours == 2  # one buffer (one dtype, one device), one segment per rank
        if not bucket:
            assert theirs == num_params


def test_checkpoint_from_two_ranks_resumes_on_three(two_ranks: Any) -> None:
    out, ckpt = two_ranks
    diffs = run_world(resume_world, 3, out["ours_sd"], out["model"], str(ckpt))
    for rank_diffs in diffs:
        assert len(rank_diffs) == 6
        for case, diff in rank_diffs.items():
            assert diff <= 1e-6, case


@pytest.mark.usefixtures("single_rank_group")
def test_checkpoint_from_two_ranks_resumes_on_one(two_ranks: Any) -> None:
    out, ckpt = two_ranks
    diffs = resume_world(0, 1, out["ours_sd"], out["model"], str(ckpt))
    assert len(diffs) == 6
    for case, diff in diffs.items():
        assert diff <= 1e-6, case


@pytest.mark.usefixtures("single_rank_group")
def test_checkpoint_missing_a_rank_is_refused(two_ranks: Any, tmp_path: pathlib.Path) -> None:
    _, ckpt = two_ranks
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        if f.name != "__1_0.distcp":
            (broken / f.name).write_bytes(f.read_bytes())
    m = make_model()
    cls, kwargs = OPTIMIZERS["adam"]
    z = ZeroRedundancyOptimizer(m.parameters(), cls, **kwargs)
    before = copy.deepcopy(z.optim.state_dict())
    with pytest.raises(ValueError, match="missing"):
        load_sharded(z, broken)
    assert z.optim.state_dict() == before


def failing_world(rank: int, world: int) -> None:
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    if rank == 1:
        raise RuntimeError("rank 1 fails before the step")
    model(torch.randn(2, 9)).sum().backward()
    opt.step()  # would wait for rank 1 forever without the harness


@pytest.mark.timeout(90)
def test_a_failing_rank_does_not_hang_the_others() -> None:
    # Whichever rank is reported first (the failing one, or its peer that lost
    # the connection), the run ends with an error instead of waiting.
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails|Connection|peer"):
        run_world(failing_world, 2)
