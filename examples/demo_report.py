"""The demo's report: the results table, the explanatory lines and the plot.

Pure functions of the per-rank results ``examples/demo.py`` collects (plain
dicts, one per rank), so the tests check them without training anything.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from demo_data import printable
from demo_runs import KINDS, RunSpec
from zerofn_torch.traffic import Traffic

from zerofn.footprint import Footprint

GRADIENT_KINDS = ("all_reduce", "reduce")  # what carries gradients; broadcasts carry parameters
HOOK_EFFECT = {
    "powersgd": "PowerSGD sends low-rank approximations of the gradients (with error "
    "feedback), so the two runs take slightly different paths. Expected, not an error.",
    "fp16": "the fp16 hook rounds the gradients to float16 for the all-reduce, so the two "
    "runs take slightly different paths. Expected, not an error.",
    "allreduce": "the all-reduce hook averages as DDP does, and flat ZeRO steps AdamW "
    "element by element, so the two runs agree up to float rounding.",
}
WARMUP_STEPS = 5  # left out of the timing medians
Results = Sequence[dict[str, Any]]  # one per rank


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, columns padded to their widest cell."""
    width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, width, strict=True)) + " |"

    rule = "| " + " | ".join("-" * w for w in width) + " |"
    return "\n".join([line(head), rule, *map(line, rows)])


def mean_losses(results: Results, key: str) -> list[float]:
    """Per step, the loss averaged over the ranks (each trained on its slice)."""
    per_rank = [r["losses"][key] for r in results]
    return [statistics.fmean(step) for step in zip(*per_rank, strict=True)]


def median_ms(seconds: Sequence[float]) -> float:
    tail = seconds[WARMUP_STEPS:] if len(seconds) > WARMUP_STEPS else seconds
    return 1e3 * statistics.median(tail)


def timings(result: dict[str, Any], key: str) -> dict[str, float]:
    """Rank-0 medians in ms: the step (forward+backward, then the optimizer step),
    its compute (forward+backward under ``no_sync``, run just before some steps on
    the same batch), its communication (those steps' forward+backward minus
    that compute) and its optimizer step."""
    fb, opt = median_ms(result["fb"][key]), median_ms(result["opt"][key])
    pairs = [(result["fb"][key][step], seconds) for step, seconds in result["compute"][key]]
    if not pairs:  # a one-step run measures no split
        return {"step": fb + opt, "compute": math.nan, "comm": math.nan, "opt": opt}
    compute = 1e3 * statistics.median(c for _, c in pairs)
    comm = 1e3 * statistics.median(max(0.0, f - c) for f, c in pairs)
    return {"step": fb + opt, "compute": compute, "comm": comm, "opt": opt}


def split_sent(payload: dict[str, int], world_size: int) -> tuple[float, float]:
    """Bytes one rank sends (ring estimate): (gradients, updated parameters)."""
    grads = {k: v for k, v in payload.items() if k in GRADIENT_KINDS}
    params = {k: v for k, v in payload.items() if k not in GRADIENT_KINDS}
    return (
        Traffic(payload_bytes=grads).sent_bytes(world_size),
        Traffic(payload_bytes=params).sent_bytes(world_size),
    )


def describe_calls(calls: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(calls.items())) or "-"


def planned_memory(plan: Footprint, rank: int, kinds: Sequence[str] = KINDS) -> dict[str, int]:
    """The planner's bytes by kind for ``rank``, keyed like ``memory_bytes()`` (0
    for a kind the planner does not count)."""
    return {k: int(getattr(plan.ranks[rank], k, 0)) for k in kinds}


def memory_kinds(results: Results) -> tuple[str, ...]:
    """The four kinds every run reports, then any other kind a run reports
    bytes of (``memory_bytes()`` may count more kinds, such as master weights)."""
    extra = {
        k: None
        for r in results
        for mem in r["memory"].values()
        for k, v in mem.items()
        if k not in KINDS and v
    }
    return (*KINDS, *extra)


def _memory_cells(per_rank: Sequence[dict[str, int]], kinds: Sequence[str]) -> list[str]:
    """Rank 0's bytes by kind, then every rank's total."""
    return [mib(per_rank[0].get(k, 0)) for k in kinds] + [
        mib(sum(m.get(k, 0) for k in kinds)) for m in per_rank
    ]


def row_labels(world_size: int, kinds: Sequence[str] = KINDS) -> list[str]:
    """The table's first column; :func:`run_column` and :func:`plan_column` follow it."""
    return [
        "training loss, last 10 steps (nats/byte)",
        "held-out loss (nats/byte)",
        *(f"{k.replace('_', ' ')}, rank 0" for k in kinds),
        *(f"total memory, rank {r}" for r in range(world_size)),
        "sent per step, rank 0 (ring estimate)",
        "  gradients (all-reduce)",
        "  updated parameters (broadcast)",
        "collectives per step",
        "time per step, median (ms)",
        "  forward+backward compute (no_sync)",
        "  gradient exchange in backward (+ hook math)",
        "  optimizer step",
    ]


def run_column(results: Results, spec: RunSpec, kinds: Sequence[str]) -> list[str]:
    """A run's live numbers, one per :func:`row_labels` row."""
    r0 = results[0]
    grads, params = split_sent(r0["payload"][spec.key], len(results))
    calls = describe_calls(r0["calls"][spec.key]) if spec.zerofn else "DDP's own all-reduce"
    t = timings(r0, spec.key)
    return [
        f"{statistics.fmean(mean_losses(results, spec.key)[-10:]):.3f}",
        f"{r0['held_out'][spec.key]:.3f}",
        *_memory_cells([r["memory"][spec.key] for r in results], kinds),
        *(mib(b) for b in (grads + params, grads, params)),
        calls,
        *("-" if math.isnan(t[k]) else f"{t[k]:.0f}" for k in ("step", "compute", "comm", "opt")),
    ]


def plan_column(plan: Footprint, kinds: Sequence[str]) -> list[str]:
    """The planner's numbers for a run, one per :func:`row_labels` row ('' where it has none)."""
    ws = plan.world_size
    grads, params = split_sent(dict(plan.payload_bytes), ws)
    return [
        "",
        "",
        *_memory_cells([planned_memory(plan, r, kinds) for r in range(ws)], kinds),
        *(mib(b) for b in (grads + params, grads, params)),
        describe_calls(dict(plan.zero_collectives)) + " (the ZeRO step's)",
        *[""] * 4,
    ]


def table(results: Results, specs: Sequence[RunSpec], plans: Sequence[Footprint | None]) -> str:
    """The results table: one column per run, then one per planner prediction."""
    kinds = memory_kinds(results)
    head = ["rank 0 unless stated", *(s.title for s in specs)]
    columns = [run_column(results, s, kinds) for s in specs]
    for spec, plan in zip(specs, plans, strict=True):
        if plan is not None:
            head.append(f"{spec.key}: planned (plan_footprint)")
            columns.append(plan_column(plan, kinds))
    labels = row_labels(len(results), kinds)
    rows = [[label, *(c[i] for c in columns)] for i, label in enumerate(labels)]
    return format_table(head, rows)


def matches_plan(results: Results, key: str, plan: Footprint) -> bool:
    """Whether every rank's live bytes equal the planner's, kind for kind."""
    kinds = memory_kinds(results)
    return all(
        {k: r["memory"][key].get(k, 0) for k in kinds} == planned_memory(plan, rank, kinds)
        for rank, r in enumerate(results)
    )


def samples(
    results: Results, specs: Sequence[RunSpec], prompt: bytes, seen: int = 0, lines: int = 6
) -> str:
    """Each run's sampled text after ``prompt``, at most ``lines`` lines, indented;
    ``seen``: the bytes of text each run trained on, if known."""
    after = f" after {seen / 1e3:,.0f} KB of training text" if seen else ""
    out = [
        f"Sampled text{after} (prompt {prompt.decode()!r}, temperature 0.8, the same random "
        "numbers for every run):"
    ]
    for spec in specs:
        text = printable(prompt + results[0]["samples"][spec.key])
        out.append(f"  {spec.key}:")
        out.extend(f"    | {line}" for line in text.splitlines()[:lines])
    return "\n".join(out)


def dominant_line(results: Results, specs: Sequence[RunSpec]) -> str:
    """One plain sentence: what takes most of a step here, measured on rank 0."""
    names = {
        "compute": "forward+backward compute",
        "comm": "the gradient exchange in backward (communication, waiting, hook math)",
        "opt": "the optimizer step",
    }
    shares = []
    for spec in specs:
        t = timings(results[0], spec.key)
        if math.isnan(t["compute"]):
            return "The step's time was not split: that takes at least 2 steps."
        total = sum(t[k] for k in names) or 1.0
        shares.append({k: t[k] / total for k in names})
    top = max(names, key=lambda k: shares[0][k])
    each = ", ".join(f"{s[top]:.0%} of {spec.key}'s" for spec, s in zip(specs, shares, strict=True))
    line = (
        f"What dominates the time on this machine: {names[top]} ({each} step). Measured on "
        "rank 0: forward+backward re-run under DDP's no_sync() (no hook, no communication) "
        "on the same batch against the full forward+backward, whose extra time is the hook's "
        "(all-reduces, waiting for the other rank, and PowerSGD's own compression math); the "
        "optimizer step (zerofn's includes broadcasting the shards) timed on its own."
    )
    if top == "compute":
        line += (
            " So here the step's time is set by arithmetic: zerofn's smaller optimizer state "
            "and fewer bytes sent pay where memory or the network is the limit (bigger "
            "models, more ranks, slower links), not in this step time."
        )
    return line


def notes(
    results: Results, specs: Sequence[RunSpec], plans: Sequence[Footprint | None], cfg: Any
) -> list[str]:
    """The lines under the table that say how to read it."""
    base = specs[0].key
    out = []
    for spec, plan in zip(specs[1:], plans[1:], strict=True):
        d = results[0]["held_out"][spec.key] - results[0]["held_out"][base]
        out.append(
            f"{spec.key} vs {base}: held-out loss {d:+.3f} nats/byte. Both start from the same "
            f"weights and see the same batches; {HOOK_EFFECT[cfg.hook.kind]}"
        )
        if plan is not None:
            verdict = (
                "equal the planner's prediction on every rank, byte for byte"
                if matches_plan(results, spec.key, plan)
                else "differ from the planner's prediction where the columns differ"
            )
            out.append(
                f"Memory: {spec.key}'s live bytes (ZeroRedundancyOptimizer.memory_bytes()) "
                f"{verdict}; plain's are counted the same way from its live tensors."
            )
    if cfg.hook.kind == "powersgd" and cfg.steps <= cfg.hook.start_iter:
        out.append(
            f"PowerSGD compresses from step {cfg.hook.start_iter}, after this run's last step: "
            "the gradients measured went uncompressed; the planner counts compressing steps."
        )
    out.append(
        "Bytes sent: each collective's payload times a rank's share under ring algorithms "
        "(all-reduce 2(N-1)/N, broadcast (N-1)/N); zerofn's counted on the last step with "
        "zerofn_torch.traffic.collective_traffic, plain DDP's all-reduce of every gradient "
        "computed from the gradients' bytes."
    )
    return out


def moving_average(xs: Sequence[float], window: int = 10) -> list[float]:
    """The mean of each value and up to ``window - 1`` before it."""
    return [statistics.fmean(xs[max(0, i + 1 - window) : i + 1]) for i in range(len(xs))]


def plot(
    results: Results,
    specs: Sequence[RunSpec],
    plans: Sequence[Footprint | None],
    path: str,
) -> None:
    """Loss against step for every run, and each rank's memory by kind as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, spec in enumerate(specs):
        losses = mean_losses(results, spec.key)
        steps = range(1, len(losses) + 1)
        line = left.plot(steps, losses, lw=0.8, alpha=0.35)[0]
        left.plot(
            steps,
            moving_average(losses),
            color=line.get_color(),
            lw=2.0 - 0.5 * i,
            ls=("-", "--", ":")[i % 3],
            label=f"{spec.title} (10-step mean)",
        )
    left.set(xlabel="step", ylabel="training loss (nats/byte, mean over ranks)")
    left.set_title("loss")
    left.legend()
    bars: list[tuple[str, dict[str, int]]] = []
    for spec, plan in zip(specs, plans, strict=True):
        bars += [
            (f"{spec.key}\nrank {r}", res["memory"][spec.key]) for r, res in enumerate(results)
        ]
        if plan is not None:
            bars += [(f"{spec.key}\nplanned", planned_memory(plan, 0))]
    bottom = [0.0] * len(bars)
    for kind in memory_kinds(results):
        heights = [m.get(kind, 0) / 2**20 for _, m in bars]
        right.bar(range(len(bars)), heights, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    right.set_xticks(range(len(bars)), [label for label, _ in bars])
    right.set(ylabel="MiB per rank", ylim=(0, 1.4 * max(bottom)))
    right.set_title("memory per rank, by kind")
    right.legend(loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
