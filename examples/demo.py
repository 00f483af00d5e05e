"""Train a small MLP on scikit-learn's digits with DDP, twice side by side in the
same processes, from the same initial weights and on the same batches:

* **run A**: DDP + a communication hook (PowerSGD by default) + zerofn's
  ``ZeroRedundancyOptimizer`` overlapped with backward (``overlap_with_ddp=True``,
  registered through ``zerofn_torch.hooks.hook_with_zero_step``): each rank
  keeps optimizer state only for the DDP buckets it owns, and the optimizer
  step happens inside ``loss.backward()``;
* **run B**: plain DDP + the plain ``torch.optim`` optimizer.

What it shows:

* **Accuracy.** Final train loss and test accuracy of both runs. PowerSGD
  (and fp16) compress the gradients, so run A differs a little from run B and
  the demo prints by how much; with ``--hook allreduce`` or ``--hook none`` the
  two runs compute the same numbers and the parameters come out identical.
* **Memory.** Optimizer-state bytes per rank: the rank's share under ZeRO,
  the whole model under the plain optimizer.
* **Communication.** The collectives each rank issues in one steady-state step
  (the last one), counted with ``zerofn_torch.traffic.collective_traffic``;
  bytes sent per rank are estimated for ring algorithms. Run B registers
  ``zerofn_torch.hooks.allreduce_hook`` (the same numbers as DDP's built-in
  all-reduce, which is issued from C++ and could not be counted).
* **Time.** Median wall time of one training step (forward, backward, optimizer
  step and the communication of each) on rank 0, per run.

``--hook`` picks run A's hook: ``powersgd`` (``PowerSGDState`` /
``powerSGD_hook``, rank ``--powersgd-rank``, plain averaging for the first
``--start-iter`` steps), ``allreduce`` (with overlap, gradients are reduced to
their owner rather than all-reduced), ``fp16``, or ``none`` (DDP's averaging and
a separate, non-overlapped ``zero.step()``; only then does ``--partition`` apply).

Data: ``sklearn.datasets.load_digits`` (1797 8x8 images shipped inside the
package, no download), features scaled to [0, 1], a fixed 80/20 train/test
split. Every step draws one global batch from a per-epoch shuffle shared by all
ranks; rank ``r`` trains on the ``r``-th slice of it. Model: 64 -> 256 -> 256 ->
256 -> 10 with ReLUs.

Run: ``python examples/demo.py --world-size 2`` (``make demo``). It spawns the
gloo ranks itself, shows a progress bar per epoch on rank 0, prints a results
table and saves a plot of the loss against the step (``--plot``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import (
    PowerSGDState,
    allreduce_hook,
    fp16_compress_hook,
    hook_with_zero_step,
    powerSGD_hook,
)
from zerofn_torch.launch import run_local_world
from zerofn_torch.traffic import Traffic, collective_traffic

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
HOOKS = ("powersgd", "allreduce", "fp16", "none")
EXACT_HOOKS = ("allreduce", "none")  # run A computes run B's numbers
GRADIENT_KINDS = ("all_reduce", "reduce")  # what carries gradients; broadcasts carry parameters
RELATIVE_TOLERANCE = 1e-6
# Small DDP buckets so the model spans several and overlapped ZeRO can spread
# their ownership over the ranks (one bucket would belong wholly to rank 0).
BUCKET_CAP_MB = 0.05

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state."""
    return sum(
        v.numel() * v.element_size()
        for per_param in optim.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on the whole of ``x``, ``y``."""
    logits = model(x)
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def build_run_a(
    model: nn.Module, cfg: dict[str, Any]
) -> tuple[Step, ZeroRedundancyOptimizer, PowerSGDState | None]:
    """DDP + ``cfg["hook"]`` + zerofn ZeRO (overlapped unless the hook is ``none``)."""
    optimizer_class, hyper = cfg["optim"]
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    powersgd: PowerSGDState | None = None
    if cfg["hook"] == "none":
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class, partition=cfg["partition"], **hyper
        )
        ddp.register_comm_hook(None, allreduce_hook)  # DDP's numbers, but countable

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            zero.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            zero.step()
            return loss.detach()

        return step, zero, None

    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class, overlap_with_ddp=True, **hyper
    )
    if cfg["hook"] == "powersgd":
        powersgd = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg["powersgd_rank"],
            start_powerSGD_iter=cfg["start_iter"],
        )
        ddp.register_comm_hook(powersgd, hook_with_zero_step(powerSGD_hook, ddp, zero))
    else:
        inner = allreduce_hook if cfg["hook"] == "allreduce" else fp16_compress_hook
        ddp.register_comm_hook(None, hook_with_zero_step(inner, ddp, zero))

    def overlapped_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zero.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # the ZeRO step runs in here
        return loss.detach()

    return overlapped_step, zero, powersgd


def build_run_b(model: nn.Module, cfg: dict[str, Any]) -> tuple[Step, torch.optim.Optimizer]:
    """Plain DDP (averaging counted through ``allreduce_hook``) + plain ``torch.optim``."""
    optimizer_class, hyper = cfg["optim"]
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(None, allreduce_hook)
    plain = optimizer_class(ddp.parameters(), **hyper)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        plain.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        plain.step()
        return loss.detach()

    return step, plain


def train_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank's share of both runs; returns what the report needs."""
    x_train, y_train, x_test, y_test = load_data(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model_a, model_b = make_mlp(), make_mlp()
    model_b.load_state_dict(model_a.state_dict())
    step_a, zero, powersgd = build_run_a(model_a, cfg)
    step_b, plain = build_run_b(model_b, cfg)
    steps: tuple[Step, Step] = (step_a, step_b)

    per_rank = cfg["batch_size"]
    global_batch = per_rank * world_size
    batches_per_epoch = len(y_train) // global_batch
    epochs = -(-cfg["steps"] // batches_per_epoch)
    losses: list[tuple[float, float]] = []
    seconds: tuple[list[float], list[float]] = ([], [])
    payload: list[dict[str, int]] = [{}, {}]
    calls: list[dict[str, int]] = [{}, {}]
    bar: Any = None
    started = time.perf_counter()
    for step in range(cfg["steps"]):
        epoch, k = divmod(step, batches_per_epoch)
        if k == 0:  # the same shuffle on every rank; a new bar on rank 0
            perm = torch.randperm(
                len(y_train), generator=torch.Generator().manual_seed(cfg["seed"] + epoch)
            )
            if rank == 0:
                from tqdm import tqdm  # type: ignore[import-untyped]

                if bar is not None:
                    bar.close()
                bar = tqdm(
                    total=min(batches_per_epoch, cfg["steps"] - step),
                    desc=f"epoch {epoch + 1:>2}/{epochs}",
                    unit="step",
                    ncols=90,
                )
        lo = k * global_batch + rank * per_rank
        mine = perm[lo : lo + per_rank]
        x, y = x_train[mine], y_train[mine]
        step_losses = []
        for run, fn in enumerate(steps):
            if step == cfg["steps"] - 1:  # the last step: count its collectives
                with collective_traffic() as traffic:
                    t0 = time.perf_counter()
                    step_losses.append(fn(x, y))
                    seconds[run].append(time.perf_counter() - t0)
                payload[run] = dict(traffic.payload_bytes)
                calls[run] = dict(traffic.calls)
            else:
                t0 = time.perf_counter()
                step_losses.append(fn(x, y))
                seconds[run].append(time.perf_counter() - t0)
        global_loss = torch.stack(step_losses)
        dist.all_reduce(global_loss)
        global_loss /= world_size
        losses.append((global_loss[0].item(), global_loss[1].item()))
        if bar is not None:
            bar.update()
            bar.set_postfix(A=f"{losses[-1][0]:.3f}", B=f"{losses[-1][1]:.3f}")
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started

    max_abs = max(
        (p - q).abs().max().item()
        for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
    scale = max(q.abs().max().item() for q in model_b.parameters())
    return {
        "losses": losses,
        "train": [evaluate(m, x_train, y_train) for m in (model_a, model_b)],
        "test": [evaluate(m, x_test, y_test) for m in (model_a, model_b)],
        "max_abs_diff": max_abs,
        "param_scale": scale,
        "state_bytes": (state_bytes(zero.optim), state_bytes(plain)),
        "owned": sum(p.numel() for g in zero.optim.param_groups for p in g["params"]),
        "payload": tuple(payload),
        "calls": tuple(calls),
        "step_ms": tuple(1e3 * statistics.median(s) for s in seconds),
        "compression": powersgd.compression_stats() if powersgd is not None else None,
        "numel": sum(p.numel() for p in model_a.parameters()),
        "grad_bytes": sum(p.numel() * p.element_size() for p in model_a.parameters()),
        "seconds": elapsed,
    }


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def run_a_name(cfg: dict[str, Any]) -> str:
    if cfg["hook"] == "none":
        return "A: DDP + zerofn ZeRO"
    hook = {"powersgd": "PowerSGD", "allreduce": "all-reduce", "fp16": "fp16"}[cfg["hook"]]
    return f"A: DDP + {hook} + zerofn ZeRO (overlapped)"


def split_sent(payload: dict[str, int], world_size: int) -> tuple[float, float]:
    """Estimated bytes one rank sent, (gradient collectives, parameter collectives)."""
    grads = {k: v for k, v in payload.items() if k in GRADIENT_KINDS}
    params = {k: v for k, v in payload.items() if k not in GRADIENT_KINDS}
    return (
        Traffic(payload_bytes=grads).sent_bytes(world_size),
        Traffic(payload_bytes=params).sent_bytes(world_size),
    )


def describe_calls(calls: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(calls.items())) or "none"


def report(results: Sequence[dict[str, Any]], cfg: dict[str, Any]) -> str:
    r0 = results[0]
    world_size = len(results)
    rows: list[tuple[str, str, str]] = [
        (
            "final train loss (whole train set)",
            f"{r0['train'][0][0]:.4f}",
            f"{r0['train'][1][0]:.4f}",
        ),
        ("test accuracy", f"{r0['test'][0][1]:.2%}", f"{r0['test'][1][1]:.2%}"),
    ]
    for rank, res in enumerate(results):
        zero_b, plain_b = res["state_bytes"]
        rows.append((f"optimizer state, rank {rank}", kib(zero_b), kib(plain_b)))
    for rank, res in enumerate(results):
        grads, params = zip(*(split_sent(p, world_size) for p in res["payload"]), strict=True)
        rows.append(
            (f"sent per step, rank {rank}", kib(grads[0] + params[0]), kib(grads[1] + params[1]))
        )
        rows.append(("  of which gradients", kib(grads[0]), kib(grads[1])))
        rows.append(("  of which parameters", kib(params[0]), kib(params[1])))
    rows.append(
        (
            "collectives per step, rank 0",
            describe_calls(r0["calls"][0]),
            describe_calls(r0["calls"][1]),
        )
    )
    rows.append(
        ("time per step, median (ms)", f"{r0['step_ms'][0]:.2f}", f"{r0['step_ms'][1]:.2f}")
    )

    head = ("", run_a_name(cfg), "B: DDP + torch.optim")
    width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, width, strict=True)) + " |"

    table = [line(head), "| " + " | ".join("-" * w for w in width) + " |", *map(line, rows)]

    max_abs = max(res["max_abs_diff"] for res in results)
    relative = max_abs / max(r0["param_scale"], 1e-12)
    d_loss = r0["train"][0][0] - r0["train"][1][0]
    d_acc = r0["test"][0][1] - r0["test"][1][1]
    if cfg["hook"] in EXACT_HOOKS:
        verdict = "identical" if relative <= RELATIVE_TOLERANCE else "DIFFERENT (unexpected!)"
    else:
        verdict = "they differ: the hook compresses gradients, so this is expected"
    owned = ", ".join(f"rank {r}: {res['owned']:,}" for r, res in enumerate(results))
    lines = [
        "",
        f"{cfg['optimizer']}, hook={cfg['hook']}"
        + (f", partition={cfg['partition']}" if cfg["hook"] == "none" else "")
        + f", {world_size} gloo ranks, {cfg['steps']} steps, global batch "
        f"{cfg['batch_size'] * world_size}, {r0['numel']:,} parameters "
        f"(optimizer state held for: {owned})",
        "",
        *table,
        "",
        f"A - B: train loss {d_loss:+.4f}, test accuracy {d_acc * 100:+.2f} points; "
        f"max |param difference| {max_abs:.3g} ({relative:.3g} relative to the "
        f"largest |param|): {verdict}",
    ]
    if r0["compression"] is not None:
        rate, before, after = r0["compression"]
        lines.append(
            f"PowerSGD rank {cfg['powersgd_rank']} from step {cfg['start_iter']}: "
            f"compressible gradients shrink {rate:.1f}x ({before:,} -> {after:,} elements "
            "over all compressing steps); biases are averaged uncompressed"
        )
    lines.append(
        f"Bytes sent: payloads of the last step's collectives, times the per-rank share of a "
        f"ring algorithm (all-reduce 2(N-1)/N, reduce and broadcast (N-1)/N); one plain "
        f"all-reduce of the {kib(r0['grad_bytes'])} of gradients is "
        f"{kib(2 * (world_size - 1) / world_size * r0['grad_bytes'])}."
    )
    lines.append(f"Training wall time, both runs interleaved: {r0['seconds']:.1f} s")
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], cfg: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = results[0]["losses"]
    steps = range(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [a for a, _ in losses], label=run_a_name(cfg), lw=2.2)
    ax.plot(steps, [b for _, b in losses], "--", label="B: DDP + torch.optim", lw=1.2)
    if cfg["hook"] == "powersgd":
        ax.axvline(cfg["start_iter"], color="grey", lw=0.8, ls=":", label="PowerSGD starts")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.set_title(f"digits MLP, {len(results)} gloo ranks, {cfg['optimizer']}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="DDP on digits: hook + zerofn ZeRO (overlapped) vs plain DDP + torch.optim"
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hook", choices=HOOKS, default="powersgd")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument(
        "--partition",
        choices=("greedy", "balanced", "flat"),
        default="greedy",
        help="ZeRO partition; only with --hook none (overlapped ZeRO follows DDP's buckets)",
    )
    parser.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD matrix rank")
    parser.add_argument("--start-iter", type=int, default=10, help="PowerSGD start iteration")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=None, help="override the default lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=os.path.join("out", "demo_loss.png"))
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1 or args.batch_size < 1:
        parser.error("--world-size, --steps and --batch-size must be positive")
    if args.batch_size * args.world_size > 1437:
        parser.error("the global batch must fit in the 1437 training images")
    if args.partition != "greedy" and args.hook != "none":
        parser.error("--partition applies only with --hook none (the non-overlapped ZeRO)")
    if args.hook == "powersgd" and (args.powersgd_rank < 1 or args.start_iter < 2):
        parser.error("PowerSGD needs --powersgd-rank >= 1 and --start-iter >= 2")
    optimizer_class, hyper = OPTIMIZERS[args.optimizer]
    cfg = {
        "hook": args.hook,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "optim": (optimizer_class, {**hyper, **({"lr": args.lr} if args.lr is not None else {})}),
        "partition": args.partition,
        "powersgd_rank": args.powersgd_rank,
        "start_iter": args.start_iter,
        "batch_size": args.batch_size,
        "seed": args.seed,
    }
    started = time.perf_counter()
    results = run_local_world(train_rank, args.world_size, cfg)
    print(report(results, cfg))
    plot(results, cfg, args.plot)
    print(f"loss plot: {args.plot}; total {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
