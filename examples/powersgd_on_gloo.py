"""PowerSGD rank 4 under DDP on 2 gloo ranks, PyTorch's hook or zerofn's.

The set-up on which PyTorch 2.13's own ``powerSGD_hook`` ends the process
(gloo: "Received data size doesn't match expected size", then SIGABRT) a few
iterations after compression starts: an MLP 512-2048-1024-512 (3.7M
parameters, so DDP makes several buckets), AdamW, batch 64. PyTorch's hook
issues its second and third all-reduce from future callbacks, so with
several buckets the two ranks can issue them in different orders and gloo
pairs collectives of different sizes. zerofn's hook issues every collective
from the hook itself, in bucket order, and runs the same script to the end::

    .venv/bin/python examples/powersgd_on_gloo.py --hook zerofn   # trains, prints the loss
    .venv/bin/python examples/powersgd_on_gloo.py --hook torch    # ends with SIGABRT

Each rank prints the iteration it finished, so the last line before an
abort says how far it got.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.multiprocessing.spawn import ProcessExitedException
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks import powersgd as zerofn_powersgd
from zerofn_torch.runtime.launch import run_local_world

WIDTHS = (512, 2048, 1024, 512)
BATCH = 64
RANK = 4
START = 10  # iterations of plain all-reduce before compression starts


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def train_rank(
    rank: int, world_size: int, hook: str, steps: int, quiet: bool
) -> tuple[list[float], list[torch.Tensor]]:
    """``steps`` iterations of DDP + PowerSGD on this rank; its losses and
    final parameters."""
    model = DDP(make_model())
    module: Any = torch_powersgd if hook == "torch" else zerofn_powersgd
    state = module.PowerSGDState(
        process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=START
    )
    model.register_comm_hook(state, module.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for step in range(steps):
        x = torch.randn(BATCH, WIDTHS[0], generator=generator)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not quiet:
            print(f"rank {rank}: iteration {step} done, loss {loss.item():.4f}", flush=True)
    dist.barrier()
    return losses, [p.detach().clone() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=("torch", "zerofn"), default="zerofn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quiet", action="store_true", help="print only the outcome")
    args = parser.parse_args(argv)
    try:
        results = run_local_world(train_rank, 2, args.hook, args.steps, args.quiet)
    except ProcessExitedException as exited:
        print(f"{args.hook}'s hook: a rank ended with {exited} ", flush=True)
        return 1
    print(f"{args.hook}'s hook: {args.steps} iterations, last loss {results[0][0][-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
