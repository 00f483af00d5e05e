"""Code lines of zerofn's features against PyTorch's modules for the same features.

A *code line* is a line that holds at least one token other than a comment or
whitespace, and that no docstring spans (a docstring: the first statement of a
module, class or function body, when it is a string expression). Lines are
counted per file with :mod:`tokenize` and :mod:`ast`, and summed per feature.
zerofn's files are found from the repository root, PyTorch's from the installed
``torch`` package; every pattern must match a file and every exclusion must
name one, or the count fails (a renamed file must not silently drop out).

:data:`FEATURES` holds every choice; the rule is to count only what both sides
have, and each side's whole implementation of it:

* ZeRO + overlap with DDP: zerofn's ZeRO core and adapter, the overlap core and
  its hook, against ``zero_redundancy_optimizer.py`` and ``ddp_zero_hook.py``.
  Left out on our side: sharded checkpoints, the compressed exchange and
  redundant shards with their regrouping (PyTorch has none) and the loss
  scaler (PyTorch's ZeRO has none); mixed-precision masters, gradient
  clipping and the flat partition stay in, since they are woven through the
  ZeRO modules. Left out on PyTorch's: the ``.pyi`` stub (signatures again),
  the functional optimizers and ``_optimizer_overlap`` (an unsharded
  optimizer run in DDP's hook, a feature zerofn has not got).
* communication hooks: averaging, fp16/bf16 and their wrappers, per-tensor and
  per-channel quantization, the no-op hook and post-local SGD's hook, with the
  shared hook machinery (``hook.py``, ``gather.py``, ``error_feedback.py``,
  which PowerSGD also uses). Left out on our side: top-k and random-k
  sparsification (PyTorch has neither). Left out on PyTorch's:
  ``__init__.py`` (``DDPCommHookType`` and ``register_ddp_comm_hook``, which
  zerofn does not offer), ``mixed_precision_hooks.py`` (DDP's internal
  upcasting hook) and ``optimizer_overlap_hooks.py`` (the unsharded
  optimizer in the hook).
* PowerSGD: zerofn's PowerSGD package and its hooks against ``powerSGD_hook.py``.
* model averaging: periodic and hierarchical averagers and the post-local SGD
  optimizer, on both sides.
* Join: the join context and its hooks, on both sides.

Shared runtime (``adapters/zerofn_torch/runtime``, ``zerofn/comm.py``) is
left out of every feature, as PyTorch's c10d and DDP's reducer are.

A second table says what the counted lines hold that PyTorch's do not
(:data:`BEYOND`): behaviour woven through shared modules, named by file or by
top-level definition; each name must exist and no line may be in two rows, or
the count fails. A third takes those rows out of each feature and sets what
is left, the code of the features both have, against PyTorch's count: at most
2.0x is the target. Imports count like any other line: a module for each idea
costs its imports.

Run ``python benchmarks/code_lines.py`` to print the table (``--write``: and
write it into ``docs/design.md``'s block ``code-lines``, as every ``make bench``
does).
"""

from __future__ import annotations

import argparse
import ast
import glob
import io
import os
import tokenize

import attrs
import torch
from blocks import rewrite_block
from report import md_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE, BLOCK = "docs/design.md", "code-lines"
"""Where the table is quoted: the page and its block."""
"""The repository root, where zerofn's paths start."""

TORCH = os.path.dirname(torch.__file__)
"""The installed ``torch`` package, where PyTorch's paths start."""


@attrs.frozen
class Feature:
    """One row of the table: a feature and each side's files for it.

    Attributes:
        name: the row's words.
        ours: glob patterns under the repository root.
        ours_minus: paths under the repository root the patterns match but the
            feature leaves out.
        theirs: glob patterns under the ``torch`` package.
    """

    name: str
    ours: tuple[str, ...]
    ours_minus: tuple[str, ...]
    theirs: tuple[str, ...]


_HOOKS = "distributed/algorithms/ddp_comm_hooks/"

FEATURES: tuple[Feature, ...] = (
    Feature(
        "ZeRO + overlap with DDP",
        ours=(
            "zerofn/zero/*.py",
            "zerofn/zero/*/*.py",
            "zerofn/overlap/*.py",
            "adapters/zerofn_torch/zero/*.py",
            "adapters/zerofn_torch/hooks/overlap.py",
        ),
        ours_minus=(
            "zerofn/zero/checkpoint/sharded.py",
            "zerofn/zero/checkpoint/manifest.py",
            "zerofn/zero/checkpoint/run.py",
            "zerofn/zero/compressed/exchange.py",
            "zerofn/zero/compressed/finish.py",
            "zerofn/zero/compressed/payloads.py",
            "zerofn/zero/elastic/carried.py",
            "zerofn/zero/elastic/redundancy.py",
            "zerofn/zero/elastic/piece_state.py",
            "zerofn/zero/elastic/regroup.py",
            "zerofn/zero/mixed_precision/loss_scale.py",
            "adapters/zerofn_torch/zero/loss_scaling.py",
        ),
        theirs=("distributed/optim/zero_redundancy_optimizer.py", _HOOKS + "ddp_zero_hook.py"),
    ),
    Feature(
        "communication hooks (default, quantization, post-local SGD)",
        ours=(
            "zerofn/hooks/*.py",
            "adapters/zerofn_torch/hooks/__init__.py",
            "adapters/zerofn_torch/hooks/default.py",
            "adapters/zerofn_torch/hooks/post_local_sgd.py",
        ),
        ours_minus=("zerofn/hooks/random_k.py", "zerofn/hooks/sparsify.py"),
        theirs=(
            _HOOKS + "default_hooks.py",
            _HOOKS + "quantization_hooks.py",
            _HOOKS + "debugging_hooks.py",
            _HOOKS + "post_localSGD_hook.py",
        ),
    ),
    Feature(
        "PowerSGD",
        ours=("zerofn/hooks/powersgd/*.py", "adapters/zerofn_torch/hooks/powersgd.py"),
        ours_minus=(),
        theirs=(_HOOKS + "powerSGD_hook.py",),
    ),
    Feature(
        "model averaging",
        ours=("zerofn/averaging.py", "adapters/zerofn_torch/averaging.py"),
        ours_minus=(),
        theirs=(
            "distributed/algorithms/model_averaging/*.py",
            "distributed/optim/post_localSGD_optimizer.py",
        ),
    ),
    Feature(
        "Join",
        ours=("zerofn/join.py", "adapters/zerofn_torch/join.py"),
        ours_minus=(),
        theirs=("distributed/algorithms/join.py",),
    ),
)
"""Every feature counted, in the table's order."""


@attrs.frozen
class Beyond:
    """Behaviour zerofn has and PyTorch's counted modules have not, inside
    the files of one :class:`Feature`.

    Attributes:
        name: the row's words.
        feature: the name of the :class:`Feature` whose files hold it.
        files: files (under the repository root) that hold only it.
        definitions: ``"path:name"`` of top-level functions, classes and
            assignments, or ``"path:Class.method"`` of methods, that hold only it.
    """

    name: str
    feature: str
    files: tuple[str, ...] = ()
    definitions: tuple[str, ...] = ()


_ZERO, _HOOK_ROW, _POWERSGD = (f.name for f in FEATURES[:3])
_OPTIMIZER = "adapters/zerofn_torch/zero/optimizer.py"
_PSGD_ADAPTER = "adapters/zerofn_torch/hooks/powersgd.py"


def _in(path: str, *names: str) -> tuple[str, ...]:
    """``names`` of the file ``path``, as :attr:`Beyond.definitions` lists them."""
    return tuple(f"{path}:{name}" for name in names)


BEYOND: tuple[Beyond, ...] = (
    Beyond(
        "the flat partition (tensors cut at the ranks' seams, stepped in chunks)",
        _ZERO,
        files=("zerofn/zero/planning/chunks.py",),
        definitions=(
            *_in("zerofn/zero/planning/partition.py", "Piece", "FlatPartition", "flat_partition"),
            *_in("zerofn/zero/shards.py", "FlatShards"),
            *_in(
                "zerofn/zero/shard_state.py", "_consolidate_flat", "_shard_flat", "is_elementwise"
            ),
            *_in(
                "zerofn/zero/optimizers.py",
                "ELEMENTWISE_OPTIMIZERS",
                "check_elementwise",
                "steps_in_parts",
            ),
        ),
    ),
    Beyond(
        "the balanced and manual partitions",
        _ZERO,
        definitions=(
            *_in(
                "zerofn/zero/planning/partition.py",
                "manual_partition",
                "_largest_first",
                "_improve",
                "_best_swap",
                "balanced_partition",
            ),
            *_in("zerofn/zero/params.py", "manual_indices"),
        ),
    ),
    Beyond(
        "master weights, gradient clipping and unscaling",
        _ZERO,
        files=(
            "zerofn/zero/mixed_precision/masters.py",
            "zerofn/zero/mixed_precision/precision.py",
            "adapters/zerofn_torch/zero/gradients.py",
        ),
        definitions=(
            *_in("zerofn/zero/step.py", "finish_masters"),
            *_in("zerofn/zero/rank_state.py", "_load_masters"),
        ),
    ),
    Beyond(
        "the compressed exchange's options (its codec, and the masters it keeps)",
        _ZERO,
        definitions=_in(
            "zerofn/zero/options.py", "resolve_compression", "compression_master_dtype"
        ),
    ),
    Beyond(
        "the compressed exchange's overlapped path",
        _ZERO,
        definitions=(
            *_in("zerofn/overlap/step.py", "broadcast_differences_from_owners"),
            *_in("zerofn/overlap/orders.py", "SendCompressed"),
            *_in("zerofn/zero/hook_driven.py", "send_compressed"),
            *_in("adapters/zerofn_torch/zero/overlap_binding.py", "HookDriven._send_compressed"),
        ),
    ),
    Beyond(
        "the overlapped step with redundancy=2 (every bucket averaged, the whole step after it)",
        _ZERO,
        definitions=(
            *_in("zerofn/zero/rank.py", "ZeroRank.steps_whole_in_hook", "_whole_in_hook"),
            *_in("adapters/zerofn_torch/hooks/overlap.py", "_OverlapRunner._step_whole"),
            *_in("adapters/zerofn_torch/hooks/overlap.py", "_check_whole_step"),
            *_in("adapters/zerofn_torch/zero/overlap_binding.py", "HookDriven._step_whole"),
        ),
    ),
    Beyond(
        "the exchange behind the next forward (gather_during_forward: pieces in the forward's "
        "order, each module's wait)",
        _ZERO,
        files=("zerofn/zero/forward_gather.py", "adapters/zerofn_torch/zero/forward_gather.py"),
        definitions=(
            *_in("zerofn/overlap/step.py", "send_pieces", "broadcast_in_forward_order"),
            *_in("zerofn/overlap/orders.py", "_sends_behind_forward"),
            *_in("zerofn/zero/shards.py", "WholeTensorShards.unpack_range"),
            *_in(
                "adapters/zerofn_torch/zero/overlap_binding.py",
                "HookDriven._sends_order",
                "HookDriven._sends_behind_forward",
            ),
        ),
    ),
    Beyond(
        "going on in another world (zerofn_torch.elastic's side of the optimizer)",
        _ZERO,
        files=("adapters/zerofn_torch/zero/world_changes.py",),
        definitions=_in("adapters/zerofn_torch/zero/shell_state.py", "ShellState._counted"),
    ),
    Beyond(
        "memory accounting per rank",
        _ZERO,
        definitions=(
            *_in("zerofn/zero/rank.py", "memory_bytes", "_nbytes", "_state_bytes"),
            *_in(_OPTIMIZER, "ZeroRedundancyOptimizer.memory_bytes"),
        ),
    ),
    Beyond(
        "error feedback around any hook",
        _HOOK_ROW,
        definitions=_in(
            "zerofn/hooks/error_feedback.py",
            "ErrorFeedbackState",
            "error_feedback",
            "remembered_error",
            "decoded_on_one_rank",
            "run_alone",
            "_fulfil_alone",
        ),
    ),
    Beyond(
        "codecs that draw shared random numbers (random-k's)",
        _HOOK_ROW,
        definitions=_in(
            "zerofn/hooks/gather.py",
            "_non_negative_int",
            "SharedStream",
            "StreamState",
            "next_iteration",
            "SharedRandomCodec",
            "shared_random_hook",
        ),
    ),
    Beyond(
        "state kept per parameter across DDP's bucket rebuilds",
        _POWERSGD,
        definitions=(
            *_in(
                "zerofn/hooks/powersgd/keys.py",
                "KeyFinder",
                "tracked",
                "bucket_keys",
                "finish_key_iteration",
            ),
            *_in(
                "zerofn/hooks/powersgd/state.py",
                "UNCLAIMED",
                "memories",
                "_by_key",
                "_check_shape",
                "claim",
                "with_parameter_keys",
                "claim_parameters",
                "_parameter_count",
                "_square_for",
                "_without",
                "_unclaimed",
            ),
            # Factors kept per parameter key, and the random starts of an
            # iteration on other buckets drawn by the layout before it.
            *_in(
                "zerofn/hooks/powersgd/layerwise.py",
                "_keyed",
                "_grouped",
                "_draw_ahead",
                "_differs_from_reference",
            ),
            # A square kept for parameters that come back in another order.
            *_in(
                "zerofn/hooks/powersgd/batched.py", "_square_order", "_permuted", "_restored_order"
            ),
            *_in(_PSGD_ADAPTER, "PowerSGDState.track_parameters"),
        ),
    ),
    Beyond(
        "versioned weights-only state dicts (PyTorch's pickling stays in its count)",
        _POWERSGD,
        files=("zerofn/hooks/powersgd/checkpoint.py",),
        definitions=_in(_PSGD_ADAPTER, "PowerSGDState.state_dict", "PowerSGDState.load_state_dict"),
    ),
    Beyond(
        "PyTorch's attribute names as read-only views of the records",
        _POWERSGD,
        definitions=_in(
            _PSGD_ADAPTER,
            "_ReadOnlyDict",
            "_View",
            "_by_bucket",
            "_config",
            "_PYTORCH_SLOTS",
            "_PYTORCH_NAMES",
        ),
    ),
)
"""What zerofn's counted lines hold beyond PyTorch's, in the second table's order."""

_NOT_CODE = frozenset(
    {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
)


def docstring_lines(tree: ast.AST) -> set[int]:
    """Every line a docstring of ``tree`` spans (1-based)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            end = first.end_lineno if first.end_lineno is not None else first.lineno
            lines.update(range(first.lineno, end + 1))
    return lines


def count_code_lines(source: str) -> int:
    """The code lines of Python source ``source`` (see the module's docstring).

    A token spanning several lines (a multi-line string that is no docstring)
    makes each of them a code line.
    """
    return len(code_line_numbers(source))


def code_line_numbers(source: str) -> set[int]:
    """The numbers (1-based) of ``source``'s code lines."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstring_lines(ast.parse(source))


def top_level_spans(tree: ast.Module) -> dict[str, range]:
    """Each top-level function, class and assigned name of ``tree``, and each
    method as ``"Class.method"``, with the lines it spans (decorators included)."""
    spans: dict[str, range] = {}
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        for name in names:
            spans[name] = _span(node)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    spans[f"{node.name}.{member.name}"] = _span(member)
    return spans


def _span(node: ast.stmt) -> range:
    decorators = getattr(node, "decorator_list", [])
    start = min([d.lineno for d in decorators] + [node.lineno])
    return range(start, (node.end_lineno or node.lineno) + 1)


def resolve(base: str, patterns: tuple[str, ...], minus: tuple[str, ...] = ()) -> list[str]:
    """The files ``patterns`` match under ``base``, less ``minus``, sorted.

    Raises:
        FileNotFoundError: a pattern matches no file, or an exclusion names
            none of the matched files.
    """
    found: set[str] = set()
    for pattern in patterns:
        matched = glob.glob(os.path.join(base, pattern))
        if not matched:
            raise FileNotFoundError(f"{pattern!r} matches no file under {base}")
        found.update(os.path.relpath(path, base) for path in matched)
    for path in minus:
        if path not in found:
            raise FileNotFoundError(f"{path!r} is left out but no pattern matches it")
    return sorted(found - set(minus))


def count_files(base: str, paths: list[str]) -> int:
    """The code lines of the files ``paths`` under ``base``, summed."""
    total = 0
    for path in paths:
        with open(os.path.join(base, path), encoding="utf-8") as f:
            total += count_code_lines(f.read())
    return total


def counts() -> list[tuple[str, int, int]]:
    """Each feature's name, zerofn's code lines and PyTorch's, in table order."""
    return [
        (
            feature.name,
            count_files(ROOT, resolve(ROOT, feature.ours, feature.ours_minus)),
            count_files(TORCH, resolve(TORCH, feature.theirs)),
        )
        for feature in FEATURES
    ]


def _parsed(base: str, path: str) -> tuple[set[int], ast.Module]:
    with open(os.path.join(base, path), encoding="utf-8") as f:
        source = f.read()
    return code_line_numbers(source), ast.parse(source)


def beyond_counts() -> list[tuple[str, str, int]]:
    """Each row of :data:`BEYOND`: its words, its feature and its code lines.

    Raises:
        LookupError: a row names a file outside its feature's count, or a
            definition its file does not have, or two rows claim one line.
    """
    counted = {f.name: set(resolve(ROOT, f.ours, f.ours_minus)) for f in FEATURES}
    parsed: dict[str, tuple[set[int], ast.Module]] = {}

    def read(path: str, feature: str) -> tuple[set[int], ast.Module]:
        # Many rows name definitions of one file: each file is parsed once.
        if path not in counted[feature]:
            raise LookupError(f"{path!r} is not counted in {feature!r}")
        if path not in parsed:
            parsed[path] = _parsed(ROOT, path)
        return parsed[path]

    claimed: set[tuple[str, int]] = set()
    rows = []
    for row in BEYOND:
        lines: set[tuple[str, int]] = set()
        for path in row.files:
            code, _ = read(path, row.feature)
            lines.update((path, n) for n in code)
        for definition in row.definitions:
            path, name = definition.split(":")
            code, tree = read(path, row.feature)
            span = top_level_spans(tree).get(name)
            if span is None:
                raise LookupError(f"{path} has no top-level {name!r}")
            lines.update((path, n) for n in code.intersection(span))
        if lines & claimed:
            raise LookupError(f"{row.name!r} claims lines another row claims")
        claimed |= lines
        rows.append((row.name, row.feature, len(lines)))
    return rows


def beyond_tables(found: list[tuple[str, int, int]]) -> str:
    """The second and third tables: each row of :data:`BEYOND`, then per
    feature what is left of zerofn's count without them, against PyTorch's
    count.

    Args:
        found: :func:`counts`' rows.
    """
    behaviour = beyond_counts()
    rows: list[list[object]] = [[name, feature, n] for name, feature, n in behaviour]
    rows.append(["total", "", sum(n for _, _, n in behaviour)])
    per_feature: list[list[object]] = []
    sums = [0, 0, 0, 0]
    for name, ours, theirs in found:
        beyond = sum(n for _, row_feature, n in behaviour if row_feature == name)
        left = ours - beyond
        per_feature.append([name, ours, beyond, left, theirs, f"{left / theirs:.2f}x"])
        sums = [a + b for a, b in zip(sums, (ours, beyond, left, theirs), strict=True)]
    per_feature.append(["total", *sums, f"{sums[2] / sums[3]:.2f}x"])
    header = ["feature", "zerofn", "behaviour beyond", "left", "PyTorch", "ratio left"]
    return (
        md_table(["what zerofn's count holds beyond PyTorch's", "feature", "code lines"], rows)
        + "\n\n"
        + md_table(header, per_feature)
    )


def table() -> str:
    """The Markdown tables ``make bench`` writes into ``docs/design.md``:
    feature, zerofn's code lines, PyTorch's, and their ratio, with a total;
    then :func:`beyond_tables`."""
    found = counts()
    total = ("total", sum(c[1] for c in found), sum(c[2] for c in found))
    rows = [[name, ours, theirs, f"{ours / theirs:.2f}x"] for name, ours, theirs in [*found, total]]
    version = torch.__version__.split("+")[0]
    main = md_table(["feature", "zerofn code lines", "PyTorch code lines", "ratio"], rows)
    return (
        f"_Counted by `benchmarks/code_lines.py` against torch {version}._\n\n{main}\n\n"
        + beyond_tables(found)
    )


def main(argv: list[str] | None = None) -> None:
    """Print :func:`table`; with ``--write``, also write it into ``docs/design.md``.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--write", action="store_true", help="also rewrite docs/design.md's code-lines block"
    )
    args = parser.parse_args(argv)
    print(table())
    if args.write:
        rewrite_block(os.path.join(ROOT, PAGE), BLOCK, table())
        print(f"(written into {PAGE})")


if __name__ == "__main__":
    main()
