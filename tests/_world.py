"""Run a function on N gloo ranks in spawned processes and collect what each returns."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple[Any, ...]
) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    A rank that raises makes this raise (with the rank's traceback), and
    torch.multiprocessing terminates the other ranks rather than let them
    wait on a collective; collectives also time out after a minute.
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(fn, world_size, tmp, args), nprocs=world_size, start_method="spawn"
        )
        return [
            torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
