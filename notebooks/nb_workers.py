"""Per-rank functions for the notebooks.

``zerofn_torch.runtime.launch.run_local_world`` starts each rank in a fresh
process, which imports the per-rank function by name. A function defined in a
notebook cell lives in the kernel's ``__main__`` and cannot be imported that
way, so the notebooks keep their per-rank code here, next to them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's per-parameter state."""
    return sum(
        v.numel() * v.element_size()
        for per_param in optim.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def _mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


# ----- notebook 02: a composed hook under real DDP ------------------------------------


def _regression_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def custom_hook_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the same small regression model twice under DDP, with PyTorch's
    default all-reduce and with the composed hook
    ``with_stats(cast(error_feedback(top_k(k)), float16))``."""
    from zerofn_torch.hooks import HookRunner, run_hook

    from zerofn.hooks.error_feedback import error_feedback
    from zerofn.hooks.hook import cast
    from zerofn.hooks.sparsify import top_k
    from zerofn.stats import comm_stats, with_stats

    # The same teacher and the same initial weights on every rank.
    torch.manual_seed(cfg["seed"])
    teacher = nn.Linear(32, 1)
    base = _regression_model()
    models = {"allreduce (fp32)": base, "top-k + EF @ fp16": _regression_model()}
    models["top-k + EF @ fp16"].load_state_dict(base.state_dict())

    ddps = {name: DDP(m, bucket_cap_mb=cfg["bucket_cap_mb"]) for name, m in models.items()}
    runner = HookRunner(with_stats(cast(error_feedback(top_k(cfg["k_fraction"])), torch.float16)))
    ddps["top-k + EF @ fp16"].register_comm_hook(runner, run_hook)
    optims = {name: torch.optim.SGD(d.parameters(), lr=cfg["lr"]) for name, d in ddps.items()}

    # Each rank draws its own batches.
    data = torch.Generator().manual_seed(1000 + rank)
    losses: dict[str, list[float]] = {name: [] for name in ddps}
    for _ in range(cfg["steps"]):
        x = torch.randn(cfg["batch_size"], 32, generator=data)
        with torch.no_grad():
            y = torch.sin(teacher(x))
        for name, ddp in ddps.items():
            optims[name].zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optims[name].step()
            losses[name].append(_mean_across_ranks(loss))

    stats = comm_stats(runner.state)
    flat = torch.cat([p.detach().reshape(-1) for p in models["top-k + EF @ fp16"].parameters()])
    return {
        "losses": losses,
        "hook_name": runner.hook.name,
        "bytes_per_iteration": stats.bytes_per_iteration,
        "collectives_per_bucket": stats.collectives_per_bucket,
        "fp32_grad_bytes": sum(p.numel() * p.element_size() for p in base.parameters()),
        "params": flat,
    }


# ----- notebook 03: drop-in ZeroRedundancyOptimizer --------------------------------


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (shipped inside the package: no download), as float
    features in [0, 1], split 80/20 by a seeded shuffle."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


def _mlp() -> nn.Module:
    # One wide layer and a small head: whole-tensor partitions cannot split it evenly.
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))


def drop_in_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same training loop three times: with PyTorch's
    ``ZeroRedundancyOptimizer``, and with zerofn's under the greedy and the
    flat partition. Only the class (and its optional ``partition``) changes."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from zerofn_torch import ZeroRedundancyOptimizer as ZerofnZeRO

    x_train, y_train, x_test, y_test = _digits(cfg["seed"])
    runs = {
        "torch": lambda params: TorchZeRO(params, torch.optim.Adam, lr=cfg["lr"]),
        "zerofn greedy": lambda params: ZerofnZeRO(params, torch.optim.Adam, lr=cfg["lr"]),
        "zerofn flat": lambda params: ZerofnZeRO(
            params, torch.optim.Adam, lr=cfg["lr"], partition="flat"
        ),
    }
    out: dict[str, Any] = {}
    final: dict[str, torch.Tensor] = {}
    for name, make_optimizer in runs.items():
        torch.manual_seed(cfg["seed"])  # the same initial weights for every run
        model = DDP(_mlp())
        optimizer = make_optimizer(model.parameters())
        per_rank = cfg["batch_size"]
        global_batch = per_rank * world_size
        batches = len(y_train) // global_batch
        losses = []
        for step in range(cfg["steps"]):
            epoch, k = divmod(step, batches)
            perm = torch.randperm(
                len(y_train), generator=torch.Generator().manual_seed(cfg["seed"] + epoch)
            )
            lo = k * global_batch + rank * per_rank
            mine = perm[lo : lo + per_rank]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(_mean_across_ranks(loss))
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        final[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[name] = {
            "losses": losses,
            "test_accuracy": accuracy,
            "state_bytes": _state_bytes(optimizer.optim),
        }
    out["max_param_diff_vs_torch"] = {
        name: (final[name] - final["torch"]).abs().max().item() for name in final
    }
    out["param_bytes"] = final["torch"].numel() * final["torch"].element_size()
    return out
