"""What each rank holds and sends, from parameter shapes alone.

:func:`plan_footprint` counts, per rank: **parameters** (every rank holds the
whole model), **gradients** (DDP's gradient buckets, one per parameter
element), **master weights** (with ``master_dtype``, the rank's shard),
**optimizer state** (only the rank's shard, plus per-tensor scalars such as
Adam's step), **exchange buffers** (the flat buffers the ZeRO step exchanges
through; with ``bucket_view``, the default under ``flat``, the parameters
live in them, so nothing extra). And per step: the payload bytes each kind
of collective carries on this rank, and how many collectives the ZeRO step
issues.

Every number comes from the same core functions the adapter uses
(partition, buffer layouts, PowerSGD's compression decisions), so it equals
what ``zerofn_torch`` allocates and sends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.hooks.powersgd import PowerSGDConfig, bucket_layout
from zerofn.zero.compressed.exchange import compressed_buffer_bytes, exchange_bytes
from zerofn.zero.elastic.redundancy import carried_owner, check_redundancy
from zerofn.zero.mixed_precision.precision import resolve_master_dtype
from zerofn.zero.options import compression_master_dtype, resolve_compression
from zerofn.zero.planning.chunks import chunk_sizes
from zerofn.zero.planning.partition import FlatPartition, PartitionMode
from zerofn.zero.planning.plan import ShardPlan, plan_shards

__all__ = [
    "OPTIMIZERS",
    "Footprint",
    "HookKind",
    "OptimizerModel",
    "RankBytes",
    "plan_footprint",
    "shapes_of",
]

HookKind = Literal["allreduce", "fp16", "powersgd"]
Backend = Literal["gloo", "nccl"]
Shapes = Sequence[Sequence[Sequence[int]]]  # per param group, per parameter


@attrs.frozen
class OptimizerModel:
    """What an optimizer keeps per parameter it steps.

    Attributes:
        name: for reports.
        elementwise_states: state tensors shaped like the parameter
            (``exp_avg`` and ``exp_avg_sq`` for Adam).
        scalar_bytes: bytes of 0-dim state tensors per stepped tensor (Adam's
            ``step``: one float32).
    """

    name: str
    elementwise_states: int
    scalar_bytes: int


OPTIMIZERS: dict[str, OptimizerModel] = {
    "adam": OptimizerModel("adam", 2, 4),
    "adamw": OptimizerModel("adamw", 2, 4),
    "sgd-momentum": OptimizerModel("sgd-momentum", 1, 0),
    "sgd": OptimizerModel("sgd", 0, 0),
}
"""The optimizers ``torch.optim`` keeps state for this way, by name."""


@attrs.frozen
class RankBytes:
    """One rank's bytes by kind (``carried``: the copy of another rank's
    shard kept with ``redundancy=2``, its values and optimizer state;
    ``kept_gradients``: with ``redundancy=2`` and ``gather_during_forward``,
    the gradients the last local step took, kept until its exchange lands)."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    exchange_buffers: int
    carried: int = 0
    kept_gradients: int = 0

    @property
    def total(self) -> int:
        """All of it."""
        return (
            self.parameters
            + self.gradients
            + self.master_weights
            + self.optimizer_state
            + self.exchange_buffers
            + self.carried
            + self.kept_gradients
        )


@attrs.frozen
class Footprint:
    """What :func:`plan_footprint` found.

    Attributes:
        numel: parameters of the model.
        world_size: number of ranks.
        partition: the partition mode.
        param_dtype: the parameters' dtype (also the gradients').
        master_dtype: the master weights' dtype (also the optimizer
            state's), or ``None`` without masters (the state then has the
            parameters' dtype).
        optimizer: the optimizer's name.
        hook: the DDP communication hook.
        ranks: each rank's bytes.
        payload_bytes: per collective kind, the bytes one rank hands to
            collectives of that kind per step (as
            ``zerofn_torch.runtime.traffic.collective_traffic`` counts them).
        zero_collectives: collectives the ZeRO step issues per step, by kind
            (the hook's count depends on DDP's buckets: one all-reduce per
            bucket, two with PowerSGD).
        powersgd_rank: the rank of PowerSGD's factors with the PowerSGD
            hook, else ``None``.
        exchange_compression: the ZeRO exchange's compression (``"int8"``,
            ``"int4"``), or ``None`` for the exact exchange.
    """

    numel: int
    world_size: int
    partition: PartitionMode
    param_dtype: str
    master_dtype: str | None
    optimizer: str
    hook: HookKind
    ranks: tuple[RankBytes, ...]
    payload_bytes: tuple[tuple[str, int], ...]
    zero_collectives: tuple[tuple[str, int], ...]
    powersgd_rank: int | None = None
    exchange_compression: str | None = None

    @property
    def heaviest(self) -> int:
        """The rank holding the most bytes (the lowest on ties)."""
        return max(range(self.world_size), key=lambda r: (self.ranks[r].total, -r))

    @property
    def lightest(self) -> int:
        """The rank holding the fewest bytes (the lowest on ties)."""
        return min(range(self.world_size), key=lambda r: (self.ranks[r].total, r))

    def bytes_per_parameter(self, rank: int) -> float:
        """``rank``'s bytes per model parameter."""
        return self.ranks[rank].total / self.numel if self.numel else 0.0

    def payload(self, kind: str) -> int:
        """The bytes one rank hands to collectives of ``kind`` per step (0
        for a kind the step does not issue)."""
        return dict(self.payload_bytes).get(kind, 0)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data (exact integers)."""
        data = attrs.asdict(self)
        data["heaviest"], data["lightest"] = self.heaviest, self.lightest
        data["payload_bytes"] = dict(self.payload_bytes)
        data["zero_collectives"] = dict(self.zero_collectives)
        return data


def shapes_of(module: torch.nn.Module) -> list[list[tuple[int, ...]]]:
    """The shapes of ``module``'s trainable parameters, as one param group
    (a module on the ``meta`` device works: nothing is allocated)."""
    return [[tuple(p.shape) for p in module.parameters() if p.requires_grad]]


def _state_bytes(
    plan: ShardPlan, rank: int, model: OptimizerModel, itemsize: int, chunked: bool
) -> int:
    """The local optimizer's state on ``rank``: one stepped tensor per owned
    parameter, or (flat) per owned piece of a parameter, or per cache-sized
    chunk of it (see :func:`zerofn.zero.planning.chunks.chunk_sources`)."""
    partition = plan.partition
    if isinstance(partition, FlatPartition):
        pieces = [p.numel for g in partition.group_pieces_of(rank) for p in g if p.numel]
        tensors = [c for n in pieces for c in (chunk_sizes(n, itemsize) if chunked else (n,))]
    else:
        sizes = partition.sizes
        tensors = [sizes[i] for i in partition.params_of(rank)]
    return sum(model.elementwise_states * n * itemsize + model.scalar_bytes for n in tensors)


def _hook_payload(shapes: list[Sequence[int]], hook: HookKind, rank: int, itemsize: int) -> int:
    """Bytes one rank hands to the hook's all-reduces per step."""
    numel = sum(math.prod(s) for s in shapes)
    if hook == "allreduce":
        return numel * itemsize
    if hook == "fp16":
        return numel * 2
    # PowerSGD's own decisions, at PyTorch's default min_compression_rate; a
    # gradient's cost does not depend on which bucket it is in.
    min_rate = PowerSGDConfig(rank).min_compression_rate
    return bucket_layout(shapes, rank, min_rate).sent_numel * itemsize


def _exchange_bytes(plan: ShardPlan, itemsize: int, quantizer: BlockQuantizer | None) -> int:
    """The bytes of one exchange buffer set: values, or compressed payloads."""
    if quantizer is None:
        return sum(ly.numel for ly in plan.layouts) * itemsize
    return exchange_bytes(quantizer, plan)


def _zero_traffic(
    plan: ShardPlan, backend: Backend, itemsize: int, quantizer: BlockQuantizer | None
) -> tuple[dict[str, int], dict[str, int]]:
    """(collectives, payload bytes) of the ZeRO step's exchange, per kind."""
    if backend == "nccl":  # one all-gather per buffer; the payload is one segment
        return {"all_gather": len(plan.layouts)}, {}
    broadcasts = sum(1 for ly in plan.layouts for s in ly.segments if s.length)
    return {"broadcast": broadcasts}, {"broadcast": _exchange_bytes(plan, itemsize, quantizer)}


def _checked_groups(
    shapes: Shapes | torch.nn.Module, optimizer: str, hook: str, powersgd_rank: int
) -> Shapes:
    """The shapes per param group, once the arguments are known good."""
    groups = shapes_of(shapes) if isinstance(shapes, torch.nn.Module) else shapes
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZERS)}")
    if hook not in get_args(HookKind):
        raise ValueError(f"unknown hook {hook!r}; choose from {get_args(HookKind)}")
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be an int of at least 1, got {powersgd_rank!r}")
    if not any(groups):
        raise ValueError("the model has no trainable parameters")
    return groups


def _rank_bytes(
    plan: ShardPlan,
    itemsize: int,
    masters: torch.dtype | None,
    model: OptimizerModel,
    bucket_view: bool,
    flat_chunks: bool,
    quantizer: BlockQuantizer | None,
    redundancy: int = 1,
    kept_gradients: bool = False,
) -> tuple[RankBytes, ...]:
    """Every rank's bytes by kind under ``plan`` (with ``redundancy=2`` rank
    ``r`` carries rank ``r - 1``'s shard: its values, or masters, and
    optimizer state; with ``kept_gradients``, each rank keeps a copy of its
    gradients beside an exchange in flight)."""
    numel = sum(plan.partition.loads())
    state_itemsize = itemsize if masters is None else torch.empty((), dtype=masters).element_size()
    buffers = 0 if bucket_view else sum(ly.numel for ly in plan.layouts) * itemsize
    if quantizer is not None:  # payloads and scratch, beside the exchange buffers
        buffers += compressed_buffer_bytes(quantizer, plan)
    return tuple(
        RankBytes(
            parameters=numel * itemsize,
            gradients=numel * itemsize,
            kept_gradients=numel * itemsize if kept_gradients else 0,
            master_weights=plan.partition.loads()[r] * state_itemsize if masters else 0,
            optimizer_state=_state_bytes(plan, r, model, state_itemsize, flat_chunks),
            exchange_buffers=buffers,
            carried=(
                _carried_bytes(plan, r, model, state_itemsize, flat_chunks)
                if redundancy == 2
                else 0
            ),
        )
        for r in range(plan.world_size)
    )


def _carried_bytes(
    plan: ShardPlan, rank: int, model: OptimizerModel, itemsize: int, flat_chunks: bool
) -> int:
    """The copy of :func:`~zerofn.zero.elastic.redundancy.carried_owner`'s shard:
    its values (its masters, with master copies) and its optimizer state,
    both of ``itemsize`` bytes an element."""
    owner = carried_owner(rank, plan.world_size)
    values = plan.partition.loads()[owner] * itemsize
    return values + _state_bytes(plan, owner, model, itemsize, flat_chunks)


def plan_footprint(
    shapes: Shapes | torch.nn.Module,
    world_size: int,
    partition: PartitionMode = "greedy",
    *,
    param_dtype: torch.dtype = torch.float32,
    master_dtype: torch.dtype | None = None,
    optimizer: str = "adam",
    hook: HookKind = "allreduce",
    powersgd_rank: int = 1,
    bucket_view: bool | None = None,
    backend: Backend = "gloo",
    flat_chunks: bool = True,
    exchange_compression: str | None = None,
    redundancy: int = 1,
    gather_during_forward: bool = False,
) -> Footprint:
    """Every rank's bytes by kind, and the bytes and collectives of a step.

    Args:
        shapes: parameter shapes per param group, or a module.
        world_size: number of ranks.
        partition: ``"greedy"``, ``"balanced"`` or ``"flat"``.
        param_dtype: dtype of parameters and gradients (and of the optimizer
            state without masters).
        master_dtype: keep master weights of each rank's shard in this
            dtype, and the optimizer state with them (``ZeroRedundancyOptimizer``'s
            ``master_dtype``); ``None`` or ``param_dtype``: none.
        optimizer: a key of :data:`OPTIMIZERS`.
        hook: DDP's communication hook (``"allreduce"`` is DDP's default).
        powersgd_rank: the rank of PowerSGD's factors (``r``: a compressed
            ``n x m`` gradient sends ``r (n + m)`` elements); read only with
            ``hook="powersgd"``.
        bucket_view: ``parameters_as_bucket_view``; ``None`` (the default)
            follows the optimizer's default: on under ``"flat"``, off otherwise.
        backend: ``"gloo"`` (broadcasts) or ``"nccl"`` (one all-gather).
        flat_chunks: under ``"flat"``, the optimizer steps the shard in
            cache-sized chunks, one scalar state each (what the adapter does
            on CPU without ``foreach``/``fused``).
        exchange_compression: ``"int8"`` or ``"int4"``: the exchange sends
            block-quantized differences, and each rank keeps masters of its
            shard (float32 unless ``master_dtype`` says otherwise).
        redundancy: ``2``: every rank also carries the next-lower rank's
            shard (``ZeroRedundancyOptimizer(redundancy=2)``): for fp32 Adam
            ``4 + 4 + 20/d`` bytes per parameter against ``4 + 4 + 8/d``
            (plus the exchange buffers either way).
        gather_during_forward: the exchange runs behind the next forward
            (``ZeroRedundancyOptimizer(gather_during_forward=True)``); with
            ``redundancy=2`` each rank keeps a copy of the gradients its local
            step took until the exchange lands (``kept_gradients``).

    Returns:
        The :class:`Footprint`.

    Raises:
        ValueError: an unknown optimizer, hook, partition or compression;
            no parameters; a ``powersgd_rank`` below 1; a ``redundancy``
            the optimizer refuses.
    """
    groups = _checked_groups(shapes, optimizer, hook, powersgd_rank)
    flat_shapes = [s for g in groups for s in g]
    sizes = [[math.prod(s) for s in g] for g in groups]
    plan = plan_shards(
        sizes, ["p"] * len(flat_shapes), [True] * len(flat_shapes), world_size, partition
    )
    quantizer = resolve_compression(exchange_compression, param_dtype)
    masters = (
        resolve_master_dtype(param_dtype, master_dtype)
        if quantizer is None
        else compression_master_dtype(param_dtype, master_dtype)
    )
    itemsize = torch.empty((), dtype=param_dtype).element_size()
    if bucket_view is None:
        bucket_view = partition == "flat"
    model = OPTIMIZERS[optimizer]
    check_redundancy(redundancy, world_size)
    ranks = _rank_bytes(
        plan,
        itemsize,
        masters,
        model,
        bucket_view,
        flat_chunks,
        quantizer,
        redundancy,
        kept_gradients=redundancy == 2 and gather_during_forward,
    )
    collectives, payload = _zero_traffic(plan, backend, itemsize, quantizer)
    payload["all_reduce"] = _hook_payload(flat_shapes, hook, powersgd_rank, itemsize)
    return Footprint(
        numel=sum(sum(g) for g in sizes),
        world_size=world_size,
        partition=partition,
        param_dtype=str(param_dtype).removeprefix("torch."),
        master_dtype=str(masters).removeprefix("torch.") if masters else None,
        optimizer=optimizer,
        hook=hook,
        ranks=ranks,
        payload_bytes=tuple(sorted(payload.items())),
        zero_collectives=tuple(sorted(collectives.items())),
        powersgd_rank=powersgd_rank if hook == "powersgd" else None,
        exchange_compression=exchange_compression,
    )
