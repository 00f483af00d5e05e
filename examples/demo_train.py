"""The demo's training loop on one rank: every run stepped side by side on the
same batches, evaluated on held-out text as it goes, timed and counted.

:func:`train_rank` is what each spawned rank runs; it returns one
:class:`demo_summary.Measured` per run.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from demo_data import batch, load_corpus, rank_slice
from demo_model import ModelConfig, TinyGPT, eval_windows, generate, lm_loss
from demo_runs import RunSpec
from demo_summary import Measured
from demo_trainer import StepRecord, Trainer

T = TypeVar("T")
PROMPT = b"Return the "  # how many of the docstrings begin


@attrs.frozen
class Config:
    """Everything a rank needs (picklable: it travels to the spawned ranks).

    Attributes:
        model: the model's shape.
        runs: the runs, trained side by side.
        steps: training steps.
        batch_size: sequences per rank per step.
        lr: AdamW's peak learning rate.
        seed: initial weights and batches.
        data_bytes: bytes of standard-library docstrings to read (at most).
        eval_every: steps between held-out evaluations (the last step is one).
        eval_windows: held-out windows per evaluation, split across the ranks.
        split_every: steps between the time split's ``no_sync`` re-runs; the
            runs' order turns by one after each.
        count_steps: the last steps whose collectives are counted.
        sample_bytes: bytes of text to sample after training (0: none).
        progress_bar: a tqdm bar on rank 0 instead of plain lines.

    Raises:
        ValueError: a non-positive count, or ``count_steps`` that does not
            cover whole DiLoCo sync periods (say which to use instead).
    """

    model: ModelConfig
    runs: tuple[RunSpec, ...]
    steps: int = 120
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0
    data_bytes: int = 4_000_000
    eval_every: int = 20
    eval_windows: int = 128
    split_every: int = 4
    count_steps: int = 20
    sample_bytes: int = 0
    progress_bar: bool = False

    def __attrs_post_init__(self) -> None:
        counts = (self.steps, self.batch_size, self.eval_every, self.eval_windows)
        if min(*counts, self.split_every, self.count_steps) < 1:
            raise ValueError(
                "steps, batch_size, eval_every, eval_windows, split_every and "
                "count_steps must be positive"
            )
        for spec in self.runs:
            if spec.sync_every and min(self.count_steps, self.steps) % spec.sync_every:
                raise ValueError(
                    f"{spec.key} syncs every {spec.sync_every} steps: count a multiple of that "
                    f"(count_steps={self.count_steps}, steps={self.steps})"
                )

    @property
    def counted_steps(self) -> int:
        """How many of the last steps are counted."""
        return min(self.count_steps, self.steps)

    def evaluates_after(self, step: int) -> bool:
        """Whether the held-out loss is measured after step ``step`` (0-based)."""
        return (step + 1) % self.eval_every == 0 or step + 1 == self.steps


def warmup_steps(steps: int) -> int:
    """Steps of linear warm-up: 10, or a thirtieth of a longer run (a wide
    model jumping to its peak lr in 10 steps settles on a plateau it leaves
    slowly)."""
    return max(10, steps // 30)


def lr_schedule(peak: float, steps: int, warmup: int = 10) -> Callable[[int], float]:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it."""

    def lr(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return lr


def turn(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``: which run steps first changes from one
    split step to the next, so that every run is timed in every place of the
    order, and equal work measures as equal time."""
    if not items:
        return []
    k = by % len(items)
    return [*items[k:], *items[:k]]


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else a plain line every few steps."""

    def __init__(self, total: int, bar: bool) -> None:
        self.total, self.every = total, max(1, total // 8)
        self.started = time.perf_counter()
        self.bar: Any = None
        if bar:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, unit="step", ncols=100)

    def update(self, step: int, losses: dict[str, float]) -> None:
        shown = "  ".join(f"{k} {v:.3f}" for k, v in losses.items())
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix_str(shown)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            elapsed = time.perf_counter() - self.started
            print(
                f"step {step + 1:>4}/{self.total}  training loss, rank 0: {shown}  {elapsed:5.0f} s"
            )
            sys.stdout.flush()

    def close(self, runs: int) -> None:
        """End the bar; say how fast the steps went (each steps every run)."""
        if self.bar is not None:
            self.bar.close()
        seconds = time.perf_counter() - self.started
        print(
            f"Trained {self.total} steps of {runs} runs in {seconds:.0f} s: "
            f"{self.total / seconds:.2f} steps/s, evaluations included"
        )


@torch.no_grad()
def shared_held_out_loss(
    model: torch.nn.Module, windows: torch.Tensor, rank: int, world_size: int, group: Any
) -> float:
    """The mean loss over ``windows``: each rank evaluates every ``world_size``-th
    one with its own parameters, the sums are added up over ``group``."""
    mine = windows[rank::world_size]
    total = torch.zeros(2, dtype=torch.float64)
    if len(mine):
        total[0] = lm_loss(model(mine[:, :-1]), mine[:, 1:]).double() * len(mine)
        total[1] = len(mine)
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1])


class _Log:
    """One run's measurements on this rank, as training goes."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.compute: list[tuple[int, float]] = []
        self.backward: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.held_out: list[tuple[int, float]] = []
        self.fingerprints: list[int] = []

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        for counted, into in ((record.backward, self.backward), (record.after, self.after)):
            if counted is not None:
                for kind, n in counted.payload_bytes.items():
                    into[kind] = into.get(kind, 0) + n

    def measured(self, counted_steps: int, memory: dict[str, int], sample: bytes) -> Measured:
        return Measured(
            losses=tuple(r.loss for r in self.steps),
            forward_backward=tuple(r.forward_backward for r in self.steps),
            optimizer_step=tuple(r.optimizer_step for r in self.steps),
            local_step=tuple(r.local_step for r in self.steps),
            compute=tuple(self.compute),
            backward_payload=dict(self.backward),
            after_payload=dict(self.after),
            counted_steps=counted_steps,
            memory=memory,
            held_out=tuple(self.held_out),
            fingerprints=tuple(self.fingerprints),
            sample=sample,
        )


def train_rank(rank: int, world_size: int, cfg: Config) -> dict[str, Measured]:
    """One rank's share of every run, side by side: run key -> what it measured."""
    corpus = load_corpus(cfg.data_bytes)
    windows = eval_windows(corpus.held_out, cfg.model.context, cfg.eval_windows)
    # Evaluations get a group of their own, so they never interleave with a
    # run's collectives still in flight on the default group (DiLoCo's syncs).
    eval_group = dist.new_group(backend="gloo")
    torch.manual_seed(cfg.seed)
    initial = TinyGPT(cfg.model)
    trainers = [Trainer(spec, copy.deepcopy(initial), cfg.lr) for spec in cfg.runs]
    logs = {spec.key: _Log() for spec in cfg.runs}
    lr = lr_schedule(cfg.lr, cfg.steps, warmup_steps(cfg.steps))
    progress = Progress(cfg.steps, cfg.progress_bar) if rank == 0 else None
    first_counted = cfg.steps - cfg.counted_steps
    for step in range(cfg.steps):
        xy = batch(corpus.train, step, cfg.seed, cfg.batch_size * world_size, cfg.model.context)
        x, y = rank_slice(xy, rank, world_size)
        split = step % cfg.split_every == cfg.split_every - 1 or step == cfg.steps - 2
        for trainer in turn(trainers, step // cfg.split_every):
            log = logs[trainer.spec.key]
            if split:  # compute alone, then the same batch with communication
                log.compute.append((step, trainer.compute_seconds(x, y)))
            log.add(trainer.step(x, y, lr(step), count=step >= first_counted))
        if cfg.evaluates_after(step):
            for trainer in trainers:
                log = logs[trainer.spec.key]
                loss = shared_held_out_loss(trainer.module, windows, rank, world_size, eval_group)
                log.held_out.append((step + 1, loss))
                log.fingerprints.append(trainer.fingerprint())
        if progress is not None:
            progress.update(step, {k: log.steps[-1].loss for k, log in logs.items()})
    if progress is not None:
        progress.close(len(trainers))
    for trainer in trainers:  # a delayed DiLoCo sync may still be in flight
        trainer.finish()
    out = {}
    for trainer in trainers:
        sample = b""
        if cfg.sample_bytes and rank == 0:
            sample = generate(trainer.module, PROMPT, cfg.sample_bytes, cfg.model.context)
        out[trainer.spec.key] = logs[trainer.spec.key].measured(
            cfg.counted_steps, trainer.memory_bytes(), sample
        )
    dist.destroy_process_group(eval_group)
    return out
