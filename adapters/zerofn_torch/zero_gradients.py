"""The gradients a ZeRO step reads: handing them to the local optimizer,
clipping them by the whole model's norm, unscaling them for a loss scaler.
Each rank reads only what it owns; the global answers come from one
all-reduce of one number (programs of :mod:`zerofn.zero.precision`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import Optimizer

from zerofn.zero.precision import (
    clip_coefficient,
    global_norm_program,
    local_norm_power,
    nonfinite_program,
)
from zerofn.zero.step import load_step_grads
from zerofn_torch.driver import drive
from zerofn_torch.zero_setup import ZeroSetup

__all__ = [
    "check_stepped_here",
    "clip_grad_norm",
    "hand_grads",
    "step_grads",
    "unscale_gradients",
]


def check_stepped_here(setup: ZeroSetup, what: str) -> None:
    """Refuse ``what`` when DDP's hook steps the optimizer.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``.
    """
    if setup.shards.stepped_by_hook:
        raise RuntimeError(
            f"{what} is not available with overlap_with_ddp=True: the DDP hook steps each "
            "bucket during backward, before the gradients of the whole model are known. "
            "Pass max_grad_norm= and loss_scaler= to hook_with_zero_step instead."
        )


def hand_grads(
    setup: ZeroSetup, params: list[torch.Tensor], optim: Optimizer, unscale: float = 1.0
) -> None:
    """Hand the local optimizer this step's gradients: the masters get
    them upcast (times ``unscale``), a flat shard's chunks get views of
    the parameters' gradients; owned whole parameters hold their own."""
    local = [t for g in optim.param_groups for t in g["params"]]
    load_step_grads(setup.shards, params, local, setup.masters, unscale)


def step_grads(
    setup: ZeroSetup, params: list[torch.Tensor], optim: Optimizer
) -> list[torch.Tensor]:
    """The gradients this rank's step reads, for the elements it owns: the
    masters' (upcast now if not yet), or views into the parameters' ``.grad``."""
    if setup.masters is not None:
        hand_grads(setup, params, optim)
        return setup.masters.grads()
    views = []
    for piece in setup.plan.partition.pieces_of(setup.options.rank):
        grad = params[piece.param].grad
        if grad is not None and piece.numel:
            views.append(grad.reshape(-1)[piece.start : piece.stop])
    return views


def clip_grad_norm(
    setup: ZeroSetup,
    params: list[torch.Tensor],
    optim: Optimizer,
    group: Any,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Clip the step's gradients by the whole model's norm (see
    :meth:`zerofn_torch.zero.ZeroRedundancyOptimizer.clip_grad_norm_`).

    Returns:
        The norm before clipping: a float32 scalar, equal on every rank.

    Raises:
        ValueError: ``max_norm`` negative, ``norm_type`` not positive.
        RuntimeError: with ``overlap_with_ddp=True``; a non-finite norm
            with ``error_if_nonfinite``.
        zerofn.errors.CollectiveError: the all-reduce failed.
    """
    check_stepped_here(setup, "clip_grad_norm_")
    clip_coefficient(0.0, max_norm)  # reject a bad max_norm before any collective
    share = local_norm_power(step_grads(setup, params, optim), float(norm_type))
    program = global_norm_program(share, float(norm_type), setup.options.device)
    total = drive(program, group, "clip_grad_norm_'s global norm").wait()
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coefficient = clip_coefficient(total, max_norm)
    if coefficient != 1.0:
        grads = (
            setup.masters.grads()
            if setup.masters is not None
            else [p.grad for p in params if p.grad is not None]
        )
        for grad in grads:
            grad.mul_(coefficient)
    return torch.tensor(total, dtype=torch.float32)


def unscale_gradients(
    setup: ZeroSetup, params: list[torch.Tensor], optim: Optimizer, group: Any, factor: float
) -> bool:
    """Multiply the step's gradients by ``factor`` and agree on inf/nan (see
    :meth:`zerofn_torch.zero.ZeroRedundancyOptimizer.unscale_gradients_`).

    Returns:
        ``True`` on every rank if any rank found inf or nan.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``, or if the gradients
            were already read for this step (clipped or unscaled).
        zerofn.errors.CollectiveError: the all-reduce failed.
    """
    check_stepped_here(setup, "loss scaling")
    if setup.masters is not None:
        if setup.masters.grads():
            raise RuntimeError(
                "the gradients were already unscaled or clipped for this step: unscale "
                "once per step, before clip_grad_norm_"
            )
        hand_grads(setup, params, optim, unscale=factor)
        grads = setup.masters.grads()
    else:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
        grads = step_grads(setup, params, optim)
    program = nonfinite_program(grads, setup.options.device)
    result: bool = drive(program, group, "loss scaling's inf/nan check").wait()
    return result
