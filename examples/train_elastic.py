"""Training that goes on when a rank dies: 3 gloo ranks on this machine, DDP
and ``ZeroRedundancyOptimizer(redundancy=2)``; at step 3 rank 2 exits, and
ranks 0 and 1 regroup in-process and finish the run on 2 ranks, no restart,
no checkpoint read::

    .venv/bin/python examples/train_elastic.py                 # lost before its step 3
    .venv/bin/python examples/train_elastic.py --in-exchange   # lost inside step 3's exchange

Under torchrun it takes one agent per node: a node's agent stops all of its
workers when one dies, but the other nodes' agents leave theirs running. 3
"nodes" on this machine, node ``n``'s worker rank ``n``, node 0's agent
hosting the job's store (which the roll call needs: node 0 must live)::

    for n in 0 1 2; do
      .venv/bin/torchrun --nnodes=3 --nproc-per-node=1 --node-rank=$n \
          --master-addr=127.0.0.1 --master-port=29511 --rdzv-id=zerofn-elastic \
          --max-restarts=0 examples/train_elastic.py --torchrun-worker out &
    done; wait

Rank 2 kills itself (``SIGKILL``) at step 3 and node 2's agent exits with an
error; ranks 0 and 1 recover, finish and save their results in ``out/``;
their agents then wait up to 300 s at torchrun's exit barrier for node 2's
agent, and exit 0.

Each step's data comes from a ``DistributedSampler`` of the current world, so
after the loss the two survivors split the data between them (a sampler for 2
ranks, each survivor's new rank). ``tests/test_elastic.py`` runs :func:`train`
and checks the survivors' result bit for bit against a run that never lost a
rank but shrank at the same step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import DEADLINE_S, Recovered, init_process_group, recover
from zerofn_torch.hooks import allreduce_hook, hook_with_zero_step
from zerofn_torch.runtime.heartbeat import destroy_process_groups
from zerofn_torch.runtime.launch import run_local_world

from zerofn.errors import CollectiveError
from zerofn.zero.elastic.redundancy import plan_after_join, plan_after_loss
from zerofn.zero.params import plan_for
from zerofn.zero.planning.partition import FlatPartition
from zerofn.zero.planning.plan import ShardPlan

STEPS, LOST_AT, LOST = 6, 3, 2
BATCH = 4
TIMEOUT_S = dist.default_pg_timeout.total_seconds()
"""The process group's collective timeout: PyTorch's default (30 minutes for
gloo). Nothing waits for it: a dead or silent rank is known by its heartbeat,
and a survivor that gloo leaves blocked in a collective is released by the
job's alarm (docs/resilience.md)."""


@dataclass(frozen=True)
class Config:
    """A training configuration the lost-rank examples run: the model's
    dtype and the ``ZeroRedundancyOptimizer`` options beside Adam's.

    Attributes:
        name: how ``--config`` names it.
        summary: what it trains, in a few words (the benchmarks' legends).
        dtype: the parameters' dtype.
        options: the optimizer's keyword arguments (``redundancy`` apart).
    """

    name: str
    summary: str
    dtype: torch.dtype = torch.float32
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The masters' dtype asked for (``None``: none asked for)."""
        dtype: torch.dtype | None = dict(self.options).get("master_dtype")
        return dtype

    @property
    def keeps_masters(self) -> bool:
        """The optimizer keeps master copies (asked for, or kept by a
        compressed exchange): the carried copy is masters too."""
        options = dict(self.options)
        return "master_dtype" in options or "exchange_compression" in options


CONFIGS = {
    config.name: config
    for config in (
        Config("plain", "fp32"),
        Config(
            "masters",
            "bf16 parameters, fp32 masters",
            torch.bfloat16,
            (("master_dtype", torch.float32),),
        ),
        Config("flat", "fp32, a flat partition", options=(("partition", "flat"),)),
        Config("int8", "fp32, the int8 exchange", options=(("exchange_compression", "int8"),)),
        Config(
            "overlap", "fp32, stepped inside DDP's backward", options=(("overlap_with_ddp", True),)
        ),
        Config(
            "gather",
            "fp32, the exchange behind the next forward",
            options=(("gather_during_forward", True),),
        ),
        Config(
            "gather-int8",
            "fp32, the int8 exchange behind the next forward",
            options=(("gather_during_forward", True), ("exchange_compression", "int8")),
        ),
    )
}
"""The configurations a lost rank is survived in, by name: ``plain`` (fp32
parameters, Adam's state sharded by whole parameters), ``masters`` (bf16
parameters, fp32 masters and Adam's state sharded, as a mixed-precision job
trains), ``flat`` (fp32, every rank an equal range of the elements,
the parameters views of the exchange buffer), ``int8`` (fp32, the
updated shards sent as int8 differences from fp32 masters), ``overlap``
(fp32, ``overlap_with_ddp=True``: DDP's hook takes the step when the last
bucket is averaged), ``gather`` (fp32, ``gather_during_forward=True``: the
exchange travels behind the next forward, so a loss inside it fails the
survivors' next forward) and ``gather-int8`` (the int8 exchange behind the
next forward)."""
PLAIN = CONFIGS["plain"]


def legend() -> str:
    """Every configuration, named and summed up: ``plain``: fp32; ..."""
    return "; ".join(f"`{c.name}`: {c.summary}" for c in CONFIGS.values())


def make_model(config: Config = PLAIN) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    )
    return model.to(config.dtype)


Owners = tuple[tuple[int, ...], ...]
"""The parameters each rank owns (global indices), rank by rank."""


def make_zero(
    model: torch.nn.Module,
    config: Config = PLAIN,
    redundancy: int = 2,
    owners: Owners | None = None,
) -> ZeroRedundancyOptimizer:
    """The ZeRO optimizer of ``config`` over ``model``: Adam, lr 0.01;
    ``owners`` gives a manual partition in place of the configuration's.
    With ``redundancy=1`` (a reference) the overlapped configuration steps
    after backward: its hook, with ``redundancy=2``, takes that same step,
    from the same averaged gradients, inside backward."""
    options = dict(config.options)
    if redundancy == 1:
        options.pop("overlap_with_ddp", None)
    if owners is not None:
        params = list(model.parameters())
        options["partition"] = [[params[i] for i in owned] for owned in owners]
    return ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, redundancy=redundancy, lr=0.01, **options
    )


def owners_after_loss(
    config: Config, world_size: int, lost: int, owners: Owners | None = None
) -> Owners | None:
    """Who owns what once rank ``lost`` of a world of ``world_size`` ranks
    (of ``config``, partitioned by ``owners`` or the configuration's own
    partition) is gone: :func:`~zerofn.zero.elastic.redundancy.plan_after_loss`'s
    plan, which a reference world takes so that it shards as the survivors
    do (with a compressed exchange the shards decide the numbers). ``None``
    for a flat partition: no whole-parameter list says its ranges, and its
    exact exchange's numbers do not depend on them."""
    return _owners(plan_after_loss(_plan_of(config, world_size, owners), [lost]).plan)


def owners_after_join(
    config: Config, world_size: int, joiners: int, owners: Owners | None = None
) -> Owners | None:
    """Who owns what once ``joiners`` ranks join a world of ``world_size``
    ranks: :func:`~zerofn.zero.elastic.redundancy.plan_after_join`'s plan, as
    :func:`owners_after_loss` says."""
    return _owners(plan_after_join(_plan_of(config, world_size, owners), joiners).plan)


def _plan_of(config: Config, world_size: int, owners: Owners | None) -> ShardPlan:
    """The plan of a world of ``config`` partitioned by ``owners`` (or the
    configuration's own partition)."""
    params = list(make_model(config).parameters())
    chosen: Any = dict(config.options).get("partition", "greedy")
    if owners is not None:
        chosen = [[params[i] for i in owned] for owned in owners]
    return plan_for([{"params": params}], world_size, chosen)


def _owners(plan: ShardPlan) -> Owners | None:
    partition = plan.partition
    if isinstance(partition, FlatPartition):
        return None
    return tuple(partition.params_of(r) for r in range(partition.world_size))


DATA = TensorDataset(
    torch.randn(96, 8, generator=torch.Generator().manual_seed(0)),
    torch.randn(96, 1, generator=torch.Generator().manual_seed(1)),
)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step`` in a world of ``world_size``: the
    sampler re-splits the data whenever the world changes."""
    sampler = DistributedSampler(DATA, num_replicas=world_size, rank=rank, seed=0)
    sampler.set_epoch(step)
    indices = list(sampler)[:BATCH]
    x, y = DATA[indices]
    return x, y


def make_ddp(
    model: torch.nn.Module, group: Any = None, zero: ZeroRedundancyOptimizer | None = None
) -> DDP:
    """DDP over ``model`` in ``group`` (``None``: the default one), with
    zerofn's all-reduce hook: the same sums as DDP's own, and a future that
    fails once another rank raises the alarm, so a survivor blocked in
    backward's all-reduce joins the roll call at once. With a ``zero`` built
    with ``overlap_with_ddp=True``, the hook steps it too."""
    ddp = DDP(model, process_group=group)
    if zero is not None and zero.zero_rank.stepped_by_hook:
        ddp.register_comm_hook(group, hook_with_zero_step(allreduce_hook, ddp, zero))
    else:
        ddp.register_comm_hook(group, allreduce_hook)  # its state: the group to reduce in
    return ddp


def train_step(ddp: DDP, zero: ZeroRedundancyOptimizer, step: int) -> None:
    zero.zero_grad()
    x, y = batch(step, zero.rank, zero.world_size)
    dtype = next(ddp.module.parameters()).dtype  # bf16 batches for a bf16 model
    torch.nn.functional.mse_loss(ddp(x.to(dtype)), y.to(dtype)).backward()
    if not zero.zero_rank.stepped_by_hook:  # else backward stepped
        zero.step()


def fresh_phase(
    rank: int,
    world_size: int,
    start: dict[str, Any] | None,
    steps: range,
    config: Config = PLAIN,
    owners: Owners | None = None,
) -> Any:
    """A reference: a fresh world of ``world_size`` ranks of ``config`` that
    loses nobody (partitioned by ``owners``, if given), from ``start``'s
    parameters and consolidated state (or from scratch), training ``steps``;
    its parameters and (on rank 0) the state consolidated."""
    model = make_model(config)
    zero = make_zero(model, config, redundancy=1, owners=owners)
    if start is not None:
        with torch.no_grad():
            for p, value in zip(model.parameters(), start["params"], strict=True):
                p.copy_(value)
        zero.load_state_dict(start["state"])
    ddp = make_ddp(model, zero=zero)
    for step in steps:
        train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if rank == 0 else None,
    }


@dataclass(frozen=True)
class Survived:
    """One recovery, as a surviving rank saw it.

    Attributes:
        recovered: what :func:`recover` returned.
        caught: when the failure was caught (wall clock, ``time.time()``).
        generation: the failed world's number in the job (``zero.generation``).
        world_size: the failed world's size.
        seconds: how long :func:`recover` took.
    """

    recovered: Recovered
    caught: float
    generation: int
    world_size: int
    seconds: float


def step_surviving(
    ddp: DDP,
    model: torch.nn.Module,
    zero: ZeroRedundancyOptimizer,
    step: int,
    deadline_s: float = DEADLINE_S,
) -> tuple[DDP, list[Survived]]:
    """Run ``step`` until it is complete, recovering from each loss on the
    way (a step the survivors finished is not redone).

    Returns:
        The DDP to go on with (rebuilt on the survivors' group after a
        loss), and each recovery.

    Raises:
        zerofn.errors.CollectiveError: what :func:`recover` raises (this
            rank left behind, or no consistent point).
    """
    recoveries: list[Survived] = []
    while True:
        try:
            train_step(ddp, zero, step)
            return ddp, recoveries
        except (CollectiveError, RuntimeError) as error:  # DDP raises RuntimeError
            caught, generation, world_size = time.time(), zero.generation, zero.world_size
            began = time.perf_counter()
            survivors = recover(zero, error, deadline_s=deadline_s)
            ddp = make_ddp(model, survivors.group, zero)
            seconds = time.perf_counter() - began
            recoveries.append(Survived(survivors, caught, generation, world_size, seconds))
            if survivors.finished_step:
                return ddp, recoveries


def exit_quietly() -> None:
    """How the lost rank ends under :func:`run_local_world`: at once, status 0."""
    os._exit(0)


def kill_self() -> None:
    """How the lost rank ends under torchrun: ``SIGKILL``, as the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_after_local_step(zero: ZeroRedundancyOptimizer, die: Callable[[], None]) -> None:
    """This rank dies right after its next local step, inside the step:
    the others' exchange then fails."""
    local = zero.optim
    step = local.step

    def step_then_exit(*args: Any, **kwargs: Any) -> Any:
        step(*args, **kwargs)
        die()

    local.step = step_then_exit  # type: ignore[method-assign]


def train(
    rank: int, world_size: int, in_exchange: bool = False, die: Callable[[], None] = exit_quietly
) -> dict[str, Any] | None:
    """The training loop of one rank: rank :data:`LOST` ends at step
    :data:`LOST_AT` (calls ``die``); the others recover and go on.

    Returns:
        The parameters, the consolidated optimizer state (on the new rank
        0), what each recovery reported, and the final world size.
    """
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = make_ddp(model, zero=zero)
    recoveries = []
    for step in range(STEPS):
        if rank == LOST and step == LOST_AT:
            if not in_exchange:
                die()
            _exit_after_local_step(zero, die)
        ddp, recovered = step_surviving(ddp, model, zero, step)
        recoveries += [
            {
                "step": step,
                "lost": r.recovered.lost,
                "finished_step": r.recovered.finished_step,
                "seconds": r.seconds,
            }
            for r in recovered
        ]
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if zero.rank == 0 else None,
        "recoveries": recoveries,
        "world_size": zero.world_size,
    }


def torchrun_worker(out_dir: str, in_exchange: bool) -> None:
    """One worker under torchrun (one agent per node, ``--max-restarts 0``):
    the process group from torchrun's environment, :func:`train` as under
    :func:`run_local_world`, the lost rank killing itself with ``SIGKILL``;
    each survivor saves its result as ``rank<N>.pt`` in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as run_local_world's ranks: the same sums, bit for bit
    # zerofn's init_process_group: a loss also frees a rank PyTorch blocked in C++.
    init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    result = train(rank, dist.get_world_size(), in_exchange, kill_self)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_process_groups()  # but a group a recovery gave up a wait on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-exchange", action="store_true", help="lose the rank mid-step")
    parser.add_argument(
        "--torchrun-worker",
        metavar="OUT_DIR",
        help="run as one torchrun worker (one agent per node), saving the result in OUT_DIR",
    )
    args = parser.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args.torchrun_worker, args.in_exchange)
        return
    results = run_local_world(train, 3, args.in_exchange, timeout_s=TIMEOUT_S, may_exit=[LOST])
    for rank, result in enumerate(results):
        if result is None:
            print(f"rank {rank}: exited at step {LOST_AT}")
            continue
        for r in result["recoveries"]:
            how = "finished from the carried copies" if r["finished_step"] else "redone"
            print(
                f"rank {rank}: lost ranks {list(r['lost'])} at step {r['step']}, went on in "
                f"{r['seconds']:.2f} s, the step {how}; ended on {result['world_size']} ranks"
            )


if __name__ == "__main__":
    main()
