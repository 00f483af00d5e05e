"""Applying a sync's result: merging the local values with the global ones.

When a fragment's sync is applied, ``delay`` inner steps after it started,
each rank's parameters have moved on from the values it sent. Streaming
DiLoCo merges the two::

    params = mixing * local + (1 - mixing) * global

``mixing = 0`` takes the global values as they are (DiLoCo: every rank
restarts from the new anchor; the steps taken during the delay are
dropped); a positive ``mixing`` keeps that share of each rank's own values,
so progress made while the sync was in flight is not thrown away (Streaming
DiLoCo uses 0.5).
"""

from __future__ import annotations

import torch

__all__ = ["merge"]


def merge(local: torch.Tensor, global_: torch.Tensor, mixing: float) -> torch.Tensor:
    """``mixing * local + (1 - mixing) * global_``, in ``float32``.

    Args:
        local: this rank's current values of the fragment (only read).
        global_: the sync's result, the same on every rank (only read).
        mixing: the weight of ``local``, in [0, 1].

    Returns:
        A new ``float32`` tensor; exactly ``global_`` when ``mixing == 0``
        and exactly ``local`` when ``mixing == 1``.

    Raises:
        ValueError: ``mixing`` outside [0, 1], or shapes that differ.
    """
    if not 0.0 <= mixing <= 1.0:
        raise ValueError(f"mixing must lie in [0, 1], got {mixing}")
    if local.shape != global_.shape:
        raise ValueError(
            f"cannot merge local values of shape {tuple(local.shape)} with global values "
            f"of shape {tuple(global_.shape)}"
        )
    if mixing == 0.0:
        return global_.to(torch.float32, copy=True)
    if mixing == 1.0:
        return local.to(torch.float32, copy=True)
    return torch.lerp(global_.float(), local.float(), mixing)
