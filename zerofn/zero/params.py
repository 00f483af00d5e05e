"""Param groups: checking what a user passes as ``params`` before anything
is built from it, and the one way groups, their hyperparameters and their
global indices are read and written (optimizer, consolidation, checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "StateDict",
    "check_same_dense_type",
    "global_groups",
    "hyperparameters",
    "normalize_params",
]

StateDict = dict[str, Any]
"""An optimizer state dict: ``{"state": ..., "param_groups": [...]}``."""


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's options: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def global_groups(
    counts: Sequence[int], hyper: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """State-dict param groups holding global parameter indices: group ``g``
    has ``counts[g]`` parameters, numbered on from the previous group's, and
    ``hyper[g]``'s options.

    Raises:
        ValueError: ``counts`` and ``hyper`` differ in length.
    """
    if len(counts) != len(hyper):
        raise ValueError(f"{len(counts)} group sizes but {len(hyper)} groups of options")
    groups, start = [], 0
    for count, options in zip(counts, hyper, strict=True):
        groups.append({**hyperparameters(options), "params": list(range(start, start + count))})
        start += count
    return groups


def normalize_params(params: Any) -> list[dict[str, Any]]:
    """Turn ``params`` (an iterable of tensors, or of param-group dicts) into a
    list of param groups, each with its ``params`` as a list.

    Args:
        params: what the user passed to the optimizer.

    Returns:
        New group dicts (the user's dicts are not modified).

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or mixes tensors and
            dicts, or a group holds something other than tensors.
        ValueError: ``params`` is empty, or a group has no ``'params'`` key.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params should be an iterable of Tensors or dicts, but got a single "
            f"{torch.typename(params)}; wrap it in a list"
        )
    try:
        items = list(params)
    except TypeError as e:
        raise TypeError(
            f"params should be an iterable of Tensors or dicts, but got {torch.typename(params)}"
        ) from e
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in items):
        groups = [{"params": items}]
    elif all(isinstance(p, dict) for p in items):
        groups = []
        for g, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"param group {g} has no 'params' key")
            tensors = group["params"]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            groups.append({**group, "params": tensors})
    else:
        kinds = sorted({torch.typename(p) for p in items})
        raise TypeError(
            f"params should be all Tensors or all dicts, but got a mix of {', '.join(kinds)}"
        )
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param group {g}, entry {i}: expected a Tensor, got {torch.typename(p)}"
                )
    return groups


def check_same_dense_type(tensors: list[torch.Tensor]) -> None:
    """Require one dense layout, dtype and device for all ``tensors``.

    Raises:
        ValueError: naming the first sparse tensor, or the two differing types.
    """
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ValueError(
                f"parameter {i} is {t.layout}; ZeroRedundancyOptimizer needs dense parameters"
            )
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "ZeroRedundancyOptimizer needs all parameters of one dtype and device, but "
                f"parameter 0 is {first.dtype} on {first.device} and parameter {i} is "
                f"{t.dtype} on {t.device}"
            )
