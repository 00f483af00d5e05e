"""Checking that every rank holds the same parameters (:mod:`zerofn.replicas`),
on a process group: ``verify_replicas(model)`` after the world changed, or
every ``every`` steps::

    for step in range(steps):
        train_step(...)
        verify_replicas(ddp.module, every=100, step=step)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from zerofn.replicas import ReplicaMismatch, replicas_program
from zerofn_torch.runtime.driver import drive

__all__ = ["ReplicaMismatch", "verify_replicas"]


def verify_replicas(
    module: torch.nn.Module | Iterable[torch.Tensor],
    group: Any | None = None,
    *,
    every: int = 1,
    step: int = 0,
) -> bool:
    """Check that every rank of ``group`` holds the same parameters (a digest
    per tensor, one all-gather of 8 bytes per tensor). Collective: call on
    every rank alike.

    Args:
        module: a module (its named parameters and buffers) or tensors.
        group: the process group (default: the world).
        every: check only when ``step`` is a multiple of it.
        step: the training step (with ``every``).

    Returns:
        Whether it checked (``step % every == 0``).

    Raises:
        ValueError: ``every`` below 1.
        zerofn.replicas.ReplicaMismatch: on every rank, naming the first
            tensor that differs and the ranks holding each version.
        zerofn.errors.CollectiveError: the all-gather failed.
    """
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if step % every:
        return False
    if isinstance(module, torch.nn.Module):
        named = [*module.named_parameters(), *module.named_buffers()]
        names, tensors = [n for n, _ in named], [t for _, t in named]
    else:
        tensors = list(module)
        names = [f"tensor {i}" for i in range(len(tensors))]
    group = group if group is not None else dist.group.WORLD
    device = tensors[0].device if tensors and tensors[0].device.type != "cpu" else None
    program = replicas_program(tensors, names, device or torch.device("cpu"))
    drive(program, group, "checking that the replicas agree").wait()
    return True
