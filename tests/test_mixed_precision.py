"""Mixed-precision ZeRO on 2 gloo ranks: bf16 parameters with fp32 master
shards equal an unsharded fp32-master reference built here, in every
partition mode, with and without bucket views, and with the overlapped step;
fp16 with loss scaling skips an overflowing step on every rank together;
clipping across shards equals clipping the whole model; checkpoints carry
the masters and continue bitwise on 1 and 3 ranks."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import LossScaler, ZeroRedundancyOptimizer, verify_replicas
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.hooks import allreduce_hook, hook_with_zero_step

STEPS = 30
LR = 1e-3
MODES = [(mode, view) for mode in ("flat", "greedy", "balanced") for view in (False, True)]


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 17), torch.nn.Linear(17, 4)
    )
    return model.to(dtype)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(100 * step + rank))


def averaged_backward(model: torch.nn.Module, x: torch.Tensor, scale: float = 1.0) -> None:
    (model(x.to(next(model.parameters()).dtype)).float().square().mean() * scale).backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


class Reference:
    """The unsharded answer: an fp32 master per parameter, torch.optim.Adam on
    the masters, parameters = masters cast down."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.masters = [p.detach().float() for p in model.parameters()]
        self.adam = torch.optim.Adam(self.masters, lr=LR)

    def step(self, unscale: float = 1.0, max_norm: float | None = None) -> bool:
        """Step unless a gradient is not finite; returns whether it stepped."""
        for m, p in zip(self.masters, self.model.parameters(), strict=True):
            m.grad = p.grad.float() * unscale if unscale != 1.0 else p.grad.float()  # type: ignore[union-attr]
        if not all(bool(torch.isfinite(m.grad).all()) for m in self.masters):  # type: ignore[arg-type]
            return False
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, max_norm)
        self.adam.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.model.parameters(), strict=True):
                p.copy_(m)
        return True


def train_beside(model: torch.nn.Module, opt: Any, ref: Reference, rank: int) -> None:
    """``STEPS`` steps of ``model`` with ``opt`` and of the reference, on the
    same batches."""
    for step in range(STEPS):
        for m in (model, ref.model):
            m.zero_grad()
            averaged_backward(m, batch(step, rank))
        opt.step()
        ref.step()


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def bf16_world(rank: int, world: int) -> dict[str, Any]:
    """Every mode trained 30 steps beside the reference; what differed."""
    out: dict[str, Any] = {}
    for mode, view in MODES:
        model, ref = make_model(torch.bfloat16), Reference(make_model(torch.bfloat16))
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            lr=LR,
            partition=mode,
            parameters_as_bucket_view=view,
            master_dtype=torch.float32,
        )
        train_beside(model, opt, ref, rank)
        out[f"{mode}/view={view}"] = _mismatch(model, ref.model)
        out[f"{mode}/view={view}/memory"] = opt.memory_bytes()
        out[f"{mode}/view={view}/local_dtypes"] = sorted(
            {str(p.dtype) for g in opt.optim.param_groups for p in g["params"]}
        )
    out["naive_bf16_differs"] = _naive_bf16_fraction(rank)
    out["overlap"] = _overlapped(rank)
    out["overlap_clipped"] = _overlapped(rank, max_norm=0.5)
    out["clip"] = _clipped(rank)
    return out


def _mismatch(model: torch.nn.Module, ref: torch.nn.Module) -> int:
    """How many elements differ at all."""
    return sum(
        int((p != q).sum()) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


def _naive_bf16_fraction(rank: int) -> float:
    """The fraction of elements where Adam stepping bf16 directly (what
    PyTorch's ZeRO does) ends away from the fp32-master answer."""
    model, ref = make_model(torch.bfloat16), Reference(make_model(torch.bfloat16))
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    train_beside(model, adam, ref, rank)
    total = sum(p.numel() for p in model.parameters())
    return _mismatch(model, ref.model) / total


def _overlapped(rank: int, max_norm: float | None = None) -> int:
    """The overlapped step (DDP + hook_with_zero_step) beside DDP + reference."""
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=0.001)
    ref_ddp = DDP(ref_model, bucket_cap_mb=0.001)
    ref = Reference(ref_model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        lr=LR,
        overlap_with_ddp=True,
        master_dtype=torch.float32,
    )
    hook = hook_with_zero_step(allreduce_hook, ddp, opt, max_grad_norm=max_norm)
    ddp.register_comm_hook(None, hook)
    for step in range(STEPS):
        x = batch(step, rank).to(torch.bfloat16)
        for d in (ddp, ref_ddp):
            d.module.zero_grad()
            (d(x).float().square().mean() * (50.0 if max_norm else 1.0)).backward()
        ref.step(max_norm=max_norm)
    return _mismatch(model, ref_model)


CLIPPED = (("flat", 1), ("greedy", 1), ("greedy", 2))
"""The partitions clipped, and their redundancy (2: the carried masters are
clipped by the same coefficient as their owner's)."""


def _clipped(rank: int) -> dict[str, float]:
    """clip_grad_norm_ across shards beside clipping the whole model; with
    ``redundancy=2`` every carried copy checked against its owner's after."""
    out = {}
    for mode, redundancy in CLIPPED:
        model, ref = make_model(torch.bfloat16), Reference(make_model(torch.bfloat16))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, lr=LR, partition=mode,
            master_dtype=torch.float32, redundancy=redundancy,
        )  # fmt: skip
        norms = []
        for step in range(5):
            for m in (model, ref.model):
                m.zero_grad()
                averaged_backward(m, batch(step, rank), scale=50.0)
            norms.append(float(opt.clip_grad_norm_(0.5)))
            opt.step()
            ref.step(max_norm=0.5)
        expected = [p.grad.float() for p in ref.model.parameters()]  # type: ignore[union-attr]
        whole = float(torch.linalg.vector_norm(torch.stack([e.norm() for e in expected])))
        key = f"{mode}/redundancy={redundancy}"
        out[f"{key}/norm_error"] = abs(norms[-1] - whole) / whole
        out[f"{key}/mismatch"] = float(_mismatch(model, ref.model))
        if redundancy == 2:  # raises ReplicaMismatch if a carried master or state differs
            verify_replicas(model, optimizer=opt)
    return out


@pytest.fixture(scope="module")
def bf16() -> list[dict[str, Any]]:
    return run_world(bf16_world, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "view"), MODES)
def test_bf16_with_fp32_masters_equals_the_unsharded_reference(
    bf16: list[dict[str, Any]], mode: str, view: bool
) -> None:
    for rank_out in bf16:
        assert rank_out[f"{mode}/view={view}"] == 0
        assert rank_out[f"{mode}/view={view}/local_dtypes"] == ["torch.float32"]


@pytest.mark.timeout(240)
def test_masters_are_what_keeps_small_updates(bf16: list[dict[str, Any]]) -> None:
    # Stepping bf16 directly loses small updates: most elements end elsewhere.
    assert bf16[0]["naive_bf16_differs"] > 0.3


@pytest.mark.timeout(240)
def test_overlapped_step_with_masters_equals_the_reference(bf16: list[dict[str, Any]]) -> None:
    assert [r["overlap"] for r in bf16] == [0, 0]
    # Clipped inside the hook by the whole model's norm, as the reference clips.
    assert [r["overlap_clipped"] for r in bf16] == [0, 0]


@pytest.mark.timeout(240)
def test_clipping_across_shards_equals_clipping_the_whole_model(
    bf16: list[dict[str, Any]],
) -> None:
    for rank_out in bf16:
        for mode, redundancy in CLIPPED:
            key = f"{mode}/redundancy={redundancy}"
            assert rank_out["clip"][f"{key}/norm_error"] < 1e-5
            assert rank_out["clip"][f"{key}/mismatch"] == 0


@pytest.mark.timeout(240)
def test_master_bytes_are_this_ranks_shard_in_fp32(bf16: list[dict[str, Any]]) -> None:
    total = sum(p.numel() for p in make_model(torch.bfloat16).parameters())
    for rank_out in bf16:
        flat = rank_out["flat/view=False/memory"]
        assert flat["parameters"] == 2 * total
        assert flat["master_weights"] == pytest.approx(4 * total / 2, abs=4)
        # Adam: two fp32 states per owned element (+ per-tensor step counters).
        assert 8 * total / 2 <= flat["optimizer_state"] <= 8 * total / 2 + 64


# ----- fp16 with loss scaling ------------------------------------------------------

INF_STEP = 4


def _inject_inf(opt: ZeroRedundancyOptimizer, model: torch.nn.Module, rank: int) -> bool:
    """Put an inf in the last gradient element, on the rank that owns it only."""
    params = list(model.parameters())
    last = len(params) - 1
    owns = any(
        piece.param == last and piece.stop == params[last].numel()
        for piece in opt.shard_plan.partition.pieces_of(rank)
    )
    if owns:
        params[last].grad.view(-1)[-1] = float("inf")  # type: ignore[union-attr]
    return owns


def fp16_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("flat", "greedy"):
        model, ref = make_model(torch.float16), Reference(make_model(torch.float16))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, lr=LR, partition=mode, master_dtype=torch.float32
        )
        scaler = LossScaler(init_scale=2.0**10, growth_interval=3)
        ref_scale, ref_good, scales, owned_inf = 2.0**10, 0, [], False
        for step in range(12):
            for m, s in ((model, scaler.get_scale()), (ref.model, ref_scale)):
                m.zero_grad()
                averaged_backward(m, batch(step, rank), scale=s)
            if step == INF_STEP:
                owned_inf = _inject_inf(opt, model, rank)
                ref.model[-1].bias.grad.view(-1)[-1] = float("inf")  # type: ignore[index, union-attr]
            scaler.step(opt)
            scaler.update()
            stepped = ref.step(unscale=1.0 / ref_scale)
            ref_good = ref_good + 1 if stepped else 0
            ref_scale = ref_scale * 0.5 if not stepped else ref_scale
            if ref_good == 3:
                ref_scale, ref_good = ref_scale * 2.0, 0
            scales.append((scaler.get_scale(), ref_scale))
        out[mode] = {
            "mismatch": _mismatch(model, ref.model),
            "scales": scales,
            "owned_inf": owned_inf,
        }
    return out


@pytest.mark.timeout(120)
def test_fp16_loss_scaling_skips_an_overflow_on_every_rank_together() -> None:
    ranks = run_world(fp16_world, 2)
    for mode in ("flat", "greedy"):
        # Exactly one rank saw the inf; both skipped, as the reference did.
        assert sorted(r[mode]["owned_inf"] for r in ranks) == [False, True]
        for r in ranks:
            assert r[mode]["mismatch"] == 0
            assert [a for a, _ in r[mode]["scales"]] == [b for _, b in r[mode]["scales"]]
        scales = [a for a, _ in ranks[0][mode]["scales"]]
        assert scales[INF_STEP] == scales[INF_STEP - 1] / 2  # backed off at the inf
        assert max(scales) > 2.0**10  # and grew after good steps


# ----- checkpoints carry the masters ----------------------------------------------


def _same_grads_step(model: torch.nn.Module, opt: ZeroRedundancyOptimizer, step: int) -> None:
    # The same batch on every rank: the gradients do not depend on world size,
    # so runs on 1, 2 and 3 ranks can be compared bitwise.
    opt.zero_grad()
    averaged = batch(step, 0).to(torch.bfloat16)
    model(averaged).float().square().mean().backward()
    opt.step()


def _new(model: torch.nn.Module) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=LR, partition="flat", master_dtype=torch.float32
    )


def saving_world(rank: int, world: int, path: str) -> list[torch.Tensor]:
    model = make_model(torch.bfloat16)
    opt = _new(model)
    for step in range(5):
        _same_grads_step(model, opt, step)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{path}/full.pt")
    save_sharded(opt, f"{path}/sharded")
    torch.save(model.state_dict(), f"{path}/model.pt")
    for step in range(5, 10):
        _same_grads_step(model, opt, step)
    return params_of(model)


def resuming_world(rank: int, world: int, path: str, how: str) -> list[torch.Tensor]:
    model = make_model(torch.bfloat16)
    model.load_state_dict(torch.load(f"{path}/model.pt", weights_only=True))
    opt = _new(model)
    if how == "consolidated":
        opt.load_state_dict(torch.load(f"{path}/full.pt", weights_only=True)["optim"])
    else:
        load_sharded(opt, f"{path}/sharded")
    for step in range(5, 10):
        _same_grads_step(model, opt, step)
    return params_of(model)


@pytest.mark.timeout(180)
def test_checkpoints_with_masters_continue_bitwise_on_one_and_three_ranks(
    tmp_path: pathlib.Path,
) -> None:
    uninterrupted = run_world(saving_world, 2, str(tmp_path))[0]
    saved = torch.load(tmp_path / "full.pt", weights_only=True)["optim"]
    masters = [entry["master_param"] for entry in saved["state"].values()]
    assert len(masters) == 6 and all(m.dtype == torch.float32 for m in masters)
    for world, how in ((1, "consolidated"), (3, "consolidated"), (3, "sharded"), (1, "sharded")):
        resumed = run_world(resuming_world, world, str(tmp_path), how)
        for params in resumed:
            assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True)), (
                world,
                how,
            )


def fp16_overlap_world(rank: int, world: int) -> dict[str, Any]:
    """The overlapped step with loss scaling: an inf in one parameter's local
    gradient on rank 0 reaches only that parameter's owner, yet both skip."""
    model, ref_model = make_model(torch.float16), make_model(torch.float16)
    ddp, ref_ddp = DDP(model, bucket_cap_mb=0.001), DDP(ref_model, bucket_cap_mb=0.001)
    ref = Reference(ref_model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=LR, overlap_with_ddp=True,
        master_dtype=torch.float32,
    )  # fmt: skip
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3)
    hook = hook_with_zero_step(allreduce_hook, ddp, opt, max_grad_norm=5.0, loss_scaler=scaler)
    ddp.register_comm_hook(None, hook)
    poison = {"on": False}
    for m in (model, ref_model):
        m[-1].bias.register_hook(lambda g: g.fill_(float("inf")) if poison["on"] else g)  # type: ignore[index, union-attr]
    ref_scale, ref_good, scales = 2.0**10, 0, []
    for step in range(12):
        poison["on"] = step == INF_STEP and rank == 0
        x = batch(step, rank).to(torch.float16)
        for d, s in ((ddp, scaler.get_scale()), (ref_ddp, ref_scale)):
            d.module.zero_grad()
            (d(x).float().square().mean() * s).backward()
        scaler.update()
        stepped = ref.step(unscale=1.0 / ref_scale, max_norm=5.0)
        ref_good = ref_good + 1 if stepped else 0
        ref_scale = ref_scale * 0.5 if not stepped else ref_scale
        if ref_good == 3:
            ref_scale, ref_good = ref_scale * 2.0, 0
        scales.append((scaler.get_scale(), ref_scale))
    return {"mismatch": _mismatch(model, ref_model), "scales": scales}


@pytest.mark.timeout(120)
def test_fp16_loss_scaling_and_clipping_inside_the_overlapped_step() -> None:
    for r in run_world(fp16_overlap_world, 2):
        assert r["mismatch"] == 0
        assert [a for a, _ in r["scales"]] == [b for _, b in r["scales"]]
        assert r["scales"][INF_STEP][0] == r["scales"][INF_STEP - 1][0] / 2
