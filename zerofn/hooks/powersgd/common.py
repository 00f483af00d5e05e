"""What PowerSGD's two hooks share: the hook itself around their compressing
steps, reading a bucket's memories, plain averaging before compression
starts, and drawing a random start."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias

import attrs
import torch

from zerofn.comm import Program
from zerofn.hooks.error_feedback import split_residual
from zerofn.hooks.hook import BucketInfo, CommHook, averaged
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.state import (
    Key,
    ParamMemory,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    SquareMemory,
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
    "draw",
    "errors_of",
    "fresh_start_due",
    "new_state",
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
        keys: its parameters' keys: those a driver claimed
            (:func:`zerofn.hooks.powersgd.claim`), else the bucket's positions
            (:func:`zerofn.hooks.powersgd.state.default_keys`).
        bucket_state: the bucket's state before this call.
    """

    grad: torch.Tensor
    bucket: BucketInfo
    keys: tuple[Key, ...]
    bucket_state: PowerSGDBucketState | None

    @property
    def params(self) -> tuple[ParamMemory | None, ...]:
        """Its parameters' memories (``None`` where none yet)."""
        held = self.bucket_state
        return tuple(held.memory(j) if held is not None else None for j in range(len(self.keys)))


Compress: TypeAlias = Callable[
    [PowerSGDConfig, BucketCall, PowerSGDGlobalState],
    tuple[PowerSGDGlobalState, Program[BucketResult]],
]
"""A hook's compressing step for one bucket: ``(config, call, state) -> (state,
program)``."""


def powersgd_hook(config: PowerSGDConfig, name: str, compress: Compress) -> PowerSGDHook:
    """A PowerSGD hook: each bucket's keys read and its layout noted (a
    bucket state made for other shapes refused), averaged plainly before
    ``config.start_powerSGD_iter``, then ``compress``-ed.

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
        if not fits_bucket(bucket_state, bucket):
            assert bucket_state is not None
            raise ValueError(
                f"PowerSGD state for bucket {bucket.index} was made for gradients of shapes "
                f"{list(bucket_state.shapes)}, but this bucket holds {list(bucket.shapes)}: is one "
                "PowerSGDState shared by models with different buckets? Give each model its own "
                "(or let the driver claim the bucket's parameters, see zerofn.hooks.powersgd.claim)"
            )
        keys = bucket_state.keys if bucket_state is not None else default_keys(bucket)
        state = record_bucket(state, keys, bucket.shapes)
        if state.iteration < config.start_powerSGD_iter:
            return state, averaged(grad, bucket.world_size, bucket_state)
        return compress(config, BucketCall(grad, bucket, keys, bucket_state), state)

    return CommHook(
        init=lambda: init_global_state(config),
        start=start,
        end_iteration=end_iteration,
        name=name,
    )


def errors_of(params: tuple[ParamMemory | None, ...]) -> list[torch.Tensor | None]:
    """Each parameter's remembered error (``None`` where none)."""
    return [m.error if m is not None else None for m in params]


def new_state(
    keys: tuple[Key, ...],
    bucket: BucketInfo,
    residual: torch.Tensor | None,
    factors: Mapping[Key, torch.Tensor],
    config: PowerSGDConfig,
    square: SquareMemory | None = None,
) -> PowerSGDBucketState | None:
    """What each parameter keeps: its error (its part of ``residual``, the
    compensated input less the averaged result, PyTorch's definition) and its
    ``Q`` (from ``factors``); ``None`` when neither is kept."""
    if not (config.use_error_feedback or config.warm_start):
        return None
    errors = split_residual(residual, bucket.numels) if residual is not None else None
    params = tuple(
        ParamMemory(shape, errors[j] if errors is not None else None, factors.get(key))
        for j, (key, shape) in enumerate(zip(keys, bucket.shapes, strict=True))
    )
    return PowerSGDBucketState(keys, bucket.shapes, params, square)


def draw(state: PowerSGDGlobalState) -> tuple[PowerSGDGlobalState, int]:
    """The next seed, and the state with the stream moved past it."""
    seed, seeds = draw_seed(state.seeds)
    return attrs.evolve(state, seeds=seeds), seed


def fresh_start_due(state: PowerSGDGlobalState, config: PowerSGDConfig) -> bool:
    """Whether every bucket draws a random start this iteration, as in
    PyTorch: always without warm start, else in the first compressing one."""
    return not config.warm_start or state.iteration == config.start_powerSGD_iter
