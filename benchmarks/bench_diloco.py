"""DiLoCo: bytes per inner step against DDP, peak bytes with fragments, and step time.

Two gloo ranks on CPU train an MLP with AdamW as the inner optimizer. Counted
per rank from the collectives each side calls (ring estimate on 2 ranks, as
``zerofn_torch.runtime.traffic`` weighs them):

* bytes per inner step of DiLoCo at ``sync_every`` H against DDP's gradient
  all-reduce every step (DDP runs zerofn's averaging hook, so that its
  all-reduce is visible to the counter);
* the largest single sync with ``fragments`` P against P = 1 (peak
  bandwidth), and a compressed sync against an fp32 one: int8, int4, 2-bit
  (``"int2"``) and top-k (``TopK(density=0.02, bits=2)``);
* the outer state each rank keeps (``memory_bytes()``) against the anchor and
  momentum a replicated implementation keeps (8 bytes per parameter);
* with ``redundancy=2``: a sync's bytes (an all-reduce of the fragment
  where the plain sync reduces each slice to its owner) and the outer state
  (the carried copy and the kept sum) against the plain sync's.

Timed: windows of H inner steps (forward, backward, step) of Streaming
DiLoCo with ``delay=1`` (and ``delay=0``, with and without
``redundancy=2``) against the same inner optimizer
with no communication at all, taking turns window by window. Prints
Markdown; no timing is asserted anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from report import Headline, Section, Spread, md_table, paired_ratios, standalone_main, take_turns
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.averaging import DiLoCoOptimizer
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.diloco.config import Compression
from zerofn.topk import TopK

SYNC_EVERY = (10, 50)
FRAGMENTS = 4
TIMED_H = 8  # H of the timed runs: 4 fragments, one sync every 2 steps
CODECS: dict[str, Compression] = {
    "int8": "int8",
    "int4": "int4",
    "int2": "int2",
    "topk": TopK(density=0.02, bits=2),
}
"""The compressed syncs measured, by name."""


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()


def window(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, n: int
) -> Callable[[], None]:
    """``n`` inner steps, as a call."""
    return lambda: _steps(model, opt, batch, n)


def sent(fn: Callable[[], None]) -> float:
    """Bytes this rank sends while ``fn`` runs (ring estimate, 2 ranks)."""
    with collective_traffic() as traffic:
        fn()
    return traffic.sent_bytes(2)


def _bytes(rank: int, width: int, depth: int, batch: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ddp = DDP(make_model(width, depth), bucket_cap_mb=4)
    ddp.register_comm_hook(None, allreduce_hook)
    ddp_opt = adamw(ddp)
    _steps(ddp, ddp_opt, batch, 1)  # DDP rebuilds its buckets after the first iteration
    out["ddp"] = sent(window(ddp, ddp_opt, batch, 1))
    del ddp, ddp_opt

    for h in SYNC_EVERY:
        model = make_model(width, depth)
        opt = DiLoCoOptimizer(adamw(model), sync_every=h)
        out[f"H={h}"] = sent(window(model, opt, batch, h)) / h

    runs = [(1, "None"), (FRAGMENTS, "None")] + [(1, name) for name in CODECS]
    for fragments, name in runs:
        model = make_model(width, depth)
        opt = DiLoCoOptimizer(
            adamw(model),
            sync_every=FRAGMENTS,
            fragments=fragments,
            compression=CODECS.get(name),
        )
        # The largest sync: each step's bytes, one sync at most per step.
        per_step = [sent(window(model, opt, batch, 1)) for _ in range(FRAGMENTS)]
        out[f"peak P={fragments} {name}"] = max(per_step)
        out[f"memory P={fragments} {name}"] = opt.memory_bytes()
    model = make_model(width, depth)
    opt = DiLoCoOptimizer(adamw(model), sync_every=FRAGMENTS, redundancy=2)
    out["peak redundancy"] = max(sent(window(model, opt, batch, 1)) for _ in range(FRAGMENTS))
    out["memory redundancy"] = opt.memory_bytes()
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


def _rank(rank: int, world: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(32, width, generator=gen)
    out = _bytes(rank, width, depth, batch)

    local = make_model(width, depth)
    local_opt = adamw(local)
    streams = {}
    for delay, redundancy in ((1, 1), (0, 1), (0, 2)):
        model = make_model(width, depth)
        opt = DiLoCoOptimizer(
            adamw(model), sync_every=TIMED_H, fragments=FRAGMENTS, delay=delay,
            redundancy=redundancy,
        )  # fmt: skip
        streams[delay, redundancy] = (model, opt)
    runs: dict[str, Callable[[], object]] = {
        "no communication": window(local, local_opt, batch, TIMED_H),
        "DiLoCo delay 1": window(*streams[1, 1], batch, TIMED_H),
        "DiLoCo delay 0": window(*streams[0, 1], batch, TIMED_H),
        "DiLoCo delay 0, redundancy=2": window(*streams[0, 2], batch, TIMED_H),
    }
    out["times"] = take_turns(runs, rounds, warmup=2)
    # A delayed sync may still be in flight: finish it before the group goes.
    for _, opt in streams.values():
        opt.drain()
    return out


def _overlap_why(times: dict[str, list[float]]) -> str:
    """One line: what a blocking sync costs per inner step in this run, and
    how much of it the delayed sync still shows."""
    quiet = Spread.of(times["no communication"]).median
    blocking = Spread.of(times["DiLoCo delay 0"]).median - quiet
    delayed = Spread.of(times["DiLoCo delay 1"]).median - quiet
    per_step = 1e3 / TIMED_H
    hidden = 1.0 - delayed / blocking if blocking > 0 else 0.0
    return (
        f"a blocking sync (delay=0) adds {blocking * per_step:.1f} ms per inner step here and "
        f"the delayed one {delayed * per_step:.1f} ms ({hidden:.0%} hidden): on 2 cores shared "
        "by both ranks, gloo's copies of the sync in flight take CPU time from the inner steps "
        "they overlap"
    )


def bench_diloco(quick: bool) -> Section:
    width, depth, rounds = (256, 2, 4) if quick else (1024, 4, 15)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    numel = r0["numel"]
    model = f"MLP {numel / 1e6:.2f}M params, AdamW inner, 2 gloo ranks"
    ddp = r0["ddp"]
    byte_rows = [["DDP all-reduce, every step", f"{ddp:,.0f}", "1.000"]]
    headlines = []
    for h in SYNC_EVERY:
        ratio = r0[f"H={h}"] / ddp
        byte_rows.append([f"DiLoCo, H = {h}", f"{r0[f'H={h}']:,.0f}", f"{ratio:.3f}"])
        headlines.append(
            Headline(
                f"DiLoCo H={h} ({model})",
                "bytes per inner step: DiLoCo / DDP all-reduce",
                Spread.exact(ratio),
                f"<= {1 / h:.3f}",
                ratio <= 1 / h * 1.001,
                short=f"DiLoCo H={h} bytes",
            )
        )
    whole, streamed = r0["peak P=1 None"], r0[f"peak P={FRAGMENTS} None"]
    int8 = r0["peak P=1 int8"]
    peak_rows = [
        ["P = 1, fp32", f"{whole:,.0f}", "1.000", f"{r0['memory P=1 None']:,}"],
        [
            f"P = {FRAGMENTS}, fp32",
            f"{streamed:,.0f}",
            f"{streamed / whole:.3f}",
            f"{r0[f'memory P={FRAGMENTS} None']:,}",
        ],
    ]
    peak_rows += [
        [
            f"P = 1, {name}",
            f"{r0[f'peak P=1 {name}']:,.0f}",
            f"{r0[f'peak P=1 {name}'] / whole:.4f} (1/{whole / r0[f'peak P=1 {name}']:.0f})",
            f"{r0[f'memory P=1 {name}']:,}",
        ]
        for name in CODECS
    ]
    carried = r0["peak redundancy"] / whole
    peak_rows.append(
        [
            "P = 1, fp32, redundancy=2",
            f"{r0['peak redundancy']:,.0f}",
            f"{carried:.3f}",
            f"{r0['memory redundancy']:,} ({r0['memory redundancy'] / r0['memory P=1 None']:.2f}x)",
        ]
    )
    replicated = 8 * numel
    memory = r0["memory P=1 None"] / replicated
    headlines += [
        Headline(
            f"Streaming DiLoCo P={FRAGMENTS} ({model})",
            f"peak bytes per sync: P={FRAGMENTS} / P=1",
            Spread.exact(streamed / whole),
            f"<= {1 / FRAGMENTS * 1.01:.3f}",
            streamed / whole <= 1 / FRAGMENTS * 1.01,
            short="DiLoCo peak bytes",
        ),
        Headline(
            f"DiLoCo int8 ({model})",
            "bytes per sync: int8 / fp32",
            Spread.exact(int8 / whole),
            "<= 0.3",
            int8 / whole <= 0.3,
            short="DiLoCo int8 bytes",
        ),
        *(
            Headline(
                f"DiLoCo {name} ({model})",
                f"bytes per sync: fp32 / {name}",
                Spread.exact(whole / r0[f"peak P=1 {name}"]),
                f">= {1 / most:.0f}",
                r0[f"peak P=1 {name}"] / whole <= most,
                short=f"DiLoCo {name} bytes",
                why=""
                if r0[f"peak P=1 {name}"] / whole <= most
                else f"bytes: 1/{whole / r0[f'peak P=1 {name}']:.1f} of fp32's on the wire",
            )
            for name, most in (("int2", 1 / 14), ("topk", 1 / 100))
        ),
        Headline(
            f"DiLoCo redundancy=2 ({model})",
            "bytes per sync: redundancy=2 / redundancy=1",
            Spread.exact(carried),
            "<= 1.5",
            carried <= 1.5 * 1.001,
            short="DiLoCo redundancy bytes",
            why="" if carried <= 1.5 * 1.001 else "the all-reduce's bytes on 2 ranks",
        ),
        Headline(
            f"DiLoCo ({model})",
            "outer state per rank / replicated anchor and momentum",
            Spread.exact(memory),
            "<= 0.5",
            memory <= 0.5,
        ),
    ]
    times = r0["times"]
    quiet = times["no communication"]
    step = {
        name: paired_ratios(t, quiet) for name, t in times.items() if name != "no communication"
    }
    delayed = step["DiLoCo delay 1"]
    headlines.append(
        Headline(
            f"Streaming DiLoCo H={TIMED_H} P={FRAGMENTS} delay=1 ({model})",
            "step time: DiLoCo / no communication",
            delayed,
            "<= 1.05",
            delayed.median <= 1.05,
            short="DiLoCo delay=1 step",
            why=_overlap_why(times) if delayed.median > 1.05 else "",
        )
    )
    spreads = {name: Spread.of(t).scaled(1e3 / TIMED_H) for name, t in times.items()}
    time_rows = [
        [name, spreads[name].fmt(1), "1.00" if name == "no communication" else step[name].fmt()]
        for name in times
    ]
    body = "\n\n".join(
        [
            f"{numel / 1e6:.2f}M parameters, AdamW as the inner optimizer, default outer "
            "optimizer (SGD, Nesterov). Bytes are what one rank sends, estimated for ring "
            "algorithms from the collectives called (all-reduce 2(W-1)/W, reduce and "
            "broadcast (W-1)/W of the payload).",
            md_table(["communication", "bytes per inner step", "/ DDP"], byte_rows),
            md_table(
                ["sync", "largest sync (bytes)", "/ P = 1, fp32", "outer state per rank (bytes)"],
                peak_rows,
            ),
            f"A replicated anchor with momentum would keep {replicated:,} bytes per rank.",
            f"Step time (ms per inner step), windows of {TIMED_H} inner steps with "
            f"{FRAGMENTS} fragments (one sync every {TIMED_H // FRAGMENTS} steps), "
            f"{rounds} timed rounds taking turns:",
            md_table(["run", "ms per inner step", "/ no communication"], time_rows),
        ]
    )
    return Section("DiLoCo (2 gloo ranks, CPU)", body, headlines)


BENCHES: dict[str, Callable[[bool], Section]] = {"diloco": bench_diloco}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
