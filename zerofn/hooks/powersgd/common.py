"""What PowerSGD's two hooks share: the hook itself around their compressing
steps, reading a bucket's memories, plain averaging before compression
starts, and drawing a random start."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import attrs
import torch

from zerofn.comm import AllReduce, Program
from zerofn.hooks.hook import BucketInfo, CommHook
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.state import (
    Key,
    ParamMemory,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    default_keys,
    draw_seed,
    end_iteration,
    fits_bucket,
    init_global_state,
    record_bucket,
)

__all__ = [
    "BucketCall",
    "BucketResult",
    "Compress",
    "PowerSGDHook",
    "averaging",
    "begin",
    "draw",
    "errors_of",
    "fresh_start_due",
    "powersgd_hook",
]

PowerSGDHook: TypeAlias = CommHook[PowerSGDGlobalState, PowerSGDBucketState | None]
"""The type of the hooks :func:`zerofn.hooks.powersgd.layerwise` and
:func:`zerofn.hooks.powersgd.batched` make."""

BucketResult: TypeAlias = tuple[torch.Tensor, PowerSGDBucketState | None]
"""What a PowerSGD bucket program returns: the averaged flat gradient and the
bucket's new state."""


@attrs.frozen(eq=False)
class BucketCall:
    """One bucket's call of a PowerSGD hook in a compressing iteration.

    Attributes:
        grad: the bucket's flat gradient.
        bucket: the bucket.
        keys: its parameters' keys, as :func:`begin` read them.
        params: its parameters' memories (``None`` where none yet).
        bucket_state: the bucket's state before this call.
    """

    grad: torch.Tensor
    bucket: BucketInfo
    keys: tuple[Key, ...]
    params: tuple[ParamMemory | None, ...]
    bucket_state: PowerSGDBucketState | None


Compress: TypeAlias = Callable[
    [PowerSGDConfig, BucketCall, PowerSGDGlobalState],
    tuple[PowerSGDGlobalState, Program[BucketResult]],
]
"""A hook's compressing step for one bucket: ``(config, call, state) -> (state,
program)``."""


def powersgd_hook(config: PowerSGDConfig, name: str, compress: Compress) -> PowerSGDHook:
    """A PowerSGD hook: each bucket read by :func:`begin`, averaged plainly
    before ``config.start_powerSGD_iter``, then ``compress``-ed.

    Args:
        config: the hyperparameters.
        name: the hook's label.
        compress: the compressing step.

    Returns:
        The hook, its global state advanced by
        :func:`zerofn.hooks.powersgd.end_iteration` after each iteration.
    """

    def start(
        grad: torch.Tensor,
        bucket: BucketInfo,
        state: PowerSGDGlobalState,
        bucket_state: PowerSGDBucketState | None,
    ) -> tuple[PowerSGDGlobalState, Program[BucketResult]]:
        state, keys, params = begin(bucket, state, bucket_state)
        if state.iteration < config.start_powerSGD_iter:
            return state, averaging(grad, bucket.world_size, bucket_state)
        return compress(config, BucketCall(grad, bucket, keys, params, bucket_state), state)

    return CommHook(
        init=lambda: init_global_state(config),
        start=start,
        end_iteration=end_iteration,
        name=name,
    )


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
