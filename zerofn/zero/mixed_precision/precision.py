"""Mixed precision: master weights and gradient clipping.

With low-precision parameters (bf16, fp16) an optimizer that steps them
directly loses small updates to rounding. The ZeRO optimizer therefore keeps
a *master* copy, in a wider dtype, of the parameters each rank owns, steps
that, and casts the result back. This module holds the decisions, as pure
functions of their inputs:

- :func:`resolve_master_dtype`: whether masters are kept, and in which dtype.
- :func:`norm_of_powers` / :func:`clip_coefficient`: the global gradient norm
  from every rank's share, and the factor that clips it.

The master copies themselves are :mod:`zerofn.zero.mixed_precision.masters` (the simulated
world keeps them too); fp16's loss-scale schedule is :mod:`zerofn.zero.mixed_precision.loss_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from zerofn.comm import AllReduce, Program, Reduction

__all__ = [
    "MASTER_KEY",
    "clip_coefficient",
    "clip_program",
    "global_norm_program",
    "has_nonfinite",
    "local_norm_power",
    "nonfinite_program",
    "norm_of_powers",
    "resolve_master_dtype",
    "step_factor_program",
]

MASTER_KEY = "master_param"
"""The per-parameter optimizer-state entry that carries a master weight in
state dicts (consolidated and sharded), beside ``exp_avg`` and the like."""


def resolve_master_dtype(
    param_dtype: torch.dtype, master_dtype: torch.dtype | None
) -> torch.dtype | None:
    """The dtype of the master copies to keep, or ``None`` for none.

    Args:
        param_dtype: the parameters' dtype.
        master_dtype: what the user asked for (``None``: no masters).

    Returns:
        ``master_dtype``, or ``None`` when no copy is needed (not asked for,
        or the parameters already have that dtype).

    Raises:
        TypeError: ``master_dtype`` is not a floating-point ``torch.dtype``.
        ValueError: the parameters are not floating point, or
            ``master_dtype`` is narrower than they are (it would lose bits).
    """
    if master_dtype is None:
        return None
    if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
        raise TypeError(
            f"master_dtype must be a floating-point torch.dtype such as torch.float32, "
            f"got {master_dtype!r}"
        )
    if not param_dtype.is_floating_point:
        raise ValueError(f"master weights need floating-point parameters, not {param_dtype}")
    if master_dtype == param_dtype:
        return None
    if torch.finfo(master_dtype).bits < torch.finfo(param_dtype).bits:
        raise ValueError(
            f"master_dtype={master_dtype} is narrower than the parameters' {param_dtype}: "
            "masters must keep at least the parameters' bits (use torch.float32)"
        )
    return master_dtype


def norm_of_powers(total: float, norm_type: float) -> float:
    """The ``norm_type``-norm from the sum over every rank of ``sum |g|^p``
    (or, for ``inf``, from the maximum of ``max |g|``)."""
    if math.isinf(norm_type):
        return total
    return float(total ** (1.0 / norm_type))


def local_norm_power(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's share of a global norm, as a one-element float32 tensor:
    ``sum |g|^p`` over ``grads`` (``max |g|`` for ``inf``).

    Computed as ``torch.nn.utils.clip_grad_norm_`` computes its total: each
    tensor's norm in float32, then the norm of those norms (raised to ``p``
    here; the root of one rank's share rounds back to PyTorch's total).

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, 1.0, inf), got {norm_type}")
    # Accumulated where the gradients live and moved once: one sync, not one
    # per tensor, on an accelerator. An empty shard adds nothing (and has no max).
    norms = [
        torch.linalg.vector_norm(g.detach().to(torch.float32), norm_type)
        for g in grads
        if g.numel()
    ]
    if not norms:
        return torch.zeros(1, dtype=torch.float32)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type).reshape(1)
    return (total if math.isinf(norm_type) else total.pow(norm_type)).cpu()


def global_norm_program(
    share: torch.Tensor, norm_type: float, device: torch.device
) -> Program[float]:
    """The gradient norm over every rank's share: one all-reduce of one number.

    Args:
        share: this rank's :func:`local_norm_power`.
        norm_type: the norm's order.
        device: where the collective's tensor lives (the group's device).

    Returns:
        A program whose value is the global norm.
    """
    op: Reduction = "max" if math.isinf(norm_type) else "sum"
    (total,) = yield AllReduce((share.to(device),), op)
    return norm_of_powers(float(total.item()), norm_type)


def has_nonfinite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``grads`` holds inf or nan (this rank's answer alone)."""
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def nonfinite_program(grads: Sequence[torch.Tensor], device: torch.device) -> Program[bool]:
    """Whether any rank's ``grads`` hold inf or nan: one all-reduce of one flag.

    Returns:
        A program whose value is the same on every rank.
    """
    flag = torch.tensor([1.0 if has_nonfinite(grads) else 0.0], device=device)
    (total,) = yield AllReduce((flag,), "max")
    return bool(total.item() > 0)


def clip_program(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    device: torch.device,
    *,
    shared: bool = False,
    scale: float = 1.0,
) -> Program[tuple[float, float]]:
    """The norm of every rank's share of the gradients, and the factor that
    clips it to ``max_norm``: one all-reduce of one number, unless
    ``shared`` (every rank holds every gradient: its own norm is everyone's).
    The plain step's ``clip_grad_norm_`` and the overlapped step's hook
    (:func:`step_factor_program`) both ask it.

    Args:
        grads: this rank's share of the gradients.
        max_norm: the clipping threshold.
        norm_type: the norm's order.
        device: where the collective's tensor lives.
        shared: every rank holds every gradient.
        scale: what the gradients are yet to be multiplied by (a loss
            scaler's ``1 / scale``): the norm is the scaled gradients'.

    Returns:
        A program whose value is ``(norm, coefficient)``, equal on every rank.

    Raises:
        ValueError: ``max_norm`` negative or not finite; ``norm_type`` not positive.
    """
    clip_coefficient(0.0, max_norm)  # a bad max_norm is refused before any collective
    power = local_norm_power(grads, norm_type)
    if shared:
        norm = norm_of_powers(float(power.item()), norm_type)
    else:
        norm = yield from global_norm_program(power, norm_type, device)
    norm *= scale
    return norm, clip_coefficient(norm, max_norm)


def step_factor_program(
    grads: Sequence[torch.Tensor],
    *,
    inv_scale: float | None,
    max_norm: float | None,
    device: torch.device,
    shared: bool,
) -> Program[tuple[bool, float]]:
    """What to multiply this rank's share of the gradients by before a step.

    A loss scaler's ``inv_scale`` asks first whether any rank's share holds
    inf or nan (:func:`nonfinite_program`; then every rank skips the step);
    ``max_norm`` then clips by the 2-norm over every rank's share
    (:func:`clip_program`). Each question is one all-reduce of one number,
    unless ``shared``: every rank holds all of the gradients, so its own
    answer is everyone's and nothing is sent.

    Args:
        grads: this rank's share of the model's gradients.
        inv_scale: the loss scaler's ``1 / scale``; ``None`` without one.
        max_norm: the clipping threshold; ``None`` not to clip.
        device: where the collectives' tensors live.
        shared: every rank holds every gradient.

    Returns:
        A program whose value is ``(skip, factor)``, equal on every rank:
        ``skip`` when some share held inf or nan (only asked with
        ``inv_scale``), else the factor (unscale times the clip coefficient).
    """
    unscale = 1.0 if inv_scale is None else inv_scale
    if inv_scale is not None:
        found = has_nonfinite(grads) if shared else (yield from nonfinite_program(grads, device))
        if found:
            return True, 0.0
    if max_norm is None:
        return False, unscale
    _, coefficient = yield from clip_program(
        grads, max_norm, 2.0, device, shared=shared, scale=unscale
    )
    return False, unscale * coefficient


def clip_coefficient(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """The factor to multiply gradients by so their norm is at most
    ``max_norm`` (``1.0`` when it already is), as
    ``torch.nn.utils.clip_grad_norm_`` computes it.

    Raises:
        ValueError: ``max_norm`` is negative or not finite.
    """
    if not math.isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a finite non-negative number, got {max_norm}")
    if math.isnan(total_norm):
        return math.nan  # as PyTorch: the gradients become nan, not silently kept
    return min(1.0, max_norm / (total_norm + eps))
