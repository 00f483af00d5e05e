"""The demo's figure: one page, five panels (six with a DiLoCo run), drawn
from the runs' summaries.

Top: held-out loss against step for every run, and each run's held-out loss
relative to its baseline run (with its target, if it has one). Bottom: memory
per rank by kind (with the planner's prediction), bytes sent per step, with a
DiLoCo run the final held-out loss against the bytes sent in the run, and time
per step split into compute, communication and the optimizer step (medians,
whiskers from the first to the third quartile).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from demo_summary import RunSummary, memory_kinds, total_memory

MIB = 2**20
LINEAR_WITHIN = 2.5  # percent: the gap panel's linear range, the largest target inside it
GAP_TICKS = (-50, -20, -10, -5, -2, -1, 0, 1, 2, 5, 10, 20, 50)
RUN_STYLES = ("-", "--", "-.", ":")
RUN_MARKERS = ("o", "x", "s", "^", "v", "D", "P")
KIND_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494")


def figure(
    summaries: Sequence[RunSummary], title: str, planned: Mapping[str, int] | None = None
) -> Any:
    """The figure (a ``matplotlib.figure.Figure``), not yet saved; ``planned``:
    run key -> the predicted bytes on rank 0, marked beside its memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diloco = any(s.spec.optimizer == "diloco" for s in summaries)
    columns = 4 if diloco else 3
    fig = plt.figure(figsize=(20 if diloco else 16, 9.5))
    grid = fig.add_gridspec(2, columns, height_ratios=(1.1, 1))
    colors = {s.spec.key: f"C{i}" for i, s in enumerate(summaries)}
    _loss_panel(fig.add_subplot(grid[0, :2]), summaries, colors)
    _gap_panel(fig.add_subplot(grid[0, 2:]), summaries, colors)
    # The loss-against-bytes panel sits between the bytes and the time bars.
    bars = [fig.add_subplot(grid[1, i]) for i in (0, 1, columns - 1)]
    _memory_panel(bars[0], summaries, planned or {})
    _bytes_panel(bars[1], summaries)
    _time_panel(bars[2], summaries)
    if diloco:
        _loss_bytes_panel(fig.add_subplot(grid[1, 2]), summaries, colors)
    for ax in bars:  # each run's name in its colour in the curves above
        for tick in ax.get_xticklabels():
            tick.set_color(colors.get(tick.get_text(), "black"))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def save(fig: Any, path: str) -> None:
    """Write ``fig`` to ``path`` (folders made as needed) and release it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label(s: RunSummary) -> str:
    label = f"{s.spec.key}: {s.spec.title}"
    if s.spec.exact and s.losses_equal:
        label += f"\n  (same curve as {s.spec.baseline}: every loss bitwise equal)"
    return label


def _loss_panel(ax: Any, summaries: Sequence[RunSummary], colors: dict[str, str]) -> None:
    for i, s in enumerate(summaries):
        steps, losses = zip(*s.held_out, strict=True)
        ax.plot(
            steps,
            losses,
            color=colors[s.spec.key],
            ls=RUN_STYLES[i % len(RUN_STYLES)],
            marker=RUN_MARKERS[i % len(RUN_MARKERS)],
            lw=3.0 if i == 0 else 1.5,
            alpha=0.55 if i == 0 else 1.0,
            label=_label(s),
        )
    ax.set(xlabel="training step", ylabel="held-out loss (nats/byte)")
    ax.set_title("Held-out loss of each run's model, same weights and batches throughout")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _gap_panel(ax: Any, summaries: Sequence[RunSummary], colors: dict[str, str]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter

    by_key = {s.spec.key: s for s in summaries}
    for i, s in enumerate(summaries):
        if s.spec.baseline is None:
            continue
        base = dict(by_key[s.spec.baseline].held_out)
        steps = [step for step, _ in s.held_out]
        gaps = [100 * (loss - base[step]) / base[step] for step, loss in s.held_out]
        color = colors[s.spec.key]
        ax.plot(
            steps,
            gaps,
            color=color,
            marker=RUN_MARKERS[i % len(RUN_MARKERS)],
            ls=RUN_STYLES[i % len(RUN_STYLES)],
            label=f"{s.spec.key} vs {s.spec.baseline}",
        )
        if s.spec.target is not None:  # named on the line, so the legend holds runs only
            bound = 100 * s.spec.target.relative
            for sign in (1, -1):
                ax.axhline(sign * bound, color=color, ls=":", lw=1)
            ax.annotate(
                f"{s.spec.key}'s target: within ±{bound:g}%",
                (1.0, bound),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom",
                fontsize=7,
                color=color,
            )
    ax.axhline(0, color="black", lw=0.8)
    ax.margins(y=0.15)
    # Linear within the targets, logarithmic beyond: a run far off its
    # baseline (DiLoCo) does not flatten the ones near theirs.
    ax.set_yscale("symlog", linthresh=LINEAR_WITHIN)
    ax.yaxis.set_major_locator(FixedLocator(GAP_TICKS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.set(
        xlabel="training step",
        ylabel=f"held-out loss vs baseline run's (log scale beyond ±{LINEAR_WITHIN:g}%)",
    )
    ax.set_title("Held-out loss relative to each run's baseline")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)


def _stacked(
    ax: Any, keys: Sequence[str], parts: Mapping[str, Sequence[float]], unit: str
) -> list[float]:
    """Stacked bars, one per run, one layer per non-zero part; the tops, labelled."""
    bottom = [0.0] * len(keys)
    shown = [(name, heights) for name, heights in parts.items() if any(heights)]
    for i, (name, heights) in enumerate(shown):
        # A palette of its own: these are kinds, not runs (the runs own C0, C1, ...).
        ax.bar(range(len(keys)), heights, bottom=bottom, label=name, color=KIND_COLORS[i])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, top in enumerate(bottom):
        ax.annotate(f"{top:.3g} {unit}", (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), keys, rotation=25, ha="right", fontsize=8)
    ax.set_ylim(0, 1.35 * max(bottom, default=1.0) or 1.0)
    ax.legend(fontsize=7, loc="upper left")
    return bottom


def _memory_panel(ax: Any, summaries: Sequence[RunSummary], planned: Mapping[str, int]) -> None:
    keys = [s.spec.key for s in summaries]
    parts = {
        kind.replace("_", " "): [s.memory[0].get(kind, 0) / MIB for s in summaries]
        for kind in memory_kinds(summaries)
    }
    tops = _stacked(ax, keys, parts, "MiB")
    if len(summaries[0].memory) > 1:
        xs = [x for x, s in enumerate(summaries) for _ in s.memory[1:]]
        ys = [total_memory(m) / MIB for s in summaries for m in s.memory[1:]]
        ax.plot(
            xs, ys, ls="none", marker="_", ms=22, mew=2, color="black", label="other ranks' totals"
        )
    at = [(x, planned[s.spec.key] / MIB) for x, s in enumerate(summaries) if s.spec.key in planned]
    if at:
        ax.plot(
            [x + 0.3 for x, _ in at],
            [y for _, y in at],
            ls="none",
            marker="<",
            ms=7,
            color="black",
            label="planned, rank 0"
            + (" (hook state not planned)" if "hook_state" in memory_kinds(summaries) else ""),
        )
    # Room above the bars for a legend of up to nine entries, in two columns.
    ax.set_ylim(0, 1.7 * max([*tops, *(y for _, y in at)], default=1.0) or 1.0)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set(ylabel="MiB on the rank")
    ax.set_title("Memory per rank, by kind (bars: rank 0)")


def _bytes_panel(ax: Any, summaries: Sequence[RunSummary]) -> None:
    parts = {
        "gradients, in backward": [s.sent.gradients / MIB for s in summaries],
        "updated shards, after the step": [s.sent.parameters / MIB for s in summaries],
        "DiLoCo syncs, averaged per step": [s.sent.sync / MIB for s in summaries],
    }
    _stacked(ax, [s.spec.key for s in summaries], parts, "MiB")
    ax.set(ylabel="MiB sent per step by rank 0 (ring estimate)")
    ax.set_title("Bytes sent per step")


def _loss_bytes_panel(ax: Any, summaries: Sequence[RunSummary], colors: dict[str, str]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    steps = summaries[0].held_out[-1][0]
    sent = [s.sent.total * steps / MIB for s in summaries]
    for i, (s, mib) in enumerate(zip(summaries, sent, strict=True)):
        ax.plot(
            [mib],
            [s.final_held_out],
            ls="none",
            color=colors[s.spec.key],
            marker=RUN_MARKERS[i % len(RUN_MARKERS)],
            ms=9,
            label=s.spec.key,
        )
    # A log axis cannot place a run that sent nothing (a world of one rank).
    ax.set_xscale("log" if min(sent) > 0 else "symlog")
    # Labels at 1, 2 and 5 of each decade, as plain numbers: matplotlib's
    # labelled minor ticks crowd a narrow panel.
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.15, y=0.15)
    ax.set(
        xlabel=f"MiB sent by rank 0 in the {steps} steps (mean per counted step x {steps}; log)",
        ylabel=f"held-out loss after step {steps} (nats/byte)",
    )
    ax.set_title("Final held-out loss against bytes sent")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, which="both")


TIME_PARTS = (
    ("total", "step (forward+backward + optimizer.step)"),
    ("compute", "compute (forward+backward, no_sync)"),
    ("communication", "communication (+ hook math, waiting)"),
    ("optimizer", "optimizer step (local AdamW)"),
)


def _time_panel(ax: Any, summaries: Sequence[RunSummary]) -> None:
    """Each part's median per run, its quartiles as whiskers (the table's numbers)."""
    timed = [s for s in summaries if s.time is not None]
    width, top = 0.8 / len(TIME_PARTS), 1.0
    for i, (part, label) in enumerate(TIME_PARTS):
        spreads = [getattr(s.time, part) for s in timed]
        xs = [x + (i - (len(TIME_PARTS) - 1) / 2) * width for x in range(len(timed))]
        medians = [t.median for t in spreads]
        whiskers = [[t.median - t.q1 for t in spreads], [t.q3 - t.median for t in spreads]]
        ax.bar(xs, medians, width, yerr=whiskers, capsize=2, label=label, color=KIND_COLORS[i])
        top = max([top, *(t.q3 for t in spreads)])
    ax.set_xticks(
        range(len(timed)), [s.spec.key for s in timed], rotation=25, ha="right", fontsize=8
    )
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the whiskers
    ax.set(ylabel="ms per step on rank 0: median, whiskers q1 to q3")
    ax.set_title("Time per step, split (medians, quartiles)")
    ax.legend(fontsize=7, loc="upper left")
