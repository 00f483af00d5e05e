"""The planner's command line: ``python -m zerofn.footprint``.

It plans for a built-in model (:data:`zerofn.model_shapes.MODELS`) or for the
module a ``pkg.module:factory`` builds on the ``meta`` device, at each world
size and partition asked for, and prints one Markdown table row per plan, its
columns listed in :data:`COLUMNS` (each a :class:`Column`: a header and how to
read its cell from a :class:`~zerofn.footprint.plan.Footprint`); ``--json``
prints the records.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

import attrs
import torch

from zerofn import footprint
from zerofn.diloco.config import Compression
from zerofn.diloco.footprint import outer_state_bytes_per_rank, sync_bytes_per_rank
from zerofn.footprint.plan import (
    OPTIMIZERS,
    Footprint,
    HookKind,
    RankBytes,
    Shapes,
    plan_footprint,
    shapes_of,
)
from zerofn.model_shapes import MODELS
from zerofn.topk import TopK
from zerofn.zero.planning.partition import PartitionMode

__all__ = ["COLUMNS", "Column", "main", "table"]

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


CARRIED = Column("carried GiB", _heaviest(lambda r: r.carried))
"""The copy of another rank's shard a rank carries (``--redundancy 2``)."""

KEPT = Column("kept grads GiB", _heaviest(lambda r: r.kept_gradients))
"""The gradients kept while the exchange is behind the forward
(``--redundancy 2 --gather-during-forward``)."""


DILOCO_CODECS: dict[str, Compression] = {
    "int8": "int8",
    "int4": "int4",
    "int2": "int2",
    "topk": TopK(density=0.02, bits=2),
}
"""What ``--diloco-compression`` names: DiLoCoOptimizer's ``compression``
(``topk``: the top 2% of each chunk of 2048, 2-bit values)."""


def _diloco_columns(
    fragments: int, compression: str | None, redundancy: int = 1
) -> tuple[Column, ...]:
    """DiLoCo's bytes per sync on its busiest rank, fp32 and with
    ``compression``, then its outer state on its heaviest rank (with the
    replica and residual a compressed sync keeps; with ``redundancy=2``, the
    carried copy and what a recovery reads), from :mod:`zerofn.diloco.footprint`."""

    def sync(name: str) -> Column:
        codec = DILOCO_CODECS.get(name)
        return Column(
            f"DiLoCo MiB/sync ({name})",
            lambda f: _mib(
                sync_bytes_per_rank(f.numel, f.world_size, fragments, codec, redundancy)
            ),
        )

    compressed = compression is not None

    def outer(f: Footprint) -> str:
        return _gib(
            outer_state_bytes_per_rank(
                f.numel, f.world_size, fragments, compressed, redundancy=redundancy
            )
        )

    syncs = (sync("fp32"),) + ((sync(compression),) if compression is not None else ())
    carried = ", redundancy 2" if redundancy == 2 else ""
    return (*syncs, Column(f"DiLoCo outer GiB (P={fragments}{carried})", outer))


def table(footprints: Sequence[Footprint], columns: Sequence[Column] = COLUMNS) -> str:
    """A Markdown table: one row per footprint, one column per ``columns``."""
    rows = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---:" if c.numeric else "---" for c in columns) + "|",
    ]
    rows.extend("| " + " | ".join(c.cell(f) for c in columns) + " |" for f in footprints)
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    """The command's arguments, as ``--help`` lists them."""
    doc = footprint.__doc__
    parser = argparse.ArgumentParser(
        prog="python -m zerofn.footprint", description=doc.splitlines()[0] if doc else None
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
        "--redundancy",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: every rank also carries the previous rank's shard (survives a lost rank)",
    )
    parser.add_argument(
        "--gather-during-forward",
        action="store_true",
        help="the exchange runs behind the next forward (with --redundancy 2 each rank keeps "
        "a copy of the gradients until it lands)",
    )
    parser.add_argument(
        "--diloco-fragments",
        type=int,
        metavar="P",
        help="add DiLoCo's bytes per sync and outer state per rank (anchor and SGD momentum, "
        "sharded over the ranks, synced in P fragments)",
    )
    parser.add_argument(
        "--diloco-compression",
        choices=sorted(DILOCO_CODECS),
        help="with --diloco-fragments: also the bytes per sync with this codec (topk: the top "
        "2%% of each chunk, 2-bit values), and the replica and residual it keeps",
    )
    parser.add_argument("--json", action="store_true", help="the records as JSON")
    return parser


def _refuse_bad_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for numbers argparse's types let through.

    Raises:
        SystemExit: a world size or DiLoCo fragment count below 1, or a
            PowerSGD rank below 1 or without ``--hook powersgd``.
    """
    bad_sizes = [n for n in args.world_size if n < 1]
    if bad_sizes:
        parser.error(f"--world-size must be at least 1, got {bad_sizes[0]}")
    if args.diloco_fragments is not None and args.diloco_fragments < 1:
        parser.error(f"--diloco-fragments must be at least 1, got {args.diloco_fragments}")
    if args.diloco_compression is not None and args.diloco_fragments is None:
        parser.error("--diloco-compression needs --diloco-fragments (e.g. --diloco-fragments 1)")
    if args.powersgd_rank is not None:
        if args.powersgd_rank < 1:
            parser.error(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
        if args.hook != "powersgd":
            parser.error(
                f"--powersgd-rank applies only to --hook powersgd (the hook is {args.hook})"
            )


def _plan_all(args: argparse.Namespace, shapes: Shapes) -> list[Footprint]:
    """One footprint per world size and partition the arguments name, in that order.

    Raises:
        ValueError: what :func:`~zerofn.footprint.plan.plan_footprint` refuses.
    """
    return [
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
            redundancy=args.redundancy,
            gather_during_forward=args.gather_during_forward,
        )
        for n in args.world_size
        for mode in args.partition or ["greedy"]
    ]


def _heading(args: argparse.Namespace, footprints: Sequence[Footprint]) -> str:
    """The line above the table: the model, its size and what it was planned with."""
    masters = f", {args.master_dtype} masters" if args.master_dtype else ""
    if args.exchange_compression:
        masters += f", {args.exchange_compression} exchange"
    rank = footprints[0].powersgd_rank
    hook = f"{args.hook} hook" + (f" (rank {rank})" if rank is not None else "")
    return (
        f"{args.model}: {footprints[0].numel:,} parameters, {args.param_dtype}{masters}, "
        f"{args.optimizer}, {hook}"
    )


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
    parser = _parser()
    args = parser.parse_args(argv)
    _refuse_bad_numbers(parser, args)
    try:
        shapes = _load_shapes(args.model)
    except _UsageError as e:  # not the factory's own errors: those keep their traceback
        parser.error(str(e))
    try:
        footprints = _plan_all(args, shapes)
    except ValueError as e:  # plan_footprint refuses only what the arguments asked for
        parser.error(str(e))
    if args.json:
        json.dump([f.to_dict() for f in footprints], sys.stdout, indent=1)
        print()
        return
    print(_heading(args, footprints))
    columns = COLUMNS
    if args.redundancy == 2:
        total = len(COLUMNS) - 5  # before the totals: the carried copy is part of them
        kept = (KEPT,) if args.gather_during_forward else ()
        columns = (*COLUMNS[:total], CARRIED, *kept, *COLUMNS[total:])
    if args.diloco_fragments is not None:
        diloco = _diloco_columns(args.diloco_fragments, args.diloco_compression, args.redundancy)
        columns = (*columns, *diloco)
    print(table(footprints, columns))
