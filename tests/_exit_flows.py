"""Multi-rank flows run in fresh processes that then exit the way a training
script does, for ``tests/test_clean_exit.py``.

``python tests/_exit_flows.py --batch 2,3:4:zero_step,join_throw:busy``
imports torch and zerofn once, then for each world size (2, 3) and run (4
each) forks one fresh process per rank, beside a process that keeps one core
busy (``busy``; leave it out for an unloaded machine). A rank joins a new
gloo group (a file store in the run's own directory), runs the flows, and
exits through the interpreter's normal teardown (``sys.exit``, never ``os._exit``): that teardown is where a group
destroyed on one of its own worker threads aborts the process. With
``--destroy=always`` a rank first calls ``dist.destroy_process_group()``, as
PyTorch's multi-process test harness and many training scripts do; with
``never`` the group goes down with the interpreter; ``alternate`` does one,
then the other.

Why fork rather than start an interpreter per rank: importing torch costs
about 3 s of CPU, and the test needs dozens of runs on a 2-core machine. The
fork happens before any group, thread pool or collective exists, so each
rank's group, its gloo threads and its teardown are its own, as in a fresh
interpreter; only the imported modules are shared (copy-on-write).

The ``r``-th run (counted over all world sizes) rotates the flows left by
``r``, so each flow is the last one before exit in some run: what a flow
leaves in flight matters most then.

Prints one JSON line per run: the world size, the flows in order, and per
rank the exit code (negative: the signal that ended it), whether its stderr
holds ``terminate called``, and stderr's tail when something went wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch

# DDP imports dynamo at its first construction (a second of CPU): once, here,
# rather than in every rank of every run.
import torch._dynamo
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable as TorchJoinable
from torch.distributed.algorithms.join import JoinHook as TorchJoinHook
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer, hooks
from zerofn_torch.averaging import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
    average_parameters,
)
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.join import Join, Joinable, JoinHook

from zerofn.hooks.error_feedback import error_feedback
from zerofn.hooks.hook import cast
from zerofn.hooks.sparsify import top_k

Flow = Callable[[int, int, str], None]
"""A flow: ``flow(rank, world_size, run_directory)``."""

TIMEOUT_S = 60.0  # a run that takes longer has hung; it is killed and reported
GRACE_S = 5.0  # how long a failed rank's peers may take to notice before they are killed
STEPS = 3
CHURN = [8]  # groups group_churn makes and destroys per run (a batch's churn=N sets it)


# ----- a small model and its data --------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _ddp(model: torch.nn.Module | None = None) -> DDP:
    # A tiny bucket cap: several buckets, so pipelines hold several programs.
    return DDP(model if model is not None else _model(), bucket_cap_mb=0.001)


def _batches(rank: int, count: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    for _ in range(count):
        yield torch.randn(8, 16, generator=g)


def _train(ddp: DDP, optimizer: torch.optim.Optimizer | None, rank: int, steps: int) -> None:
    """``steps`` iterations of forward, backward and (if any) an optimizer step."""
    for x in _batches(rank, steps):
        ddp(x).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()


# ----- flows ------------------------------------------------------------------------


def zero_step(rank: int, world_size: int, tmp: str) -> None:
    """ZeRO's step after DDP's built-in all-reduce, greedy and flat."""
    modes: list[dict[str, Any]] = [{}, {"partition": "flat"}]
    for options in modes:
        ddp = _ddp()
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3, **options)
        _train(ddp, zero, rank, STEPS)


def overlap(rank: int, world_size: int, tmp: str) -> None:
    """The overlapped ZeRO step around zerofn's, PowerSGD's and PyTorch's hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

    powersgd = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)

    def powersgd_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        return hooks.powerSGD_hook(powersgd, bucket)

    cases: list[tuple[Any, Any]] = [
        (hooks.hook_with_zero_step, hooks.allreduce_hook),
        (hooks.hook_with_zero_step_interleaved, powersgd_hook),
        (hooks.hook_with_zero_step, torch_hooks.fp16_compress_hook),
    ]
    for wrap, inner in cases:
        ddp = _ddp()
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
        )
        ddp.register_comm_hook(None, wrap(inner, ddp, zero))
        _train(ddp, None, rank, STEPS + 1)  # the first iterations fix DDP's buckets


def every_hook(rank: int, world_size: int, tmp: str) -> None:
    """Every communication hook, each on its own DDP model."""
    subgroup, _ = dist.new_subgroups(group_size=1)  # type: ignore[no-untyped-call]
    registrations: list[tuple[Any, Any]] = [
        (None, hooks.allreduce_hook),
        (None, hooks.fp16_compress_hook),
        (None, hooks.bf16_compress_hook),
        (None, hooks.fp16_compress_wrapper(hooks.allreduce_hook)),
        (None, hooks.bf16_compress_wrapper(hooks.allreduce_hook)),
        (None, hooks.noop_hook),
        (None, hooks.quantization_pertensor_hook),
        (None, hooks.quantization_perchannel_hook),
        (hooks.PowerSGDState(None, 1, start_powerSGD_iter=2), hooks.powerSGD_hook),
        (hooks.PowerSGDState(None, 1, start_powerSGD_iter=2), hooks.batched_powerSGD_hook),
        (hooks.HookRunner(cast(error_feedback(top_k(0.25)), torch.float16)), hooks.run_hook),
        (hooks.PostLocalSGDState(None, subgroup, start_localSGD_iter=2), hooks.post_localSGD_hook),
    ]
    for state, hook in registrations:
        ddp = _ddp()
        ddp.register_comm_hook(state, hook)
        _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, STEPS)


def join_ddp(rank: int, world_size: int, tmp: str) -> None:
    """zerofn's Join around DDP (built-in all-reduce, then zerofn's hook) on
    uneven inputs."""
    for hook in (None, hooks.allreduce_hook):
        ddp = _ddp()
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with Join([ddp]):
            _train(ddp, optimizer, rank, STEPS + rank)


def join_zero(rank: int, world_size: int, tmp: str) -> None:
    """zerofn's Join around DDP and zerofn's ZeRO optimizer on uneven inputs."""
    ddp = _ddp()
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
    with Join([ddp, zero]):
        _train(ddp, zero, rank, STEPS + rank)


class AllReducer(Joinable):
    """A joinable that all-reduces ones, as in PyTorch's own Join tests."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __call__(self) -> None:
        Join.notify_join_context(self)
        dist.all_reduce(torch.ones(1), group=self.group)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return AllReducerHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class AllReducerHook(JoinHook):
    """Shadows an :class:`AllReducer`'s all-reduce with zeros."""

    def __init__(self, reducer: AllReducer) -> None:
        self.reducer = reducer

    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1), group=self.reducer.group)


def join_throw(rank: int, world_size: int, tmp: str) -> None:
    """PyTorch's ``test_multiple_joinables_throw`` case (on
    zerofn's Join): two joinables, uneven inputs, every rank raises."""
    reducers = [AllReducer(dist.group.WORLD), AllReducer(dist.group.WORLD)]
    try:
        with Join(reducers, throw_on_early_termination=True):
            for _ in range(5 + rank):
                for reducer in reducers:
                    reducer()
    except RuntimeError as e:
        assert "exhausted" in str(e), e
    else:
        raise AssertionError("Join with throw_on_early_termination did not raise")


def _use_group_for_join(rank: int, group: Any) -> None:
    """Issue 23's case on ``group``: two joinables, uneven inputs, a throw."""
    reducers = [AllReducer(group), AllReducer(group)]
    try:
        with Join(reducers, throw_on_early_termination=True):
            for _ in range(1 + rank):
                for reducer in reducers:
                    reducer()
    except RuntimeError as e:
        assert "exhausted" in str(e), e


def _use_group_for_a_hook(rank: int, group: Any) -> None:
    """One DDP iteration on ``group`` with zerofn's averaging hook."""
    ddp = DDP(_model(), process_group=group, bucket_cap_mb=0.001)
    ddp.register_comm_hook(group, hooks.allreduce_hook)
    _train(ddp, None, rank, 1)


def _use_group_for_zero(rank: int, group: Any) -> None:
    """One ZeRO step on ``group`` (its exchange ends the work)."""
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, group, lr=0.1)
    model(next(_batches(rank, 1))).square().mean().backward()
    zero.step()


def group_churn(rank: int, world_size: int, tmp: str) -> None:
    """Groups made, used by zerofn (Join, a DDP hook, a ZeRO step in turn) and
    destroyed at once, ``CHURN[0]`` times: each time, a completion callback
    still running on the group's worker thread could be left holding it
    (many chances to abort in one process, each cheap)."""
    uses = [_use_group_for_join, _use_group_for_a_hook, _use_group_for_zero]
    for i in range(CHURN[0]):
        group = dist.new_group(list(range(world_size)))
        uses[i % len(uses)](rank, group)
        dist.destroy_process_group(group)
        del group  # now only what zerofn may still hold keeps it


def averagers(rank: int, world_size: int, tmp: str) -> None:
    """average_parameters, both averagers, and PostLocalSGDOptimizer."""
    model = _model()
    average_parameters(model.parameters(), None)
    for averager in (
        PeriodicModelAverager(period=2, warmup_steps=1),
        HierarchicalModelAverager({2: 1, 4: world_size}, warmup_steps=1),
    ):
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
        for x in _batches(rank, 2 * STEPS):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def checkpoint(rank: int, world_size: int, tmp: str) -> None:
    """Sharded save and load, then a background save left to finish at exit."""
    ddp = _ddp()
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
    _train(ddp, zero, rank, STEPS)
    run = os.path.join(tmp, "checkpoints")
    save_sharded(zero, os.path.join(run, "a"))
    load_sharded(zero, os.path.join(run, "a"))
    _train(ddp, zero, rank, 1)
    save_sharded(zero, os.path.join(run, "b"), blocking=False)  # settled at exit


# ----- PyTorch's own, the control ---------------------------------------------------


def torch_ddp(rank: int, world_size: int, tmp: str) -> None:
    """Control: plain DDP (built-in all-reduce) and torch.optim, nothing of zerofn."""
    ddp = _ddp()
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, STEPS)


class TorchAllReducer(TorchJoinable):
    """:class:`AllReducer` under PyTorch's join protocol."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __call__(self) -> None:
        TorchJoin.notify_join_context(self)
        dist.all_reduce(torch.ones(1), group=self.group)

    def join_hook(self, **kwargs: Any) -> TorchJoinHook:
        return TorchAllReducerHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class TorchAllReducerHook(TorchJoinHook):
    """Shadows a :class:`TorchAllReducer`'s all-reduce with zeros."""

    def __init__(self, reducer: TorchAllReducer) -> None:
        self.reducer = reducer

    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1), group=self.reducer.group)


def torch_join_throw(rank: int, world_size: int, tmp: str) -> None:
    """Control: :func:`join_throw` on PyTorch's own Join."""
    reducers = [TorchAllReducer(dist.group.WORLD), TorchAllReducer(dist.group.WORLD)]
    joinables: list[TorchJoinable] = list(reducers)
    try:
        with TorchJoin(joinables, throw_on_early_termination=True):
            for _ in range(5 + rank):
                for reducer in reducers:
                    reducer()
    except RuntimeError as e:
        assert "exhausted" in str(e), e
    else:
        raise AssertionError("PyTorch's Join with throw_on_early_termination did not raise")


def torch_group_churn(rank: int, world_size: int, tmp: str) -> None:
    """Control: :func:`group_churn` with PyTorch's Join, DDP and optimizer."""
    for i in range(CHURN[0]):
        group = dist.new_group(list(range(world_size)))
        if i % 2 == 0:
            reducers = [TorchAllReducer(group), TorchAllReducer(group)]
            joinables: list[TorchJoinable] = list(reducers)
            try:
                with TorchJoin(joinables, throw_on_early_termination=True):
                    for _ in range(1 + rank):
                        for reducer in reducers:
                            reducer()
            except RuntimeError as e:
                assert "exhausted" in str(e), e
            del reducers, joinables
        else:
            ddp = DDP(_model(), process_group=group, bucket_cap_mb=0.001)
            _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, 1)
            del ddp
        dist.destroy_process_group(group)
        del group


# In this order, the first runs of a batch of all of zerofn's flows end with
# (rotation by run): group_churn, join_throw, overlap, join_ddp, every_hook,
# join_zero, ...; with --destroy=alternate, join_throw (two joinables that throw),
# join_ddp and join_zero end a run that destroys the group.
FLOWS: dict[str, Flow] = {
    "join_throw": join_throw,
    "overlap": overlap,
    "join_ddp": join_ddp,
    "every_hook": every_hook,
    "join_zero": join_zero,
    "zero_step": zero_step,
    "averagers": averagers,
    "checkpoint": checkpoint,
    "group_churn": group_churn,
    "torch_ddp": torch_ddp,
    "torch_join_throw": torch_join_throw,
    "torch_group_churn": torch_group_churn,
}
ZEROFN_FLOWS = [name for name in FLOWS if not name.startswith("torch_")]
CONTROL_FLOWS = [name for name in FLOWS if name.startswith("torch_")]


# ----- one rank ---------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, tmp: str, flows: list[str], destroy: bool) -> None:
    """A forked rank: its own stderr and group, the flows, then a normal exit.

    Never returns: ``sys.exit`` unwinds to the interpreter, which tears down
    as at the end of any script (atexit handlers, module teardown).
    """
    err = os.open(os.path.join(tmp, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # C++'s "terminate called ..." goes to fd 2, not sys.stderr
    os.dup2(err, 1)
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        for name in flows:
            FLOWS[name](rank, world_size, tmp)
        if destroy:
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)


# ----- the parent -------------------------------------------------------------------


def _wait_all(pids: list[int], deadline: float) -> dict[int, int]:
    """Each child's exit code (negative: the signal that ended it).

    Children still running at ``deadline``, or :data:`GRACE_S` after a child
    failed (its peers may wait on it until their timeout), are killed and
    reported as ``-SIGKILL``.
    """
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -signal.SIGKILL
        time.sleep(0.02)
    return codes


def run_once(world_size: int, flows: list[str], destroy: bool) -> dict[str, Any]:
    """Fork ``world_size`` ranks that run ``flows`` and exit; what each did."""
    tmp = tempfile.mkdtemp(prefix="zerofn-exit-")
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank_main(rank, world_size, tmp, flows, destroy)
        pids.append(pid)
    codes = _wait_all(pids, time.monotonic() + TIMEOUT_S + 30)
    ranks = []
    for rank, pid in enumerate(pids):
        with open(os.path.join(tmp, f"stderr{rank}"), errors="replace") as f:
            stderr = f.read()
        bad = codes[pid] != 0 or "terminate called" in stderr
        ranks.append(
            {
                "exit": codes[pid],
                "terminate": "terminate called" in stderr,
                "stderr": stderr[-3000:] if bad else "",
            }
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return {"world_size": world_size, "flows": flows, "destroy": destroy, "ranks": ranks}


class Batch(NamedTuple):
    """Runs of the same flows: on which world sizes, how many, how loaded."""

    world_sizes: list[int]
    runs: int  # per world size
    flows: list[str]
    busy: bool  # a process burning one core runs beside the ranks
    churn: int  # groups group_churn makes and destroys per run


def _batch(text: str) -> Batch:
    """Parse ``WORLD_SIZES:RUNS:FLOWS[:OPTIONS]``, e.g. ``"2,3:4:zero_step:busy,churn=24"``.

    Raises:
        argparse.ArgumentTypeError: an unknown flow or option.
    """
    worlds, runs, flows, *rest = text.split(":")
    unknown = set(flows.split(",")) - set(FLOWS)
    options = dict(o.partition("=")[::2] for o in rest[0].split(",")) if rest else {}
    if unknown or set(options) - {"busy", "churn"}:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown flows {sorted(unknown)} or options (busy, churn=N)"
        )
    churn = int(options.get("churn") or CHURN[0])
    sizes = [int(w) for w in worlds.split(",")]
    return Batch(sizes, int(runs), flows.split(","), "busy" in options, churn)


def _start_busy() -> int:
    """Fork a process that burns one core until it is killed, or until this
    process is gone (it leaves with ``os._exit``: it is no rank, and must not
    run this process's teardown)."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        while os.getppid() == parent:
            for _ in range(100_000):
                pass
        os._exit(0)
    return pid


def _stop(pid: int) -> None:
    """Kill and reap the child ``pid``."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def main(argv: list[str]) -> None:
    """Parse the arguments and print one JSON line per run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--batch",
        type=_batch,
        action="append",
        required=True,
        help="WORLD_SIZES:RUNS:FLOWS[:busy,churn=N], e.g. 2,3,4:2:zero_step,join_throw:busy",
    )
    parser.add_argument(
        "--destroy",
        choices=["never", "always", "alternate"],
        default="never",
        help="call destroy_process_group() before exit",
    )
    args = parser.parse_args(argv)
    zygote = os.getpid()
    count = 0
    for batch in args.batch:
        CHURN[0] = batch.churn
        busy = _start_busy() if batch.busy else None
        try:
            for world_size in batch.world_sizes:
                for _ in range(batch.runs):
                    shift = count % len(batch.flows)
                    destroy = args.destroy == "always" or (
                        args.destroy == "alternate" and count % 2 == 1
                    )
                    flows = batch.flows[shift:] + batch.flows[:shift]
                    record = run_once(world_size, flows, destroy)
                    print(json.dumps({**record, "busy": batch.busy}), flush=True)
                    count += 1
        finally:
            # A rank leaves through here too (sys.exit unwinds to the
            # interpreter): only this process stops what it started.
            if busy is not None and os.getpid() == zygote:
                _stop(busy)


if __name__ == "__main__":
    main(sys.argv[1:])
