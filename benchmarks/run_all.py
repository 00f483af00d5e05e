"""``make bench``: every benchmark in one run, written to one page and one figure.

Runs, first, the features that save bytes on shaped links (1 and 10 Gbit/s
loopbacks of a network namespace: the ZeRO step exact / int8 / int4, DDP +
ZeRO overlapped, DDP + PowerSGD and DiLoCo against PyTorch or no
communication; skipped with the reason where namespaces cannot be made),
then the ZeRO step, the ZeRO step by partition mode against its floor, DDP +
PowerSGD, overlap, mixed precision (bytes per parameter, exchange bytes and
step time of bf16 + fp32 masters against PyTorch's ZeRO on fp32), the
compressed exchange (int8/int4 bytes per step against the exact exchange, the
step against PyTorch's ZeRO and its floor, and a 1,000-step error soak on the
simulated world), DiLoCo (bytes per inner step against DDP, peak bytes with
fragments, bytes per sync of each codec, outer state per rank, step time with
a delayed sync), DiLoCo's codecs (2-bit and top-k syncs against exact
DiLoCo: bytes, held-out loss, codec time, time to a target loss across a
100 Mbit/s link), partition
imbalance and core scaling benchmarks, saving
while training (a background sharded save against a blocking one), then the
soak (2,000 steps of DDP + PowerSGD + the overlapped ZeRO step: replicas
bitwise equal, memory flat), the kill-and-restart soak under torchrun
(steps lost per kill, restart time), going on after a lost rank with
``redundancy=2`` (its cost per step against ``redundancy=1`` and its floor,
and a loss's seconds, bytes moved and steps lost), and faults at random
moments (over a hundred runs on 3, 4 and 8 ranks, each checked for
consistency), each also runnable alone
(``bench_links.py``, ``bench_zero.py``, ``bench_modes.py``, ``bench_hooks.py``,
``bench_overlap.py``, ``bench_precision.py``, ``bench_compressed.py``,
``bench_diloco.py``, ``bench_diloco_codecs.py``,
``bench_checkpoint.py``, ``bench_soak.py``, ``bench_soak_restart.py``,
``bench_elastic.py``, ``bench_random_losses.py``, ``bench_recovery.py``); prints
each section as it ends, and writes:

* ``docs/benchmarks.md``: the summary table (every ratio with its spread and
  its target), the figure, then each benchmark's own tables. It is the docs
  site's benchmark page, so a fresh ``make bench`` updates the site.
* ``docs/img/benchmarks.png``: the summary ratios with their interquartile
  ranges, DiLoCo's compute utilization against link rate (measured and the
  papers' model), bytes per parameter against world size, partition imbalance against
  world size, planning time against model size, the soak's resident memory
  against step.
* the figures README.md (its headline table: a few summary rows, short),
  docs/zero.md, docs/overlap.md, docs/powersgd.md,
  docs/compressed_exchange.md, docs/diloco.md and docs/links.md
  quote, in their ``<!-- bench:NAME:begin -->`` blocks (full runs only;
  see ``generated_blocks.py``), among them the rate at which each feature
  starts to pay (``pays-at-*``, from the link section).
* ``docs/resilience.md``: the kill-and-restart soak's table, between its
  ``<!-- soak:begin -->`` and ``<!-- soak:end -->`` markers (every run;
  ``--quick``: into a copy under ``benchmarks/out/``), and, in its ``elastic``
  block (full runs only), what ``redundancy=2`` costs and what a loss costs
  with it, beside the restart figures of that soak (which runs first).
* ``docs/design.md``: zerofn's code lines against PyTorch's per feature
  (``code_lines.py``), in its ``code-lines`` block; counted, not measured,
  so every run rewrites it before any benchmark starts, ``--quick``,
  ``--only`` and ``--out`` included.

``--quick`` shrinks every benchmark for a smoke run and, unless ``--out`` is
given, writes under ``benchmarks/out/`` instead of over the committed pages.
``--rewrite-readme`` runs nothing: it rebuilds README's headline table from the
summary table on docs/benchmarks.md (as the last full run wrote it); so does
``python benchmarks/generated_blocks.py``, which needs none of the benchmarks'
own dependencies (matplotlib).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import bench_checkpoint
import bench_compressed
import bench_diloco
import bench_diloco_codecs
import bench_elastic
import bench_hooks
import bench_links
import bench_modes
import bench_overlap
import bench_precision
import bench_random_losses
import bench_recovery
import bench_soak
import bench_soak_restart
import bench_zero
import matplotlib

matplotlib.use("Agg")  # files only; no display here or in CI
import matplotlib.pyplot as plt
from generated_blocks import quote_everywhere, rewrite_counted, rewrite_readme
from matplotlib.axes import Axes
from report import Headline, Panel, Section, environment, headline_table, parser_for, run_benches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Order of the page: the link figures first (where the features that save
# bytes are for), the comparisons with PyTorch next, then the core alone,
# then the soak (the longest, and a check rather than a comparison).
BENCHES: dict[str, Callable[[bool], Section]] = {
    "links": bench_links.bench_links,
    "zero-step": bench_zero.bench_zero_step,
    "modes": bench_modes.bench_modes,
    "powersgd": bench_hooks.bench_powersgd,
    "overlap": bench_overlap.bench_overlap,
    "precision": bench_precision.bench_precision,
    **bench_compressed.BENCHES,
    "diloco": bench_diloco.bench_diloco,
    **bench_diloco_codecs.BENCHES,
    "imbalance": bench_zero.bench_imbalance,
    "scaling": bench_zero.bench_scaling,
    "checkpoint": bench_checkpoint.bench_checkpoint,
    "soak": bench_soak.bench_soak,
    "restart": bench_soak_restart.bench_restart,
    # After the restart soak: it quotes the figures that soak just wrote.
    "elastic": bench_elastic.bench_elastic,
    **bench_random_losses.BENCHES,
    **bench_recovery.BENCHES,
}


def page(sections: Sequence[Section], image: str, quick: bool, seconds: float) -> str:
    """The Markdown page: summary, figure, then every section."""
    headlines = [h for s in sections for h in s.headlines]
    parts = [
        "# Benchmarks" + (" (--quick smoke run)" if quick else ""),
        "<!-- Written by `make bench` (benchmarks/run_all.py); edit that, not this. -->",
        f"Measured by `make bench` on {environment()} Every timing is taken with zerofn "
        "and PyTorch (or two zerofn set-ups) taking turns in the same process group, and "
        "every ratio's spread is over those rounds: median [first quartile, third "
        "quartile]. No test asserts on time; these numbers are what this machine showed. "
        "Where a target is missed, the summary's last column says why, from parts timed in "
        "the same rounds (the local update alone, the bytes alone); each section below "
        "gives the parts.",
        "## Summary",
        headline_table(headlines),
        f"![Benchmark summary]({image})",
        *(s.markdown() for s in sections),
        f"_All benchmarks took {seconds:.0f} s._",
    ]
    return "\n\n".join(parts) + "\n"


def _ratio_panel(ax: Axes, headlines: Sequence[Headline]) -> None:
    rows = [h for h in headlines if "time" in h.measure and h.value.n > 1]
    labels = [f"{h.short or h.benchmark}: {h.measure.split(':')[1].strip()}" for h in rows]
    for i, h in enumerate(rows):
        v = h.value
        ax.errorbar(
            v.median,
            i,
            xerr=[[v.median - v.q1], [v.q3 - v.median]],
            fmt="o",
            color="tab:green" if h.met else "tab:red" if h.met is False else "tab:gray",
            capsize=3,
        )
        if h.target.startswith("<="):
            ax.plot(float(h.target[2:]), i, marker="|", color="black", markersize=12)
    ax.axvline(1.0, color="gray", linestyle=":")
    ax.set_yticks(range(len(rows)), [_short(label) for label in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (median, IQR); | = target; < 1 is better")
    ax.set_title("Timed ratios (zerofn / PyTorch or alternative)")


def _short(label: str, width: int = 60) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _curve_panel(ax: Axes, panel: Panel) -> None:
    markers = "os^vDx"
    for i, curve in enumerate(panel.curves):
        # Curves often coincide (greedy = balanced on most models): shrinking
        # markers and alternating dashes keep each one visible.
        ax.plot(
            curve.x,
            curve.y,
            marker=markers[i % len(markers)],
            markersize=9 - i,
            linestyle="-" if i % 2 == 0 else "--",
            label=curve.label,
        )
    if panel.log_x:
        ax.set_xscale("log")
        ticks = sorted({x for curve in panel.curves for x in curve.x})
        ax.set_xticks(ticks, [f"{x:,g}" for x in ticks])
        ax.minorticks_off()
    if panel.log_y:
        ax.set_yscale("log")
    ax.set_xlabel(panel.x_label)
    ax.set_ylabel(panel.y_label)
    ax.set_title(panel.title)
    ax.legend(fontsize=6)


def figure(sections: Sequence[Section], path: str) -> None:
    """Write the summary figure: timed ratios, then each section's panels."""
    panels = [p for s in sections for p in s.panels]
    fig, axes = plt.subplots(
        1 + len(panels), 1, figsize=(10, 3.6 * (1 + len(panels))), layout="constrained"
    )
    axes_list = list(axes) if len(panels) else [axes]
    _ratio_panel(axes_list[0], [h for s in sections for h in s.headlines])
    for ax, panel in zip(axes_list[1:], panels, strict=True):
        _curve_panel(ax, panel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = parser_for(BENCHES, __doc__)
    parser.add_argument("--out", help="Markdown page (default docs/benchmarks.md)")
    parser.add_argument(
        "--rewrite-readme",
        action="store_true",
        help="run nothing: rebuild README's headline table from docs/benchmarks.md's summary",
    )
    args = parser.parse_args(argv)
    if args.rewrite_readme:
        rewrite_readme(ROOT)
        print("(README.md's headline table rebuilt from docs/benchmarks.md)")
        return
    out = args.out or (
        os.path.join(ROOT, "benchmarks", "out", "benchmarks.md")
        if args.quick
        else os.path.join(ROOT, "docs", "benchmarks.md")
    )
    image = os.path.join("img", "benchmarks.png")
    counted = rewrite_counted(ROOT)
    print(f"(code lines against PyTorch's counted into {', '.join(counted)})")
    print(environment(), flush=True)
    started = time.perf_counter()
    sections = run_benches(BENCHES, args.quick, args.only)
    seconds = time.perf_counter() - started
    figure(sections, os.path.join(os.path.dirname(out), image))
    text = page(sections, image, args.quick, seconds)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print("\n## Summary\n\n" + headline_table([h for s in sections for h in s.headlines]))
    print(f"\n(written to {out} and {os.path.join(os.path.dirname(out), image)})")
    if not args.quick and not args.only and not args.out:
        # Only a full run speaks for every figure the pages quote.
        pages = quote_everywhere(ROOT, dict(zip(BENCHES, sections, strict=True)), environment())
        print(f"(and the figures quoted in {', '.join(pages)})")


if __name__ == "__main__":
    main()
