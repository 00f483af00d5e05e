"""Mixed precision: bytes per parameter, exchange bytes and step time against PyTorch's ZeRO.

On 2 gloo ranks, a GPT-2-small-shaped model (plain tensors of
``zerofn.model_shapes.MODELS["gpt2-small"]``'s shapes, 124M parameters; no
forward pass: every parameter carries a fixed random gradient of its own
dtype, as DDP would leave the averaged one) is stepped once by each of:

a. PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer``, fp32
   parameters, Adam (its defaults: sorted-greedy ownership, no bucket view);
b. zerofn's ``ZeroRedundancyOptimizer``, fp32, ``partition="flat"``,
   ``parameters_as_bucket_view=True``;
c. the same with bf16 parameters and ``master_dtype=torch.float32`` (fp32
   master copy of the rank's shard, fp32 Adam state).

one after another, each freed before the next is built. After the step every
rank counts its bytes **from the live tensors**, by storage (views of one
buffer count once): the parameters, their ``.grad``, the local optimizer's
own parameters that are neither (the masters), the tensors in its state, and
whatever else the optimizer object still references ("other"). zerofn's
``opt.memory_bytes()`` is shown beside the count as a cross-check. Each is held
against the goal **2 + 2 + 12/d** (bf16 parameters and gradients, fp32 master
and two Adam moments on 1/d of the model) and PyTorch's **4 + 4 + 8/d**; the
same three set-ups are computed for d = 2 ... 1024 by
``zerofn.footprint.plan_footprint`` (heaviest rank).

The exchange is counted with ``zerofn_torch.runtime.traffic.collective_traffic`` over
one more step of each (bf16 parameters must move half the bytes of fp32).

Step time: (c) takes turns (``report.take_turns``) with (a) in the same
process group, per Adam kernel: the default per-tensor loop against PyTorch's
default set-up, and ``fused=True`` for both (PyTorch with its bucket view, its
fastest set-up) when this build has a CPU fused Adam. Ratios are taken round
by round: median [q1, q3].

``--quick`` runs a ~5M-parameter model of the same structure (the computed
table stays GPT-2 small: planning allocates nothing).
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from report import (
    Curve,
    Headline,
    Panel,
    Section,
    Spread,
    fmt_bytes,
    md_table,
    paired_ratios,
    standalone_main,
    take_turns,
)
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.footprint import plan_footprint
from zerofn.model_shapes import MODELS

Shape = tuple[int, ...]
WORLD_SIZE = 2
COMPUTED_WORLD_SIZES = (2, 8, 64, 1024)

# (key, label): the three set-ups whose bytes are measured.
SETUPS: tuple[tuple[str, str], ...] = (
    ("torch", "a. PyTorch ZeRO, fp32 (greedy, no bucket view)"),
    ("fp32", "b. zerofn, fp32 (flat, bucket view)"),
    ("bf16", "c. zerofn, bf16 + fp32 masters (flat, bucket view)"),
)
KINDS = ("parameters", "gradients", "masters", "optimizer_state", "other")


def gpt2_like(d: int, ff: int, vocab: int, ctx: int, layers: int) -> list[Shape]:
    """GPT-2's parameter shapes at other sizes (``gpt2_like(768, 3072, 50257,
    1024, 12)`` is ``MODELS["gpt2-small"]()``)."""
    shapes: list[Shape] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, ff), (ff,), (ff, d), (d,)]
    return [*shapes, (d,), (d,)]


def model_shapes(quick: bool) -> tuple[str, list[Shape]]:
    """The measured model: GPT-2 small, or (quick) ~5M parameters of its structure."""
    if quick:
        return "GPT-2-shaped, d=192, 4 layers", gpt2_like(192, 768, 16384, 256, 4)
    return "GPT-2 small", MODELS["gpt2-small"]()


def pytorch_formula(d: int) -> float:
    """PyTorch's ZeRO on fp32: parameters and gradients whole, Adam's two moments on 1/d."""
    return 4 + 4 + 8 / d


def target_formula(d: int) -> float:
    """bf16 parameters and gradients, fp32 master and two fp32 moments on 1/d."""
    return 2 + 2 + 12 / d


# ----------------------------------------------------------------------------
# Counting live tensors
# ----------------------------------------------------------------------------

_DESCEND = ("zerofn", "torch.optim", "torch.distributed.optim")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


Found = dict[tuple[str, int], tuple[int, str]]
"""Storage (device, address) -> (its bytes, the first path that reached it)."""


def storages(roots: Iterable[tuple[str, object]], follow_grad: bool = True) -> Found:
    """Every distinct tensor storage reachable from ``roots`` (named objects),
    through containers, the attributes of zerofn's and ``torch.optim``'s
    objects and, with ``follow_grad``, leaf tensors' ``.grad``."""
    found: Found = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            nbytes = obj.untyped_storage().nbytes() if obj.layout == torch.strided else 0
            if nbytes:
                found.setdefault(_storage_key(obj), (nbytes, path))
            if follow_grad and obj.is_leaf and obj.grad is not None:
                stack.append((f"{path}.grad", obj.grad))
        elif isinstance(obj, dict):
            stack += [(f"{path}[key]", k) for k in obj]
            stack += [
                (f"{path}[{k if isinstance(k, str | int) else '.'}]", v) for k, v in obj.items()
            ]
        elif isinstance(obj, list | tuple | set | frozenset):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif not isinstance(obj, type) and type(obj).__module__.startswith(_DESCEND):
            stack += [(f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        stack.append((f"{path}.{slot}", getattr(obj, slot)))
    return found


def count_bytes(opt: Any, params: Sequence[torch.Tensor]) -> tuple[dict[str, int], dict[str, int]]:
    """This rank's bytes by kind, each storage counted once, in the order of
    :data:`KINDS`: a storage the parameters live in is a parameter's, then
    gradients, then the local optimizer's own parameters (masters), then its
    state; ``other`` is what else the optimizer references. Also: where the
    ``other`` bytes are held (attribute path, indices folded -> bytes)."""
    local: torch.optim.Optimizer = opt.optim
    claimed: Found = {}
    out: dict[str, int] = {}
    groups: dict[str, list[tuple[str, object]]] = {
        "parameters": [("param", p) for p in params],
        "gradients": [
            *(("grad", p.grad) for p in params if p.grad is not None),
            # What the local optimizer steps with (views of the parameters'
            # gradients under a flat partition, fp32 copies only mid-step
            # with masters): anything here not already counted is a copy.
            *(
                ("opt.optim.param_groups.grad", t.grad)
                for g in local.param_groups
                for t in g["params"]
                if t.grad is not None
            ),
        ],
        "masters": [("opt.optim.param_groups", g["params"]) for g in local.param_groups],
        "optimizer_state": [("opt.optim.state", local.state)],
        "other": [("opt", opt), *(("param", p) for p in params)],
    }
    mine: Found = {}
    for kind in KINDS:
        found = storages(groups[kind], follow_grad=kind == "other")
        mine = {k: v for k, v in found.items() if k not in claimed}
        claimed |= mine
        out[kind] = sum(n for n, _ in mine.values())
    where: dict[str, int] = {}
    for n, path in mine.values():  # the last kind's: other
        folded = re.sub(r"\[\d+\]", "[i]", path)
        where[folded] = where.get(folded, 0) + n
    return out, where


# ----------------------------------------------------------------------------
# The ranks
# ----------------------------------------------------------------------------


def _tensors(shapes: Sequence[Shape], dtype: torch.dtype, seed: int, scale: float) -> list[Any]:
    """Seeded random tensors of ``dtype`` (drawn in fp32, so every dtype gets
    the same values up to rounding)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


def _params(shapes: Sequence[Shape], dtype: torch.dtype) -> list[torch.Tensor]:
    params = [t.requires_grad_() for t in _tensors(shapes, dtype, 0, 0.02)]
    for p, g in zip(params, _tensors(shapes, dtype, 1, 1e-2), strict=True):
        p.grad = g
    return params


def _build(setup: str, shapes: Sequence[Shape], **adam: Any) -> tuple[Any, list[torch.Tensor]]:
    if setup == "torch":
        params = _params(shapes, torch.float32)
        bucket_view = bool(adam.get("fused"))  # PyTorch's fastest set-up with fused Adam
        opt: Any = TorchZero(
            params, torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-3, **adam
        )
        return opt, params
    dtype = torch.float32 if setup == "fp32" else torch.bfloat16
    params = _params(shapes, dtype)
    masters = {"master_dtype": torch.float32} if setup == "bf16" else {}
    opt = ZeroRedundancyOptimizer(
        params,
        torch.optim.Adam,
        parameters_as_bucket_view=True,
        partition="flat",
        lr=1e-3,
        **masters,
        **adam,
    )
    return opt, params


def _digest(params: Sequence[torch.Tensor]) -> tuple[float, float]:
    """Two sums of the parameters (float64): equal steps give equal sums."""
    with torch.no_grad():
        return (
            sum(p.double().sum().item() for p in params),
            sum(p.double().abs().sum().item() for p in params),
        )


def _fused_adam_on_cpu() -> bool:
    try:
        p = torch.zeros(2, requires_grad=True)
        p.grad = torch.ones(2)
        torch.optim.Adam([p], fused=True).step()
    except (RuntimeError, ValueError):
        return False
    return True


def _precision_rank(rank: int, world_size: int, quick: bool, rounds: int, warmup: int) -> Any:
    _, shapes = model_shapes(quick)
    measured: dict[str, Any] = {}
    for setup, _label in SETUPS:
        opt, params = _build(setup, shapes)
        opt.step()
        counted, other_where = count_bytes(opt, params)
        api = opt.memory_bytes() if isinstance(opt, ZeroRedundancyOptimizer) else None
        digest = _digest(params)
        with collective_traffic() as traffic:
            opt.step()
        measured[setup] = {
            "bytes": counted,
            "other_where": other_where,
            "memory_bytes": api,
            "digest": digest,
            "calls": dict(traffic.calls),
            "payload": dict(traffic.payload_bytes),
            "sent": traffic.sent_bytes(world_size),
        }
        del opt, params
        gc.collect()

    kernels: dict[str, dict[str, Any]] = {"default": {}}
    if _fused_adam_on_cpu():
        kernels["fused"] = {"fused": True}
    times: dict[str, dict[str, list[float]]] = {}
    for kernel, adam in kernels.items():
        ours, _ = _build("bf16", shapes, **adam)
        theirs, _ = _build("torch", shapes, **adam)
        times[kernel] = take_turns({"zerofn": ours.step, "torch": theirs.step}, rounds, warmup)
        del ours, theirs
        gc.collect()
    return {"measured": measured, "times": times, "numel": sum(math.prod(s) for s in shapes)}


# ----------------------------------------------------------------------------
# Computed for larger worlds
# ----------------------------------------------------------------------------


def computed_bytes_per_param(shapes: Sequence[Shape], world_size: int) -> dict[str, float]:
    """Heaviest rank's bytes per parameter by set-up, as ``plan_footprint`` plans them."""
    groups = [list(shapes)]
    plans = {
        "torch": plan_footprint(groups, world_size, "greedy", bucket_view=True),
        "fp32": plan_footprint(groups, world_size, "flat", bucket_view=True),
        "bf16": plan_footprint(
            groups,
            world_size,
            "flat",
            param_dtype=torch.bfloat16,
            bucket_view=True,
            master_dtype=torch.float32,
        ),
    }
    return {setup: f.bytes_per_parameter(f.heaviest) for setup, f in plans.items()}


def planned_exchange(shapes: Sequence[Shape], world_size: int) -> dict[str, int]:
    """Bytes each rank hands to the exchange's broadcasts per step, as planned."""
    out = {}
    for setup, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        f = plan_footprint([list(shapes)], world_size, "flat", param_dtype=dtype, bucket_view=True)
        out[setup] = dict(f.payload_bytes)["broadcast"]
    return out


# ----------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------


def _per_param(n: float, numel: int) -> str:
    return f"{n / numel:.3f}"


def _formula(setup: str, d: int) -> float:
    """The formula a set-up is held to at ``d`` ranks."""
    formulas = {"torch": pytorch_formula, "fp32": pytorch_formula, "bf16": target_formula}
    return formulas[setup](d)


def measured_table(results: Sequence[Any], numel: int) -> tuple[str, dict[str, float]]:
    """The measured bytes table, and each set-up's heaviest rank's bytes per parameter."""
    rows: list[list[object]] = []
    heaviest: dict[str, float] = {}
    for setup, label in SETUPS:
        for rank, res in enumerate(results):
            m = res["measured"][setup]
            total = sum(m["bytes"].values())
            heaviest[setup] = max(heaviest.get(setup, 0.0), total / numel)
            api = m["memory_bytes"]
            rows.append(
                [
                    label,
                    rank,
                    *(_per_param(m["bytes"][k], numel) for k in KINDS),
                    _per_param(total, numel),
                    _per_param(sum(api.values()), numel) if api else "-",
                    f"{_formula(setup, WORLD_SIZE):.3f}",
                ]
            )
    header = [
        "set-up",
        "rank",
        "params",
        "grads",
        "masters",
        "optimizer state",
        "other",
        "total (live)",
        "memory_bytes() total",
        "formula",
    ]
    return md_table(header, rows), heaviest


def other_note(results: Sequence[Any]) -> str:
    """The note on what holds the 'other' bytes on rank 0 (or that nothing does)."""
    labels = dict(SETUPS)
    held = [
        f"{labels[setup]}: " + ", ".join(f"`{path}` {fmt_bytes(n)}" for path, n in where.items())
        for setup, _ in SETUPS
        if (where := results[0]["measured"][setup]["other_where"])
    ]
    if not held:
        return "Nothing beyond these kinds is referenced by any of the optimizers."
    return "'Other' on rank 0, by the attribute that holds it: " + "; ".join(held) + "."


def measured_part(results: Sequence[Any], what: str) -> tuple[list[str], dict[str, float]]:
    """The measured paragraphs (intro, table, 'other' note) and the heaviest bytes/param."""
    table, heaviest = measured_table(results, results[0]["numel"])
    intro = (
        f"Model: {what}; each set-up built, stepped once and freed before the next. "
        "Bytes per parameter per rank, counted after the step from the live tensors, "
        "each storage once: parameters, their gradients, the local optimizer's own "
        "parameters that are neither (fp32 masters), its state, and anything else the "
        "optimizer object references ('other'). 'memory_bytes() total' is zerofn's own "
        "account (`opt.memory_bytes()`), for comparison. Formula: 4 + 4 + 8/d for fp32, "
        "2 + 2 + 12/d for bf16 with fp32 masters."
    )
    return [intro, table, other_note(results)], heaviest


def computed_part(gpt2: Sequence[Shape], computed: dict[int, dict[str, float]]) -> list[str]:
    """The computed paragraphs: intro and the bytes/param table for larger worlds."""
    sizes = COMPUTED_WORLD_SIZES
    rows: list[list[object]] = [
        [label, *(f"{computed[ws][setup]:.3f}" for ws in sizes)] for setup, label in SETUPS
    ]
    rows += [
        ["PyTorch's 4 + 4 + 8/d", *(f"{pytorch_formula(ws):.3f}" for ws in sizes)],
        ["goal 2 + 2 + 12/d", *(f"{target_formula(ws):.3f}" for ws in sizes)],
    ]
    table = md_table(["set-up (heaviest rank)", *(f"d = {ws}" for ws in sizes)], rows)
    intro = (
        f"Computed for GPT-2 small ({sum(math.prod(s) for s in gpt2) / 1e6:.1f}M), "
        "heaviest rank; PyTorch's row is `plan_footprint` with greedy ownership, "
        "zerofn's fp32 row flat, the bf16 row from "
        "`plan_footprint(..., master_dtype=torch.float32)`:"
    )
    return [intro, table]


def exchange_part(results: Sequence[Any], shapes: Sequence[Shape]) -> tuple[list[str], float]:
    """The exchange paragraphs (intro, table, bf16/fp32 and agreement note) and bf16/fp32 sent."""
    r0 = results[0]["measured"]
    planned = planned_exchange(shapes, WORLD_SIZE)
    rows = [
        [
            label,
            sum(r0[setup]["calls"].values()),
            fmt_bytes(sum(r0[setup]["payload"].values())),
            fmt_bytes(r0[setup]["sent"]),
            fmt_bytes(planned[setup]) if setup in planned else "-",
        ]
        for setup, label in SETUPS
    ]
    header = [
        "set-up",
        "collectives / step",
        "payload / step / rank",
        "sent / step / rank (ring estimate)",
        "planned payload",
    ]
    half = r0["bf16"]["sent"] / r0["fp32"]["sent"]
    same = all(
        res["measured"]["torch"]["digest"] == res["measured"]["fp32"]["digest"] for res in results
    )
    return [
        "Exchange, counted by `collective_traffic` over one more step of each (rank 0); "
        "'planned' is `plan_footprint`'s payload for the same layout:",
        md_table(header, rows),
        f"bf16 / fp32 bytes sent: {half:.3f}. PyTorch's and zerofn's fp32 parameters "
        f"after the step agree: {'yes' if same else '**no**'} (same Adam, same gradients).",
    ], half


def step_time_part(
    times: dict[str, dict[str, list[float]]], rounds: int, warmup: int
) -> tuple[list[str], dict[str, Spread]]:
    """The step-time paragraphs (intro, table) and the zerofn / PyTorch ratio per kernel."""
    rows: list[list[object]] = []
    ratios: dict[str, Spread] = {}
    for kernel, t in times.items():
        ratios[kernel] = paired_ratios(t["zerofn"], t["torch"])
        theirs = "no bucket view" if kernel == "default" else "bucket view"
        rows.append(
            [
                f"{kernel} Adam (PyTorch: {theirs})",
                Spread.of(t["zerofn"]).scaled(1e3).fmt(0),
                Spread.of(t["torch"]).scaled(1e3).fmt(0),
                ratios[kernel].fmt(),
            ]
        )
    header = [
        "kernel",
        "zerofn bf16 + masters (ms)",
        "PyTorch ZeRO fp32 (ms)",
        "ratio: zerofn / PyTorch",
    ]
    intro = (
        f"Step time, rank 0, {warmup} warm-up and {rounds} timed rounds per kernel, the "
        "two optimizers taking turns (`take_turns`); zerofn bf16 + fp32 masters (flat, "
        "bucket view) against PyTorch's ZeRO on fp32:"
    )
    return [intro, md_table(header, rows)], ratios


def headlines(
    what: str, heaviest: dict[str, float], half: float, ratios: dict[str, Spread]
) -> list[Headline]:
    """The summary rows: bytes/param (bf16 + masters, PyTorch), bytes sent, step-time ratios."""
    d = WORLD_SIZE
    goal = target_formula(d)
    return [
        Headline(
            f"mixed precision ({what})",
            "bytes/param, heaviest rank: zerofn bf16 + fp32 masters (live tensors)",
            Spread.exact(heaviest["bf16"]),
            f"<= {goal:.2f} (2 + 2 + 12/d)",
            heaviest["bf16"] <= goal * 1.001,
            short="bf16 + masters bytes/param",
        ),
        Headline(
            f"mixed precision ({what})",
            # A reference beside the target above, not a target of its own.
            f"bytes/param, heaviest rank: PyTorch ZeRO fp32 (live tensors; "
            f"4 + 4 + 8/d = {pytorch_formula(d):.2f})",
            Spread.exact(heaviest["torch"]),
        ),
        Headline(
            f"mixed precision ({what})",
            "bytes sent per step: bf16 / fp32",
            Spread.exact(half),
            "== 0.5",
            abs(half - 0.5) < 1e-9,
        ),
        *(
            Headline(
                f"mixed precision ({what}, {kernel} Adam)",
                "step time: zerofn bf16 + masters / PyTorch ZeRO fp32",
                ratio,
                short=f"mixed precision, {kernel} Adam",
            )
            for kernel, ratio in ratios.items()
        ),
    ]


def bytes_panel(computed: dict[int, dict[str, float]]) -> Panel:
    """The plot of planned bytes per parameter against d, with the goal's curve."""
    sizes = COMPUTED_WORLD_SIZES
    curves = [Curve(label, sizes, [computed[ws][setup] for ws in sizes]) for setup, label in SETUPS]
    curves.append(Curve("goal 2 + 2 + 12/d", sizes, [target_formula(ws) for ws in sizes]))
    return Panel(
        "Bytes per parameter per rank, GPT-2 small (planned, heaviest rank)",
        "data-parallel ranks d",
        "bytes per parameter",
        curves,
        log_x=True,
    )


def bench_precision(quick: bool) -> Section:
    """The mixed-precision section: measured, computed, exchange and step-time tables."""
    rounds, warmup = (3, 1) if quick else (7, 1)
    model, shapes = model_shapes(quick)
    results = run_local_world(_precision_rank, WORLD_SIZE, quick, rounds, warmup, timeout_s=600.0)
    what = f"{model}, {results[0]['numel'] / 1e6:.1f}M params, {WORLD_SIZE} gloo ranks"
    measured, heaviest = measured_part(results, what)
    # Computed for larger worlds (GPT-2 small even in --quick: nothing is allocated).
    gpt2 = MODELS["gpt2-small"]()
    computed = {ws: computed_bytes_per_param(gpt2, ws) for ws in COMPUTED_WORLD_SIZES}
    exchange, half = exchange_part(results, shapes)
    timing, ratios = step_time_part(results[0]["times"], rounds, warmup)
    body = "\n\n".join([*measured, *computed_part(gpt2, computed), *exchange, *timing])
    return Section(
        "Mixed precision: bytes per parameter (2 gloo ranks, CPU, Adam)",
        body,
        headlines(what, heaviest, half, ratios),
        [bytes_panel(computed)],
    )


BENCHES: dict[str, Callable[[bool], Section]] = {"precision": bench_precision}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
