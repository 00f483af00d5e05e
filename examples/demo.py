"""Train a small MLP on scikit-learn's digits with DDP, twice side by side: once with
zerofn's ``ZeroRedundancyOptimizer`` and once with the plain ``torch.optim`` optimizer.

What it shows:

* **Drop-in.** The two runs start from the same initial weights, see the same
  batches and differ only in the optimizer line, so they should end with the same
  parameters (to float rounding, and usually bit for bit: ZeRO runs the same
  element-wise update, only on the rank that owns each parameter).
* **Memory.** Each rank keeps optimizer state (Adam's moments, SGD's momentum)
  only for its shard under ZeRO, against the whole model under the plain
  optimizer.
* **Communication.** After its local step each rank sends its updated shard to
  the others. We count the exchange's payload from the optimizer's exchange
  layout (``opt._plan.layouts``): per step a rank *receives* every other rank's
  segment of each buffer and *sends* its own segment to each of the other
  ranks; bytes = elements x element size. This is the payload delivered, not
  wire traffic, which depends on the collective's algorithm. The DDP gradient
  all-reduce is the same in both runs and is shown for scale.

Data: ``sklearn.datasets.load_digits`` (1797 8x8 images shipped inside the
package, no download), features scaled to [0, 1], a fixed 80/20 train/test
split. Every step draws one global batch from a per-epoch shuffle shared by all
ranks; rank ``r`` trains on the ``r``-th slice of it, and DDP averages the
gradients. Model: 64 -> 256 -> 256 -> 10 with ReLUs.

Run: ``python examples/demo.py --world-size 2`` (``make demo``). It spawns the
gloo ranks itself (``torch.multiprocessing``, ``spawn``), shows a progress bar
on rank 0, prints a results table and saves a loss plot (``--plot``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.launch import run_local_world

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}

RELATIVE_TOLERANCE = 1e-6


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as float features in [0, 1] and int labels, split 80/20 by a seeded shuffle."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state."""
    return sum(
        v.numel() * v.element_size()
        for per_param in optim.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def exchange_bytes(zero: ZeroRedundancyOptimizer, rank: int) -> tuple[int, int]:
    """(received, sent) payload bytes of one step's parameter exchange on ``rank``.

    Received: the other ranks' segments of every exchange buffer. Sent: this
    rank's own segment, once to each of the other ranks.
    """
    element_size = next(p for g in zero.param_groups for p in g["params"]).element_size()
    received = sent = 0
    for layout in zero._plan.layouts:
        for segment in layout.segments:
            if segment.rank == rank:
                sent += segment.length * element_size * (len(layout.segments) - 1)
            else:
                received += segment.length * element_size
    return received, sent


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on the whole of ``x``, ``y``."""
    logits = model(x)
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def train_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank's share of both runs; returns what the report needs."""
    x_train, y_train, x_test, y_test = load_data(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model_zero = make_mlp()
    model_plain = make_mlp()
    model_plain.load_state_dict(model_zero.state_dict())
    ddp_zero, ddp_plain = DDP(model_zero), DDP(model_plain)

    optimizer_class, hyper = OPTIMIZERS[cfg["optimizer"]]
    hyper = {**hyper, **({"lr": cfg["lr"]} if cfg["lr"] is not None else {})}
    zero = ZeroRedundancyOptimizer(
        ddp_zero.parameters(), optimizer_class, partition=cfg["partition"], **hyper
    )
    plain = optimizer_class(ddp_plain.parameters(), **hyper)

    per_rank = cfg["batch_size"]
    global_batch = per_rank * world_size
    batches_per_epoch = len(y_train) // global_batch
    losses: list[tuple[float, float]] = []
    bar: Any = range(cfg["steps"])
    if rank == 0:
        from tqdm import tqdm  # type: ignore[import-untyped]

        bar = tqdm(bar, desc=f"{world_size} ranks, {cfg['optimizer']}", unit="step")
    perm = torch.empty(0, dtype=torch.int64)
    started = time.perf_counter()
    for step in bar:
        epoch, k = divmod(step, batches_per_epoch)
        if k == 0:  # the same shuffle on every rank
            perm = torch.randperm(
                len(y_train), generator=torch.Generator().manual_seed(cfg["seed"] + epoch)
            )
        mine = perm[k * global_batch + rank * per_rank : k * global_batch + (rank + 1) * per_rank]
        x, y = x_train[mine], y_train[mine]
        step_losses = []
        for ddp, opt in ((ddp_zero, zero), (ddp_plain, plain)):
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            step_losses.append(loss.detach())
        global_loss = torch.stack(step_losses)
        dist.all_reduce(global_loss)
        global_loss /= world_size
        losses.append((global_loss[0].item(), global_loss[1].item()))
        if rank == 0 and step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1][0]:.4f}")
    if rank == 0:
        bar.close()
    elapsed = time.perf_counter() - started

    max_abs = max(
        (p - q).abs().max().item()
        for p, q in zip(model_zero.parameters(), model_plain.parameters(), strict=True)
    )
    scale = max(q.abs().max().item() for q in model_plain.parameters())
    received, sent = exchange_bytes(zero, rank)
    return {
        "losses": losses,
        "train": [evaluate(m, x_train, y_train) for m in (model_zero, model_plain)],
        "test": [evaluate(m, x_test, y_test) for m in (model_zero, model_plain)],
        "max_abs_diff": max_abs,
        "param_scale": scale,
        "state_bytes": (state_bytes(zero.optim), state_bytes(plain)),
        "exchange": (received, sent),
        "grad_bytes": sum(p.numel() * p.element_size() for p in model_zero.parameters()),
        "numel": sum(p.numel() for p in model_zero.parameters()),
        "owned": sum(p.numel() for g in zero.optim.param_groups for p in g["params"]),
        "seconds": elapsed,
    }


def kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def report(results: Sequence[dict[str, Any]], cfg: dict[str, Any]) -> str:
    r0 = results[0]
    rows: list[tuple[str, str, str]] = [
        ("final train loss", f"{r0['train'][0][0]:.4f}", f"{r0['train'][1][0]:.4f}"),
        (
            "last batch loss (mean over ranks)",
            f"{r0['losses'][-1][0]:.4f}",
            f"{r0['losses'][-1][1]:.4f}",
        ),
        ("test accuracy", f"{r0['test'][0][1]:.2%}", f"{r0['test'][1][1]:.2%}"),
    ]
    for rank, res in enumerate(results):
        zero_b, plain_b = res["state_bytes"]
        rows.append((f"optimizer state, rank {rank}", kib(zero_b), kib(plain_b)))
    for rank, res in enumerate(results):
        received, sent = res["exchange"]
        rows.append(
            (f"param exchange per step, rank {rank}: received", kib(received), "0 (none needed)")
        )
        rows.append((f"param exchange per step, rank {rank}: sent", kib(sent), "0 (none needed)"))
    grad = kib(r0["grad_bytes"])
    rows.append(("DDP gradient all-reduce payload per step", grad, grad))
    rows.append(("training wall time, both runs interleaved (s)", f"{r0['seconds']:.1f}", ""))

    width = [max(len(r[i]) for r in rows) for i in range(3)]
    head = ("", "DDP + zerofn ZeRO", "DDP + plain torch.optim")
    width = [max(w, len(h)) for w, h in zip(width, head, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, width, strict=True)) + " |"

    table = [line(head), "| " + " | ".join("-" * w for w in width) + " |", *map(line, rows)]

    max_abs = max(res["max_abs_diff"] for res in results)
    relative = max_abs / max(r0["param_scale"], 1e-12)
    verdict = "identical" if relative <= RELATIVE_TOLERANCE else "DIFFERENT"
    owned = ", ".join(f"rank {r}: {res['owned']:,}" for r, res in enumerate(results))
    return "\n".join(
        [
            "",
            f"{cfg['optimizer']}, partition={cfg['partition']}, {len(results)} gloo ranks, "
            f"{cfg['steps']} steps, global batch {cfg['batch_size'] * len(results)}, "
            f"{r0['numel']:,} parameters (ZeRO owners: {owned})",
            "",
            *table,
            "",
            f"max |param difference| between the runs: {max_abs:.3g} "
            f"({relative:.3g} relative to the largest |param|): {verdict}",
            "Exchange bytes are the payload from the optimizer's exchange layout: a rank "
            "receives every other rank's segment and sends its own to each other rank.",
        ]
    )


def plot(results: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = results[0]["losses"]
    steps = range(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [a for a, _ in losses], label="DDP + zerofn ZeroRedundancyOptimizer", lw=2.5)
    ax.plot(steps, [b for _, b in losses], "--", label="DDP + plain torch.optim", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.set_title(f"digits MLP, {len(results)} gloo ranks")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DDP on digits: zerofn ZeRO vs torch.optim")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--partition", choices=("greedy", "balanced", "flat"), default="greedy")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=None, help="override the default lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=os.path.join("out", "demo_loss.png"))
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1 or args.batch_size < 1:
        parser.error("--world-size, --steps and --batch-size must be positive")
    if args.batch_size * args.world_size > 1437:
        parser.error("the global batch must fit in the 1437 training images")
    cfg = {
        "steps": args.steps,
        "optimizer": args.optimizer,
        "partition": args.partition,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
    }
    started = time.perf_counter()
    results = run_local_world(train_rank, args.world_size, cfg)
    print(report(results, cfg))
    plot(results, args.plot)
    print(f"loss plot: {args.plot}; total {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
