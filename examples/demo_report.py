"""The demo's text report: the results table and the lines that say what it shows.

Pure functions of the runs' summaries (:mod:`demo_summary`), so the tests
check them without training anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from demo_data import MIN_WORD, known_word_share, printable
from demo_summary import RunSummary, memory_kinds, total_memory

from zerofn.footprint import Footprint, RankBytes

PLANNED_KINDS = tuple(f.name for f in attrs.fields(RankBytes))
# Where sampled text starts to read as text: a model trained for --long writes
# English words in sentence shapes well above this share, a barely trained one
# letter soup far below it.
READABLE_SHARE = 0.8


def size(n: float) -> str:
    """Bytes in MiB, or KiB below one MiB."""
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, columns padded to their widest cell."""
    width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, width, strict=True)) + " |"

    rule = "| " + " | ".join("-" * w for w in width) + " |"
    return "\n".join([line(head), rule, *map(line, rows)])


def matches_plan(summary: RunSummary, plan: Footprint) -> bool:
    """Whether every rank's live bytes equal the planner's, for every kind it plans."""
    return all(
        all(memory.get(k, 0) == getattr(plan.ranks[rank], k) for k in PLANNED_KINDS)
        for rank, memory in enumerate(summary.memory)
    )


def _difference(s: RunSummary) -> str:
    d = s.max_loss_difference
    if d is None:
        return ""
    return "0 (bitwise equal)" if d == 0 else f"{d:.3g}"


def _target(s: RunSummary) -> str:
    if s.gap is None or s.gap.target is None:
        return ""
    return f"within {s.gap.target:.1%}: {'met' if s.gap.met else 'MISSED'}"


def _rows(s: RunSummary, kinds: Sequence[str], plan: Footprint | None) -> list[str]:
    """A run's column, one cell per :func:`row_labels` row."""
    t = s.time
    times = (
        ["-"] * 4
        if t is None
        else [f"{v:.0f}" for v in (t.total, t.compute, t.communication, t.optimizer)]
    )
    planned = "-" if plan is None else ("yes" if matches_plan(s, plan) else "no")
    return [
        f"{s.final_held_out:.4f}",
        "" if s.gap is None else f"{s.gap.relative:+.2%} vs {s.gap.baseline}",
        _target(s),
        _difference(s),
        f"{s.train_loss:.3f}",
        "yes" if s.identical else "NO",
        *(size(s.memory[0].get(k, 0)) for k in kinds),
        *(size(total_memory(m)) for m in s.memory),
        planned,
        *(size(b) for b in (s.sent.total, s.sent.gradients, s.sent.parameters, s.sent.sync)),
        *times,
    ]


def row_labels(world_size: int, kinds: Sequence[str]) -> list[str]:
    """The table's first column."""
    return [
        "held-out loss at the end (nats/byte)",
        "  gap to the baseline run",
        "  target for that gap",
        "max |training loss - baseline's|, all steps and ranks",
        "training loss, last 10 steps, rank 0",
        "parameters bitwise equal on every rank",
        *(f"memory, rank 0: {k.replace('_', ' ')}" for k in kinds),
        *(f"memory, rank {r}: total" for r in range(world_size)),
        "memory equals plan_footprint's prediction",
        "sent per step, rank 0 (ring estimate)",
        "  gradients, in backward",
        "  updated shards, after the step",
        "  DiLoCo syncs (averaged per step)",
        "time per step, rank 0 (mean ms)",
        "  compute (forward+backward, no_sync)",
        "  communication (backward + after the step)",
        "  optimizer step (the local AdamW)",
    ]


def table(summaries: Sequence[RunSummary], plans: Mapping[str, Footprint]) -> str:
    """The results table: one column per run."""
    kinds = memory_kinds(summaries)
    columns = [_rows(s, kinds, plans.get(s.spec.key)) for s in summaries]
    labels = row_labels(len(summaries[0].memory), kinds)
    keep = [i for i in range(len(labels)) if any(c[i] not in ("", "0.0 KiB") for c in columns)]
    rows = [[labels[i], *(c[i] for c in columns)] for i in keep]
    return format_table(["run", *(s.spec.key for s in summaries)], rows)


def legend(summaries: Sequence[RunSummary]) -> list[str]:
    """What each run is, one line each."""
    return [f"  {s.spec.key}: {s.spec.title}" for s in summaries]


def _ratio(new: float, old: float) -> str:
    return f"{size(old)} -> {size(new)} (x{new / old:.2f})" if old else size(new)


def findings(summaries: Sequence[RunSummary]) -> list[str]:
    """One line per run with a baseline: what changed against it, and why."""
    by_key = {s.spec.key: s for s in summaries}
    out = []
    for s in summaries:
        spec, gap = s.spec, s.gap
        if gap is None:
            continue
        base = by_key[gap.baseline]
        loss = (
            "held-out loss equal"
            if gap.absolute == 0
            else f"held-out loss {gap.relative:+.2%} ({gap.absolute:+.4f} nats/byte)"
        )
        head = f"{spec.key} vs {base.spec.key}:"
        if spec.exact:
            mem = _ratio(total_memory(s.memory[0]), total_memory(base.memory[0]))
            same = (
                "training losses bitwise equal at every step on every rank (max |difference| = 0)"
                if s.max_loss_difference == 0
                else f"training losses NOT bitwise equal (max |difference| "
                f"{s.max_loss_difference:.2g})"
            )
            sent = _ratio(s.sent.total, base.sent.total)
            out.append(
                f"{head} {same}; {loss}. Memory on rank 0 {mem}: AdamW's state is sharded. "
                f"Bytes sent per step {sent}: the updated shards travel after the step."
            )
        elif spec.gradients == "powersgd":
            grads = _ratio(s.sent.gradients, base.sent.gradients)
            hook = size(s.memory[0].get("hook_state", 0))
            out.append(
                f"{head} {loss}: PowerSGD's own effect, both run the same ZeRO. Gradient bytes "
                f"per step {grads}; its error feedback and factors hold {hook} per rank."
            )
        elif spec.exchange_compression is not None:
            verdict = _target(s)
            if gap.met is False:
                verdict += f" ({gap.why_missed})"
            shards = _ratio(s.sent.parameters, base.sent.parameters)
            out.append(f"{head} {loss}, {verdict}. Updated shards sent per step {shards}.")
        elif spec.optimizer == "diloco":
            sent = _ratio(s.sent.total, base.sent.total)
            state = size(s.memory[0].get("diloco_state", 0))
            syncs = f"one sync every {spec.sync_every} steps, nothing in between"
            if spec.fragments > 1:
                syncs = (
                    f"each of {spec.fragments} fragments synced every {spec.sync_every} steps, "
                    f"one every {spec.sync_every // spec.fragments}, applied {spec.delay} "
                    "step(s) after it starts"
                )
            out.append(
                f"{head} {loss}. Bytes sent per step {sent}: {syncs}; its anchor and outer "
                f"state hold {state} per rank."
            )
        else:
            sent = _ratio(s.sent.total, base.sent.total)
            out.append(f"{head} {loss}; bytes sent per step {sent}.")
    differ = [s.spec.key for s in summaries if not s.identical]
    if differ:
        out.append(
            f"Parameters differ between ranks at some evaluation in: {', '.join(differ)} "
            "(their held-out loss is the mean over the ranks' models)."
        )
    return out


def dominant_line(summaries: Sequence[RunSummary]) -> str:
    """One sentence: what takes most of a step on this machine, measured on rank 0."""
    names = {
        "compute": "compute",
        "communication": "communication",
        "optimizer": "the optimizer step",
    }
    timed = [(s.spec.key, s.time) for s in summaries if s.time is not None]
    if not timed:
        return "The step's time was not split: that takes at least 2 steps."
    shares = [(key, {k: getattr(t, k) / (t.total or 1.0) for k in names}) for key, t in timed]
    top = max(names, key=lambda k: shares[0][1][k])
    each = ", ".join(f"{share[top]:.0%} of {key}'s" for key, share in shares)
    line = f"Time per step on this machine is mostly {names[top]} ({each})."
    if top == "compute":
        line += (
            " Here the ranks talk through local memory, so fewer bytes barely shorten a "
            "step; they pay where the link between ranks is the bottleneck."
        )
    return line


METHOD = (
    "How it is measured: every run starts from the same weights and trains on the same "
    "batches. Held-out loss: the same windows of held-out text at every evaluation, half of "
    "them evaluated on each rank. Bytes sent: each collective's payload times a rank's share "
    "under ring algorithms (all-reduce 2(N-1)/N, broadcast (N-1)/N), counted with "
    "zerofn_torch.traffic.collective_traffic over the last steps; DDP's built-in all-reduce, "
    "issued from C++ where that cannot see it, is counted as the gradients' bytes. Time: "
    "compute is forward+backward re-run under no_sync() on some steps' batches; "
    "communication is the rest of forward+backward (all-reduce or PowerSGD, waiting for the "
    "other rank) plus optimizer.step() outside the local AdamW (ZeRO's exchange, quantizing, "
    "DiLoCo's syncs). Memory: live tensors after the last step."
)


def samples(
    summaries: Sequence[RunSummary],
    texts: Mapping[str, bytes],
    prompt: bytes,
    known: frozenset[bytes],
) -> str:
    """Each run's sampled text after ``prompt``, indented, where it reads as
    text: at least ``READABLE_SHARE`` of its words are words of the training
    text (``known``). A run whose text does not is named with its share instead."""
    out = [
        f"Sampled text (prompt {prompt.decode()!r}, temperature 0.8, the same random numbers "
        f"for every run), shown where at least {READABLE_SHARE:.0%} of its words of "
        f"{MIN_WORD}+ letters are words of the training text:"
    ]
    shares = {s.spec.key: known_word_share(texts[s.spec.key], known) for s in summaries}
    for s in summaries:
        share = shares[s.spec.key]
        if share < READABLE_SHARE:
            out.append(f"  {s.spec.key}: not shown, {share:.0%} of its words are words")
            continue
        out.append(f"  {s.spec.key} ({share:.0%} of its words are words):")
        text = printable(prompt + texts[s.spec.key])
        out.extend(f"    | {line}" for line in text.splitlines()[:8])
    if any(share < READABLE_SHARE for share in shares.values()):
        out.append("  (too little training for text to read as text: --long trains to it)")
    return "\n".join(out)
