"""DDP iteration with PowerSGD: zerofn's hook against PyTorch's, in one run.

Two gloo ranks on CPU train an MLP of ~4M parameters split over several DDP
buckets, with PowerSGD at rank 4 (same compression for both). Each timed
iteration is forward + backward (the hook runs inside backward); the two
implementations take turns iteration by iteration on two identical DDP models
in the same process group, after warm-up past ``start_powerSGD_iter``.

PyTorch's hook issues collectives from future callbacks; with several buckets
on gloo they interleave differently on each rank and the run aborts. To let it
run here, PyTorch's side gets one process group and one ``PowerSGDState`` per
bucket (a dispatcher hook picks them by bucket index), so its collectives never
need a common order. zerofn's hook needs none of that.

Also counted, per iteration and rank: collectives issued and bytes handed to
``all_reduce`` / ``all_gather``, against a plain all-reduce of every gradient.
Prints Markdown; no timing is asserted anywhere. (No postponed annotations in
this file: DDP checks a hook's annotations when it is registered.)
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from report import (
    Headline,
    Section,
    Spread,
    md_table,
    paired_ratios,
    standalone_main,
    take_turns,
)
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks import PowerSGDState, allreduce_hook, powerSGD_hook
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

RANK = 4
START_ITER = 2
BUCKET_CAP_MB = 4
MAX_BUCKETS = 16


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _torch_hook_per_bucket(num_buckets: int) -> tuple[list[Any], Callable[..., Any]]:
    states = [
        torch_powersgd.PowerSGDState(
            process_group=dist.new_group(),
            matrix_approximation_rank=RANK,
            start_powerSGD_iter=START_ITER,
            min_compression_rate=1,
        )
        for _ in range(num_buckets)
    ]

    def dispatch(states: list[Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # Each state counts iterations only when it sees the last bucket;
        # keep them all on the iteration the last bucket's state counted.
        state = states[bucket.index()]
        state.iter = max(s.iter for s in states)
        return torch_powersgd.powerSGD_hook(state, bucket)

    return states, dispatch


BUILTIN = "DDP all-reduce"
"""DDP with its built-in (C++) all-reduce and no hook: what PowerSGD replaces."""


def _rank(
    rank: int,
    world: int,
    width: int,
    depth: int,
    rounds: int,
    timed: Sequence[str] = ("zerofn", "pytorch"),
    count_link: Callable[[Callable[[], object]], int] | None = None,
) -> dict[str, Any]:
    """One rank's timings of the set-ups in ``timed`` ("zerofn", "pytorch",
    :data:`BUILTIN`), taking turns, and their collectives counted;
    ``count_link`` (bytes a link carried while a call ran) counts one more
    iteration of each."""
    models: dict[str, torch.nn.Module] = {}
    ours = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=RANK,
        start_powerSGD_iter=START_ITER,
        min_compression_rate=1,
    )
    ours.register_comm_hook(state, powerSGD_hook)
    models["zerofn"] = ours
    if "pytorch" in timed:
        theirs = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
        # More groups than buckets; each bucket index picks its own.
        torch_states, dispatch = _torch_hook_per_bucket(MAX_BUCKETS)
        theirs.register_comm_hook(torch_states, dispatch)
        models["pytorch"] = theirs
    if BUILTIN in timed:
        models[BUILTIN] = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    plain = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    plain.register_comm_hook(None, allreduce_hook)  # the same all-reduce, visible to the count

    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(32, width, generator=gen)

    def iteration(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=False)
        model(batch).square().mean().backward()

    times = take_turns(
        {name: (lambda m=models[name]: iteration(m)) for name in timed},
        rounds,
        warmup=START_ITER + 3,
    )

    counted: dict[str, dict[str, int]] = {}
    iteration(plain)  # DDP rebuilds its buckets after the first iteration
    counted_models = [(n, m) for n, m in models.items() if n != BUILTIN] + [
        ("plain all-reduce", plain)
    ]
    for name, model in counted_models:
        with collective_traffic() as traffic:
            iteration(model)
        counted[name] = {"calls": traffic.total_calls, "bytes": sum(traffic.payload_bytes.values())}
    on_link = {}
    if count_link is not None:
        on_link = {name: count_link(lambda m=m: iteration(m)) for name, m in models.items()}
    return {
        "times": times,
        "counted": counted,
        "numel": sum(p.numel() for p in ours.parameters()),
        "on_link": on_link,
    }


def bench_powersgd(quick: bool) -> Section:
    width, depth, rounds = (256, 4, 4) if quick else (1024, 4, 20)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    times = {name: Spread.of(t).scaled(1e3) for name, t in r0["times"].items()}
    counted = r0["counted"]
    buckets = counted["plain all-reduce"]["calls"]
    table = md_table(
        ["implementation", "iteration (ms): median [q1, q3]", "collectives / iteration", "bytes"],
        [
            [
                name,
                times[name].fmt(1) if name in times else "-",
                counted[name]["calls"],
                f"{counted[name]['bytes']:,}",
            ]
            for name in ("zerofn", "pytorch", "plain all-reduce")
        ],
    )
    model = f"MLP {r0['numel'] / 1e6:.1f}M params, {buckets} buckets, 2 gloo ranks"
    step = paired_ratios(r0["times"]["zerofn"], r0["times"]["pytorch"])
    sent = counted["zerofn"]["bytes"] / counted["pytorch"]["bytes"]
    compressed = counted["zerofn"]["bytes"] / counted["plain all-reduce"]["bytes"]
    headlines = [
        Headline(
            f"DDP + PowerSGD rank {RANK} ({model})",
            "iteration time: zerofn / PyTorch",
            step,
            "<= 0.9",
            step.median <= 0.9,
            short="DDP + PowerSGD",
        ),
        Headline(
            f"DDP + PowerSGD rank {RANK} ({model})",
            "bytes per iteration: zerofn / PyTorch",
            Spread.exact(sent),
            "<= 1.0",
            sent <= 1.0,
        ),
        Headline(
            f"DDP + PowerSGD rank {RANK} ({model})",
            "bytes per iteration: zerofn PowerSGD / plain all-reduce",
            Spread.exact(compressed),
        ),
    ]
    body = "\n\n".join(
        [
            f"{r0['numel'] / 1e6:.1f}M parameters in {buckets} DDP buckets, rank {RANK} from "
            f"iteration {START_ITER}; {rounds} timed rounds after warm-up, the two "
            "implementations alternating (order flipping each round); forward + backward "
            "timed on rank 0 after a barrier. Bytes are those handed to `all_reduce` / "
            "`all_gather` by one rank in one iteration.",
            table,
            f"zerofn / PyTorch iteration time, round by round: {step.fmt()} (median [q1, q3]).",
        ]
    )
    return Section("DDP + PowerSGD iteration (2 gloo ranks, CPU)", body, headlines)


BENCHES: dict[str, Callable[[bool], Section]] = {"powersgd": bench_powersgd}


if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
