"""The demo's text report: the results table and the lines that say what it shows.

Pure functions of the runs' summaries (:mod:`demo_summary`), so the tests
check them without training anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from demo_data import MIN_WORD, known_word_share, printable
from demo_summary import SPIKE_SPAN, WARMUP_STEPS, RunSummary, Spread, memory_kinds, total_memory

from zerofn.footprint import Footprint

# Where sampled text starts to read as text: a model trained for --long writes
# English words in sentence shapes well above this share, a barely trained one
# letter soup far below it.
READABLE_SHARE = 0.8
REFERENCE = "ddp"  # the run whose memory the others' is explained against


@attrs.frozen
class Plan:
    """A run's predicted bytes per rank, by kind (the kinds it plans).

    Attributes:
        ranks: per rank, kind -> bytes (a kind absent here is not planned).
    """

    ranks: tuple[Mapping[str, int], ...]

    @classmethod
    def of(
        cls, footprint: Footprint, world_size: int | None = None, **extra: Sequence[int]
    ) -> Plan:
        """From the planner's :class:`Footprint`: its ranks, or its rank 0 on
        each of ``world_size`` ranks (a run whose ranks hold the same as one
        unsharded rank); ``extra``: kind -> bytes per rank, planned elsewhere."""
        ranks = [attrs.asdict(r) for r in footprint.ranks]
        if world_size is not None:
            ranks = [dict(ranks[0]) for _ in range(world_size)]
        for kind, per_rank in extra.items():
            for memory, n in zip(ranks, per_rank, strict=True):
                memory[kind] = n
        return cls(tuple(ranks))

    def total(self, rank: int = 0) -> int:
        return sum(self.ranks[rank].values())


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


def matches_plan(summary: RunSummary, plan: Plan) -> bool:
    """Whether every rank's live bytes equal the plan's, for every kind it plans."""
    return len(summary.memory) == len(plan.ranks) and all(
        all(memory.get(k, 0) == n for k, n in planned.items())
        for memory, planned in zip(summary.memory, plan.ranks, strict=True)
    )


def unplanned(summary: RunSummary, plan: Plan) -> list[str]:
    """The kinds some rank of the run holds bytes of that the plan leaves out."""
    held = memory_kinds([summary])
    return [k for k in held if any(k not in planned for planned in plan.ranks)]


def _plan_cells(s: RunSummary, plan: Plan | None) -> list[str]:
    """The planned total on rank 0 (naming the kinds it leaves out), and
    whether every rank's live bytes equal the plan, kind by kind."""
    if plan is None:
        return ["not planned", ""]
    missing = [k.replace("_", " ") for k in unplanned(s, plan)]
    planned = " + ".join([size(plan.total()), *missing])
    return [planned, "yes" if matches_plan(s, plan) else "NO"]


def _target(s: RunSummary) -> str:
    if s.gap is None or s.gap.target is None:
        return ""
    return f"within {s.gap.target:.1%}: {'met' if s.gap.met else 'MISSED'}"


def _equal(s: RunSummary) -> str:
    """Whether the training losses equal the baseline's bitwise: ``NO`` where
    the run claims they do (``exact``), a plain ``no`` where it does not."""
    if s.losses_equal is None:
        return ""
    return "yes" if s.losses_equal else ("NO" if s.spec.exact else "no")


def _spread(t: Spread) -> str:
    return f"{t.median:.0f} [{t.q1:.0f}, {t.q3:.0f}]"


def _rows(s: RunSummary, kinds: Sequence[str], plan: Plan | None) -> list[str]:
    """A run's column, one cell per :func:`row_labels` row."""
    t = s.time
    times = (
        ["-"] * 4
        if t is None
        else [_spread(x) for x in (t.total, t.compute, t.communication, t.optimizer)]
    )
    base = s.spec.baseline
    return [
        f"{s.final_held_out:.4f}",
        "" if s.gap is None else f"{s.gap.relative:+.2%} vs {s.gap.baseline}",
        _target(s),
        f"{s.train_loss:.4f}",
        "" if s.train_gap is None else f"{s.train_gap:+.2%} vs {base}",
        _equal(s),
        "yes" if s.identical else "NO",
        *(size(s.memory[0].get(k, 0)) for k in kinds),
        *(size(total_memory(m)) for m in s.memory),
        *_plan_cells(s, plan),
        *(size(b) for b in (s.sent.total, s.sent.gradients, s.sent.parameters, s.sent.sync)),
        *times,
    ]


def row_labels(world_size: int, kinds: Sequence[str], train_window: int) -> list[str]:
    """The table's first column."""
    return [
        "held-out loss at the end (nats/byte)",
        "  gap to the baseline run",
        "  target for that gap",
        f"training loss, mean of the last {train_window} steps, all ranks",
        "  gap to the baseline's, same steps",
        "training losses bitwise equal to the baseline's, every step",
        "parameters bitwise equal on every rank",
        *(f"memory, rank 0: {k.replace('_', ' ')}" for k in kinds),
        *(f"memory, rank {r}: total" for r in range(world_size)),
        "  planned (plan_footprint), rank 0 total",
        "  memory equals the plan, every rank and kind",
        "sent per step, rank 0 (ring estimate)",
        "  gradients, in backward",
        "  updated shards, after the step",
        "  DiLoCo syncs (averaged per step)",
        "time per step, rank 0, ms: median [quartiles]",
        "  compute (forward+backward, no_sync)",
        "  communication (backward + after the step)",
        "  optimizer step (the local AdamW)",
    ]


def table(summaries: Sequence[RunSummary], plans: Mapping[str, Plan]) -> str:
    """The results table: one column per run."""
    kinds = memory_kinds(summaries)
    columns = [_rows(s, kinds, plans.get(s.spec.key)) for s in summaries]
    labels = row_labels(len(summaries[0].memory), kinds, summaries[0].train_window)
    keep = [i for i in range(len(labels)) if any(c[i] not in ("", "0.0 KiB") for c in columns)]
    rows = [[labels[i], *(c[i] for c in columns)] for i in keep]
    return format_table(["run", *(s.spec.key for s in summaries)], rows)


def _why(kind: str, s: RunSummary) -> str:
    """What a kind of memory is, in a run."""
    spec = s.spec
    if kind == "master_weights":
        if spec.exchange_compression is not None:
            return (
                "float32 masters of its shard: the exact values the compressed exchange "
                "sends differences of"
            )
        return "float32 masters of its shard, which AdamW steps"
    if kind == "exchange_buffers":
        if spec.exchange_compression is not None:
            return (
                "payload buffers: every rank's codes and scales as received, and a float32 "
                "scratch the differences are taken in"
            )
        return "the flat buffers the exchange goes through"
    if kind == "hook_state":
        return "PowerSGD's error feedback and low-rank factors"
    if kind == "diloco_state":
        return "DiLoCo's anchor and outer momentum, for the slices it owns"
    if kind == "optimizer_state":
        return "AdamW's moments" + (", of its shard" if spec.optimizer == "zero" else "")
    return kind.replace("_", " ")


def memory_notes(summaries: Sequence[RunSummary]) -> list[str]:
    """Why each run that holds more than ``ddp`` on rank 0 does: the kinds it
    holds more of, and those it holds less of (none if ``ddp`` did not run)."""
    by_key = {s.spec.key: s for s in summaries}
    if REFERENCE not in by_key:
        return []
    ref = by_key[REFERENCE].memory[0]
    out = []
    for s in summaries:
        mine = s.memory[0]
        if s.spec.key == REFERENCE or total_memory(mine) <= total_memory(ref):
            continue
        kinds = memory_kinds([s, by_key[REFERENCE]])
        more = [k for k in kinds if mine.get(k, 0) > ref.get(k, 0)]
        less = [k for k in kinds if mine.get(k, 0) < ref.get(k, 0)]
        parts = [
            f"+{size(mine.get(k, 0) - ref.get(k, 0))} {k.replace('_', ' ')} ({_why(k, s)})"
            for k in more
        ]
        parts += [
            f"-{size(ref.get(k, 0) - mine.get(k, 0))} {k.replace('_', ' ')} ({_why(k, s)})"
            for k in less
        ]
        out.append(
            f"  {s.spec.key} holds {size(total_memory(mine))} against {REFERENCE}'s "
            f"{size(total_memory(ref))}: " + "; ".join(parts) + "."
        )
    if out:
        out.insert(0, f"Why a run holds more memory than {REFERENCE} (rank 0, by kind):")
    return out


def time_note(summaries: Sequence[RunSummary]) -> str:
    """How far apart equal work measures here: the compute medians of runs
    that do the same forward and backward (the same model, batches and dtype,
    under ``no_sync``)."""
    groups: dict[str, list[tuple[str, Spread]]] = {}
    for s in summaries:
        if s.time is not None:
            groups.setdefault(str(s.spec.param_dtype), []).append((s.spec.key, s.time.compute))
    same = max(groups.values(), key=len, default=[])
    if not same:
        return "The step's time was not split: that takes at least 2 steps."
    lo = min(same, key=lambda x: x[1].median)
    hi = max(same, key=lambda x: x[1].median)
    samples = same[0][1].samples
    line = (
        f"Time is rank 0's: medians, and in brackets the quartiles [q1, q3] over the steps "
        f"(compute and communication over the {samples} steps whose forward+backward was re-run "
        f"under no_sync; the step and the optimizer over every step after the first "
        f"{WARMUP_STEPS}). "
    )
    if len(same) > 1:
        line += (
            f"Compute is the same work in {', '.join(k for k, _ in same)} (the same model on the "
            f"same batches): its medians span {lo[1].median:.0f} ms ({lo[0]}) to "
            f"{hi[1].median:.0f} ms ({hi[0]}), which is how far apart equal work measures on "
            "this machine; a difference between two runs smaller than that, or within their "
            "quartiles, is noise."
        )
    return line


def legend(summaries: Sequence[RunSummary]) -> list[str]:
    """What each run is, one line each."""
    return [f"  {s.spec.key}: {s.spec.title}" for s in summaries]


def _ratio(new: float, old: float) -> str:
    return f"{size(old)} -> {size(new)} (x{new / old:.2f})" if old else size(new)


def _worst(s: RunSummary) -> str:
    """Where a run's training loss differs most from its baseline's, and
    whether that is one run's spike (empty: equal at every step)."""
    w = s.worst_step
    if w is None or w.difference == 0:
        return ""
    high, low = max(w.loss, w.baseline_loss), min(w.loss, w.baseline_loss)
    higher, lower = (
        (s.spec.baseline, s.spec.key) if w.higher_is_baseline else (s.spec.key, s.spec.baseline)
    )
    head = (
        f" The largest single-step difference in training loss, {w.difference:.3g} at step "
        f"{w.step} on rank {w.rank}, "
    )
    if w.spike:
        return head + (
            f"is a spike in {higher}'s loss: {high:.3f} there against {lower}'s {low:.3f}, where "
            f"over the {SPIKE_SPAN} steps either side {higher}'s median loss is "
            f"{w.usual_higher:.3f} and the median difference {w.usual_difference:.3g}. One "
            "run's excursion, not a gap between the runs."
        )
    return head + (
        f"is where {higher}'s loss was the higher ({high:.3f} against {low:.3f}); over the "
        f"{SPIKE_SPAN} steps either side the median difference is {w.usual_difference:.3g}."
    )


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
        if s.train_gap:
            loss += f", training loss over the last {s.train_window} steps {s.train_gap:+.2%}"
        head = f"{spec.key} vs {base.spec.key}:"
        worst = _worst(s)
        if spec.exact:
            mem = _ratio(total_memory(s.memory[0]), total_memory(base.memory[0]))
            same = (
                "training losses bitwise equal at every step on every rank"
                if s.losses_equal
                else "training losses NOT bitwise equal"
            )
            sent = _ratio(s.sent.total, base.sent.total)
            out.append(
                f"{head} {same}; {loss}. Memory on rank 0 {mem}: AdamW's state is sharded. "
                f"Bytes sent per step {sent}: the updated shards travel after the step.{worst}"
            )
        elif spec.gradients == "powersgd":
            grads = _ratio(s.sent.gradients, base.sent.gradients)
            hook = size(s.memory[0].get("hook_state", 0))
            out.append(
                f"{head} {loss}: PowerSGD's own effect, both run the same ZeRO. Gradient bytes "
                f"per step {grads}; its error feedback and factors hold {hook} per rank.{worst}"
            )
        elif spec.exchange_compression is not None:
            verdict = _target(s)
            if gap.met is False:
                verdict += f" ({gap.why_missed})"
            shards = _ratio(s.sent.parameters, base.sent.parameters)
            out.append(
                f"{head} {loss}; held-out gap {verdict}. Updated shards sent per step "
                f"{shards}.{worst}"
            )
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
                f"state hold {state} per rank.{worst}"
            )
        else:
            sent = _ratio(s.sent.total, base.sent.total)
            out.append(f"{head} {loss}; bytes sent per step {sent}.{worst}")
    differ = [s.spec.key for s in summaries if not s.identical]
    if differ:
        out.append(
            f"Parameters differ between ranks at some evaluation in: {', '.join(differ)} "
            "(their held-out loss is the mean over the ranks' models)."
        )
    return out


def dominant_line(summaries: Sequence[RunSummary]) -> str:
    """One sentence: what takes most of a step on this machine, measured on
    rank 0 (each part's median, as a share of the three medians' sum)."""
    names = {
        "compute": "compute",
        "communication": "communication",
        "optimizer": "the optimizer step",
    }
    timed = [(s.spec.key, s.time) for s in summaries if s.time is not None]
    if not timed:
        return "The step's time was not split: that takes at least 2 steps."
    shares = []
    for key, t in timed:
        medians = {k: getattr(t, k).median for k in names}
        whole = sum(medians.values()) or 1.0
        shares.append((key, {k: v / whole for k, v in medians.items()}))
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
    "them evaluated on each rank. Training loss: each rank's loss on its slice of the batch, "
    "averaged over the last steps and the ranks, so that no single step's spike decides the "
    "comparison; the bitwise row compares every step on every rank. Bytes sent: each "
    "collective's payload times a rank's share under ring algorithms (all-reduce 2(N-1)/N, "
    "broadcast (N-1)/N), counted with zerofn_torch.runtime.traffic.collective_traffic over the "
    "last "
    "steps; DDP's built-in all-reduce, issued from C++ where that cannot see it, is counted as "
    "the gradients' bytes. Time: compute is forward+backward re-run under no_sync() on some "
    "steps' batches; communication is the rest of forward+backward on those steps "
    "(all-reduce or PowerSGD, waiting for the other rank) plus optimizer.step() outside the "
    "local AdamW (ZeRO's exchange, quantizing, DiLoCo's syncs); the runs take turns at going "
    "first, so that each is timed in every place of the order. Memory: live tensors after the "
    "last step. Planned: "
    "zerofn.footprint.plan_footprint with each run's options (the compressed runs' "
    "exchange_compression included); ddp and DiLoCo's inner AdamW hold what one unsharded "
    "rank holds (planned with world_size=1), DiLoCo's outer state by "
    "zerofn.diloco.footprint.outer_state_bytes; PowerSGD's hook state is not planned."
)


def samples(
    summaries: Sequence[RunSummary],
    texts: Mapping[str, bytes],
    prompt: bytes,
    known: frozenset[bytes],
) -> str:
    """Each run's sampled text after ``prompt``, indented, where it reads as
    text: at least ``READABLE_SHARE`` of its words occur in the training text
    (``known``). The others are named in one line that says why not: the
    share, after how many steps (read from the last evaluation), and how to
    train until they read as text."""
    steps = summaries[0].held_out[-1][0]
    words = f"words ({MIN_WORD}+ letters) occur in the training text"
    out = [
        f"Sampled text (prompt {prompt.decode()!r}, temperature 0.8, the same random numbers "
        f"for every run), shown where at least {READABLE_SHARE:.0%} of its {words}:"
    ]
    shares = {s.spec.key: known_word_share(texts[s.spec.key], known) for s in summaries}
    for s in summaries:
        share = shares[s.spec.key]
        if share >= READABLE_SHARE:
            out.append(f"  {s.spec.key} ({share:.0%} of its {words}):")
            text = printable(prompt + texts[s.spec.key])
            out.extend(f"    | {line}" for line in text.splitlines()[:8])
    hidden = [f"{key} {share:.0%}" for key, share in shares.items() if share < READABLE_SHARE]
    if hidden:
        out.append(
            f"  Sample not shown for {len(hidden)} of {len(shares)} runs: after {steps} steps "
            f"only this share of their {words}: {', '.join(hidden)}. That is letter soup, not "
            f"yet text; --long trains until at least {READABLE_SHARE:.0%} do."
        )
    return "\n".join(out)
