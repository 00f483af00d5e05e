"""The shaped-link benchmark's tables, one measurement at one rate each
(:data:`PARTS`): the ZeRO step, DDP + ZeRO, DDP + PowerSGD and DiLoCo, each
with its headlines and the why of each missed target."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import bench_compressed
import bench_hooks
import bench_overlap
from links_setup import (
    DELAY_1_TARGET,
    FRAGMENTS,
    LONG_TARGET,
    OVERLAP_TARGET,
    POWERSGD_TARGET,
    PYTORCH,
    QUIET,
    TARGET_RATE,
    WORLD,
    ZERO_LABELS,
    ZERO_SETUPS,
    delay_formula,
    link_seconds,
    per_step,
    rate_label,
    streaming_name,
)
from links_why import diloco_why, link_factors, overlap_why, powersgd_why, zero_why
from report import Headline, Spread, md_table, paired_ratios


def _headline(
    benchmark: str,
    measure: str,
    value: Spread,
    target: float | None,
    why: Callable[[], str],
    short: str,
) -> Headline:
    if target is None:
        return Headline(benchmark, measure, value, short=short)
    met = value.median <= target
    return Headline(benchmark, measure, value, f"<= {target}", met, short, "" if met else why())


@attrs.frozen
class Part:
    """One measurement's share of a rate's subsection."""

    body: str
    headlines: tuple[Headline, ...] = attrs.field(converter=tuple)


def zero_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    pt = times[PYTORCH]
    held = rate == TARGET_RATE
    model = f"Adam, {raw['numel'] / 1e6:.1f}M params in {raw['tensors']} tensors"
    bench = f"link {rate_label(bits)}: ZeRO step ({model}, 2 gloo ranks)"
    rows, headlines = [], []
    for label in ZERO_LABELS:
        on = raw["on_link"][label]
        ratio = paired_ratios(times[label], pt)
        target = ZERO_SETUPS[label][1] if label in ZERO_SETUPS else None
        rows.append(
            [
                label,
                Spread.of(times[label]).scaled(1e3).fmt(1),
                ratio.fmt() if label != PYTORCH else "1.00",
                f"{raw['payload'][label] / 1e6:.1f}",
                f"{on / 1e6:.1f}",
                f"{link_seconds(on, bits) * 1e3:.1f}",
                f"<= {target}" if held and target is not None else "-",
            ]
        )
        if label == PYTORCH:
            continue
        headlines.append(
            _headline(
                bench,
                f"step time: {label} / PyTorch",
                ratio,
                target if held else None,
                lambda label=label, on=on: zero_why(label, times, on, bits),
                f"link {rate_label(bits)} ZeRO",
            )
        )
    steps = md_table(
        [
            "set-up",
            "step (ms)",
            "/ PyTorch",
            "payload sent / step (MB, both ranks)",
            "MB on the link / step",
            "their link time (ms)",
            "target",
        ],
        rows,
    )
    part_names = (
        bench_compressed.UPDATE,
        *bench_compressed.BYTES_ALONE.values(),
        *bench_compressed.CODEC_ALONE.values(),
    )
    link = raw["link_parts"]
    part_rows = [
        [
            name,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], pt).fmt(),
            f"{link[name] / 1e6:.1f}" if name in link else "-",
        ]
        for name in part_names
    ]
    parts = md_table(["part alone (rank 0)", "ms", "/ PyTorch step", "MB on the link"], part_rows)
    missed = [f"- {h.measure}: {h.why}." for h in headlines if h.met is False]
    body = "\n\n".join(
        [
            f"**ZeRO step** ({model}; {len(pt)} timed rounds): the payload is what both ranks "
            "hand to the collectives to send (each rank's segment, broadcast from its owner); "
            "MB on the link is the loopback's counter over one more step (payload, TCP/IP "
            "headers, acknowledgements), and its link time those bytes x 8 / the rate. The "
            "parts are one rank's share, timed in the same rounds: the update; each "
            "exchange's payloads broadcast alone; each codec alone (difference, encode, decode, "
            "add). Replicas bitwise equal across the ranks: "
            f"{'yes' if raw['equal'] else '**no**'}.",
            steps,
            parts,
            *(["Missed:", "\n".join(missed)] if missed else []),
        ]
    )
    return Part(body, headlines)


def overlap_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    grad_bytes = raw["grad_bytes"]
    factors = link_factors(raw["link_parts"], grad_bytes)
    on_link: dict[str, int] = raw["on_link"]
    held = rate == TARGET_RATE
    model = f"Adam, MLP {grad_bytes / 4e6:.1f}M params"
    bench = f"link {rate_label(bits)}: DDP + ZeRO ({model}, 2 gloo ranks)"
    rows = [
        [
            name,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], times["pytorch"]).fmt(),
            ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(raw["kinds"][name].items())),
            f"{on_link[name] / 1e6:.1f}",
            f"{link_seconds(on_link[name], bits) * 1e3:.1f}",
        ]
        for name in bench_overlap.SETUPS
    ]
    ratio = paired_ratios(times["overlapped"], times["pytorch"])
    headline = _headline(
        bench,
        "iteration time: overlapped / PyTorch's DDP + separate ZeRO step",
        ratio,
        OVERLAP_TARGET if held else None,
        lambda: overlap_why(times, on_link, factors, bits),
        f"link {rate_label(bits)} overlap",
    )
    table = md_table(
        [
            "iteration",
            "ms",
            "/ pytorch",
            "payload by collective (MB, rank 0)",
            "MB on the link",
            "its link time (ms)",
        ],
        rows,
    )
    parts = md_table(
        ["part alone (rank 0)", "ms", "/ pytorch", "MB on the link"],
        [
            [
                name,
                Spread.of(times[name]).scaled(1e3).fmt(1),
                paired_ratios(times[name], times["pytorch"]).fmt(),
                f"{raw['link_parts'][name] / 1e6:.1f}" if name in raw["link_parts"] else "-",
            ]
            for name in bench_overlap.PARTS
        ],
    )
    factor_line = ", ".join(f"{k} {v:.2f}x" for k, v in factors.items())
    gathered, gathered_text = bench_overlap.gather_headline(
        times, bench, f"link {rate_label(bits)} gather behind forward", held
    )
    both, both_text = bench_overlap.both_headlines(
        times,
        bench,
        f"link {rate_label(bits)} overlap + gather",
        held,
        (on_link["overlapped"], bits),
    )
    body = "\n\n".join(
        [
            f"**DDP + ZeRO** ({model}; {len(times['pytorch'])} timed rounds): 'overlapped' is "
            "zerofn's step inside backward (gradients sent to their owners, shards broadcast "
            "back), 'separate' DDP + zerofn's step after backward, 'pytorch' DDP's built-in "
            "all-reduce + PyTorch's `ZeroRedundancyOptimizer.step()`. MB on the link: the "
            "loopback's counter over one more iteration of each (PyTorch's payload is counted "
            "on a twin with PyTorch's Python all-reduce hook). The parts use gloo's own "
            "collectives, each on all the gradients' bytes "
            f"({grad_bytes / 1e6:.1f} MB): on the link they put {factor_line} of that.",
            table,
            parts,
            gathered_text,
            both_text,
            *(f"Missed ({h.measure}): {h.why}." for h in (headline, *both) if h.met is False),
        ]
    )
    return Part(body, (headline, gathered, *both))


def powersgd_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    on_link: dict[str, int] = raw["on_link"]
    ddp = times[bench_hooks.BUILTIN]
    numel = raw["numel"]
    held = rate == TARGET_RATE
    model = f"MLP {numel / 1e6:.1f}M params, rank {bench_hooks.RANK}"
    bench = f"link {rate_label(bits)}: DDP + PowerSGD ({model}, 2 gloo ranks)"
    ratio = paired_ratios(times["zerofn"], ddp)
    ours, theirs = on_link["zerofn"], on_link[bench_hooks.BUILTIN]
    headlines = [
        _headline(
            bench,
            "iteration time: zerofn PowerSGD / DDP all-reduce",
            ratio,
            POWERSGD_TARGET if held else None,
            lambda: powersgd_why(times, ours, theirs, bits),
            f"link {rate_label(bits)} PowerSGD",
        )
    ]
    aborted = raw.get("aborted")
    if not aborted:
        headlines.append(
            Headline(
                bench,
                "iteration time: zerofn PowerSGD / PyTorch's powerSGD_hook",
                paired_ratios(times["zerofn"], times["pytorch"]),
                short=f"link {rate_label(bits)} PowerSGD",
            )
        )

    def row(label: str, name: str) -> list[object]:
        if name not in times:
            return [label, "PyTorch's hook aborted", "-", "-", "-"]
        return [
            label,
            Spread.of(times[name]).scaled(1e3).fmt(1),
            paired_ratios(times[name], ddp).fmt() if name != bench_hooks.BUILTIN else "1.00",
            f"{on_link[name] / 1e6:.2f}",
            f"{link_seconds(on_link[name], bits) * 1e3:.1f}",
        ]

    table = md_table(
        ["iteration", "ms", "/ DDP all-reduce", "MB on the link", "its link time (ms)"],
        [
            row("DDP's built-in all-reduce", bench_hooks.BUILTIN),
            row("zerofn powerSGD_hook", "zerofn"),
            row("PyTorch's powerSGD_hook", "pytorch"),
        ],
    )
    notes = [
        f"**DDP + PowerSGD** ({model}; {len(ddp)} timed rounds): zerofn's `powerSGD_hook`, "
        "DDP's built-in all-reduce (no hook) and PyTorch's `powerSGD_hook` (one process group "
        "and state per bucket, as in the PowerSGD section) taking turns. MB on the link: the "
        "loopback's counter over one more iteration of each.",
        table,
    ]
    if aborted:
        notes.append(
            f"PyTorch's hook aborted: the run with it died ({aborted}); the rows above are "
            "from the same run repeated without it."
        )
    if headlines[0].met is False:
        notes.append(f"Missed: {headlines[0].why}.")
    return Part("\n\n".join(notes), headlines)


def diloco_part(raw: Mapping[str, Any], rate: str, bits: float) -> Part:
    times: dict[str, list[float]] = raw["times"]
    steps: dict[str, int] = raw["steps"]
    quiet = per_step(times[QUIET], steps[QUIET])
    model = f"MLP {raw['numel'] / 1e6:.1f}M params, AdamW inner"
    bench = f"link {rate_label(bits)}: DiLoCo ({model}, 2 gloo ranks)"
    long, short = raw["long"], raw["delay_1"]
    held: dict[str, list[tuple[str, float]]] = {}
    held.setdefault(long, []).append((long, LONG_TARGET))
    held.setdefault(short, []).append((streaming_name(1), DELAY_1_TARGET))
    rows, headlines = [], []
    for name, sample in times.items():
        ratio = paired_ratios(per_step(sample, steps[name]), quiet)
        wire = raw["wire"][name] / steps[name]
        targets = held.get(name, [])
        rows.append(
            [
                name,
                steps[name],
                Spread.of(per_step(sample, steps[name])).scaled(1e3).fmt(1),
                ratio.fmt() if name != QUIET else "1.00",
                f"{wire / 1e6:.2f}",
                f"{link_seconds(wire, bits) * 1e3:.1f}",
                "; ".join(f"<= {t}" for _, t in targets) or "-",
            ]
        )
        if name == QUIET:
            continue
        judged: list[tuple[str, float | None]] = [*targets] or [(name, None)]
        for shown, target in judged:
            headlines.append(
                _headline(
                    bench,
                    f"time per inner step: {shown} / no communication",
                    ratio,
                    target,
                    lambda name=name: diloco_why(name, raw, bits),
                    f"link {rate_label(bits)} DiLoCo",
                )
            )
    table = md_table(
        [
            "run",
            "window (inner steps)",
            "ms per inner step",
            "/ no communication",
            "MB on the link per inner step",
            "its link time (ms)",
            "target",
        ],
        rows,
    )
    formula = delay_formula(raw["fragment_link_bytes"], bits, raw["quiet_step"])
    codec = Spread.of([t / WORLD for t in raw["codec"]]).scaled(1e3).fmt(2)
    missed = [f"- {h.measure}: {h.why}." for h in headlines if h.met is False]
    same = (
        [f"Delay 1 already covers the link here: the run '{long}' is held to both targets."]
        if long == short
        else []
    )
    body = "\n\n".join(
        [
            f"**DiLoCo** ({model}; {len(quiet)} timed rounds): windows of inner steps (forward, "
            "backward, step) taking turns; each window holds whole syncs (a streaming window "
            "starts `delay` steps after a sync, so every sync it starts is applied inside it). "
            f"Blocking: one fragment, delay 0. Streaming: P = {FRAGMENTS} fragments, int8, at "
            "a delay long enough for the link and at delay 1. That delay is computed before "
            "the timed rounds from B, the bytes one fragment's int8 sync puts on the link "
            "(2 x the payload of every owner's slice, codes and block scales: the codes to "
            "the owner, the new anchor's codes back), the rate R and t, the inner step with "
            "no communication (the fastest of 5 windows on either rank, so that the delay still "
            "covers the link when the timed windows run faster):",
            f"`{formula}`",
            *same,
            table,
            f"The int8 sync's arithmetic alone (one rank's share of both ranks' syncs run "
            f"in the simulated world): {codec} ms per sync. MB on the link: the loopback's "
            "counter over one more window of each run.",
            *(["Missed:", "\n".join(missed)] if missed else []),
        ]
    )
    return Part(body, headlines)


PARTS: dict[str, Callable[[Mapping[str, Any], str, float], Part]] = {
    "zero": zero_part,
    "overlap": overlap_part,
    "powersgd": powersgd_part,
    "diloco": diloco_part,
}
