"""DDP + ZeRO: the step overlapped with backward against separate steps, in one run.

Two gloo ranks on CPU train identical MLPs (Adam) three ways: zerofn's
``hook_with_zero_step`` around the plain averaging hook (gradients reduced to
their owner, updated parameters broadcast back, all inside backward); DDP with
the averaging hook and then zerofn's ``ZeroRedundancyOptimizer.step()``; and
DDP with its built-in (C++) all-reduce and then PyTorch's
``ZeroRedundancyOptimizer.step()`` (the shard exchange). PyTorch's own overlap
hooks refuse gloo, so this is the fastest it offers here. The three take
turns iteration by iteration after DDP has fixed its buckets; each timed
iteration is forward + backward (+ step).

Bytes per iteration and rank are counted from the collectives each side calls
(for PyTorch, on an untimed twin whose all-reduce goes through PyTorch's Python
averaging hook, since the counter cannot see DDP's C++ one),
weighted by what a ring sends per payload byte on 2 ranks (all-reduce 1.0,
reduce 0.5, broadcast 0.5), and compared with one all-reduce of the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from report import (
    Headline,
    Section,
    Spread,
    md_table,
    paired_ratios,
    standalone_main,
    take_turns,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import allreduce_hook
from zerofn_torch.launch import run_local_world
from zerofn_torch.overlap import hook_with_zero_step
from zerofn_torch.traffic import collective_traffic


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def wire_bytes(fn: Callable[[], None]) -> float:
    """Bytes this rank sends while ``fn`` runs (ring estimate, 2 ranks)."""
    with collective_traffic() as traffic:
        fn()
    return traffic.sent_bytes(2)


def _rank(rank: int, world: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
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
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))

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

    runs = {"overlapped": run_overlapped, "separate": run_separate, "pytorch": run_pytorch}
    times = take_turns(runs, rounds, warmup=3)  # DDP fixes its buckets after iteration 1
    # All three took the same steps on the same data: compare before counting
    # bytes, which steps two of them once more.
    diff = max(
        (p - q).abs().max().item()
        for other in (separate, theirs)
        for p, q in zip(overlapped.parameters(), other.parameters(), strict=True)
    )
    for _ in range(2):  # past the twin's bucket rebuild
        run_twin()
    wire = {name: wire_bytes(fn) for name, fn in {**runs, "pytorch": run_twin}.items()}
    grad_bytes = sum(p.numel() * p.element_size() for p in separate.parameters())
    return {"times": times, "wire": wire, "grad_bytes": grad_bytes, "diff": diff}


def bench_overlap(quick: bool) -> Section:
    width, depth, rounds = (256, 4, 4) if quick else (1024, 8, 20)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    times = {name: Spread.of(t).scaled(1e3) for name, t in r0["times"].items()}
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
            for name in r0["times"]
        ],
    )
    model = f"DDP + ZeRO overlap (Adam, MLP {r0['grad_bytes'] / 4e6:.1f}M params, 2 gloo ranks)"
    headlines = []
    for other, label in (
        ("pytorch", "PyTorch's separate step"),
        ("separate", "zerofn's separate step"),
    ):
        step = paired_ratios(r0["times"]["overlapped"], r0["times"][other])
        headlines.append(
            Headline(
                model,
                f"iteration time: overlapped / {label}",
                step,
                "<= 1.0",
                step.median <= 1.0,
                short="DDP + ZeRO overlap",
            )
        )
    against_one = r0["wire"]["overlapped"] / one_allreduce
    headlines.append(
        Headline(
            model,
            "bytes per iteration: overlapped / one all-reduce of the gradients",
            Spread.exact(against_one),
            "= 1.0",
            abs(against_one - 1.0) < 0.01,
        )
    )
    body = "\n\n".join(
        [
            f"{rounds} timed rounds after 3 warm-up iterations, the three setups taking turns "
            "(who goes first rotates each round): zerofn's overlapped step, DDP + zerofn's "
            "`step()` after backward ('separate'), and DDP with its built-in all-reduce + "
            "PyTorch's `ZeroRedundancyOptimizer.step()` after backward ('pytorch'; its bytes "
            "are counted on a twin using PyTorch's Python averaging hook, which the counter "
            "sees); "
            "forward + backward (+ step) timed on rank 0 after a barrier. Bytes sent by one "
            "rank, from the collectives it called, weighted as a ring on 2 ranks sends them "
            "(all-reduce 1.0, reduce and broadcast 0.5 per payload byte).",
            table,
            f"Largest parameter difference between the three after the run: {r0['diff']:.3g}.",
        ]
    )
    return Section("DDP + ZeRO: step overlapped with backward (2 gloo ranks, CPU)", body, headlines)


BENCHES: dict[str, Callable[[bool], Section]] = {"overlap": bench_overlap}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
