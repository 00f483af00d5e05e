"""Benchmarks for zerofn, each printed as a Markdown table of ratios measured in this run.

Nothing here asserts on time: machines differ, so every number that matters is
a ratio between zerofn and PyTorch (or between partition modes) taken side by
side in the same run, on the same data, in the same processes.

Sections:

1. **ZeRO step** (2 gloo ranks on CPU, ~20M parameters in ~60 tensors, Adam).
   One process group holds four optimizers over four identical copies of the
   parameters: ``zerofn_torch.ZeroRedundancyOptimizer`` and
   ``torch.distributed.optim.ZeroRedundancyOptimizer``, each with
   ``parameters_as_bucket_view`` off and on. Every parameter carries the same
   fixed random gradient. The implementations take turns step by step (the
   order rotates every round) so that drift in machine load hits all of them
   alike; each timed step is preceded by a ``dist.barrier()`` and only
   ``opt.step()`` (local update plus the shard exchange) is timed on rank 0.
   We report median and interquartile range, the zerofn / PyTorch ratio of
   medians per bucket setting (the target is <= 0.8), each rank's
   optimizer-state bytes, and, as a sanity check, the largest difference
   between the parameters each implementation produced (they run the same
   Adam on the same gradients, so it should be 0).
2. **Partition imbalance** (pure, no processes): the heaviest rank's
   optimizer-state load divided by the ideal ``total / world_size`` for
   GPT-2 small and for 200 seeded random models, under greedy (PyTorch's
   sorted-greedy), balanced and flat partitions. This is the memory saving
   ZeRO actually delivers: the heaviest rank sets the peak.
3. **Core scaling** (pure): wall time of ``greedy_partition``,
   ``balanced_partition``, ``flat_partition`` and
   ``assign_buckets(shard_buckets=True)`` for 1k / 10k / 100k parameters at
   world sizes 2 / 8 / 64: how planning cost grows with model and world size.

Run ``python benchmarks/bench_zero.py`` (``make bench``); ``--quick`` shrinks
every section for a smoke run. Tables go to stdout and to ``--out``
(``benchmarks/results.md`` by default; ``--out ''`` writes nothing).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.launch import run_local_world

from zerofn.ddp_buckets import assign_buckets
from zerofn.partition import balanced_partition, flat_partition, greedy_partition, rank_loads

# ----------------------------------------------------------------------------
# Markdown helpers
# ----------------------------------------------------------------------------


def _numeric(value: object) -> bool:
    if isinstance(value, int | float):
        return True
    try:
        float(str(value).replace(",", "").removesuffix("x"))
    except ValueError:
        return False
    return True


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; numeric columns right-aligned."""
    aligns = [
        "---:" if rows and all(_numeric(row[i]) for row in rows) else "---"
        for i in range(len(header))
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(aligns) + " |",
    ]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``xs``."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


# ----------------------------------------------------------------------------
# 1. ZeRO step on 2 gloo ranks
# ----------------------------------------------------------------------------

IMPLS: tuple[tuple[str, str, bool], ...] = (
    # (label, implementation, parameters_as_bucket_view)
    ("zerofn, bucket_view=False", "zerofn", False),
    ("PyTorch, bucket_view=False", "torch", False),
    ("zerofn, bucket_view=True", "zerofn", True),
    ("PyTorch, bucket_view=True", "torch", True),
)


def model_shapes(quick: bool) -> list[tuple[int, ...]]:
    """~20M parameters in 60 tensors (30 linear layers of mixed widths, with
    biases); ``quick``: the same structure at ~1/10 of the size."""
    widths = [704, 832, 960, 768, 896] if not quick else [224, 256, 320, 240, 288]
    shapes: list[tuple[int, ...]] = []
    for i in range(30):
        fan_in, fan_out = widths[i % len(widths)], widths[(i + 1) % len(widths)]
        shapes += [(fan_out, fan_in), (fan_out,)]
    return shapes


def state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state."""
    total = 0
    for per_param in optim.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _exchange_only(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """The implementation's shard exchange without the update (private APIs)."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        return lambda: opt._receive(opt._send_shards())
    return opt._sync_params  # type: ignore[attr-defined,no-any-return]


def _zero_step_rank(rank: int, world_size: int, quick: bool, rounds: int, warmup: int) -> Any:
    shapes = model_shapes(quick)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]

    optimizers: list[torch.optim.Optimizer] = []
    copies: list[list[torch.Tensor]] = []
    for _label, impl, bucket_view in IMPLS:
        params = [t.clone().requires_grad_() for t in init]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt: torch.optim.Optimizer
        if impl == "zerofn":
            opt = ZeroRedundancyOptimizer(
                params,
                torch.optim.Adam,
                parameters_as_bucket_view=bucket_view,
                lr=1e-3,
            )
        else:
            opt = TorchZero(
                params, torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-3
            )
        optimizers.append(opt)
        copies.append(params)

    times: list[list[float]] = [[] for _ in IMPLS]
    for r in range(warmup + rounds):
        for k in range(len(IMPLS)):
            i = (k + r) % len(IMPLS)  # rotate who goes first
            dist.barrier()
            start = time.perf_counter()
            optimizers[i].step()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[i].append(elapsed)

    # Diagnostic: the parameter exchange alone (each implementation's private
    # exchange method; it re-sends the current shards, so it changes nothing).
    exchanges = [_exchange_only(opt) for opt in optimizers]
    exchange_times: list[list[float]] = [[] for _ in IMPLS]
    for r in range(warmup + rounds):
        for k in range(len(IMPLS)):
            i = (k + r) % len(IMPLS)
            dist.barrier()
            start = time.perf_counter()
            exchanges[i]()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                exchange_times[i].append(elapsed)

    # Every copy took the same Adam steps on the same gradients.
    reference = copies[0]
    max_diff = max(
        (p.detach() - q.detach()).abs().max().item()
        for params in copies[1:]
        for p, q in zip(params, reference, strict=True)
    )
    return {
        "times": times,
        "exchange_times": exchange_times,
        "state_bytes": [state_bytes(opt.optim) for opt in optimizers],  # type: ignore[attr-defined]
        "max_diff": max_diff,
        "numel": sum(t.numel() for t in init),
        "tensors": len(init),
    }


def bench_zero_step(quick: bool, rounds: int | None = None) -> str:
    world_size = 2
    default_rounds, warmup = (5, 1) if quick else (25, 3)
    rounds = rounds or default_rounds
    results = run_local_world(_zero_step_rank, world_size, quick, rounds, warmup)
    r0 = results[0]
    stats = [quartiles(t) for t in r0["times"]]
    xstats = [quartiles(t) for t in r0["exchange_times"]]
    rows: list[list[object]] = []
    for i, (label, _impl, _bv) in enumerate(IMPLS):
        (q1, med, q3), (xq1, xmed, xq3) = stats[i], xstats[i]
        rows.append(
            [
                label,
                f"{med * 1e3:.1f}",
                f"{(q3 - q1) * 1e3:.1f}",
                f"{min(r0['times'][i]) * 1e3:.1f}",
                f"{xmed * 1e3:.1f}",
                f"{(xq3 - xq1) * 1e3:.1f}",
            ]
        )
    timing = md_table(
        [
            "implementation",
            "step: median (ms)",
            "step: IQR (ms)",
            "step: min (ms)",
            "exchange only: median (ms)",
            "exchange only: IQR (ms)",
        ],
        rows,
    )

    ratio_rows: list[list[object]] = []
    for bv in (False, True):
        z = next(i for i, (_, impl, b) in enumerate(IMPLS) if impl == "zerofn" and b == bv)
        t = next(i for i, (_, impl, b) in enumerate(IMPLS) if impl == "torch" and b == bv)
        ratio = stats[z][1] / stats[t][1]
        ratio_rows.append(
            [
                f"parameters_as_bucket_view={bv}",
                f"{ratio:.2f}",
                "yes" if ratio <= 0.8 else "no",
                f"{min(r0['times'][z]) / min(r0['times'][t]):.2f}",
                f"{xstats[z][1] / xstats[t][1]:.2f}",
            ]
        )
    ratios = md_table(
        [
            "setting",
            "step: zerofn / PyTorch (medians)",
            "<= 0.8 (target)",
            "step: ratio of minima",
            "exchange only: ratio of medians",
        ],
        ratio_rows,
    )

    mem_rows: list[list[object]] = []
    for i, (label, _impl, _bv) in enumerate(IMPLS):
        mem_rows.append([label, *(fmt_bytes(res["state_bytes"][i]) for res in results)])
    memory = md_table(
        ["implementation", *(f"rank {r} optimizer state" for r in range(world_size))], mem_rows
    )
    diff = max(res["max_diff"] for res in results)
    return "\n\n".join(
        [
            "## 1. ZeRO step (2 gloo ranks, CPU, Adam)",
            f"Model: {r0['numel'] / 1e6:.1f}M parameters in {r0['tensors']} tensors; "
            f"{warmup} warm-up rounds, {rounds} timed rounds, implementations alternating "
            "step by step; `opt.step()` timed on rank 0 after a barrier; one thread per rank. "
            "'Exchange only' times, in separate alternating rounds, just the shard exchange "
            "that follows the local Adam update (zerofn's `_send_shards` + `_receive`, PyTorch's "
            "`_sync_params`; both private), to separate communication from the optimizer "
            "math that both run identically. The minimum is the least disturbed sample "
            "when other processes share the cores; compare it with the median.",
            timing,
            ratios,
            "Per-rank optimizer state (sum of tensor bytes in `opt.optim.state`):",
            memory,
            f"Largest parameter difference between the four implementations after the run: "
            f"{diff:.3g} (same Adam on the same gradients).",
        ]
    )


# ----------------------------------------------------------------------------
# 2. Partition imbalance
# ----------------------------------------------------------------------------


def gpt2_small_sizes() -> list[int]:
    """Element counts of GPT-2 small's parameters, in ``model.parameters()`` order."""
    vocab, n_embd, n_layer, n_positions = 50257, 768, 12, 1024
    sizes = [vocab * n_embd, n_positions * n_embd]
    for _ in range(n_layer):
        sizes += [n_embd, n_embd]  # ln_1
        sizes += [n_embd * 3 * n_embd, 3 * n_embd]  # attn.c_attn
        sizes += [n_embd * n_embd, n_embd]  # attn.c_proj
        sizes += [n_embd, n_embd]  # ln_2
        sizes += [n_embd * 4 * n_embd, 4 * n_embd]  # mlp.c_fc
        sizes += [4 * n_embd * n_embd, n_embd]  # mlp.c_proj
    sizes += [n_embd, n_embd]  # ln_f
    return sizes


def random_model(rng: random.Random) -> list[int]:
    """A random model: 4-400 tensors, a mix of matrices (log-uniform widths)
    and vectors, and in 30% of models one embedding-sized tensor."""
    n = rng.randint(4, 400)
    sizes = []
    for _ in range(n):
        if rng.random() < 0.4:
            sizes.append(int(2 ** rng.uniform(0, 12)))  # bias / norm vector
        else:
            sizes.append(int(2 ** rng.uniform(4, 12)) * int(2 ** rng.uniform(4, 12)))
    if rng.random() < 0.3:
        sizes[0] = int(2 ** rng.uniform(14, 17)) * int(2 ** rng.uniform(7, 11))
    return sizes


def few_per_rank_model(rng: random.Random, world_size: int) -> list[int]:
    """A model with only 1-3 tensors per rank, of comparable sizes: the case
    where sorted-greedy leaves the most room for a better whole-tensor split."""
    n = rng.randint(world_size, 3 * world_size)
    return [rng.randint(1_000, 100_000) for _ in range(n)]


def imbalance(loads: Sequence[int]) -> float:
    """Heaviest rank's load over the ideal share ``total / world_size``."""
    return max(loads) / (sum(loads) / len(loads))


def whole_tensor_bound(sizes: Sequence[int], world_size: int) -> float:
    """A lower bound on :func:`imbalance` for any whole-tensor partition: the
    heaviest rank holds at least the largest tensor and at least the ideal."""
    ideal = sum(sizes) / world_size
    return max(max(sizes), ideal) / ideal


MODES: tuple[tuple[str, Callable[[Sequence[Sequence[int]], int], Any]], ...] = (
    ("greedy", greedy_partition),
    ("balanced", balanced_partition),
    ("flat", flat_partition),
)


def _imbalance_rows(
    label: str, models: Sequence[Sequence[int]], ws: int
) -> tuple[list[list[object]], int, int]:
    """Mean and worst rows for ``models`` at ``ws``; also how often balanced
    was lighter / heavier than greedy."""
    per_mode: list[list[float]] = [[] for _ in MODES]
    bounds: list[float] = []
    lighter = heavier = 0
    for sizes in models:
        loads = [rank_loads(fn([sizes], ws)) for _, fn in MODES]
        lighter += max(loads[1]) < max(loads[0])
        heavier += max(loads[1]) > max(loads[0])
        for k, ld in enumerate(loads):
            per_mode[k].append(imbalance(ld))
        bounds.append(whole_tensor_bound(sizes, ws))
    rows: list[list[object]] = [
        [
            f"{label}: mean",
            ws,
            *(f"{statistics.fmean(v):.3f}" for v in per_mode),
            f"{statistics.fmean(bounds):.3f}",
            lighter,
        ],
        [
            f"{label}: worst",
            ws,
            *(f"{max(v):.3f}" for v in per_mode),
            f"{max(bounds):.3f}",
            "",
        ],
    ]
    return rows, lighter, heavier


def bench_imbalance(quick: bool) -> str:
    world_sizes = (2, 8, 64)
    n_models = 40 if quick else 200
    rng = random.Random(12345)
    models = [random_model(rng) for _ in range(n_models)]
    gpt2 = gpt2_small_sizes()
    rows: list[list[object]] = []
    heavier_total = 0
    for ws in world_sizes:
        r = [imbalance(rank_loads(fn([gpt2], ws))) for _, fn in MODES]
        rows.append(
            [
                f"GPT-2 small ({sum(gpt2) / 1e6:.1f}M, {len(gpt2)} tensors)",
                ws,
                *(f"{x:.3f}" for x in r),
                f"{whole_tensor_bound(gpt2, ws):.3f}",
                int(r[1] < r[0]),
            ]
        )
        mixed, _, heavier = _imbalance_rows(f"{n_models} random models", models, ws)
        heavier_total += heavier
        few = [few_per_rank_model(rng, ws) for _ in range(n_models)]
        sparse, _, heavier = _imbalance_rows(f"{n_models} models, 1-3 tensors/rank", few, ws)
        heavier_total += heavier
        rows += mixed + sparse
    table = md_table(
        [
            "model",
            "world size",
            "greedy",
            "balanced",
            "flat",
            "whole-tensor bound",
            "balanced < greedy (models)",
        ],
        rows,
    )
    return "\n\n".join(
        [
            "## 2. Partition imbalance: max rank load / (total / world size)",
            "1.0 is a perfect split. No whole-tensor partition (greedy, balanced) can go below "
            "the bound max(largest tensor, ideal) / ideal; flat splits tensors and reaches 1.0. "
            "Random models (seeded `random`): 4-400 tensors of mixed shapes, 30% with one "
            "embedding-sized tensor; the '1-3 tensors/rank' family has world_size to "
            "3 * world_size tensors of 1k-100k elements.",
            table,
            f"Models where balanced was heavier than greedy: {heavier_total} "
            f"(over {2 * n_models * len(world_sizes)} random models and world sizes).",
        ]
    )


# ----------------------------------------------------------------------------
# 3. Core scaling
# ----------------------------------------------------------------------------

DDP_BUCKET_ELEMENTS = 25 * 2**20 // 4  # DDP's default 25 MiB buckets, float32


def ddp_buckets(sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive parameters grouped into buckets of at most ~25 MiB (fp32)."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for n in sizes:
        if buckets[-1] and filled + n > DDP_BUCKET_ELEMENTS:
            buckets.append([])
            filled = 0
        buckets[-1].append(n)
        filled += n
    return buckets


def median_time(repeats: int, fn: Callable[..., object], *args: Any, **kwargs: Any) -> float:
    """Median wall time of ``fn(*args, **kwargs)`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_scaling(quick: bool) -> str:
    counts = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    world_sizes = (2, 8, 64)
    rng = random.Random(7)
    rows: list[list[object]] = []
    for n in counts:
        sizes = [int(2 ** rng.uniform(0, 20)) for _ in range(n)]
        buckets = ddp_buckets(sizes)
        repeats = 5 if n <= 10_000 else 3
        for ws in world_sizes:
            timings = [
                median_time(repeats, greedy_partition, [sizes], ws),
                median_time(repeats, balanced_partition, [sizes], ws),
                median_time(repeats, flat_partition, [sizes], ws),
                median_time(repeats, assign_buckets, buckets, ws, shard_buckets=True),
            ]
            rows.append([f"{n:,}", len(buckets), ws, *(f"{t:.4f}" for t in timings)])
    table = md_table(
        [
            "parameters",
            "DDP buckets",
            "world size",
            "greedy (s)",
            "balanced (s)",
            "flat (s)",
            "assign_buckets shard (s)",
        ],
        rows,
    )
    growth = ""
    if len(counts) >= 2:
        names = ("greedy", "balanced", "flat", "assign_buckets")
        lo, hi = counts[-2], counts[-1]
        at = {(row[0], row[2]): row[3:] for row in rows}
        factors = [
            float(str(at[(f"{hi:,}", 8)][k])) / max(float(str(at[(f"{lo:,}", 8)][k])), 1e-9)
            for k in range(len(names))
        ]
        growth = (
            f"Growth from {lo:,} to {hi:,} parameters at world size 8: "
            + ", ".join(f"{n} x{f:.0f}" for n, f in zip(names, factors, strict=True))
            + f" (x{hi // lo} would be linear)."
        )
    return "\n\n".join(
        [
            "## 3. Core scaling: seconds per call (median of 3-5)",
            "Parameter sizes log-uniform in [1, 2^20); buckets are consecutive runs of "
            "at most 25 MiB of fp32, as DDP's default.",
            table,
            *([growth] if growth else []),
        ]
    )


# ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.md"),
        help="Markdown file for the tables ('' to skip)",
    )
    parser.add_argument("--rounds", type=int, help="timed rounds of the ZeRO step (default 25)")
    parser.add_argument(
        "--only", choices=("step", "imbalance", "scaling"), action="append", help="sections"
    )
    args = parser.parse_args(argv)
    sections = args.only or ["step", "imbalance", "scaling"]

    started = time.perf_counter()
    header = "\n".join(
        [
            "# zerofn benchmarks" + (" (--quick)" if args.quick else ""),
            "",
            f"{datetime.date.today().isoformat()}; torch {torch.__version__}; "
            f"Python {platform.python_version()}; {os.cpu_count()} CPU cores; "
            f"{platform.machine()}.",
        ]
    )
    print(header, flush=True)
    parts = [header]
    benches: dict[str, Callable[[bool], str]] = {
        "step": lambda quick: bench_zero_step(quick, args.rounds),
        "imbalance": bench_imbalance,
        "scaling": bench_scaling,
    }
    for name in ("step", "imbalance", "scaling"):
        if name in sections:
            t0 = time.perf_counter()
            text = benches[name](args.quick)
            text += f"\n\n_section took {time.perf_counter() - t0:.1f} s_"
            print("\n" + text, flush=True)
            parts.append(text)
    footer = f"Total: {time.perf_counter() - started:.1f} s."
    print("\n" + footer)
    parts.append(footer)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n\n".join(parts) + "\n")
        print(f"(written to {args.out})", file=sys.stderr)


if __name__ == "__main__":
    main()
