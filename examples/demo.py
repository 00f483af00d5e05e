"""Train a small byte-level transformer language model on the Python standard
library's own source, with DDP on local gloo ranks, twice side by side in the
same processes, from the same initial weights and on the same batches:

* **plain**: DDP (its built-in all-reduce) + ``torch.optim.AdamW``;
* **zerofn**: DDP + zerofn's PowerSGD hook (``zerofn_torch.hooks``) +
  ``zerofn_torch.ZeroRedundancyOptimizer(..., partition="flat")`` running
  AdamW: each rank keeps AdamW's state for its half of the elements only and
  broadcasts its updated half after the step.

It prints one table (loss, held-out loss, each rank's bytes by kind, the
planner's prediction for them, bytes sent per step, time per step split into
compute, communication and optimizer step), a few sampled lines of generated
text per run, one line saying what dominates the step's time on this machine,
and saves a plot (loss against step; memory per rank by kind) to ``--plot``.

The text ships with Python (no download): the standard library's top-level
modules, sorted by name, up to ``--data-mb`` MB, one token per byte (see
``demo_data.py``). The model is in ``demo_model.py`` (3.3M parameters by
default), the runs in ``demo_runs.py`` (adding one, such as mixed precision,
is adding a ``RunSpec``), the table and plot in ``demo_report.py``.

Run: ``python examples/demo.py --world-size 2`` (``make demo``). A progress
bar shows on a terminal; piped output gets a plain line every few steps.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, get_args

import attrs
import torch
from demo_data import batch, load_corpus, rank_slice
from demo_model import ModelConfig, TinyGPT, generate, held_out_loss
from demo_report import dominant_line, notes, plot, samples, table
from demo_runs import MIXED, RUNS, HookConfig, RunSpec, Trainer, lr_schedule, plan
from zerofn_torch.launch import run_local_world
from zerofn_torch.traffic import Traffic, collective_traffic

from zerofn.footprint import HookKind

PROMPT = b"def "
TIME_SPLIT_EVERY = 6  # steps between forward+backward runs under no_sync (the time split)


@attrs.frozen
class Config:
    """Everything a rank needs (picklable: it travels to the spawned ranks)."""

    model: ModelConfig
    hook: HookConfig
    steps: int = 120
    batch_size: int = 8  # sequences per rank
    lr: float = 1e-3
    seed: int = 0
    data_bytes: int = 4_000_000
    sample_bytes: int = 200
    progress_bar: bool = False
    runs: tuple[RunSpec, ...] = RUNS


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else a plain line every few steps."""

    def __init__(self, total: int, bar: bool) -> None:
        self.total, self.every = total, max(1, total // 8)
        self.started = time.perf_counter()
        self.bar: Any = None
        if bar:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, unit="step", ncols=90)

    def update(self, step: int, losses: dict[str, float]) -> None:
        shown = "  ".join(f"{k} {v:.3f}" for k, v in losses.items())
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix_str(shown)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            elapsed = time.perf_counter() - self.started
            print(f"step {step + 1:>4}/{self.total}  loss (rank 0) {shown}  {elapsed:5.1f} s")
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_steps(
    rank: int, world_size: int, cfg: Config, trainers: Sequence[Trainer], text: torch.Tensor
) -> dict[str, Any]:
    """Every run's training steps, interleaved: losses, timings, last step's traffic."""
    keys = [t.spec.key for t in trainers]
    out: dict[str, Any] = {k: {key: [] for key in keys} for k in ("losses", "fb", "opt")}
    out["payload"], out["calls"], out["compute"] = {}, {}, {key: [] for key in keys}
    lr = lr_schedule(cfg.lr, cfg.steps)
    progress = Progress(cfg.steps, cfg.progress_bar) if rank == 0 else None
    global_batch = cfg.batch_size * world_size
    for step in range(cfg.steps):
        xy = batch(text, step, cfg.seed, global_batch, cfg.model.context)
        x, y = rank_slice(xy, rank, world_size)
        last, last_but_one = step == cfg.steps - 1, step == cfg.steps - 2
        split = not last and (step % TIME_SPLIT_EVERY == TIME_SPLIT_EVERY - 1 or last_but_one)
        for trainer, key in zip(trainers, keys, strict=True):
            if split:  # compute alone, then the same batch with communication
                out["compute"][key].append((step, trainer.compute_seconds(x, y)))
            with collective_traffic() if last else nullcontext(Traffic()) as traffic:
                loss, fb, opt = trainer.step(x, y, lr(step))
            for name, value in (("losses", loss), ("fb", fb), ("opt", opt)):
                out[name][key].append(value)
            if last:
                out["payload"][key], out["calls"][key] = traffic.payload_bytes, traffic.calls
        if progress is not None:
            progress.update(step, {k: out["losses"][k][-1] for k in keys})
    if progress is not None:
        progress.close()
    return out


def train_rank(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """One rank's share of every run; returns what the report needs."""
    corpus = load_corpus(cfg.data_bytes)
    torch.manual_seed(cfg.seed)
    initial = TinyGPT(cfg.model)
    trainers = [Trainer(spec, copy.deepcopy(initial), cfg.hook, cfg.lr) for spec in cfg.runs]
    out = train_steps(rank, world_size, cfg, trainers, corpus.train)
    for t in trainers:
        if not t.spec.zerofn:  # DDP's built-in all-reduce, issued from C++, is not counted
            grads = sum(p.numel() * p.element_size() for p in t.module.parameters())
            out["payload"][t.spec.key] = {"all_reduce": grads}
    out["memory"] = {t.spec.key: t.memory_bytes() for t in trainers}
    if rank == 0:
        out["held_out"] = {
            t.spec.key: held_out_loss(t.module, corpus.held_out, cfg.model.context)
            for t in trainers
        }
        out["samples"] = {
            t.spec.key: generate(t.module, PROMPT, cfg.sample_bytes, cfg.model.context)
            for t in trainers
        }
    return out


def parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    """The configuration from the command line, and the parsed arguments."""
    parser = argparse.ArgumentParser(
        description="A byte-level transformer on the Python standard library's source: "
        "DDP + zerofn (flat ZeRO, PowerSGD) beside DDP + torch.optim.AdamW"
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
    parser.add_argument(
        "--hook", choices=get_args(HookKind), default="powersgd", help="zerofn run's DDP hook"
    )
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix rank")
    parser.add_argument("--start-iter", type=int, default=10, help="PowerSGD's first step")
    parser.add_argument("--width", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--data-mb", type=float, default=4.0, help="MB of stdlib source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="add a third run: zerofn with bf16 parameters and fp32 master shards",
    )
    parser.add_argument("--plot", default=os.path.join("out", "demo.png"))
    args = parser.parse_args(argv)
    if min(args.world_size, args.steps, args.batch_size, args.layers) < 1:
        parser.error("--world-size, --steps, --batch-size and --layers must be positive")
    if args.width % 4 or args.context < 2:
        parser.error("--width must be a multiple of 4 (the heads) and --context at least 2")
    if args.hook == "powersgd" and (args.powersgd_rank < 1 or args.start_iter < 2):
        parser.error("PowerSGD needs --powersgd-rank >= 1 and --start-iter >= 2")
    return Config(
        model=ModelConfig(width=args.width, layers=args.layers, context=args.context),
        hook=HookConfig(args.hook, args.powersgd_rank, args.start_iter),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        data_bytes=int(args.data_mb * 1e6),
        progress_bar=sys.stdout.isatty(),
        runs=(*RUNS, MIXED) if args.mixed_precision else RUNS,
    ), args


def header(cfg: Config, world_size: int, numel: int) -> str:
    corpus = load_corpus(cfg.data_bytes)
    m, h = cfg.model, cfg.hook
    hook = (
        f"PowerSGD hook (rank {h.powersgd_rank}, from step {h.start_iter})"
        if h.kind == "powersgd"
        else f"{h.kind} hook"
    )
    return (
        f"{numel:,}-parameter byte-level transformer (width {m.width}, {m.layers} blocks, "
        f"context {m.context}) on {len(corpus.train) / 1e6:.1f} MB of the standard library's "
        f"source ({corpus.files} files), {world_size} gloo ranks, {cfg.steps} steps of "
        f"{cfg.batch_size * world_size} x {m.context} bytes, AdamW peak lr {cfg.lr:g}.\n"
        "Same initial weights, same batches. plain: DDP's built-in all-reduce + "
        f"torch.optim.AdamW. zerofn: zerofn's {hook} + ZeroRedundancyOptimizer("
        'AdamW, partition="flat", parameters_as_bucket_view=True).'
    )


def main(argv: Sequence[str] | None = None) -> None:
    started = time.perf_counter()
    cfg, args = parse(argv)
    shapes = TinyGPT(cfg.model)  # for the planner, which reads only the shapes
    plans = [plan(spec, shapes, args.world_size, cfg.hook) for spec in cfg.runs]
    print(header(cfg, args.world_size, sum(p.numel() for p in shapes.parameters())), flush=True)
    results = run_local_world(train_rank, args.world_size, cfg, timeout_s=300)
    plot(results, cfg.runs, plans, args.plot)
    print()
    print(table(results, cfg.runs, plans))
    print()
    for line in notes(results, cfg.runs, plans, cfg):
        print(line)
    print()
    seen = cfg.steps * cfg.batch_size * args.world_size * cfg.model.context
    print(samples(results, cfg.runs, PROMPT, seen))
    print()
    print(dominant_line(results, cfg.runs))
    print(f"\nPlot: {args.plot}. Wall time, spawn included: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
