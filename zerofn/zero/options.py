"""The ZeRO optimizer's options, resolved in one place: every constructor
argument in, the options record out (:class:`ZeroOptions`), or one clear
error before anything is built.

:func:`resolve_options` runs every check there is on the arguments, the
optimizer's own included, each kept with the idea it checks: the
optimizer class and element-wise promise (:mod:`zerofn.zero.optimizers`),
the parameters (:mod:`zerofn.zero.params`), redundancy
(:func:`~zerofn.zero.elastic.redundancy.check_redundancy`), the codec
(:func:`resolve_compression`) and the masters' dtype
(:func:`~zerofn.zero.mixed_precision.precision.resolve_master_dtype`, and
:func:`compression_master_dtype` for a compressed exchange's).
``zerofn_torch.ZeroRedundancyOptimizer`` and the simulated world
(:mod:`zerofn.testing.zero`) both call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.optim import Optimizer

from zerofn.blockquant import BlockQuantizer, quantizer_for
from zerofn.zero.compressed.exchange import PIECE_ELEMENTS
from zerofn.zero.elastic.redundancy import check_redundancy
from zerofn.zero.exchange import ExchangeCollective
from zerofn.zero.forward_gather import check_gather_during_forward
from zerofn.zero.mixed_precision.precision import resolve_master_dtype
from zerofn.zero.optimizers import check_elementwise, check_optimizer_class
from zerofn.zero.params import check_same_dense_type, hyperparameters

__all__ = [
    "ZeroOptions",
    "check_local_optimizer",
    "collective_for_backend",
    "compression_master_dtype",
    "resolve_compression",
    "resolve_options",
]


@attrs.frozen
class ZeroOptions:
    """What the constructor fixed, for the optimizer's life.

    Attributes:
        optimizer_class: the local optimizer's class (or a factory of one).
        defaults: the keyword arguments it gets.
        rank: this rank in the process group.
        world_size: ranks in the process group.
        bucket_view: parameters are views of the exchange buffers.
        master_dtype: the masters' dtype (``None``: no masters).
        quantizer: the compressed exchange's codec (``None``: exact).
        device: the parameters' device, where scalar collectives run.
        collective: how the exchange moves shards.
        piece_elements: the compressed exchange's piece length.
        redundancy: on how many ranks each shard's state lives (1 or 2; see
            :mod:`zerofn.zero.elastic.redundancy`).
        gather_during_forward: the exchange travels behind the next forward
            (:mod:`zerofn.zero.forward_gather`).
    """

    optimizer_class: type[Optimizer]
    defaults: dict[str, Any]
    rank: int
    world_size: int
    bucket_view: bool
    master_dtype: torch.dtype | None
    quantizer: BlockQuantizer | None
    device: torch.device
    collective: ExchangeCollective
    piece_elements: int = PIECE_ELEMENTS
    redundancy: int = 1
    gather_during_forward: bool = False


def collective_for_backend(backend: str) -> ExchangeCollective:
    """How the exchange moves shards on ``backend``: gloo's all-gather
    measured 2-3.5x slower than broadcasts of the same bytes on CPU; NCCL's
    all-gather is its best path."""
    return "broadcasts" if backend == "gloo" else "all_gather"


def check_local_optimizer(
    groups: Sequence[Mapping[str, Any]],
    optimizer_class: type[Optimizer],
    defaults: dict[str, Any],
    probe: torch.Tensor,
) -> None:
    """Let ``optimizer_class`` check its hyperparameters before anything is built.

    The local optimizer is made last, after the exchange buffers, and with
    ``parameters_as_bucket_view`` the parameters' storage has moved into
    them by then; so its own checks (a negative ``lr``, an unknown option)
    run first here, on one throwaway tensor per param group, each group
    with its own options as the local optimizer will see them.

    Args:
        groups: the param groups (their tensors are not touched).
        optimizer_class: the local optimizer's class.
        defaults: the keyword arguments it will get.
        probe: a one-element tensor of the local optimizer's dtype and
            device (each group gets a copy).

    Raises:
        ValueError: ``optimizer_class`` refuses a value (``torch.optim``'s
            checks: a negative ``lr``, ``betas`` out of range, ...).
        TypeError: ``optimizer_class`` takes no option of that name, or
            (a factory rather than a class) builds no ``torch.optim.Optimizer``.
    """
    probes = [{**hyperparameters(g), "params": [probe.clone()]} for g in groups]
    built = optimizer_class(probes, **defaults)
    if not isinstance(built, Optimizer):
        raise TypeError(
            f"optimizer_class={optimizer_class!r} built a {type(built).__name__}, not a "
            "torch.optim.Optimizer; pass an optimizer class such as torch.optim.AdamW"
        )


def resolve_options(
    groups: Sequence[Mapping[str, Any]],
    optimizer_class: type[Optimizer],
    defaults: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    collective: ExchangeCollective,
    bucket_view: bool | None,
    overlap_with_ddp: bool,
    partition: str | Sequence[Sequence[torch.Tensor]],
    master_dtype: torch.dtype | None,
    exchange_compression: str | BlockQuantizer | None,
    elementwise: bool = False,
    piece_elements: int = PIECE_ELEMENTS,
    redundancy: int = 1,
    gather_during_forward: bool = False,
) -> ZeroOptions:
    """The constructor's options, resolved and checked before anything is built
    (the arguments are ``zerofn_torch.ZeroRedundancyOptimizer``'s).

    Returns:
        The options record: the codec, the masters' dtype, whether parameters
        are bucket views (by default with ``partition="flat"`` only; never
        with ``overlap_with_ddp``).

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class (a string, a
            module class, ...), or takes no option of a name in ``defaults``.
        ValueError: sparse or mixed-type parameters; ``overlap_with_ddp``
            with a partition other than the default; ``partition="flat"``
            with an optimizer not known to be element-wise; an unknown
            compression, or of non-float parameters; ``master_dtype``
            narrower than the parameters; a ``redundancy`` the optimizer
            cannot keep; ``gather_during_forward`` beside an option it does
            not compose with; a value ``optimizer_class`` refuses.
        RuntimeError: ``overlap_with_ddp`` with more than one param group.
    """
    check_optimizer_class(optimizer_class)
    check_same_dense_type([p for g in groups for p in g["params"]])
    if overlap_with_ddp and len(groups) != 1:
        raise RuntimeError(
            "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single param "
            f"group, got {len(groups)}"
        )
    if overlap_with_ddp and partition != "greedy":
        raise ValueError(
            "with overlap_with_ddp=True ownership follows DDP's buckets (with redundancy=2, "
            "the default greedy partition); leave partition at its default"
        )
    if partition == "flat":
        check_elementwise(optimizer_class, elementwise)
    check_redundancy(redundancy, world_size)
    if gather_during_forward:
        check_gather_during_forward(redundancy, overlap_with_ddp)
    first = next(p for g in groups for p in g["params"])
    quantizer = resolve_compression(exchange_compression, first.dtype)
    wide = (
        resolve_master_dtype(first.dtype, master_dtype)
        if quantizer is None
        else compression_master_dtype(first.dtype, master_dtype)
    )
    probe = torch.zeros(1, dtype=wide or first.dtype, device=first.device)
    check_local_optimizer(groups, optimizer_class, defaults, probe)
    if bucket_view is None:
        bucket_view = partition == "flat"
    return ZeroOptions(
        optimizer_class=optimizer_class,
        defaults=defaults,
        rank=rank,
        world_size=world_size,
        bucket_view=bucket_view and not overlap_with_ddp,
        master_dtype=wide,
        quantizer=quantizer,
        device=first.device,
        collective=collective,
        piece_elements=piece_elements,
        redundancy=redundancy,
        gather_during_forward=gather_during_forward,
    )


def resolve_compression(
    compression: str | BlockQuantizer | None, dtype: torch.dtype
) -> BlockQuantizer | None:
    """The quantizer ``exchange_compression`` asks for, checked against the
    parameters' dtype.

    Args:
        compression: ``None`` (the exact exchange), ``"int8"``, ``"int4"``, or
            a :class:`~zerofn.blockquant.BlockQuantizer` (another block size).
        dtype: the parameters' dtype.

    Raises:
        ValueError: an unknown name, or parameters that are not floating point.
        TypeError: something other than a name or a quantizer.
    """
    if compression is None:
        return None
    if isinstance(compression, str):
        quantizer = quantizer_for(compression)
    elif isinstance(compression, BlockQuantizer):
        quantizer = compression
    else:
        raise TypeError(
            "exchange_compression must be None, 'int8', 'int4' or a "
            f"zerofn.blockquant.BlockQuantizer, got {compression!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"exchange_compression quantizes differences of floating-point parameters; "
            f"these are {dtype}: leave exchange_compression=None"
        )
    return quantizer


def compression_master_dtype(
    param_dtype: torch.dtype, master_dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype of the exact copies a compressed exchange keeps: the
    ``master_dtype`` asked for, else ``float32`` (or the parameters' own
    dtype when wider).

    Raises:
        TypeError, ValueError: as
            :func:`zerofn.zero.mixed_precision.precision.resolve_master_dtype`.
    """
    resolve_master_dtype(param_dtype, master_dtype)  # its checks
    if master_dtype is not None:
        return master_dtype
    return torch.float32 if torch.finfo(param_dtype).bits < 32 else param_dtype
