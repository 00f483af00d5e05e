"""PowerSGD compressing each gradient matrix on its own (PyTorch's ``powerSGD_hook``).

The program reads as the paper's algorithm, one power iteration per step::

    M <- grad + error                 (error feedback, per parameter)
    P <- M Q;   all-reduce P          (uncompressed gradients ride along)
    P <- orthogonalise(P)
    Q <- M^T P; all-reduce Q, mean
    grad' <- P Q^T;  error <- M - grad';  Q is kept (warm start, per parameter)

Each parameter's error and ``Q`` are kept under its key (see
:mod:`zerofn.hooks.powersgd.state`), so they mean the same in any bucket layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from zerofn.comm import AllReduce, Program, split_like
from zerofn.hooks.error_feedback import compensate
from zerofn.hooks.hook import BucketInfo
from zerofn.hooks.powersgd import codec
from zerofn.hooks.powersgd.codec import BucketLayout, bucket_layout
from zerofn.hooks.powersgd.common import (
    BucketCall,
    BucketResult,
    PowerSGDHook,
    draw,
    errors_of,
    fresh_start_due,
    new_state,
    powersgd_hook,
)
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.state import (
    Key,
    PowerSGDGlobalState,
    record_compression,
)

__all__ = ["layerwise"]

Factors = dict[Key, torch.Tensor]


def _keyed(layout: BucketLayout, keys: Sequence[Key], groups: Sequence[torch.Tensor]) -> Factors:
    """Per-group factor batches as one factor per parameter key."""
    position = {m.offset: j for j, m in enumerate(layout.matrices)}
    return {
        keys[position[offset]]: factor
        for group, batch in zip(layout.groups, groups, strict=True)
        for offset, factor in zip(group.offsets, batch, strict=True)
    }


def _grouped(layout: BucketLayout, keys: Sequence[Key], factors: Factors) -> list[torch.Tensor]:
    """One factor per key as per-group batches (the inverse of :func:`_keyed`)."""
    position = {m.offset: j for j, m in enumerate(layout.matrices)}
    return [torch.stack([factors[keys[position[o]]] for o in g.offsets]) for g in layout.groups]


def _draw_for(
    state: PowerSGDGlobalState,
    layout: BucketLayout,
    keys: Sequence[Key],
    like: torch.Tensor,
    config: PowerSGDConfig,
) -> tuple[PowerSGDGlobalState, Factors]:
    state, seed = draw(state)
    groups = codec.random_factors(
        layout, seed, config.batch_tensors_with_same_shape, like.dtype, like.device
    )
    return state, _keyed(layout, keys, groups)


def _draw_ahead(
    state: PowerSGDGlobalState, index: int, like: torch.Tensor, config: PowerSGDConfig
) -> PowerSGDGlobalState:
    """Draw this iteration's remaining random starts by the reference layout
    (see :func:`zerofn.hooks.powersgd.end_iteration`), keyed by parameter."""
    table: Factors = {}
    if fresh_start_due(state, config):
        for keys, shapes in state.reference[index:]:
            layout = bucket_layout(
                shapes, config.matrix_approximation_rank, config.min_compression_rate
            )
            state, drawn = _draw_for(state, layout, keys, like, config)
            table.update(drawn)
    return attrs.evolve(state, ahead=tuple(table.items()))


def _differs_from_reference(state: PowerSGDGlobalState, bucket: BucketInfo) -> bool:
    reference = state.reference
    if not reference or state.ahead is not None:
        return False
    return bucket.index >= len(reference) or reference[bucket.index] != state.current[-1]


def _starting_factors(
    state: PowerSGDGlobalState, call: BucketCall, layout: BucketLayout, config: PowerSGDConfig
) -> tuple[PowerSGDGlobalState, list[torch.Tensor]]:
    """Each compressed matrix's starting ``Q``: its own last one (warm start),
    else a random one, drawn as PyTorch draws them for the layout in force."""
    keys, params = call.keys, call.params
    kept: Factors = {}
    if config.warm_start:
        kept = {
            k: m.q for k, m in zip(keys, params, strict=True) if m is not None and m.q is not None
        }
    if _differs_from_reference(state, call.bucket):
        state = _draw_ahead(state, call.bucket.index, call.grad, config)
    if state.ahead is not None:  # drawn ahead: those of them not kept
        kept = {**dict(state.ahead), **kept}
    missing = any(m.compressed and keys[j] not in kept for j, m in enumerate(layout.matrices))
    # PyTorch draws a seed even for a bucket with nothing to compress.
    if missing or (state.ahead is None and fresh_start_due(state, config)):
        state, drawn = _draw_for(state, layout, keys, call.grad, config)
        kept = {**drawn, **kept}
    return state, _grouped(layout, keys, kept)


def _program(
    call: BucketCall, layout: BucketLayout, initial_qs: list[torch.Tensor], config: PowerSGDConfig
) -> Program[BucketResult]:
    eps, bucket = config.orthogonalization_epsilon, call.bucket
    signal = call.grad
    if config.use_error_feedback:
        signal = compensate(signal, errors_of(call.params), bucket.numels, owned=False)
    matrices = [codec.gather_group(signal, group) for group in layout.groups]
    ps = [
        codec.project(m, codec.orthogonalize(q, eps))
        for m, q in zip(matrices, initial_qs, strict=True)
    ]
    uncompressed = codec.gather_uncompressed(signal, layout)
    if not layout.groups:
        # Nothing worth compressing: one round trip is enough.
        (summed,) = yield AllReduce((uncompressed,), "sum", last=True)
        qs: Sequence[torch.Tensor] = []
    else:
        # Round 1: the uncompressed gradients ride along with the P factors.
        # P is not averaged: orthogonalisation removes the scale anyway.
        summed, p_sum = yield AllReduce((uncompressed, codec.flat(ps)), "sum")
        ps = [codec.orthogonalize(p, eps) for p in split_like(p_sum, ps)]
        qs = [codec.project_transposed(m, p) for m, p in zip(matrices, ps, strict=True)]
        # Round 2: the Q factors.
        (q_sum,) = yield AllReduce((codec.flat(qs),), "sum", last=True)
        qs = split_like(q_sum / bucket.world_size, qs)
    out = codec.assemble(layout, summed / bucket.world_size, ps, qs, signal)
    # With error feedback the signal is the program's own: it becomes the error.
    residual = signal.sub_(out) if config.use_error_feedback else None
    factors = _keyed(layout, call.keys, qs) if config.warm_start else {}
    return out, new_state(call.keys, bucket, residual, factors, config)


def _compress(
    config: PowerSGDConfig, call: BucketCall, state: PowerSGDGlobalState
) -> tuple[PowerSGDGlobalState, Program[BucketResult]]:
    """The compressing iteration's program for one bucket (see :func:`layerwise`)."""
    rank, rate = config.matrix_approximation_rank, config.min_compression_rate
    layout = bucket_layout(call.bucket.shapes, rank, rate)
    state = record_compression(state, layout.numel, layout.sent_numel, call.bucket.is_last, config)
    state, qs = _starting_factors(state, call, layout, config)
    return state, _program(call, layout, qs, config)


def layerwise(config: PowerSGDConfig) -> PowerSGDHook:
    """PowerSGD compressing each gradient matrix on its own (PyTorch's ``powerSGD_hook``).

    Before ``config.start_powerSGD_iter`` iterations have completed, a bucket
    is averaged plainly (one all-reduce). After, its gradients worth
    compressing (see :func:`zerofn.hooks.powersgd.should_compress`) travel as
    factors and the rest as they are: two all-reduces per bucket, the first
    carrying the uncompressed gradients with the ``P`` factors, the second
    the ``Q`` factors (one, if nothing in the bucket is worth compressing).

    Given the same configuration, it draws the same random numbers as
    PyTorch's hook, in the same order, and so computes the same factors, up
    to rounding (products run transposed, same-shape matrices as one batch).
    Error and ``Q`` are kept per parameter, so a bucket with another set of
    parameters (DDP's provisional first iteration, a rebuild) continues with
    the same state; such an iteration draws its random starts by the layout
    before it (see :func:`zerofn.hooks.powersgd.end_iteration`).

    Args:
        config: the hyperparameters.

    Returns:
        A hook whose programs return the averaged flat gradient and the
        bucket's new :class:`PowerSGDBucketState` (``None`` when neither error
        feedback nor warm start keeps anything).

    Raises:
        ValueError: (from ``start``) if the bucket's state was made for other
            gradient shapes.
    """
    return powersgd_hook(config, "powersgd", _compress)
