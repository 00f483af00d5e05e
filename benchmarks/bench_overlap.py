"""DDP + ZeRO: the step overlapped with backward against separate steps, in one run.

Two gloo ranks on CPU train identical MLPs (Adam) three ways: zerofn's
``hook_with_zero_step`` around the plain averaging hook (gradients reduced to
their owner, updated parameters broadcast back, all inside backward); DDP with
the averaging hook and then zerofn's ``ZeroRedundancyOptimizer.step()``; and
DDP with its built-in (C++) all-reduce and then PyTorch's
``ZeroRedundancyOptimizer.step()`` (the shard exchange). PyTorch's own overlap
hooks refuse gloo, so this is the fastest it offers here. The three take
turns iteration by iteration after DDP has fixed its buckets; each timed
iteration is forward + backward (+ step). The same rounds time the parts
each iteration is made of, alone: forward + backward of an unwrapped copy
of the model, the update (Adam over this rank's half of the parameters,
whole tensors), the gradients' bytes reduced to their owners and
all-reduced, and the shards' bytes broadcast from their owners. The
overlapped iteration's floor is forward + backward, the reduction, the
update and the broadcast; a separate step's has the all-reduce in place of
the reduction. A missed target says where each iteration sits against its
floor.

Apart, the same rounds time zerofn's separate step against itself with
``gather_during_forward=True`` (the shards' exchange behind the next
forward), and the overlapped step against itself with it (its owners' sends
behind the next forward), each as :data:`IN_A_ROW` iterations in a row per
turn, the last exchange waited for at the end of the turn (so no byte of it
moves in another set-up's time).

Bytes per iteration and rank are counted from the collectives each side calls
(for PyTorch, on an untimed twin whose all-reduce goes through PyTorch's Python
averaging hook, since the counter cannot see DDP's C++ one),
weighted by what a ring sends per payload byte on 2 ranks (all-reduce 1.0,
reduce 0.5, broadcast 0.5), and compared with one all-reduce of the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from bench_zero import broadcasts_alone, update_alone
from report import (
    Headline,
    Section,
    Spread,
    floor_verdict,
    md_table,
    paired_ratios,
    round_sums,
    share_of,
    standalone_main,
    take_turns,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.hooks.overlap import hook_with_zero_step
from zerofn_torch.runtime.issue import issue
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import Traffic, collective_traffic

from zerofn.comm import Reduce
from zerofn.zero.planning.partition import greedy_partition

SETUPS = ("overlapped", "separate", "pytorch")
TIME_TARGET = 1.0  # overlapped / a separate step's iteration time
COMPUTE = "forward + backward alone"
UPDATE = "update alone"
REDUCE = "gradients reduced to owners alone"
ALL_REDUCE = "gradients all-reduced alone"
BROADCAST = "shards broadcast alone"
PARTS = (COMPUTE, UPDATE, REDUCE, ALL_REDUCE, BROADCAST)
IN_A_ROW = 4
"""Iterations per turn of the gather-behind-the-forward comparison."""
SEPARATE_ROW = f"separate, {IN_A_ROW} in a row"
GATHERED_ROW = f"gathered, {IN_A_ROW} in a row"
GATHER_TARGET = 1.0  # gathered / separate, per iteration
OVERLAP_ROW = f"overlapped, {IN_A_ROW} in a row"
BOTH_ROW = f"overlapped + gathered, {IN_A_ROW} in a row"
BOTH_TARGET = 1.0  # overlapped + gathered / overlapped, per iteration
FLOOR_TARGET = 1.15  # overlapped + gathered / max(compute, bytes / rate), on a link


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def wire_traffic(fn: Callable[[], None]) -> Traffic:
    """The collectives this rank issues while ``fn`` runs."""
    with collective_traffic() as traffic:
        fn()
    return traffic


def _reductions(lengths: Sequence[int]) -> Callable[[], None]:
    """Rank ``r``'s segment of ``lengths[r]`` float32 elements reduced to ``r``,
    every rank's at once, issued as the overlapped step issues them (on
    gloo, each carried to its owner by an all-to-all): the gradients' bytes
    the overlapped step moves in."""
    segments = torch.split(torch.zeros(sum(lengths)), list(lengths))

    def run() -> None:
        futures = [issue(Reduce(s, dst=r), None) for r, s in enumerate(segments)]
        for future in futures:
            future.wait()

    return run


def _parts(
    model: torch.nn.Module, batch: torch.Tensor, rank: int, world: int
) -> dict[str, Callable[[], object]]:
    """Each part of an iteration alone (see the module's docstring); ``model``
    is an unwrapped copy, stepped by nothing."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    partition = greedy_partition([[p.numel() for p in model.parameters()]], world)
    gradients = torch.zeros(sum(partition.loads()))

    def compute() -> None:
        model.zero_grad()
        model(batch).square().mean().backward()

    return {
        COMPUTE: compute,
        UPDATE: update_alone([shapes[i] for i in partition.params_of(rank)]),
        REDUCE: _reductions(partition.loads()),
        ALL_REDUCE: lambda: dist.all_reduce(gradients),
        BROADCAST: broadcasts_alone(partition.loads()),
    }


def missed_time_line(times: dict[str, list[float]], reference: str, label: str) -> str:
    """Why overlapped / ``reference`` missed its target: each part alone as a
    fraction of the reference's iteration (``label`` names it in the line),
    and where both iterations sit against their floors (same rounds)."""
    ref = times[reference]
    f = {name: share_of(times[name], ref) for name in PARTS}
    mine = round_sums(*(times[n] for n in (COMPUTE, UPDATE, REDUCE, BROADCAST)))
    theirs = round_sums(*(times[n] for n in (COMPUTE, ALL_REDUCE, UPDATE, BROADCAST)))
    common = f[COMPUTE] + f[UPDATE] + f[BROADCAST]
    line = (
        f"forward + backward alone take {f[COMPUTE]:.2f} of {label}, the update alone "
        f"{f[UPDATE]:.2f}, the gradients {f[REDUCE]:.2f} reduced to their owners "
        f"({f[ALL_REDUCE]:.2f} all-reduced) and the shards {f[BROADCAST]:.2f} broadcast back, "
        f"{common + f[REDUCE]:.2f} in all ({common + f[ALL_REDUCE]:.2f} with the all-reduce)"
    )
    names = ("the overlapped iteration", label)
    verdict = floor_verdict(names, times["overlapped"], mine, ref, theirs)
    return f"{line}; {verdict}"


def missed_bytes_line(kinds: dict[str, int], sent: float, one_allreduce: float) -> str:
    """Why the overlapped iteration's bytes are not one all-reduce's: what its
    collectives carried, kind by kind."""
    carried = ", ".join(f"{kind} {n:,} bytes" for kind, n in sorted(kinds.items())) or "nothing"
    return (
        f"its collectives carried {carried}, which a ring on 2 ranks sends as {sent:,.0f} "
        f"bytes against {one_allreduce:,.0f} for one all-reduce of the gradients"
    )


def _rank(
    rank: int,
    world: int,
    width: int,
    depth: int,
    rounds: int,
    count_link: Callable[[Callable[[], object]], int] | None = None,
) -> dict[str, Any]:
    """One rank's timings; ``count_link`` (bytes a link carried while a call
    ran) counts one more iteration of each set-up."""
    overlapped = DDP(make_model(width, depth), bucket_cap_mb=4)
    zero_o = ZeroRedundancyOptimizer(
        overlapped.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
    )
    overlapped.register_comm_hook(None, hook_with_zero_step(allreduce_hook, overlapped, zero_o))
    separate = DDP(make_model(width, depth), bucket_cap_mb=4)
    separate.register_comm_hook(None, allreduce_hook)
    zero_s = ZeroRedundancyOptimizer(separate.parameters(), torch.optim.Adam, lr=1e-3)
    # PyTorch at its fastest: DDP's built-in all-reduce (C++, no hook), then its
    # ZeRO step. The built-in all-reduce is invisible to collective_traffic, so an
    # untimed twin with PyTorch's Python averaging hook (the same collectives)
    # counts the bytes.
    theirs = DDP(make_model(width, depth), bucket_cap_mb=4)
    zero_t = TorchZero(theirs.parameters(), torch.optim.Adam, lr=1e-3)
    twin = DDP(make_model(width, depth), bucket_cap_mb=4)
    twin.register_comm_hook(None, torch_default_hooks.allreduce_hook)
    zero_twin = TorchZero(twin.parameters(), torch.optim.Adam, lr=1e-3)
    # The in-a-row pair: zerofn's separate step, without and with the exchange
    # behind the forward.
    row, gathered = (DDP(make_model(width, depth), bucket_cap_mb=4) for _ in range(2))
    for ddp in (row, gathered):
        ddp.register_comm_hook(None, allreduce_hook)
    zero_r = ZeroRedundancyOptimizer(row.parameters(), torch.optim.Adam, lr=1e-3)
    zero_g = ZeroRedundancyOptimizer(
        gathered.parameters(), torch.optim.Adam, gather_during_forward=True, lr=1e-3
    )
    # The overlapped in-a-row pair: without and with its sends behind the forward.
    row_o, both = (DDP(make_model(width, depth), bucket_cap_mb=4) for _ in range(2))
    zero_ro, zero_b = (
        ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3, **options
        )
        for ddp, options in ((row_o, {}), (both, {"gather_during_forward": True}))
    )
    for ddp, zero in ((row_o, zero_ro), (both, zero_b)):
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    plain = make_model(width, depth)

    def run_overlapped() -> None:
        zero_o.zero_grad()
        overlapped(batch).square().mean().backward()

    def run_separate() -> None:
        zero_s.zero_grad()
        separate(batch).square().mean().backward()
        zero_s.step()

    def run_pytorch() -> None:
        zero_t.zero_grad()
        theirs(batch).square().mean().backward()
        zero_t.step()

    def run_twin() -> None:
        zero_twin.zero_grad()
        twin(batch).square().mean().backward()
        zero_twin.step()

    def run_row() -> None:
        zero_r.zero_grad()
        row(batch).square().mean().backward()
        zero_r.step()

    def run_gathered() -> None:
        zero_g.zero_grad()
        gathered(batch).square().mean().backward()  # each module waits for its pieces
        zero_g.step()

    def backward_only(ddp: DDP, zero: ZeroRedundancyOptimizer) -> Callable[[], None]:
        def run() -> None:  # the overlapped step: backward steps
            zero.zero_grad()
            ddp(batch).square().mean().backward()

        return run

    def in_a_row(iteration: Callable[[], None], finish: Callable[[], None]) -> Callable[[], None]:
        def turn() -> None:
            for _ in range(IN_A_ROW):
                iteration()
            finish()

        return turn

    runs = {"overlapped": run_overlapped, "separate": run_separate, "pytorch": run_pytorch}
    # The parts take turns with the setups, in the same rounds.
    timed = {
        **runs,
        **_parts(plain, batch, rank, world),
        SEPARATE_ROW: in_a_row(run_row, lambda: None),
        GATHERED_ROW: in_a_row(run_gathered, zero_g.wait),
        OVERLAP_ROW: in_a_row(backward_only(row_o, zero_ro), lambda: None),
        BOTH_ROW: in_a_row(backward_only(both, zero_b), zero_b.wait),
    }
    times = take_turns(timed, rounds, warmup=3)  # DDP fixes its buckets after iteration 1
    # All three took the same steps on the same data: compare before counting
    # bytes, which steps two of them once more.
    diff = max(
        (p - q).abs().max().item()
        for other in (separate, theirs)
        for p, q in zip(overlapped.parameters(), other.parameters(), strict=True)
    )
    zero_g.wait()
    zero_b.wait()
    gathered_diff = max(
        (p - q).abs().max().item()
        for a, b in ((gathered, row), (both, row_o))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    for _ in range(2):  # past the twin's bucket rebuild
        run_twin()
    seen = {name: wire_traffic(fn) for name, fn in {**runs, "pytorch": run_twin}.items()}
    wire = {name: traffic.sent_bytes(world) for name, traffic in seen.items()}
    kinds = {name: dict(traffic.payload_bytes) for name, traffic in seen.items()}
    grad_bytes = sum(p.numel() * p.element_size() for p in separate.parameters())
    on_link = {name: count_link(fn) for name, fn in runs.items()} if count_link else {}
    return {
        "times": times,
        "wire": wire,
        "kinds": kinds,
        "grad_bytes": grad_bytes,
        "diff": diff,
        "gathered_diff": gathered_diff,
        "on_link": on_link,
    }


def gather_headline(
    raw: dict[str, list[float]], model: str, short: str = "gather behind forward", held: bool = True
) -> tuple[Headline, str]:
    """The exchange behind the next forward against the separate step, per
    iteration (held to its target with ``held``), and a paragraph of what it
    saved against what it could."""
    per = {name: [t / IN_A_ROW for t in raw[name]] for name in (SEPARATE_ROW, GATHERED_ROW)}
    ratio = paired_ratios(per[GATHERED_ROW], per[SEPARATE_ROW])
    saved = Spread.of([a - b for a, b in zip(per[SEPARATE_ROW], per[GATHERED_ROW], strict=True)])
    hideable = (IN_A_ROW - 1) / IN_A_ROW * Spread.of(raw[BROADCAST]).median
    compute = Spread.of(raw[COMPUTE]).median
    bound = (
        f"only the forward (inside the {compute * 1e3:.1f} ms forward + backward alone take) "
        f"runs beside the pieces, against {hideable * 1e3:.1f} ms of broadcast that "
        f"{IN_A_ROW - 1} of {IN_A_ROW} iterations could hide"
    )
    met = ratio.median <= GATHER_TARGET
    why = "" if met or not held else f"{bound}; on 2 CPU cores gloo's threads share them too"
    headline = Headline(
        model,
        "iteration time: gather behind the next forward / zerofn's separate step",
        ratio,
        f"<= {GATHER_TARGET}" if held else "",
        met if held else None,
        short=short,
        why=why,
    )
    text = (
        f"**The exchange behind the next forward** ({IN_A_ROW} iterations in a row per turn, "
        "the last exchange waited for at the end of it): zerofn's separate step with "
        f"`gather_during_forward=True` takes {ratio.fmt()} of the same step without it, per "
        f"iteration: it saves {saved.median * 1e3:.1f} ms an iteration; {bound}."
    )
    return headline, text


def both_headlines(
    raw: dict[str, list[float]],
    model: str,
    short: str = "overlap + gather behind forward",
    held: bool = True,
    link: tuple[float, float] | None = None,
) -> tuple[list[Headline], str]:
    """The overlapped step with its sends behind the next forward, per
    iteration: against the overlapped step without them (held with
    ``held``), and, on a link (``link``: the bytes one iteration put on it
    and its rate in bits/s), against its floor ``max(forward + backward +
    update alone, bytes / rate)``; and a paragraph of both."""
    per = {name: [t / IN_A_ROW for t in raw[name]] for name in (OVERLAP_ROW, BOTH_ROW)}
    ratio = paired_ratios(per[BOTH_ROW], per[OVERLAP_ROW])
    compute = Spread.of(raw[COMPUTE]).median
    update = Spread.of(raw[UPDATE]).median
    broadcast = Spread.of(raw[BROADCAST]).median
    met = ratio.median <= BOTH_TARGET
    why = (
        ""
        if met or not held
        else f"only the forward (inside the {compute * 1e3:.1f} ms forward + backward alone "
        f"take) runs beside the sends, against {broadcast * 1e3:.1f} ms of broadcast alone; "
        "on 2 CPU cores gloo's threads share the cores with it"
    )
    headlines = [
        Headline(
            model,
            "iteration time: overlapped + gathered / overlapped",
            ratio,
            f"<= {BOTH_TARGET}" if held else "",
            met if held else None,
            short=short,
            why=why,
        )
    ]
    both = Spread.of(per[BOTH_ROW]).median
    text = (
        f"**Both halves hidden** ({IN_A_ROW} iterations in a row per turn): the overlapped step "
        "with `gather_during_forward=True` (gradients reduced to their owners during backward, "
        "the updated shards gathered during the next forward) takes "
        f"{both * 1e3:.1f} ms an iteration, {ratio.fmt()} of the overlapped step without it "
        f"({Spread.of(per[OVERLAP_ROW]).median * 1e3:.1f} ms)"
    )
    if link is not None:
        nbytes, bits = link
        wire = nbytes * 8 / bits
        floor = max(compute + update, wire)
        to_floor = Spread.of([t / floor for t in per[BOTH_ROW]])
        bound = "the bytes" if wire >= compute + update else "forward + backward + update"
        floor_met = to_floor.median <= FLOOR_TARGET
        alone = sum(Spread.of(raw[name]).median for name in (COMPUTE, UPDATE, REDUCE, BROADCAST))
        floor_why = (
            ""
            if floor_met
            else f"{(both - floor) * 1e3:.1f} ms above the floor ({bound} bound it): forward + "
            f"backward, the update, the reduce and the broadcast, each alone, add up to "
            f"{alone * 1e3:.1f} ms and the iteration takes {both / alone:.2f} of that sum; on 2 "
            "CPU cores for 2 ranks gloo's threads copy every byte through the loopback on the "
            "cores the compute runs on, so the parts hide little behind each other, and the "
            f"owners' update ({update * 1e3:.1f} ms) sits between the reduce and the gather, "
            "hidden by neither"
        )
        headlines.append(
            Headline(
                model,
                "iteration time: overlapped + gathered / max(compute, bytes / rate)",
                to_floor,
                f"<= {FLOOR_TARGET}",
                floor_met,
                short=f"{short} / floor",
                why=floor_why,
            )
        )
        text += (
            f"; its floor is max(forward + backward + update alone, bytes / rate) = "
            f"max({(compute + update) * 1e3:.1f}, {wire * 1e3:.1f}) ms, which it takes "
            f"{to_floor.fmt()} of"
        )
    return headlines, text + "."


def bench_overlap(quick: bool) -> Section:
    width, depth, rounds = (256, 4, 4) if quick else (1024, 8, 20)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    raw: dict[str, list[float]] = r0["times"]
    times = {name: Spread.of(t).scaled(1e3) for name, t in raw.items()}
    one_allreduce = 1.0 * r0["grad_bytes"]  # 2(N-1)/N of the gradients, N = 2
    table = md_table(
        ["iteration", "time (ms): median [q1, q3]", "bytes sent / rank", "vs one all-reduce"],
        [
            [
                name,
                times[name].fmt(1),
                f"{r0['wire'][name]:,.0f}",
                f"{r0['wire'][name] / one_allreduce:.2f}x",
            ]
            for name in SETUPS
        ],
    )
    parts = md_table(
        ["part alone (rank 0)", "time (ms): median [q1, q3]", "/ pytorch", "/ separate"],
        [
            [
                name,
                times[name].fmt(1),
                paired_ratios(raw[name], raw["pytorch"]).fmt(),
                paired_ratios(raw[name], raw["separate"]).fmt(),
            ]
            for name in PARTS
        ],
    )
    model = f"DDP + ZeRO overlap (Adam, MLP {r0['grad_bytes'] / 4e6:.1f}M params, 2 gloo ranks)"
    headlines = []
    missed: list[str] = []
    for other, label, iteration in (
        ("pytorch", "PyTorch's separate step", "the PyTorch iteration"),
        ("separate", "zerofn's separate step", "the separate zerofn iteration"),
    ):
        step = paired_ratios(raw["overlapped"], raw[other])
        met = step.median <= TIME_TARGET
        why = "" if met else missed_time_line(raw, other, iteration)
        if why:
            missed.append(
                f"Target missed against {label} ({step.median:.3f} > {TIME_TARGET}): {why}."
            )
        headlines.append(
            Headline(
                model,
                f"iteration time: overlapped / {label}",
                step,
                f"<= {TIME_TARGET}",
                met,
                short="DDP + ZeRO overlap",
                why=why,
            )
        )
    gathered, gathered_text = gather_headline(raw, model)
    both, both_text = both_headlines(raw, model)
    for headline in (gathered, *both):
        headlines.append(headline)
        if headline.why:
            missed.append(f"Target missed by {headline.measure}: {headline.why}.")
    against_one = r0["wire"]["overlapped"] / one_allreduce
    met = abs(against_one - 1.0) < 0.01
    why = (
        ""
        if met
        else missed_bytes_line(r0["kinds"]["overlapped"], r0["wire"]["overlapped"], one_allreduce)
    )
    if why:
        missed.append(f"Target missed by the bytes ({against_one:.2f} != 1.0): {why}.")
    headlines.append(
        Headline(
            model,
            "bytes per iteration: overlapped / one all-reduce of the gradients",
            Spread.exact(against_one),
            "= 1.0",
            met,
            why=why,
        )
    )
    body = "\n\n".join(
        [
            f"{rounds} timed rounds after 3 warm-up iterations, the three setups and the "
            "parts taking turns (who goes first rotates each round): zerofn's overlapped "
            "step, DDP + zerofn's `step()` after backward ('separate'), and DDP with its "
            "built-in all-reduce + PyTorch's `ZeroRedundancyOptimizer.step()` after backward "
            "('pytorch'; its bytes are counted on a twin using PyTorch's Python averaging "
            "hook, which the counter sees); forward + backward (+ step) timed on rank 0 after "
            "a barrier. Bytes sent by one rank, from the collectives it called, weighted as a "
            "ring on 2 ranks sends them (all-reduce 1.0, reduce and broadcast 0.5 per payload "
            "byte).",
            table,
            "Each part of an iteration alone, in the same rounds: forward + backward of an "
            "unwrapped copy of the model; the update (Adam over rank 0's half of the "
            "parameters as the greedy partition assigns them, whole tensors); the gradients' "
            "bytes reduced to their owners and, apart, all-reduced; the shards' bytes "
            "broadcast from their owners. The overlapped iteration's floor is forward + "
            "backward, the reduction, the update and the broadcast; a separate step's has the "
            "all-reduce in place of the reduction.",
            parts,
            gathered_text,
            both_text,
            *missed,
            f"Largest parameter difference between the three after the run: {r0['diff']:.3g}; "
            f"between the in-a-row pair: {r0['gathered_diff']:.3g}.",
        ]
    )
    return Section("DDP + ZeRO: step overlapped with backward (2 gloo ranks, CPU)", body, headlines)


BENCHES: dict[str, Callable[[bool], Section]] = {"overlap": bench_overlap}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
