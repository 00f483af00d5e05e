"""Train a small byte-level transformer on the English of the Python standard
library's docstrings with DDP on local gloo ranks, several ways side by side in the same
processes, from the same initial weights and on the same batches, so that
each difference between two runs has one cause:

* ``ddp``: DDP (its built-in all-reduce) + ``torch.optim.AdamW``;
* ``zero``: the same with zerofn's ``ZeroRedundancyOptimizer`` running AdamW on
  flat shards: bitwise the same losses, less memory per rank;
* ``zero+powersgd``: ``zero`` plus zerofn's PowerSGD hook (fewer gradient
  bytes; compared with ``zero``, so its loss gap is PowerSGD's alone);
* ``zero+int8``, ``zero+int4``: ``zero`` with ``exchange_compression`` (fewer
  bytes for the updated shards; compared with ``zero`` against a target);
* ``diloco``: ``DiLoCoOptimizer`` around AdamW, a sync every 10 steps and
  nothing sent in between (DDP runs the no-op hook; compared with ``ddp``).

``--runs`` picks runs from the catalogue in ``demo_runs.py`` (also
``zero+bf16``: bf16 parameters with fp32 master shards; ``diloco-h50`` and
``diloco-streaming``: DiLoCo syncing every 50 steps, and Streaming DiLoCo;
``diloco+int8``, ``diloco+int4``, ``diloco+int2`` and ``diloco+topk``:
DiLoCo's syncs compressed, compared with ``diloco``).
``--diloco`` trains ``ddp`` beside the three DiLoCo runs. It prints one table
(held-out loss and the gap to each run's baseline; the training loss averaged
over the last steps and its gap; whether the training losses match the
baseline's bitwise; memory per rank by kind beside the planner's prediction;
bytes sent per step; time per step split, as medians with their quartiles), a
line for each run that holds more memory than ``ddp`` naming the kinds that do,
a line per comparison (with the largest single-step difference in training
loss, and whether it is one run's spike), and writes one figure to
``--figure``. Last, it samples text from each run and shows it where it reads
as text (most of its words occur in the training text): ``--long`` trains a
larger model for longer, to that point; the default run is too short, so a
line says so, with each run's share.

The modules: ``demo_data.py`` (the text), ``demo_model.py`` (the model),
``demo_runs.py`` (the runs), ``demo_trainer.py`` (one run on one rank, stepped
and measured), ``demo_train.py`` (one rank's training loop),
``demo_summary.py`` (measurements to numbers), ``demo_report.py`` (the table),
``demo_figure.py`` (the figure).

Run: ``python examples/demo.py --world-size 2`` (``make demo``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from demo_data import Corpus, load_corpus, vocabulary
from demo_figure import figure, save
from demo_model import ModelConfig, TinyGPT
from demo_report import (
    METHOD,
    Plan,
    dominant_line,
    findings,
    legend,
    memory_notes,
    samples,
    table,
    time_note,
)
from demo_runs import CATALOGUE, DEFAULT_RUNS, DILOCO_RUNS, select
from demo_summary import RunSummary, summarize
from demo_train import PROMPT, Config, train_rank
from zerofn_torch.runtime.launch import run_local_world

from zerofn.diloco.footprint import outer_state_bytes
from zerofn.diloco.fragments import plan_fragments
from zerofn.footprint import HookKind, plan_footprint


@attrs.frozen
class Size:
    """How much is trained: what ``--long`` changes, each overridable by its flag."""

    steps: int
    width: int
    layers: int
    lr: float


DEFAULT = Size(steps=120, width=128, layers=4, lr=3e-3)
# Long enough for the samples to read as English sentences (real words, in
# docstring phrasing); a wider model wants a lower lr (3e-3 trained it worse).
LONG = Size(steps=3000, width=256, layers=4, lr=2e-3)
SAMPLE_BYTES = 300
COUNT_AT_LEAST = 20  # steps whose bytes are counted, rounded up to whole DiLoCo periods


def parse(argv: Sequence[str] | None) -> tuple[Config, int, str]:
    """The configuration, the world size and the figure's path, from the command line."""
    parser = argparse.ArgumentParser(
        description="A byte-level transformer on the Python standard library's docstrings, "
        "trained several ways side by side: DDP, zerofn's ZeRO, ZeRO with PowerSGD, ZeRO with "
        "a compressed exchange, DiLoCo"
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--runs",
        help="comma-separated runs (their baselines are added); default: "
        + ",".join(s.key for s in DEFAULT_RUNS)
        + "; known: "
        + ", ".join(s.key for s in CATALOGUE),
    )
    parser.add_argument(
        "--diloco",
        action="store_true",
        help="train ddp beside "
        + ", ".join(s.key for s in DILOCO_RUNS if s.optimizer == "diloco")
        + " (with --runs: those as well); without --steps, the steps are rounded up to whole "
        "sync periods of every run",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"train longer ({LONG.steps} steps, width {LONG.width}, lr {LONG.lr:g}), until "
        "the sampled text reads as text: over an hour on 2 CPU cores for three runs "
        "(--runs zero+int8 trains ddp, zero and zero+int8), about twice that for the six "
        "default runs",
    )
    parser.add_argument("--steps", type=int, help=f"default {DEFAULT.steps}")
    parser.add_argument("--width", type=int, help=f"model width, default {DEFAULT.width}")
    parser.add_argument("--layers", type=int, help=f"blocks, default {DEFAULT.layers}")
    parser.add_argument("--lr", type=float, help=f"AdamW's peak lr, default {DEFAULT.lr:g}")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix rank")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--data-mb", type=float, default=4.0, help="MB of docstrings, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", default=os.path.join("out", "demo.png"))
    args = parser.parse_args(argv)
    size = attrs.evolve(
        LONG if args.long else DEFAULT,
        **{
            k: getattr(args, k)
            for k in ("steps", "width", "layers", "lr")
            if getattr(args, k) is not None
        },
    )
    if min(size.steps, size.width, size.layers, args.world_size) < 1 or size.lr <= 0:
        parser.error("--steps, --width, --layers, --world-size and --lr must be positive")
    if size.width % 4 or args.context < 2:
        parser.error("--width must be a multiple of 4 (the heads) and --context at least 2")
    keys = [k.strip() for k in (args.runs or "").split(",") if k.strip()]
    if args.runs is None and not args.diloco:
        keys = [s.key for s in DEFAULT_RUNS]
    if args.diloco:
        keys += [s.key for s in DILOCO_RUNS]
    try:
        runs = select(keys)
        # Bytes are counted over whole sync periods of every run, so a
        # DiLoCo run's per-step mean holds each of its syncs equally often.
        period = math.lcm(*(s.sync_every for s in runs if s.sync_every))
        if args.steps is None:
            size = attrs.evolve(size, steps=period * math.ceil(size.steps / period))
        runs = tuple(
            attrs.evolve(s, powersgd_rank=args.powersgd_rank) if s.gradients == "powersgd" else s
            for s in runs
        )
        cfg = Config(
            model=ModelConfig(width=size.width, layers=size.layers, context=args.context),
            runs=runs,
            steps=size.steps,
            batch_size=args.batch_size,
            lr=size.lr,
            seed=args.seed,
            data_bytes=int(args.data_mb * 1e6),
            eval_every=args.eval_every,
            count_steps=period * math.ceil(COUNT_AT_LEAST / period),
            sample_bytes=SAMPLE_BYTES,
            progress_bar=sys.stdout.isatty(),
        )
    except ValueError as error:
        parser.error(str(error))
    return cfg, args.world_size, args.figure


def plans(cfg: Config, world_size: int) -> dict[str, Plan]:
    """The predicted memory of every run, per rank by kind: ZeRO's (compressed
    exchanges included) by ``plan_footprint`` with the run's options; DDP's
    AdamW, and DiLoCo's inner one, hold what one unsharded rank holds
    (``plan_footprint`` on one rank), and DiLoCo's outer state is
    ``outer_state_bytes``'s. PowerSGD's hook state is left unplanned."""
    shapes = TinyGPT(cfg.model)
    sizes = [p.numel() for p in shapes.parameters()]
    out = {}
    for spec in cfg.runs:
        hook: HookKind = "powersgd" if spec.gradients == "powersgd" else "allreduce"
        options: dict[str, Any] = {
            "param_dtype": spec.param_dtype,
            "master_dtype": spec.master_dtype,
            "optimizer": "adamw",
            "hook": hook,
            "powersgd_rank": spec.powersgd_rank,
            "bucket_view": True,
        }
        if spec.optimizer == "zero":
            footprint = plan_footprint(
                shapes,
                world_size,
                "flat",
                exchange_compression=spec.exchange_compression,
                **options,
            )
            out[spec.key] = Plan.of(footprint)
            continue
        extra = {}
        if spec.optimizer == "diloco":
            fragments = plan_fragments(sizes, spec.fragments, world_size)
            extra["diloco_state"] = [
                outer_state_bytes(fragments, r, compressed=spec.sync_compression is not None)
                for r in range(world_size)
            ]
        unsharded = plan_footprint(shapes, 1, "greedy", **options)
        out[spec.key] = Plan.of(unsharded, world_size, **extra)
    return out


def header(cfg: Config, world_size: int, corpus: Corpus) -> str:
    """What is trained, on what, how long."""
    numel = sum(p.numel() for p in TinyGPT(cfg.model).parameters())
    m = cfg.model
    return (
        f"{numel / 1e6:.2f}M-parameter byte-level transformer (width {m.width}, {m.layers} "
        f"blocks, context {m.context}) on {len(corpus.train) / 1e6:.1f} MB of the standard "
        f"library's docstrings, {world_size} gloo ranks, {cfg.steps} steps of "
        f"{cfg.batch_size * world_size} x {m.context} bytes, AdamW peak lr {cfg.lr:g}"
    )


def report(
    summaries: Sequence[RunSummary],
    planned: Mapping[str, Plan],
    texts: Mapping[str, bytes],
    known: frozenset[bytes],
) -> str:
    """Everything printed after training; ``known``: the training text's words."""
    parts = [
        table(summaries, planned),
        "\n".join(memory_notes(summaries)),
        "\n".join(["Runs (baseline: the run each is compared with):", *legend(summaries)]),
        "\n".join(findings(summaries)),
        time_note(summaries) + " " + dominant_line(summaries),
        METHOD,
    ]
    if any(texts.values()):
        parts.append(samples(summaries, texts, PROMPT, known))
    return "\n\n".join(p for p in parts if p)


def main(argv: Sequence[str] | None = None) -> list[RunSummary]:
    """Train, print the report, write the figure; the runs' summaries."""
    started = time.perf_counter()
    cfg, world_size, path = parse(argv)
    corpus = load_corpus(cfg.data_bytes)
    title = header(cfg, world_size, corpus)
    print(title + ".\nRuns: " + ", ".join(s.key for s in cfg.runs), flush=True)
    results = run_local_world(train_rank, world_size, cfg, timeout_s=300)
    summaries = summarize(results, cfg.runs)
    planned = plans(cfg, world_size)
    save(figure(summaries, title, {k: p.total() for k, p in planned.items()}), path)
    texts = {s.key: results[0][s.key].sample for s in cfg.runs}
    print("\n" + report(summaries, planned, texts, vocabulary(corpus.train)))
    print(f"\nFigure: {path}. Wall time, spawn included: {time.perf_counter() - started:.0f} s")
    return list(summaries)


if __name__ == "__main__":
    main()
