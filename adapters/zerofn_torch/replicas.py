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

from zerofn.replicas import ReplicaMismatch, copies_disagreement, replicas_program, state_digest
from zerofn.zero.mixed_precision.precision import MASTER_KEY
from zerofn.zero.planning.partition import Piece
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.zero.forward_gather import wait_for_gathers
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ReplicaMismatch", "verify_replicas"]


def verify_replicas(
    module: torch.nn.Module | Iterable[torch.Tensor],
    group: Any | None = None,
    *,
    every: int = 1,
    step: int = 0,
    optimizer: ZeroRedundancyOptimizer | None = None,
) -> bool:
    """Check that every rank of ``group`` holds the same parameters (a digest
    per tensor, one all-gather of 8 bytes per tensor). Collective: call on
    every rank alike.

    Args:
        module: a module (its named parameters and buffers) or tensors.
        group: the process group (default: the world).
        every: check only when ``step`` is a multiple of it.
        step: the training step (with ``every``).
        optimizer: a ZeRO optimizer whose optimizer state to check too:
            with ``redundancy=2`` each carrier's copy against its owner's
            state, and one step count a parameter (one all-gather of a
            digest per state tensor).

    Returns:
        Whether it checked (``step % every == 0``).

    Raises:
        ValueError: ``every`` below 1.
        zerofn.replicas.ReplicaMismatch: on every rank, naming the first
            tensor that differs and the ranks holding each version (or the
            first shard copy that differs from its owner's state).
        zerofn.errors.CollectiveError: the all-gather failed.
    """
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if step % every:
        return False
    wait_for_gathers()  # a ZeRO exchange still behind the forward writes them
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
    if optimizer is not None:
        per_rank = all_gather_objects(
            _state_digests(optimizer), group, "checking that the shard copies agree"
        )
        problem = copies_disagreement(per_rank)
        if problem is not None:
            raise ReplicaMismatch(problem)
    return True


def _state_digests(
    optimizer: ZeroRedundancyOptimizer,
) -> tuple[dict[Piece, Any], dict[Piece, Any]]:
    """This rank's :func:`~zerofn.replicas.state_digest` of each piece it
    owns and of each it carries (a carrier's pieces are cut as its owner's)."""
    rank = optimizer.zero_rank
    masters = rank.masters is not None

    def digest(optim: torch.optim.Optimizer, tensor: torch.Tensor) -> Any:
        # With master copies the stepped tensor is the master: its value is state too.
        state = optim.state.get(tensor, {})
        return state_digest({**state, MASTER_KEY: tensor} if masters else state)

    pieces = rank.shards.local_pieces([p for g in optimizer.param_groups for p in g["params"]])
    mine = {
        piece: digest(rank.optim, t)
        for piece, t in zip(pieces, rank.local_tensors(), strict=True)
        if piece is not None and piece.numel
    }
    carried = rank.carried
    copies = (
        {}
        if carried is None
        else {
            piece: digest(carried.optim, t)
            for piece, t in zip(carried.pieces, carried.tensors(), strict=True)
        }
    )
    return mine, copies
