"""What ``redundancy=2`` costs per step, and what losing a rank costs with it.

1. **The cost per step** (2 and 3 gloo ranks on CPU, one thread each; an MLP of
   ~4M parameters, in each configuration of ``train_elastic.CONFIGS`` stepped
   after backward, :data:`elastic_costs.COSTED`;
   DDP + ``zerofn_torch.ZeroRedundancyOptimizer(Adam)``). One
   process group holds two copies of the model, one trained with
   ``redundancy=1`` and one with ``redundancy=2``; their iterations (forward,
   backward with DDP's all-reduce, the ZeRO step) take turns round by round
   with the floor of what ``redundancy=2`` adds: a plain ``torch.optim.Adam``
   step over fresh tensors of the carried shard's shapes (the extra local step,
   1/W of the parameters). Separate rounds time the optimizer step alone
   (``zero.step()`` over the gradients the last iteration left), with the same
   floor. The two copies take the same iterations on the same data, so they
   must end with the same parameters (checked). Bytes per iteration are counted
   for both (``collective_traffic``; DDP runs zerofn's all-reduce hook so that
   its all-reduce is counted too) and must be equal; memory from
   ``memory_bytes()`` (its ``carried`` key) against ``plan_footprint(...,
   redundancy=2)``. In the same rounds, ``verify_replicas`` over the model: its
   cost when it runs every :data:`elastic_costs.VERIFY_EVERY` steps is one
   check over that many iterations.
2. **A loss** (3 gloo ranks, the same model, ``redundancy=2``): rank 2 exits at
   step :data:`elastic_loss.LOST_AT`, before its step or inside the step's
   exchange (right after its local step): ``examples/train_elastic.py``'s two
   modes, with a roll-call deadline of :data:`elastic_loss.DEADLINE_S` s. The
   dying rank writes the time in the store first; the survivors time from then:
   until their collective failed, the roll call (a dead rank never answers: it ends once the rank's
   heartbeat has been silent long enough), the rest of ``recover`` (the
   survivors' group, the moves, the rebuilt optimizer, and after a loss inside
   the exchange the exchange again), DDP's rebuild, and the step redone, up to
   their next completed step; the state bytes moved to restore redundancy (the
   outboxes of ``outgoing_states``) against the model's optimizer state; steps
   lost (the steps done before the loss that the state the survivors go on from
   lacks, by Adam's step count in it). Beside it, the restart path's figures,
   read from the kill-and-restart soak's block on ``docs/resilience.md``
   (``bench_soak_restart.py``; ``make bench`` runs it first).
3. **A join** (2 gloo ranks and a new process, the same model,
   ``redundancy=2``): after the job's first step rank 0 starts a fresh
   interpreter (``python -c``) that calls ``zerofn_torch.elastic.join``;
   the running ranks call ``admit`` at every step boundary until it is in,
   then the 3 ranks take :data:`elastic_join.AFTER_JOIN` steps;
   :data:`elastic_join.JOINS` times.
   Times on one machine's wall clock, from outside the library's calls:
   the joiner's start until it calls ``join``, its wait until rank 0's
   ``admit`` that lets it in began (where in a step it announced itself:
   reported beside the running ranks' step), the growth until ``join``
   returned, DDP's rebuild, its first step; the running ranks' pause (that
   ``admit``, and the ``admit`` calls that found nobody). Bytes sent to the
   joiner: the parameters (its broadcasts inside ``join``,
   ``collective_traffic``) and the optimizer state (the tensors addressed
   to it in the outboxes of ``outgoing_states``, which ``_grow`` calls by
   name; they travel pickled, by ``all_gather_object``, which
   ``collective_traffic`` does not see), against the model's parameters
   and the state the grown plan gives it; the three ranks' parameters
   must end equal.

Each part is a module of its own: ``elastic_costs.py`` (1), ``elastic_loss.py``
(2), ``elastic_join.py`` (3), and ``elastic_setup.py`` for what they share (the
model, its batches, an iteration, the state bytes the moves send). This module
composes the section from them (:func:`elastic_block`, the headlines).

Its block (``bench:elastic``) is quoted on ``docs/resilience.md``
(``generated_blocks.QUOTED``; full runs of ``make bench`` only). Run
``python benchmarks/bench_elastic.py [--quick]`` for this section alone.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from bench_soak_restart import PAGE as RESILIENCE_PAGE
from elastic_costs import COSTED, VERIFY_EVERY, Cost, cost_tables, measure_costs, verify_line
from elastic_join import (
    AFTER_JOIN,
    JOINS,
    Join,
    join_bytes_table,
    join_summary,
    join_table,
    measure_joins,
)
from elastic_loss import (
    AFTER_DETECTION_S,
    DEADLINE_S,
    LOST_AT,
    MODES,
    Loss,
    loss_summary,
    loss_table,
    measure_losses,
    restart_figures,
)
from elastic_setup import BATCH
from report import Headline, Section, Spread, paired_ratios, standalone_main

# ----- the section -----------------------------------------------------------------------


def _headlines(
    costs: Sequence[Cost], losses: Sequence[Loss], joins: Sequence[Join], numel: int
) -> list[Headline]:
    headlines = []
    for c in costs:
        name = (
            f"redundancy=2 (DDP + ZeRO Adam, MLP {numel / 1e6:.1f}M params, "
            f"{c.world_size} gloo ranks, {c.config})"
        )
        sent = c.results[0]["traffic"]
        carried = sum(r["memory"][2]["carried"] for r in c.results)
        planned = sum(r["planned"][2]["carried"] for r in c.results)
        headlines += [
            Headline(
                name,
                "iteration time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("iterations", 2), c.times("iterations", 1)),
                short=f"redundancy=2, {c.world_size} ranks, {c.config}",
            ),
            Headline(
                name,
                "optimizer step time: redundancy=2 / redundancy=1",
                paired_ratios(c.times("steps", 2), c.times("steps", 1)),
                short=f"redundancy=2, {c.world_size} ranks, {c.config}",
            ),
            Headline(
                name,
                "bytes sent per iteration: redundancy=2 / redundancy=1",
                Spread.exact(sent[2]["sent"] / sent[1]["sent"]),
                "== 1",
                sent[2]["sent"] == sent[1]["sent"],
            ),
            Headline(
                name,
                "carried bytes: measured / planned",
                Spread.exact(carried / planned),
                "== 1",
                carried == planned,
            ),
            Headline(
                name,
                f"`verify_replicas(every={VERIFY_EVERY})`: % of an iteration "
                f"(a check / {VERIFY_EVERY} iterations)",
                c.verify_share().scaled(100),
                "<= 1",
                c.verify_share().median <= 0.01,
                short=f"verify_replicas, {c.world_size} ranks, {c.config}",
                why=(
                    f"a check takes {statistics.median(c.checks()) * 1e3:.1f} ms (hashing "
                    f"the model's {c.results[0]['numel'] / 1e6:.1f}M parameters on each rank, "
                    f"then an all-gather) against an iteration of "
                    f"{statistics.median(c.times('iterations', 1)) * 1e3:.1f} ms"
                ),
            ),
        ]
    name = f"a lost rank, redundancy=2 (3 gloo ranks → 2, roll call deadline {DEADLINE_S:g} s)"
    lost = [float(x.steps_lost) for x in losses]
    after = [x.after_detection_s for x in losses]
    headlines += [
        Headline(
            name,
            "seconds from a loss to the next completed step",
            Spread.of([x.total_s for x in losses]),
        ),
        Headline(
            name,
            "seconds from its detection (failed collective, roll call) to the next step",
            Spread.of(after),
            f"<= {AFTER_DETECTION_S:g}",
            statistics.median(after) <= AFTER_DETECTION_S,
            why=(
                f"the rest of `recover` (group, moves, rebuild) takes "
                f"{statistics.median(x.recover_rest_s for x in losses):.2f} s, DDP's rebuild "
                f"{statistics.median(x.ddp_s for x in losses):.2f} s and the step redone "
                f"{statistics.median(x.redo_s for x in losses):.2f} s"
            ),
        ),
        Headline(name, "steps lost per loss", Spread.of(lost), "== 0", max(lost) == 0),
    ]
    name = "a join, redundancy=2 (2 gloo ranks + a new process → 3)"
    sent = [(j.broadcast_bytes + j.shard_bytes + j.carried_bytes) for j in joins]
    planned = [(j.param_bytes + j.shard_planned + j.carried_planned) for j in joins]
    headlines += [
        Headline(
            name,
            "seconds from the joiner's start to its first completed step",
            Spread.of([j.total_s for j in joins]),
        ),
        Headline(
            name,
            "of which seconds in the growth (`admit` began → `join` returned)",
            Spread.of([j.grow_s for j in joins]),
        ),
        Headline(
            name,
            "running ranks' pause: seconds of the `admit` that lets it in",
            Spread.of([j.admit_s for j in joins]),
        ),
        Headline(
            name,
            "ms of an `admit` that finds nobody",
            Spread.of([s for j in joins for s in j.empty_admit_s]).scaled(1e3),
        ),
        Headline(
            name,
            "bytes sent to the joiner: parameters and its state / planned",
            Spread.of([a / b for a, b in zip(sent, planned, strict=True)]),
            "== 1",
            sent == planned,
        ),
    ]
    return headlines


def elastic_block(
    costs: Sequence[Cost],
    rounds: int,
    warmup: int,
    losses: Sequence[Loss],
    restart: tuple[str, str] | None,
    joins: Sequence[Join],
) -> str:
    """The Markdown of the ``elastic`` block (``generated_blocks`` adds the
    line saying when and on what it was measured)."""
    numel = costs[0].results[0]["numel"]
    times, memory, lines = cost_tables(costs)
    same = all(
        c.results[0]["traffic"][1]["sent"] == c.results[0]["traffic"][2]["sent"] for c in costs
    )
    diff = max(r["max_diff"] for c in costs for r in c.results)
    repeats = len(losses) // len(MODES)
    per_param = {
        c.config: c.results[0]["memory"][2]["carried"] / c.results[0]["carried_numel"]
        for c in costs
    }
    planned = all(
        r["memory"][2]["carried"] == r["planned"][2]["carried"] for c in costs for r in c.results
    )
    crowded = [c.world_size for c in costs if c.world_size > (os.cpu_count() or 1)]
    shared = f" ({crowded[0]} ranks share this machine's {os.cpu_count()} cores)" if crowded else ""
    costed = "; ".join(f"`{c.name}`: {c.summary}" for c in COSTED)
    costed += (
        "; not `overlap`, whose hook, with `redundancy=2`, takes `plain`'s whole step inside "
        "backward, after an all-reduce of every bucket where its `redundancy=1` twin reduces "
        "each to its owner (1.5 all-reduces' bytes against 1)"
    )
    return "\n\n".join(
        [
            f"**What `redundancy=2` costs a step.** DDP + `ZeroRedundancyOptimizer(Adam)` on "
            f"an MLP of {numel / 1e6:.1f}M parameters ({costed}), batch {BATCH} per rank, "
            "gloo on CPU, "
            f"one thread per rank{shared}: a copy of the model with `redundancy=1` and one "
            f"with `redundancy=2` in the same process group, taking turns with the floor of "
            f"what `redundancy=2` adds, the heaviest carrier's extra work alone (a plain Adam "
            f"step over fresh tensors of its carried shard's shapes, and the copies it makes "
            f"before that step: the parameters' values in, their gradients cloned; with "
            f"masters, which it keeps, the gradients upcast only); "
            f"{warmup} warm-up and {rounds} timed rounds, median [q1, q3]; the optimizer step "
            f"alone (`zero.step()` over the last gradients) in separate rounds.",
            times,
            "Against the floor, which is the bound here (the last column: the ratio the floor "
            "alone would give; a ratio is at it when the ratio's spread holds it): "
            + "; ".join(lines)
            + ".",
            memory,
            f"Bytes sent per iteration (DDP's all-reduce and the ZeRO exchange, "
            f"`collective_traffic`): **{'equal' if same else 'NOT equal'}** with and without "
            f"`redundancy=2`. The carried copy is the memory it costs (its values, or "
            f"masters, and Adam state; bytes per carried parameter on rank 0: "
            + ", ".join(f"{k} {v:.1f}" for k, v in per_param.items())
            + "), "
            + f"{'as planned' if planned else '**NOT as planned**'}. "
            f"The two copies of the model ended {diff:.3g} apart (the same iterations on the "
            "same data).",
            verify_line(costs),
            f"**What a loss costs.** 3 gloo ranks, the same model, `redundancy=2`; rank 2 "
            f"exits at step {LOST_AT} (`examples/train_elastic.py`'s two modes), {repeats} "
            f"time{'s' if repeats > 1 else ''} each; the survivors call `recover(..., "
            f"deadline_s={DEADLINE_S:g})` and go on on 2 ranks. Seconds from the death (the "
            f"dying rank writes the time in the store) on the survivors' new rank 0; state "
            f"moved summed over the survivors.",
            loss_table(losses),
            loss_summary(losses, restart),
            f"**What a join costs.** 2 gloo ranks, the same model, `redundancy=2`, train; "
            f"after their first step rank 0 starts a new process (`python -c`, importing "
            f"torch and this bench) that calls `join(store, model, Adam, redundancy=2, ...)`; "
            f"the running ranks call `admit(zero, store, extra=...)` at every step boundary "
            f"until it is in, then the 3 ranks take {AFTER_JOIN} steps; {len(joins)} "
            f"join{'s, each' if len(joins) > 1 else ''} with a fresh job. Seconds on one "
            f"machine's wall clock, from the moment rank 0 starts the joiner: the joiner's "
            f"start until it calls `join`, its wait until rank 0's `admit` that lets it in "
            f"began, the growth from then until `join` returned (the decision, the new "
            f"default group, the plan, the parameters, the moves, the rebuilt optimizer), "
            f"DDP's rebuild and its first step. The joiner starts beside the 2 running ranks "
            f"on this machine's {os.cpu_count()} cores.",
            join_table(joins),
            join_bytes_table(joins),
            join_summary(joins),
        ]
    )


def bench_elastic(quick: bool) -> Section:
    costs, rounds, warmup = measure_costs(quick)
    losses = measure_losses(quick, 1 if quick else 3)
    joins = measure_joins(quick, 1 if quick else JOINS)
    with open(RESILIENCE_PAGE, encoding="utf-8") as f:
        restart = restart_figures(f.read())
    block = elastic_block(costs, rounds, warmup, losses, restart, joins)
    numel = costs[0].results[0]["numel"]
    return Section(
        "Going on after a lost rank: `redundancy=2` (gloo, CPU)",
        block,
        _headlines(costs, losses, joins, numel),
        blocks={"elastic": block},
    )


BENCHES = {"elastic": bench_elastic}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
