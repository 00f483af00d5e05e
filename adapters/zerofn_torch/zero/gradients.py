"""The gradients a ZeRO step reads, clipped by the whole model's norm and
unscaled for a loss scaler. Each rank reads only what it owns
(:func:`zerofn.zero.rank.owned_grads`); the global answers are the core's
programs (:func:`~zerofn.zero.precision.clip_program`,
:func:`~zerofn.zero.precision.nonfinite_program`, the same the overlapped
step's hook asks), one all-reduce of one number each, which this module drives."""

from __future__ import annotations

import math
from typing import Any

import torch

from zerofn.zero.hook_driven import check_stepped_here
from zerofn.zero.precision import clip_program, nonfinite_program
from zerofn.zero.rank import ZeroRank, hand_grads, master_grads, owned_grads
from zerofn_torch.runtime.driver import drive

__all__ = ["clip_grad_norm", "unscale_gradients"]


def clip_grad_norm(
    rank: ZeroRank,
    params: list[torch.Tensor],
    group: Any,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Clip the step's gradients by the whole model's norm: the body of
    :meth:`zerofn_torch.zero.optimizer.ZeroRedundancyOptimizer.clip_grad_norm_`,
    which says what it returns and raises."""
    check_stepped_here(rank, "clip_grad_norm_")
    grads = owned_grads(rank, params)
    program = clip_program(grads, max_norm, float(norm_type), rank.options.device)
    total, coefficient = drive(program, group, "clip_grad_norm_'s global norm").wait()
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    if coefficient != 1.0:
        grads = (
            master_grads(rank)
            if rank.masters is not None
            else [p.grad for p in params if p.grad is not None]
        )
        for grad in grads:
            grad.mul_(coefficient)
    return torch.tensor(total, dtype=torch.float32)


def unscale_gradients(
    rank: ZeroRank, params: list[torch.Tensor], group: Any, factor: float
) -> bool:
    """Multiply the step's gradients by ``factor`` and agree on inf/nan (see
    :meth:`zerofn_torch.zero.optimizer.ZeroRedundancyOptimizer.unscale_gradients_`).

    Returns:
        ``True`` on every rank if any rank found inf or nan.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``, or if the gradients
            were already read for this step (clipped or unscaled).
        zerofn.errors.CollectiveError: the all-reduce failed.
    """
    check_stepped_here(rank, "loss scaling")
    if rank.masters is not None:
        if rank.masters.grads():
            raise RuntimeError(
                "the gradients were already unscaled or clipped for this step: unscale "
                "once per step, before clip_grad_norm_"
            )
        hand_grads(rank, params, unscale=factor)
        grads = rank.masters.grads()  # the carried masters' are the same numbers
    else:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
        grads = owned_grads(rank, params)
    program = nonfinite_program(grads, rank.options.device)
    result: bool = drive(program, group, "loss scaling's inf/nan check").wait()
    return result
