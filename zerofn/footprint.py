"""Capacity planning: what each rank holds and sends, before anything runs.

:func:`plan_footprint` answers "does this model fit on N ranks with this
partition?" from parameter shapes alone (or any ``nn.Module``, including one
built on the ``meta`` device, which allocates nothing). Every number is
exact and comes from the same core functions the adapter uses (partition,
buffer layouts, PowerSGD's compression decisions), so it equals what
``zerofn_torch`` allocates and sends; the tests check that on live ranks.

Run it as a program::

    python -m zerofn.footprint --model gpt2-small --world-size 8 --world-size 64 \\
        --partition flat --param-dtype bf16

What it counts, per rank: **parameters** (every rank holds the whole model),
**gradients** (DDP's gradient buckets, one per parameter element),
**master weights** (with ``master_dtype``, the rank's shard),
**optimizer state** (only the rank's shard, plus per-tensor scalars such as
Adam's step), **exchange buffers** (the flat buffers the ZeRO step exchanges
through; with ``bucket_view``, the default under ``flat``, the parameters
live in them, so nothing extra). And per step: the payload bytes each kind
of collective carries on this rank, and how many collectives the ZeRO step
issues.

The command prints one Markdown table row per world size and partition, its
columns listed in :data:`COLUMNS` (each a :class:`Column`: a header and how
to read its cell from a :class:`Footprint`); ``--json`` prints the records.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import attrs
import torch

from zerofn.blockquant import BlockQuantizer
from zerofn.diloco.footprint import outer_state_bytes_per_rank
from zerofn.hooks.powersgd import PowerSGDConfig, bucket_layout
from zerofn.model_shapes import MODELS
from zerofn.zero.chunks import chunk_sizes
from zerofn.zero.compressed_exchange import (
    compressed_buffer_bytes,
    compression_master_dtype,
    exchange_bytes,
    resolve_compression,
)
from zerofn.zero.partition import FlatPartition, PartitionMode
from zerofn.zero.plan import ShardPlan, plan_shards
from zerofn.zero.precision import resolve_master_dtype

__all__ = [
    "COLUMNS",
    "OPTIMIZERS",
    "Column",
    "Footprint",
    "HookKind",
    "OptimizerModel",
    "RankBytes",
    "main",
    "plan_footprint",
    "shapes_of",
    "table",
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
    """One rank's bytes by kind."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    exchange_buffers: int

    @property
    def total(self) -> int:
        """All of it."""
        return (
            self.parameters
            + self.gradients
            + self.master_weights
            + self.optimizer_state
            + self.exchange_buffers
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
            ``zerofn_torch.traffic.collective_traffic`` counts them).
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
    chunk of it (see :func:`zerofn.zero.chunks.chunk_sources`)."""
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
) -> tuple[RankBytes, ...]:
    """Every rank's bytes by kind under ``plan``."""
    numel = sum(plan.partition.loads())
    state_itemsize = itemsize if masters is None else torch.empty((), dtype=masters).element_size()
    buffers = 0 if bucket_view else sum(ly.numel for ly in plan.layouts) * itemsize
    if quantizer is not None:  # payloads and scratch, beside the exchange buffers
        buffers += compressed_buffer_bytes(quantizer, plan)
    return tuple(
        RankBytes(
            parameters=numel * itemsize,
            gradients=numel * itemsize,
            master_weights=plan.partition.loads()[r] * state_itemsize if masters else 0,
            optimizer_state=_state_bytes(plan, r, model, state_itemsize, flat_chunks),
            exchange_buffers=buffers,
        )
        for r in range(plan.world_size)
    )


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

    Returns:
        The :class:`Footprint`.

    Raises:
        ValueError: an unknown optimizer, hook, partition or compression;
            no parameters; a ``powersgd_rank`` below 1.
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
    ranks = _rank_bytes(plan, itemsize, masters, model, bucket_view, flat_chunks, quantizer)
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


# ----- the command line ----------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _UsageError(ValueError):
    """A command-line argument the planner cannot use (reported as a usage error)."""


def _factory(model: str) -> Any:
    """The ``factory`` callable named by ``model``, ``"pkg.module:factory"``.

    Raises:
        _UsageError: ``model`` has no ``:``, its module cannot be imported,
            lacks the attribute, or the attribute is not callable without
            arguments.
    """
    module_name, sep, name = model.partition(":")
    if not sep or not module_name or not name:
        raise _UsageError(
            f"--model: {model!r} is neither one of {sorted(MODELS)} nor pkg.module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # the module, or something it imports, is missing
        raise _UsageError(
            f"--model {model}: cannot import module {module_name!r} ({e}); check the name "
            "and that its package is on PYTHONPATH"
        ) from e
    factory = getattr(module, name, None)
    if factory is None:
        raise _UsageError(f"--model {model}: module {module_name!r} has no attribute {name!r}")
    if not callable(factory):
        raise _UsageError(
            f"--model {model}: {name!r} is a {type(factory).__name__}, not a function "
            "returning an nn.Module"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError as e:  # it needs arguments the planner cannot give
        raise _UsageError(
            f"--model {model}: the factory must be callable with no arguments ({e}); "
            "wrap it in a function that passes them"
        ) from e
    except ValueError:  # no signature to read (a builtin): just call it
        pass
    return factory


def _load_shapes(model: str) -> Shapes:
    """The parameter shapes of a built-in model, or of the module that
    ``"pkg.module:factory"`` builds (on the meta device).

    Raises:
        _UsageError: ``model`` names no built-in model and no usable factory,
            or the factory returns something other than an ``nn.Module``.
    """
    if model in MODELS:
        return [list(MODELS[model]())]
    factory = _factory(model)
    with torch.device("meta"):  # builds the module without allocating it
        built = factory()
    if not isinstance(built, torch.nn.Module):
        raise _UsageError(
            f"--model {model}: the factory returned a {type(built).__name__}, not an nn.Module"
        )
    return shapes_of(built)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


@attrs.frozen
class Column:
    """One column of the planner's table.

    Attributes:
        header: the column's heading.
        cell: the cell's text for one footprint.
        numeric: right-aligned (numbers) or left-aligned (words).
    """

    header: str
    cell: Callable[[Footprint], str]
    numeric: bool = True


def _heaviest(part: Callable[[RankBytes], int]) -> Callable[[Footprint], str]:
    """A cell: one kind of the heaviest rank's bytes, in GiB."""
    return lambda f: _gib(part(f.ranks[f.heaviest]))


COLUMNS: tuple[Column, ...] = (
    Column("ranks", lambda f: str(f.world_size)),
    Column("partition", lambda f: f.partition, numeric=False),
    Column("params GiB", _heaviest(lambda r: r.parameters)),
    Column("grads GiB", _heaviest(lambda r: r.gradients)),
    Column("masters GiB", _heaviest(lambda r: r.master_weights)),
    Column("optimizer state GiB", _heaviest(lambda r: r.optimizer_state)),
    Column("exchange GiB", _heaviest(lambda r: r.exchange_buffers)),
    Column("total GiB (heaviest)", _heaviest(lambda r: r.total)),
    Column("bytes/param", lambda f: f"{f.bytes_per_parameter(f.heaviest):.2f}"),
    Column("lightest total GiB", lambda f: _gib(f.ranks[f.lightest].total)),
    Column("all-reduce MiB/step", lambda f: _mib(f.payload("all_reduce"))),
    Column("broadcast MiB/step", lambda f: _mib(f.payload("broadcast"))),
)
"""The table's columns, in order: the heaviest rank's bytes by kind, then the
payload one rank hands to each kind of collective per step (DDP's gradient
all-reduce, the ZeRO exchange's broadcasts)."""


def _diloco_column(fragments: int) -> Column:
    """DiLoCo's outer state on its heaviest rank (:mod:`zerofn.diloco.footprint`)."""

    def cell(f: Footprint) -> str:
        return _gib(outer_state_bytes_per_rank(f.numel, f.world_size, fragments))

    return Column(f"DiLoCo outer GiB (P={fragments})", cell)


def table(footprints: Sequence[Footprint], columns: Sequence[Column] = COLUMNS) -> str:
    """A Markdown table: one row per footprint, one column per ``columns``."""
    rows = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---:" if c.numeric else "---" for c in columns) + "|",
    ]
    rows.extend("| " + " | ".join(c.cell(f) for c in columns) + " |" for f in footprints)
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m zerofn.footprint``: see ``--help``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: with status 2 and a usage message on stderr, for an
            argument the planner cannot use (a ``--model`` that names no
            built-in model and no factory of an ``nn.Module``, a
            ``--world-size`` below 1, a ``--master-dtype`` narrower than
            ``--param-dtype``, a ``--powersgd-rank`` below 1 or without
            ``--hook powersgd``, a model without trainable parameters).
    """
    parser = argparse.ArgumentParser(
        prog="python -m zerofn.footprint", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--model", required=True, help=f"{sorted(MODELS)} or pkg.module:factory")
    parser.add_argument("--world-size", type=int, action="append", required=True)
    parser.add_argument("--partition", action="append", choices=get_args(PartitionMode))
    parser.add_argument("--param-dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument(
        "--master-dtype", choices=sorted(_DTYPES), help="keep master weights in this dtype"
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--hook", choices=get_args(HookKind), default="allreduce")
    parser.add_argument(
        "--powersgd-rank",
        type=int,
        metavar="N",
        help="rank of PowerSGD's factors, with --hook powersgd (default: 1)",
    )
    parser.add_argument(
        "--bucket-view",
        action=argparse.BooleanOptionalAction,
        help="parameters_as_bucket_view (default: on under flat, off otherwise)",
    )
    parser.add_argument(
        "--exchange-compression",
        choices=["int8", "int4"],
        help="the ZeRO exchange sends block-quantized differences (masters kept)",
    )
    parser.add_argument(
        "--diloco-fragments",
        type=int,
        metavar="P",
        help="add DiLoCo's outer state per rank (anchor and SGD momentum, sharded over the "
        "ranks, synced in P fragments)",
    )
    parser.add_argument("--json", action="store_true", help="the records as JSON")
    args = parser.parse_args(argv)
    bad_sizes = [n for n in args.world_size if n < 1]
    if bad_sizes:
        parser.error(f"--world-size must be at least 1, got {bad_sizes[0]}")
    if args.diloco_fragments is not None and args.diloco_fragments < 1:
        parser.error(f"--diloco-fragments must be at least 1, got {args.diloco_fragments}")
    if args.powersgd_rank is not None:
        if args.powersgd_rank < 1:
            parser.error(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
        if args.hook != "powersgd":
            parser.error(
                f"--powersgd-rank applies only to --hook powersgd (the hook is {args.hook})"
            )
    try:
        shapes = _load_shapes(args.model)
    except _UsageError as e:  # not the factory's own errors: those keep their traceback
        parser.error(str(e))
    try:
        footprints = [
            plan_footprint(
                shapes,
                n,
                mode,
                param_dtype=_DTYPES[args.param_dtype],
                master_dtype=_DTYPES[args.master_dtype] if args.master_dtype else None,
                optimizer=args.optimizer,
                hook=args.hook,
                powersgd_rank=args.powersgd_rank or 1,
                bucket_view=args.bucket_view,
                exchange_compression=args.exchange_compression,
            )
            for n in args.world_size
            for mode in args.partition or ["greedy"]
        ]
    except ValueError as e:  # plan_footprint refuses only what the arguments asked for
        parser.error(str(e))
    if args.json:
        json.dump([f.to_dict() for f in footprints], sys.stdout, indent=1)
        print()
        return
    masters = f", {args.master_dtype} masters" if args.master_dtype else ""
    if args.exchange_compression:
        masters += f", {args.exchange_compression} exchange"
    rank = footprints[0].powersgd_rank
    hook = f"{args.hook} hook" + (f" (rank {rank})" if rank is not None else "")
    print(
        f"{args.model}: {footprints[0].numel:,} parameters, {args.param_dtype}{masters}, "
        f"{args.optimizer}, {hook}"
    )
    columns = COLUMNS
    if args.diloco_fragments is not None:
        columns = (*COLUMNS, _diloco_column(args.diloco_fragments))
    print(table(footprints, columns))


if __name__ == "__main__":
    main()
