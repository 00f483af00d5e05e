"""What PowerSGD's two hooks share: reading a bucket's memories, plain
averaging before compression starts, and drawing a random start."""

from __future__ import annotations

from typing import TypeAlias

import attrs
import torch

from zerofn.comm import AllReduce, Program
from zerofn.hooks.hook import BucketInfo, CommHook
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.seeds import draw_seed
from zerofn.hooks.powersgd.state import (
    Key,
    ParamMemory,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    default_keys,
    fits_bucket,
    record_bucket,
)

__all__ = [
    "BucketResult",
    "PowerSGDHook",
    "averaging",
    "begin",
    "draw",
    "errors_of",
    "fresh_start_due",
]

PowerSGDHook: TypeAlias = CommHook[PowerSGDGlobalState, PowerSGDBucketState | None]
"""The type of the hooks :func:`zerofn.hooks.powersgd.layerwise` and
:func:`zerofn.hooks.powersgd.batched` make."""

BucketResult: TypeAlias = tuple[torch.Tensor, PowerSGDBucketState | None]
"""What a PowerSGD bucket program returns: the averaged flat gradient and the
bucket's new state."""


def begin(
    bucket: BucketInfo, state: PowerSGDGlobalState, bucket_state: PowerSGDBucketState | None
) -> tuple[PowerSGDGlobalState, tuple[Key, ...], tuple[ParamMemory | None, ...]]:
    """The bucket's parameter keys and memories; the layout noted.

    Without a driver's :func:`zerofn.hooks.powersgd.claim`, the keys are the
    bucket's positions (:func:`zerofn.hooks.powersgd.state.default_keys`).

    Raises:
        ValueError: if ``bucket_state`` was made for other gradient shapes.
    """
    if not fits_bucket(bucket_state, bucket):
        assert bucket_state is not None
        raise ValueError(
            f"PowerSGD state for bucket {bucket.index} was made for gradients of shapes "
            f"{list(bucket_state.shapes)}, but this bucket holds {list(bucket.shapes)}: is one "
            "PowerSGDState shared by models with different buckets? Give each model its own "
            "(or let the driver claim the bucket's parameters, see zerofn.hooks.powersgd.claim)"
        )
    params: tuple[ParamMemory | None, ...]
    if bucket_state is None:
        keys, params = default_keys(bucket), tuple(None for _ in bucket.shapes)
    else:
        keys = bucket_state.keys
        params = tuple(bucket_state.memory(j) for j in range(len(keys)))
    return record_bucket(state, keys, bucket.shapes), keys, params


def errors_of(params: tuple[ParamMemory | None, ...]) -> list[torch.Tensor | None]:
    """Each parameter's remembered error (``None`` where none)."""
    return [m.error if m is not None else None for m in params]


def averaging(
    grad: torch.Tensor, world_size: int, bucket_state: PowerSGDBucketState | None
) -> Program[BucketResult]:
    """Plain averaging (before compression starts), as PyTorch's default hook:
    divide, then sum. The bucket's state passes through untouched."""
    (total,) = yield AllReduce((grad / world_size,), "sum", last=True)
    return total, bucket_state


def draw(state: PowerSGDGlobalState) -> tuple[PowerSGDGlobalState, int]:
    """The next seed, and the state with the stream moved past it."""
    seed, seeds = draw_seed(state.seeds)
    return attrs.evolve(state, seeds=seeds), seed


def fresh_start_due(state: PowerSGDGlobalState, config: PowerSGDConfig) -> bool:
    """Whether every bucket draws a random start this iteration, as in
    PyTorch: always without warm start, else in the first compressing one."""
    return not config.warm_start or state.iteration == config.start_powerSGD_iter
