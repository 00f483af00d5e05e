"""Run a function on N local ranks: processes joined by a gloo group.

For tests, examples, benchmarks and notebooks on one machine; training jobs
are started with ``torchrun`` instead. :func:`run_rank` runs one rank of
such a world where each rank's process is started apart (one per network
namespace, say, as the link benchmarks do).

Ranks are forked from a forkserver that has imported torch and zerofn once
(where the platform has one; elsewhere they are spawned): a spawned rank
spends 1-2 s importing torch before it runs a line, a forked one starts in
milliseconds, which is most of a short multi-rank test's time. Each rank is
still a fresh process with nothing of the caller's state, as under spawn.

The ranks meet at a store this process serves (a ``TCPStore``), as
torchrun's workers meet at their agent's: any rank may die at any moment
and the store, where the heartbeats and the roll call live, goes on
answering the others.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.multiprocessing.spawn import start_processes

from zerofn.comm import AllReduce, Program
from zerofn_torch.runtime.driver import drive, finish_polled
from zerofn_torch.runtime.group_sockets import init_process_group
from zerofn_torch.runtime.heartbeat import abandoned, destroy_process_groups

__all__ = ["run_local_world", "run_rank"]

# Imported once by the forkserver, before it forks any rank; the module of the
# first function run is added (a test module, an example), so its ranks skip
# that import too. Later calls cannot change what the running server holds.
_PRELOAD = ("torch", "torch.distributed", "zerofn", "zerofn_torch")

_HOST = "127.0.0.1"

_DUMP_STACKS = getattr(signal, "SIGUSR1", signal.SIGTERM)


def _start_method(fn: Callable[..., Any]) -> str:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    module = getattr(fn, "__module__", None)
    extra = [module] if module and module != "__main__" else []
    multiprocessing.set_forkserver_preload([*_PRELOAD, *extra])
    return "forkserver"


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    tmp: str,
    port: int,
    timeout_s: float,
    *rest: Any,
) -> None:
    if hasattr(faulthandler, "register"):  # a world past its wall asks for every thread's stack
        faulthandler.register(_DUMP_STACKS, all_threads=True)
    store = TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    result = _in_group(fn, rank, world_size, {"store": store}, timeout_s, *rest)
    torch.save(result, os.path.join(tmp, f"result{rank}.pt"))


def _job_store(timeout_s: float) -> TCPStore:
    """The world's store, served by this (the launching) process, as
    torchrun's agent serves its workers': it outlives any rank, and a rank
    that dies halfway through a write leaves nothing behind (the server
    takes whole requests). A ``FileStore`` is neither: a rank killed between
    the writes of one record leaves a torn record, at which every other
    process's next store call spins forever (``c10d::FileStore`` reads a
    record's length and then waits for bytes that never come; torch 2.13),
    so a loss at a random moment could hang the whole world."""
    return TCPStore(
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def _in_group(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    rendezvous: dict[str, Any],
    timeout_s: float,
    threads: int,
    args: tuple[Any, ...],
    may_exit: tuple[int, ...] = (),
) -> Any:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    init_process_group(
        "gloo",
        **rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        # Let every rank's outstanding collectives and their callbacks finish
        # before the group is torn down (tearing it down under them aborts);
        # a polled program (a delayed DiLoCo sync) first issues what it has left.
        failed = finish_polled()
        if failed:  # the program's own error, which the function did not wait for
            raise failed[0][1]
        # A world that may have lost ranks, or that grew (zerofn_torch.elastic),
        # is not the one started here: it has no barrier of this launcher's to
        # hold; nor has one that failed and was recovered from (its connections shut).
        world = dist.group.WORLD
        if not may_exit and dist.get_world_size() == world_size and not abandoned(world):
            drive(_barrier(), world, "the world's last barrier").wait()
        return result
    finally:
        destroy_process_groups()


def _end_stalled(processes: Sequence[Any], wall_s: float | None) -> None:
    """Ask every rank still running for its stacks, end them, and raise."""
    running = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in running:
        os.kill(processes[rank].pid, _DUMP_STACKS)
    time.sleep(1.0)  # faulthandler writes from a signal handler, at once
    for rank in running:
        processes[rank].kill()
        processes[rank].join()
    raise TimeoutError(
        f"the world ran past its wall of {wall_s} s with ranks {running} still running "
        "(each thread's stack is on stderr above); a rank waited for something that never came"
    )


def run_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    *args: Any,
    init_method: str,
    timeout_s: float = 120.0,
    threads: int = 1,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` as one rank of a gloo world whose
    ranks are started apart, each by its own call of this function.

    What a rank of :func:`run_local_world` does, in this process: join the
    group, run ``fn``, finish what the driver left polled, meet the others
    at a last barrier, leave the group.

    Args:
        fn: the per-rank function.
        rank: this process's rank.
        world_size: number of ranks.
        *args: passed to ``fn`` after the rank and world size.
        init_method: where the ranks meet, e.g. ``"tcp://10.87.0.1:29500"``
            (rank 0 listens there).
        timeout_s: collective timeout, so a rank waiting on a dead peer fails.
        threads: torch intra-op threads.

    Returns:
        What ``fn`` returned.

    Raises:
        Exception: what ``fn`` raised, or a collective's failure.
    """
    return _in_group(fn, rank, world_size, {"init_method": init_method}, timeout_s, threads, args)


def _barrier() -> Program[None]:
    """Every rank waits until all got here: an all-reduce of one number."""
    yield AllReduce((torch.zeros(1),))


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    may_exit: Sequence[int] = (),
    wall_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable by name (defined at module level), as spawned
    processes import it afresh; so must the script's ``__main__`` guard.

    Args:
        fn: the per-rank function; what it returns must survive ``torch.save``.
        world_size: number of ranks (processes).
        *args: passed to ``fn`` after the rank and world size.
        timeout_s: collective timeout, so a rank waiting on a dead peer fails.
        threads_per_rank: torch intra-op threads per process.
        may_exit: ranks that may end early without a result (a test of
            losing ranks); the world then skips its last barrier.
        wall_s: seconds the whole world may take (``None``: no limit). Past
            them, every rank still running writes each thread's stack to
            stderr and is ended: a hang fails in minutes, saying where each
            rank stood, rather than at the collective timeout.

    Returns:
        What each rank returned, in rank order (``None`` for a rank of
        ``may_exit`` that ended without a result).

    Raises:
        torch.multiprocessing.ProcessRaisedException: if a rank raised; the
            other ranks are terminated rather than left waiting.
        TimeoutError: the world ran past ``wall_s``; it names the ranks
            still running.
    """
    store = _job_store(timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        world = start_processes(  # type: ignore[no-untyped-call]
            _rank_main,
            args=(
                fn,
                world_size,
                tmp,
                store.port,
                timeout_s,
                threads_per_rank,
                args,
                tuple(may_exit),
            ),
            nprocs=world_size,
            join=False,
            start_method=_start_method(fn),
        )
        ends = None if wall_s is None else time.monotonic() + wall_s
        while not world.join(None if ends is None else max(0.0, ends - time.monotonic())):
            if ends is not None and time.monotonic() >= ends:
                _end_stalled(world.processes, wall_s)
        results: list[Any] = []
        for r in range(world_size):
            path = os.path.join(tmp, f"result{r}.pt")
            if r in may_exit and not os.path.exists(path):
                results.append(None)
            else:
                results.append(torch.load(path, weights_only=False))
        return results
