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

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks import PowerSGDState, allreduce_hook, powerSGD_hook
from zerofn_torch.launch import run_local_world
from zerofn_torch.traffic import collective_traffic

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


def _rank(rank: int, world: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
    ours = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    theirs = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=RANK,
        start_powerSGD_iter=START_ITER,
        min_compression_rate=1,
    )
    ours.register_comm_hook(state, powerSGD_hook)
    # More groups than buckets; each bucket index picks its own.
    torch_states, dispatch = _torch_hook_per_bucket(MAX_BUCKETS)
    theirs.register_comm_hook(torch_states, dispatch)
    plain = DDP(make_model(width, depth), bucket_cap_mb=BUCKET_CAP_MB)
    plain.register_comm_hook(None, allreduce_hook)  # the same all-reduce, visible to the count

    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(32, width, generator=gen)

    def iteration(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=False)
        model(batch).square().mean().backward()

    times: dict[str, list[float]] = {"zerofn": [], "pytorch": []}
    for r in range(START_ITER + 3 + rounds):
        for name, model in (("zerofn", ours), ("pytorch", theirs))[:: 1 if r % 2 else -1]:
            dist.barrier()
            start = time.perf_counter()
            iteration(model)
            if r >= START_ITER + 3:
                times[name].append(time.perf_counter() - start)

    counted: dict[str, dict[str, int]] = {}
    iteration(plain)  # DDP rebuilds its buckets after the first iteration
    for name, model in (("zerofn", ours), ("pytorch", theirs), ("plain all-reduce", plain)):
        with collective_traffic() as traffic:
            iteration(model)
        counted[name] = {"calls": traffic.total_calls, "bytes": sum(traffic.payload_bytes.values())}
    return {
        "times": times,
        "counted": counted,
        "numel": sum(p.numel() for p in ours.parameters()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PowerSGD DDP iteration: zerofn vs PyTorch")
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    width, depth, rounds = (256, 4, 4) if args.quick else (1024, 4, args.rounds)
    r0 = run_local_world(_rank, 2, width, depth, rounds)[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    buckets = r0["counted"]["plain all-reduce"]["calls"]
    print(
        f"## DDP + PowerSGD (rank {RANK}), 2 gloo ranks, {r0['numel'] / 1e6:.1f}M parameters, "
        f"{buckets} buckets, {rounds} rounds alternating\n"
    )
    print(
        "| implementation | iteration median (ms) | collectives / iteration | bytes / iteration |"
    )
    print("| --- | ---: | ---: | ---: |")
    for name in ("zerofn", "pytorch", "plain all-reduce"):
        c = r0["counted"][name]
        ms = f"{med[name] * 1e3:.1f}" if name in med else ""
        print(f"| {name} | {ms} | {c['calls']} | {c['bytes']:,} |")
    ratio = med["zerofn"] / med["pytorch"]
    print(f"\nzerofn / PyTorch iteration time: **{ratio:.2f}** (target <= 0.9)")


if __name__ == "__main__":
    main()
