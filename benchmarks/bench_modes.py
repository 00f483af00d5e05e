"""ZeRO step by partition mode, against its floor and against PyTorch.

Every zerofn setting (greedy, balanced, flat; bucket views off and on;
``torch.optim.Adam``'s default per-tensor loop and ``fused=True``) steps its
own copy of the same ~20M-parameter model on 2 gloo ranks, taking turns with
PyTorch's ``ZeroRedundancyOptimizer`` at its default (no bucket view, default
Adam) and at its fastest (bucket view, fused Adam). Two more runs take turns
with them and make the **floor**, the work no implementation can avoid:

* the local update alone: Adam, with the setting's kernel, over one rank's
  share of the elements (``numel / world_size``) held the fastest way for that
  kernel (cache-sized chunks for the per-tensor loop, one tensor for fused);
* the exchange alone: each rank's segment of a flat buffer broadcast from its
  owner (the bytes every ZeRO step must move).

A setting's floor is the sum of the two for its kernel, round by round; the
goal is every zerofn setting within 1.1x its floor, and flat no slower than
greedy. Every setting passes ``parameters_as_bucket_view`` explicitly; the
optimizer's default is the ``bucket_view=True`` row under flat and the
``bucket_view=False`` rows otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_zero import model_shapes
from report import Headline, Section, Spread, md_table, paired_ratios, standalone_main, take_turns
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.launch import run_local_world

from zerofn.zero.chunks import chunk_sizes

KERNELS: dict[str, dict[str, Any]] = {"default": {}, "fused": {"fused": True}}
SETTINGS = [
    (f"zerofn {mode}, bucket_view={bv}, {kernel}", mode, bv, kernel)
    for kernel in KERNELS
    for mode in ("greedy", "balanced", "flat")
    for bv in (False, True)
]
PYTORCH = {
    "PyTorch default (no bucket view, default Adam)": (False, "default"),
    "PyTorch fastest (bucket view, fused Adam)": (True, "fused"),
}


def _params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return params


def _floors(numel: int, world_size: int) -> dict[str, Callable[[], object]]:
    """The update alone per kernel, and the exchange alone."""
    share = numel // world_size
    runs: dict[str, Callable[[], object]] = {}
    for kernel, options in KERNELS.items():
        flat = torch.zeros(share)
        pieces = list(torch.split(flat, list(chunk_sizes(share, 4)))) if not options else [flat]
        for piece in pieces:
            piece.grad = torch.randn(piece.shape) * 1e-2
        runs[f"update alone, {kernel}"] = torch.optim.Adam(pieces, lr=1e-3, **options).step
    buffer = torch.zeros(share * world_size)
    segments = buffer.split(share)

    def exchange() -> None:
        works = [dist.broadcast(s, src=r, async_op=True) for r, s in enumerate(segments)]
        for work in works:
            assert work is not None
            work.wait()

    runs["exchange alone"] = exchange
    return runs


def _modes_rank(rank: int, world_size: int, quick: bool, rounds: int, warmup: int) -> Any:
    shapes = model_shapes(quick)
    runs: dict[str, Callable[[], object]] = {}
    for label, mode, bv, kernel in SETTINGS:
        opt = ZeroRedundancyOptimizer(
            _params(shapes),
            torch.optim.Adam,
            parameters_as_bucket_view=bv,
            partition=mode,
            lr=1e-3,
            **KERNELS[kernel],
        )
        runs[label] = opt.step
    for label, (bv, kernel) in PYTORCH.items():
        theirs = TorchZero(
            _params(shapes),
            torch.optim.Adam,
            parameters_as_bucket_view=bv,
            lr=1e-3,
            **KERNELS[kernel],
        )
        runs[label] = theirs.step
    numel = sum(torch.Size(s).numel() for s in shapes)
    runs |= _floors(numel, world_size)
    return {"times": take_turns(runs, rounds, warmup), "numel": numel, "tensors": len(shapes)}


def _rows(times: dict[str, list[float]]) -> tuple[list[list[str]], dict[str, Spread]]:
    exchange = times["exchange alone"]
    floor = {
        kernel: [u + e for u, e in zip(times[f"update alone, {kernel}"], exchange, strict=True)]
        for kernel in KERNELS
    }
    default_pt, fastest_pt = list(PYTORCH)
    to_floor: dict[str, Spread] = {}
    rows = []
    for label, _mode, _bv, kernel in SETTINGS:
        to_floor[label] = paired_ratios(times[label], floor[kernel])
        rows.append(
            [
                label,
                Spread.of(times[label]).scaled(1e3).fmt(1),
                to_floor[label].fmt(),
                paired_ratios(times[label], times[default_pt]).fmt(),
                paired_ratios(times[label], times[fastest_pt]).fmt(),
            ]
        )
    for label in PYTORCH:
        rows.append([label, Spread.of(times[label]).scaled(1e3).fmt(1), "-", "-", "-"])
    for kernel in KERNELS:
        rows.append(
            [f"floor, {kernel}", Spread.of(floor[kernel]).scaled(1e3).fmt(1), "1", "-", "-"]
        )
    return rows, to_floor


def bench_modes(quick: bool) -> Section:
    """The section: every setting against its floor and PyTorch."""
    rounds, warmup = (3, 1) if quick else (15, 3)
    r0 = run_local_world(_modes_rank, 2, quick, rounds, warmup)[0]
    times = r0["times"]
    rows, to_floor = _rows(times)
    table = md_table(
        ["setting", "step (ms)", "/ its floor", "/ PyTorch default", "/ PyTorch fastest"], rows
    )
    worst = max(to_floor, key=lambda label: to_floor[label].median)
    model = f"Adam, {r0['numel'] / 1e6:.1f}M params in {r0['tensors']} tensors, 2 gloo ranks"
    headlines = [
        Headline(
            f"ZeRO step by mode ({model})",
            f"worst zerofn setting / its floor ({worst})",
            to_floor[worst],
            "<= 1.1",
            to_floor[worst].median <= 1.1,
            short="worst mode / floor",
        )
    ]
    for kernel in KERNELS:
        for bv in (False, True):
            flat = times[f"zerofn flat, bucket_view={bv}, {kernel}"]
            greedy = times[f"zerofn greedy, bucket_view={bv}, {kernel}"]
            ratio = paired_ratios(flat, greedy)
            headlines.append(
                Headline(
                    f"ZeRO step by mode ({model}, bucket_view={bv}, {kernel} Adam)",
                    "step time: flat / greedy",
                    ratio,
                    "<= 1.0",
                    ratio.median <= 1.0,
                    short=f"flat / greedy, bv={bv}, {kernel}",
                )
            )
    body = "\n\n".join(
        [
            f"Model: {model}; {warmup} warm-up rounds, {rounds} timed rounds, every "
            "setting and both floor parts taking turns step by step (rank 0's times). "
            "The floor is the update alone (Adam with the setting's kernel over one "
            "rank's share, held the fastest way for that kernel) plus the exchange "
            "alone (each rank's segment broadcast from its owner); ratios are taken "
            "round by round, median [q1, q3]. Each setting passes bucket_view "
            "explicitly; zerofn's defaults are greedy and balanced without bucket views "
            "(PyTorch's default) and flat with them.",
            table,
        ]
    )
    return Section("ZeRO step by partition mode, against its floor", body, headlines)


BENCHES = {"modes": bench_modes}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
