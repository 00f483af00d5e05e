"""Training that survives a lost rank: DDP + zerofn's ZeroRedundancyOptimizer
under ``torchrun --max-restarts``, checkpointing in the background and
resuming from the newest whole checkpoint.

The pattern (see docs/resilience.md):

1. at start, rank 0's ``latest_checkpoint(run_dir)``, broadcast to every
   rank, names the newest whole checkpoint of the run (``None`` on the first
   start); ``load_sharded`` loads the optimizer's shard from it and returns
   the ``extra`` saved with it: the model's state and the step count; rank 0
   prints ``resumed from step N (checkpoint DIR)``;
2. every ``--save-every`` steps, ``save_sharded(..., blocking=False,
   keep_last=2)`` copies the state and writes it in the background while
   training goes on; the run directory keeps the 2 newest checkpoints;
3. at the end, wait for the last save.

If a worker dies, torchrun stops the others and starts the whole job again
(up to ``--max-restarts`` times); each start resumes where the newest whole
checkpoint left off. Data is drawn per step (a generator seeded by the step
and the rank), so a resumed run trains on exactly the batches an
uninterrupted one would: its final parameters and optimizer state are equal,
bit for bit.

Run (gloo on CPU; the variable works around torch 2.13's torchrun, see
:func:`warn_if_restarts_share_a_store`)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nproc_per_node 2 --max-restarts 3 \\
        examples/train_resumable.py --run-dir runs/demo --steps 200 --save-every 20

and ``kill -9`` one of the workers while it trains. ``--kill`` makes the job
kill its own workers at planned points instead, and ``--soak-log`` records every
start (``kill_plan.py``; ``tests/test_soak.py`` runs both).
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from kill_plan import Soak
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import SaveHandle, latest_checkpoint, load_sharded, save_sharded

from zerofn.zero.checkpoint.run import temporaries

IN, WIDTH, OUT = 16, 64, 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Resumable DDP + zerofn ZeRO under torchrun")
    parser.add_argument("--run-dir", required=True, help="this run's checkpoints (shared)")
    parser.add_argument("--steps", type=int, default=200, help="train to this step")
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout, s")
    parser.add_argument("--out", help="write the final parameters and optimizer state here")
    parser.add_argument("--kill", default="", help="soak only: rank:step:point,... per start")
    parser.add_argument("--soak-log", help="soak only: append a JSON line per start and kill")
    return parser.parse_args(argv)


def warn_if_restarts_share_a_store() -> None:
    """Warn where torchrun would hand a restarted job its last start's store.

    torch 2.13's torchrun keeps one rendezvous store for all of a job's
    starts, so a restarted worker can read a dead one's gloo address and fail
    to connect, using up a restart; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in torchrun's environment gives each start a fresh store.
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        warnings.warn(
            "torchrun shares one rendezvous store across restarts: a restart may fail to "
            "connect; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun "
            "(docs/resilience.md)",
            stacklevel=2,
        )


def make_model() -> nn.Module:
    """A small MLP, the same initial weights on every rank and every start
    (a resumed start overwrites them with the checkpoint's anyway)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT)
    )


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: a function of the two alone, so a
    resumed run draws what an uninterrupted one would have."""
    generator = torch.Generator().manual_seed(step * 65_536 + rank)
    x = torch.randn(size, IN, generator=generator)
    return x, torch.sin(3 * x[:, :OUT]) + 0.1 * torch.randn(size, OUT, generator=generator)


def checkpoint_name(step: int) -> str:
    """The checkpoint directory's name for the state after ``step`` steps."""
    return f"step-{step:08d}"


def checkpoint_step(path: str) -> int:
    """The step a checkpoint directory named by :func:`checkpoint_name` holds."""
    return int(os.path.basename(os.path.normpath(path)).removeprefix("step-"))


def newest_checkpoint(run_dir: str) -> str | None:
    """Rank 0's answer to ``latest_checkpoint(run_dir)``, on every rank: all
    ranks must load the same checkpoint, even where their views of a shared
    file system could differ for a moment."""
    choice = [latest_checkpoint(run_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def resume(optimizer: ZeroRedundancyOptimizer, model: nn.Module, run_dir: str) -> int:
    """Load the run's newest whole checkpoint, if any, into ``optimizer`` and
    ``model``.

    Args:
        optimizer: every rank's ZeRO optimizer (collective).
        model: the unwrapped model (its parameters are DDP's too).
        run_dir: the run's checkpoint directory.

    Returns:
        How many steps the checkpoint holds (0 when there is none); rank 0
        prints it and the checkpoint's directory.

    Raises:
        zerofn.errors.CheckpointError: the checkpoint is damaged (every rank).
    """
    path = newest_checkpoint(run_dir)
    if path is None:
        return 0
    extra = load_sharded(optimizer, path)
    model.load_state_dict(extra["model"])
    step = int(extra["step"])
    if dist.get_rank() == 0:
        print(f"resumed from step {step} (checkpoint {path})", flush=True)
    return step


def save(
    optimizer: ZeroRedundancyOptimizer, model: nn.Module, run_dir: str, step: int
) -> SaveHandle:
    """Start a background save of the state after ``step`` steps; keep the
    run's 2 newest checkpoints (the one being written replaces the oldest
    only once it is whole)."""
    return save_sharded(
        optimizer,
        os.path.join(run_dir, checkpoint_name(step)),
        extra={"model": model.state_dict(), "step": step},
        keep_last=2,
        blocking=False,
    )


def final_state(model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[str, Any] | None:
    """The parameters and the whole optimizer state, on rank 0 (``None``
    elsewhere). Collective: the optimizer's shards are gathered on rank 0."""
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:
        return None
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "optimizer": optimizer.state_dict()}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # torchrun sets the rank and world size; the timeout bounds how long a
    # survivor waits on a dead peer before it fails too.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    if rank == 0:
        warn_if_restarts_share_a_store()
    soak = Soak.of(args.kill, args.soak_log, rank, checkpoint_step)
    leftovers = temporaries(os.listdir(args.run_dir)) if os.path.isdir(args.run_dir) else []

    model = make_model()
    ddp = DDP(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=args.lr)
    done = resume(optimizer, model, args.run_dir)
    soak.started(done, leftovers)

    pending: SaveHandle | None = None
    for step in range(done + 1, args.steps + 1):
        x, y = batch(step, rank, args.batch_size)
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        soak.point("step", step, args.run_dir)
        optimizer.step()
        soak.stepped(step)
        if step % args.save_every == 0 or step == args.steps:
            soak.point("before-save", step, args.run_dir)
            pending = save(optimizer, model, args.run_dir, step)
            soak.point("after-save", step, args.run_dir)
    if pending is not None:
        soak.point("wait", args.steps, args.run_dir)
        pending.wait()  # the run is over only once its last checkpoint is whole

    state = final_state(model, optimizer)
    if state is not None and args.out:
        torch.save(state, args.out)
    soak.finished()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
