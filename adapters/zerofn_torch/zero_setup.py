"""What a ``ZeroRedundancyOptimizer`` holds besides its param groups and local
optimizer: the options fixed at construction (:class:`ZeroOptions`, resolved
and checked by :func:`zero_options` before anything is built) and one
record of its ZeRO state (:class:`ZeroSetup`), built by :func:`build_setup`
and replaced whole whenever the plan, the masters or the overlap status change."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from zerofn.blockquant import BlockQuantizer
from zerofn.zero.compressed_exchange import (
    CompressedExchange,
    compressed_exchange,
    compression_master_dtype,
    resolve_compression,
)
from zerofn.zero.exchange import ExchangeVia
from zerofn.zero.masters import Masters
from zerofn.zero.params import hyperparameters
from zerofn.zero.plan import ShardPlan, with_trainable
from zerofn.zero.precision import resolve_master_dtype
from zerofn.zero.shards import Shards, shards_for

__all__ = [
    "OverlapStatus",
    "ZeroOptions",
    "ZeroSetup",
    "build_setup",
    "check_local_optimizer",
    "flat_params",
    "with_current_trainable",
    "zero_options",
]

# The optimizer's own logger: its warnings are filtered by that name.
logger = logging.getLogger("zerofn_torch.zero")

OverlapStatus = Literal["off", "unattached", "attached", "sharded"]
"""Who steps the optimizer: ``"off"``, its own :meth:`step`; with
``overlap_with_ddp=True``, no hook yet (``"unattached"``), a DDP hook with
every rank stepping every parameter (``"attached"``), or a hook after DDP
fixed its buckets, each rank keeping its own (``"sharded"``)."""


def flat_params(groups: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``groups``, in the optimizer's (global index) order."""
    return [p for g in groups for p in g["params"]]


@attrs.frozen
class ZeroOptions:
    """What the constructor fixed, for the optimizer's life.

    Attributes:
        optimizer_class: the local optimizer's class.
        defaults: the keyword arguments it gets.
        rank: this rank in the process group.
        world_size: ranks in the process group.
        bucket_view: parameters are views of the exchange buffers.
        overlap_with_ddp: DDP's hook steps the optimizer.
        master_dtype: the masters' dtype (``None``: no masters).
        quantizer: the compressed exchange's codec (``None``: exact).
        device: the parameters' device, where scalar collectives run.
        via: how the exchange moves shards.
    """

    optimizer_class: type[Optimizer]
    defaults: dict[str, Any]
    rank: int
    world_size: int
    bucket_view: bool
    overlap_with_ddp: bool
    master_dtype: torch.dtype | None
    quantizer: BlockQuantizer | None
    device: torch.device
    via: ExchangeVia


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


def zero_options(
    groups: Sequence[Mapping[str, Any]],
    optimizer_class: type[Optimizer],
    defaults: dict[str, Any],
    process_group: Any,
    bucket_view: bool | None,
    overlap_with_ddp: bool,
    partition: object,
    master_dtype: torch.dtype | None,
    exchange_compression: str | BlockQuantizer | None,
) -> ZeroOptions:
    """The constructor's options, resolved and checked before anything is built
    (the arguments are :class:`zerofn_torch.zero.ZeroRedundancyOptimizer`'s).

    Returns:
        The options record: the codec, the masters' dtype, whether parameters
        are bucket views (by default with ``partition="flat"`` only; never
        with ``overlap_with_ddp``), the exchange's collectives.

    Raises:
        ValueError: an unknown compression, or of non-float parameters;
            ``master_dtype`` narrower than the parameters; a value
            ``optimizer_class`` refuses.
        TypeError: ``optimizer_class`` takes no option of a name in ``defaults``.
    """
    first = groups[0]["params"][0]
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
    # gloo's all-gather measured 2-3.5x slower than broadcasts of the same
    # bytes on CPU; NCCL's all-gather is its best path.
    gloo = dist.get_backend(process_group) == "gloo"
    return ZeroOptions(
        optimizer_class=optimizer_class,
        defaults=defaults,
        rank=dist.get_rank(process_group),
        world_size=dist.get_world_size(process_group),
        bucket_view=bucket_view and not overlap_with_ddp,
        overlap_with_ddp=overlap_with_ddp,
        master_dtype=wide,
        quantizer=quantizer,
        device=first.device,
        via="broadcasts" if gloo else "all_gather",
    )


@attrs.frozen(eq=False)
class ZeroSetup:
    """The optimizer's ZeRO state, consistent as a whole.

    Attributes:
        options: what the constructor fixed.
        plan: who owns what and how shards travel.
        shards: how this rank holds and steps its shard under ``plan``.
        masters: this rank's master copies (``None`` without ``master_dtype``).
        exchange: the compressed exchange's buffers (``None``: exact, or sent
            by the overlap hook).
        overlap: who steps the optimizer (:data:`OverlapStatus`).
    """

    options: ZeroOptions
    plan: ShardPlan
    shards: Shards
    masters: Masters | None
    exchange: CompressedExchange | None
    overlap: OverlapStatus

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The masters' dtype (``None``: no masters)."""
        return self.options.master_dtype

    @property
    def quantizer(self) -> BlockQuantizer | None:
        """The compressed exchange's codec (``None``: exact)."""
        return self.options.quantizer


def build_setup(
    groups: Sequence[Mapping[str, Any]],
    options: ZeroOptions,
    plan: ShardPlan,
    overlap: OverlapStatus,
    masters: Masters | None,
    rebuilt: bool,
) -> ZeroSetup:
    """The setup for ``plan``: this rank's shards and, with compression, the
    payload buffers (built here; with ``options.bucket_view`` the parameters
    become views of the new exchange buffers).

    Args:
        groups: the param groups, in the optimizer's order.
        options: what the constructor fixed.
        plan: who owns what.
        overlap: who steps the optimizer.
        masters: the master copies to keep (a new local optimizer makes its own).
        rebuilt: exchange buffers existed before (see
            :func:`zerofn.zero.shards.build_buffers`).

    Returns:
        The new record.
    """
    params = flat_params(groups)
    # The overlap hook sends its own payloads, bucket by bucket.
    exchange = (
        None
        if options.quantizer is None or options.overlap_with_ddp
        else compressed_exchange(options.quantizer, plan, options.device)
    )
    shards = shards_for(
        plan,
        options.rank,
        params,
        bucket_view=options.bucket_view,
        stepped_by_hook=options.overlap_with_ddp,
        step_dtype=options.master_dtype or params[0].dtype,
        options=options.defaults,
        rebuilt=rebuilt,
    )
    return ZeroSetup(options, plan, shards, masters, exchange, overlap)


def with_current_trainable(setup: ZeroSetup, groups: Sequence[Mapping[str, Any]]) -> ZeroSetup:
    """``setup``, rebuilt (exchange buffers included) if the parameters
    requiring grad changed since its plan was made.

    Raises:
        ValueError: a manual plan would leave a newly trainable parameter to
            no rank; then nothing changed.
    """
    trainable = tuple(p.requires_grad for p in flat_params(groups))
    if trainable == setup.plan.trainable:
        return setup
    plan = with_trainable(setup.plan, trainable)  # may refuse: then nothing changed
    logger.warning(
        "ZeroRedundancyOptimizer: the set of parameters requiring grad changed; "
        "rebuilding the exchange buffers"
    )
    return build_setup(groups, setup.options, plan, setup.overlap, setup.masters, rebuilt=True)
