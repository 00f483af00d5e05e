"""Saving while training: a background sharded save against a blocking one.

Two gloo ranks train an MLP under DDP with zerofn's ZeRO (Adam) and save the
optimizer's shards plus the model (``extra``) every round, the two ways taking
turns round by round:

* **blocking**: ``save_sharded(...)``; training stops until the checkpoint is
  committed (written, hashed, verified, renamed in).
* **background**: ``save_sharded(..., blocking=False)`` copies the state and
  returns; training goes on while a thread writes, on a gloo group of its
  own; ``wait()`` at the end of the round.

Measured per round: the time training is stopped by the save call, the time
until the checkpoint is durable (committed), and the training step's time
while a background save is in flight against the step's time with none. On
2 cores the writer thread competes with training for the CPU, so a step in
flight is slower; on a machine with spare cores (the usual case) less so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from report import Headline, Section, Spread, fmt_bytes, md_table, paired_ratios, standalone_main
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import save_sharded
from zerofn_torch.runtime.launch import run_local_world


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def _steps(ddp: DDP, opt: ZeroRedundancyOptimizer, batch: torch.Tensor, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        opt.zero_grad()
        ddp(batch).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def _round(
    ddp: DDP, opt: ZeroRedundancyOptimizer, batch: torch.Tensor, root: str, steps: int, kind: str
) -> dict[str, Any]:
    """One save of ``kind`` and the steps around it; seconds of each part."""
    quiet = _steps(ddp, opt, batch, steps)
    extra = {"model": ddp.module.state_dict()}
    dist.barrier()
    start = time.perf_counter()
    handle = save_sharded(opt, root, extra=extra, blocking=kind == "blocking")
    stopped = time.perf_counter() - start
    in_flight = []
    # Every rank takes the same number of steps (DDP's collectives must pair
    # up), counting only those that began while this rank's save was running.
    for _ in range(steps if kind == "background" else 0):
        running = not handle.done()
        step = _steps(ddp, opt, batch, 1)
        in_flight += step if running else []
    handle.wait()
    return {"stopped": stopped, "durable": handle.seconds, "quiet": quiet, "in_flight": in_flight}


def _rank(rank: int, world: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
    ddp = DDP(_model(width, depth))
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    root = os.path.join(_shared(tempfile.mkdtemp() if rank == 0 else ""), "ckpt")
    _steps(ddp, opt, batch, 3)  # DDP fixes its buckets; Adam has state
    save_sharded(opt, root, blocking=False).wait()  # the background group, made once
    out: dict[str, list[Any]] = {"blocking": [], "background": []}
    for r in range(rounds):
        for kind in ("blocking", "background")[:: 1 if r % 2 == 0 else -1]:
            out[kind].append(_round(ddp, opt, batch, root, 6, kind))
    bytes_on_disk = sum(e.stat().st_size for e in os.scandir(root) if e.is_file())
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)
    params = sum(p.numel() for p in ddp.parameters())
    return {**out, "bytes": bytes_on_disk, "params": params}


def _shared(root: str) -> str:
    """Rank 0's directory, told to every rank."""
    box = [root]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _median_step(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [Spread.of(r[key]).median for r in rounds if r[key]]


def bench_checkpoint(quick: bool) -> Section:
    width, depth, rounds = (256, 4, 3) if quick else (1024, 10, 8)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    blocking, background = r0["blocking"], r0["background"]
    ms = {
        kind: {
            part: Spread.of([r[part] for r in r0[kind]]).scaled(1e3)
            for part in ("stopped", "durable")
        }
        for kind in ("blocking", "background")
    }
    quiet = _median_step(background, "quiet")
    rounds_in_flight = [
        (f, q)
        for r in background
        if r["in_flight"]
        for f, q in [(Spread.of(r["in_flight"]).median, Spread.of(r["quiet"]).median)]
    ]
    slowdown = (
        paired_ratios([f for f, _ in rounds_in_flight], [q for _, q in rounds_in_flight])
        if rounds_in_flight
        else None
    )
    stall = paired_ratios([r["stopped"] for r in background], [r["stopped"] for r in blocking])
    model = (
        f"sharded save, Adam, MLP {r0['params'] / 1e6:.1f}M params "
        f"({fmt_bytes(r0['bytes'])} on disk), 2 gloo ranks"
    )
    table = md_table(
        ["save", "training stopped (ms)", "until durable (ms)"],
        [[kind, ms[kind]["stopped"].fmt(1), ms[kind]["durable"].fmt(1)] for kind in ms],
    )
    step_line = (
        f"Training step with a background save in flight / with none: {slowdown.fmt()} "
        f"(median step {Spread.of(quiet).median * 1e3:.1f} ms with none)."
        if slowdown
        else "No step ran while a background save was in flight (the save finished first)."
    )
    headlines = [
        Headline(
            model,
            "training stopped by the save: background / blocking",
            stall,
            short="background save: stall",
        ),
    ]
    if slowdown:
        headlines.append(
            Headline(
                model,
                "step time: a background save in flight / none",
                slowdown,
                short="background save: step",
            )
        )
    body = (
        f"{model}; {len(blocking)} rounds of each, taking turns. A blocking save stops "
        "training until the checkpoint is committed; a background one only while it "
        "copies the state.\n\n" + table + "\n\n" + step_line
    )
    return Section("Saving while training", body, headlines)


if __name__ == "__main__":
    standalone_main({"checkpoint": bench_checkpoint}, __doc__)
