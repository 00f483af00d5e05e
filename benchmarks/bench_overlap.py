"""DDP + ZeRO: the step overlapped with backward against a separate step, in one run.

Two gloo ranks on CPU train identical MLPs (Adam). One runs zerofn's
``hook_with_zero_step`` around the plain averaging hook (gradients reduced to
their owner, updated parameters broadcast back); the other runs DDP with the
averaging hook and then ``ZeroRedundancyOptimizer.step()`` (all-reduce, then
the shard exchange). They take turns iteration by iteration after DDP has
fixed its buckets; each timed iteration is forward + backward (+ step).

Bytes per iteration and rank are counted from the collectives each side calls,
weighted by what a ring sends per payload byte on 2 ranks (all-reduce 1.0,
reduce 0.5, broadcast 0.5), and compared with one all-reduce of the gradients.
PyTorch's own overlap hooks refuse gloo, so they are not in this table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
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
    batch = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))

    def run_overlapped() -> None:
        zero_o.zero_grad()
        overlapped(batch).square().mean().backward()

    def run_separate() -> None:
        zero_s.zero_grad()
        separate(batch).square().mean().backward()
        zero_s.step()

    runs = {"overlapped": run_overlapped, "separate": run_separate}
    times: dict[str, list[float]] = {name: [] for name in runs}
    warmup = 3  # DDP fixes its buckets after the first iteration
    for r in range(warmup + rounds):
        for name in list(runs)[:: 1 if r % 2 else -1]:
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    wire = {name: wire_bytes(fn) for name, fn in runs.items()}
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(overlapped.parameters(), separate.parameters(), strict=True)
    )
    grad_bytes = sum(p.numel() * p.element_size() for p in separate.parameters())
    return {"times": times, "wire": wire, "grad_bytes": grad_bytes, "diff": diff}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    width, depth, rounds = (256, 4, 4) if args.quick else (1024, 8, args.rounds)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    med = {name: statistics.median(t) for name, t in r0["times"].items()}
    one_allreduce = 1.0 * r0["grad_bytes"]  # 2(N-1)/N of the gradients, N = 2
    print(f"## DDP + ZeRO (Adam), 2 gloo ranks, {r0['grad_bytes'] / 4e6:.1f}M parameters\n")
    print("| iteration | median (ms) | bytes sent / rank | vs one all-reduce |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("overlapped", "separate"):
        wire = r0["wire"][name]
        print(f"| {name} | {med[name] * 1e3:.1f} | {wire:,.0f} | {wire / one_allreduce:.2f}x |")
    ratio = med["overlapped"] / med["separate"]
    print(f"\noverlapped / separate iteration time: **{ratio:.2f}** (target <= 1.0)")
    print(f"largest parameter difference between the two: {r0['diff']:.3g}")


if __name__ == "__main__":
    main()
