"""PowerSGD on a whole bucket as one square matrix (PyTorch's ``batched_powerSGD_hook``).

The bucket's factors are bucket-shaped by nature: its ``Q`` (``side x
rank``) and the error of the padding that squares it are kept in a
:class:`zerofn.hooks.powersgd.SquareMemory` for exactly the bucket's parameters,
in the order they had. The error of the parameters themselves is kept per
parameter. So:

* when a bucket holds the same parameters as when its square was made, in
  any order (DDP's provisional first iteration in a fresh model holds them
  reversed), they are compressed in the square's order and the results put
  back in the bucket's: the run continues exactly;
* when it holds other parameters (a bucket split or merged by a rebuild,
  another ``bucket_cap_mb``), each parameter's error is kept and the
  bucket's matrix is re-formed from it; the padding error is dropped and the
  power iteration starts again from a random ``Q`` (one fresh seed drawn).
  Never plain averaging.
"""

from __future__ import annotations

import attrs
import torch

from zerofn.comm import AllReduce, Program
from zerofn.hooks.error_feedback import compensate, split_residual
from zerofn.hooks.hook import BucketInfo
from zerofn.hooks.powersgd import codec
from zerofn.hooks.powersgd.codec import square_side
from zerofn.hooks.powersgd.common import (
    BucketCall,
    BucketResult,
    PowerSGDHook,
    draw,
    errors_of,
    new_state,
    powersgd_hook,
)
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.state import (
    Key,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    SquareMemory,
    record_compression,
)

__all__ = ["batched"]


def _program(
    call: BucketCall, initial_q: torch.Tensor, config: PowerSGDConfig
) -> Program[BucketResult]:
    eps, grad, held = config.orthogonalization_epsilon, call.grad, call.bucket_state
    numel, side = grad.numel(), initial_q.shape[0]
    # The bucket, padded to side * side, plus the remembered errors.
    signal = torch.zeros(side * side, dtype=grad.dtype, device=grad.device)
    signal[:numel] = grad
    if config.use_error_feedback:
        signal = compensate(signal, errors_of(call.params), call.bucket.numels, owned=True)
        if held is not None and held.square is not None and held.square.padding is not None:
            signal[numel:] += held.square.padding
    matrix = signal.view(1, side, side)
    q = codec.orthogonalize(initial_q.unsqueeze(0), eps)
    (p_sum,) = yield AllReduce((codec.project(matrix, q).contiguous(),), "sum")
    p = codec.orthogonalize(p_sum, eps)
    (q_sum,) = yield AllReduce(
        (codec.project_transposed(matrix, p).contiguous(),), "sum", last=True
    )
    q_mean = q_sum / call.bucket.world_size
    decoded = torch.bmm(p, q_mean.transpose(1, 2)).view(-1)
    # The error covers the padding too, as in PyTorch; the result drops it.
    residual = signal.sub_(decoded) if config.use_error_feedback else None
    padding = residual[numel:] if residual is not None else None
    square = SquareMemory(call.keys, padding, q_mean[0] if config.warm_start else None)
    return decoded[:numel], new_state(call.keys, call.bucket, residual, {}, config, square)


def _square_order(keys: tuple[Key, ...], square: SquareMemory | None) -> tuple[int, ...] | None:
    """Where the square's parameters sit in the bucket, in the square's order;
    ``None`` when the bucket already holds them in that order (or no square)."""
    if square is None or square.keys == keys:
        return None
    position = {key: j for j, key in enumerate(keys)}
    return tuple(position[key] for key in square.keys)


def _permuted(flat: torch.Tensor, numels: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """The parameters of a flat bucket, taken in ``order``."""
    parts = split_residual(flat, numels)
    return torch.cat([parts[j] for j in order])


def _restored_order(
    program: Program[BucketResult],
    order: tuple[int, ...],
    keys: tuple[Key, ...],
    bucket: BucketInfo,
) -> Program[BucketResult]:
    """``program`` run in the square's order, its results in the bucket's."""
    out, state = yield from program
    inverse = tuple(order.index(j) for j in range(len(order)))
    numels = tuple(bucket.numels[j] for j in order)
    out = _permuted(out, numels, inverse)
    if state is not None:
        params = tuple(state.params[i] for i in inverse)
        state = PowerSGDBucketState(keys, bucket.shapes, params, state.square)
    return out, state


def _compress(
    config: PowerSGDConfig, call: BucketCall, state: PowerSGDGlobalState
) -> tuple[PowerSGDGlobalState, Program[BucketResult]]:
    """The compressing iteration's program for one bucket (see :func:`batched`)."""
    grad, bucket, params = call.grad, call.bucket, call.params
    square = call.bucket_state.square if call.bucket_state is not None else None
    numel = grad.numel()
    side = square_side(numel)
    rank = min(side, config.matrix_approximation_rank)
    state = record_compression(state, numel, 2 * side * rank, bucket.is_last, config)
    # The square's last Q (warm start), else a random one from a fresh seed.
    if config.warm_start and square is not None and square.q is not None:
        q = square.q
    else:
        state, seed = draw(state)
        generator = torch.Generator().manual_seed(seed)
        q = torch.randn(side, rank, generator=generator, dtype=grad.dtype).to(grad.device)
    order = _square_order(call.keys, square)
    if order is None:
        return state, _program(call, q, config)
    # The square's parameters in another order: compress in the square's.
    assert square is not None
    shapes = tuple(bucket.shapes[j] for j in order)
    held = PowerSGDBucketState(square.keys, shapes, tuple(params[j] for j in order), square)
    grad = _permuted(grad, bucket.numels, order)
    square_call = BucketCall(grad, attrs.evolve(bucket, shapes=shapes), square.keys, held)
    return state, _restored_order(_program(square_call, q, config), order, call.keys, bucket)


def batched(config: PowerSGDConfig) -> PowerSGDHook:
    """PowerSGD on the whole bucket as one matrix (PyTorch's ``batched_powerSGD_hook``).

    The flat bucket, padded with zeros to ``side * side`` elements (``side =
    ceil(sqrt(numel))``), is compressed as one square matrix: faster than
    :func:`zerofn.hooks.powersgd.layerwise`, usually less accurate beyond rank 1.
    Two all-reduces per bucket (``P``, then ``Q``). The rank is clipped to
    ``side`` for tiny buckets, where PyTorch's would fail.

    The numbers are those PyTorch's hook was written to compute (PyTorch 2.13's
    own fails on every call: it passes a 2-D ``Q`` to an orthogonalisation that
    only accepts batches), except that ``config.orthogonalization_epsilon`` is
    honoured (PyTorch's batched hook ignores it; with the default 0 they agree).
    What happens when a bucket's parameters change: see the module docs.

    Args:
        config: the hyperparameters.

    Returns:
        A hook like :func:`zerofn.hooks.powersgd.layerwise`'s.

    Raises:
        ValueError: (from ``start``) if the bucket's state was made for other
            gradient shapes.
    """
    return powersgd_hook(config, "batched_powersgd", _compress)
