"""Part 3 of ``bench_elastic.py``, a join with ``redundancy=2`` (its docstring
says how it is measured): the running ranks that admit (``_running_rank``),
the fresh process that joins (:func:`joiner_main`, started by
``_joiner_command``), what they returned (:class:`Join`,
:func:`measure_joins`), and the tables and closing lines the block quotes."""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from elastic_setup import (
    GROUP_TIMEOUT_S,
    _tensor_bytes,
    _watch_outboxes,
    batch,
    iteration,
    make_model,
    span,
)
from report import fmt_bytes, md_table
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import admit, join
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.footprint import OPTIMIZERS

JOINS = 3
"""Joins measured in a full run (``--quick``: one)."""

AFTER_JOIN = 3
"""Steps the 3 ranks take once the joiner is in, its first step among them."""

JOIN_TIMEOUT_S = 60.0
"""The longest the running ranks wait for the joiner to announce itself, and
``join``'s own timeout."""

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

STATE = OPTIMIZERS["adam"]


def _record_outboxes(outboxes: list[Any]) -> None:
    """Keep every outbox this process sends in the moves (``admit`` and
    ``join`` run them in ``_grow``): what each rank sends to which."""
    _watch_outboxes(outboxes.append)


def _grown_outbox(outboxes: Sequence[Any]) -> dict[str, Any]:
    """The one outbox of the growth, sized (after the timed part): tensor
    bytes per target rank and parameter, and its pickled size (what
    ``all_gather_object`` sends).

    Raises:
        RuntimeError: the moves did not run once.
    """
    if len(outboxes) != 1:
        raise RuntimeError(
            f"the growth made {len(outboxes)} outboxes, not one: does _grow still call "
            "zerofn.zero.elastic.regroup.outgoing_states by name? elastic_join._record_outboxes "
            "counted nothing"
        )
    (out,) = outboxes
    return {
        "to": {t: _bytes_by_param(states) for t, states in out.items()},
        "pickled": len(pickle.dumps(out)),
    }


def _bytes_by_param(states: Mapping[Any, Any]) -> dict[int, int]:
    """Tensor bytes of an outbox's states (by piece), summed per parameter."""
    out: dict[int, int] = {}
    for piece, state in states.items():
        out[piece.param] = out.get(piece.param, 0) + _tensor_bytes(state)
    return out


def planned_state_bytes(sizes: Sequence[int], indices: Sequence[int]) -> int:
    """Adam's state bytes (float32) for the parameters ``indices`` of a model
    whose parameters have ``sizes`` elements: what the plan puts there."""
    return sum(STATE.elementwise_states * sizes[i] * 4 + STATE.scalar_bytes for i in indices)


def _joiner_command(job_store: str, out: str, quick: bool) -> list[str]:
    """A fresh interpreter that imports this module (torch, zerofn_torch) and joins."""
    code = (
        f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import elastic_join; "
        f"elastic_join.joiner_main({job_store!r}, {out!r}, {quick!r})"
    )
    return [sys.executable, "-c", code]


def joiner_main(job_store: str, out: str, quick: bool) -> None:
    """The replacement process: join the running job, take :data:`AFTER_JOIN`
    steps with it, save its times and what it holds to ``out``."""
    torch.set_num_threads(1)
    outboxes: list[Any] = []
    _record_outboxes(outboxes)
    store = dist.FileStore(job_store, -1)
    model = make_model(quick)
    called = time.time()
    with collective_traffic() as counted:
        joined = join(
            store, model, torch.optim.Adam, redundancy=2, timeout_s=JOIN_TIMEOUT_S, lr=1e-3
        )
    joined_at = time.time()
    zero, first = joined.optimizer, joined.extra["step"]
    carried = zero.zero_rank.carried
    assert carried is not None
    held = {
        "owned": zero.zero_rank.plan.partition.params_of(joined.rank),  # type: ignore[union-attr]
        "carried": tuple(carried.indices),
        "shard_state": zero.memory_bytes()["optimizer_state"],
        "carried_state": _tensor_bytes(list(carried.optim.state.values())),
    }
    ddp = DDP(model)
    ddp_at = time.time()
    iteration(ddp, zero, batch(first * 16 + joined.rank, quick))()
    first_at = time.time()
    for step in range(first + 1, first + AFTER_JOIN):
        iteration(ddp, zero, batch(step * 16 + joined.rank, quick))()
    result = {
        "rank": joined.rank,
        "world_size": joined.world_size,
        "called": called,
        "joined": joined_at,
        "ddp": ddp_at,
        "first": first_at,
        "broadcasts": counted.calls,
        "broadcast_bytes": counted.payload_bytes,
        "outbox": _grown_outbox(outboxes),
        "held": held,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    torch.save(result, out)
    # Leave without tearing anything down: freeing DDP's reducer drops the
    # last reference to the gloo group, whose destructor joins gloo's thread
    # holding the GIL while that thread may still run a future's Python
    # callback (zerofn's driver), which waits for the GIL: a deadlock at exit,
    # about one join in ten here.
    os._exit(0)


def _running_rank(rank: int, world_size: int, quick: bool, tmp: str) -> dict[str, Any]:
    """One of the 2 running ranks: a step, then (rank 0) the joiner's process
    started; ``admit`` at every step boundary until it is in, then
    :data:`AFTER_JOIN` steps on 3 ranks."""
    outboxes: list[Any] = []
    _record_outboxes(outboxes)
    job_store, out = os.path.join(tmp, "job"), os.path.join(tmp, "joiner.pt")
    store = dist.FileStore(job_store, -1)
    model = make_model(quick)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=1e-3)
    ddp = DDP(model)
    iteration(ddp, zero, batch(rank, quick))()  # the job runs before the joiner starts
    joiner, started = None, time.time()
    if rank == 0:
        joiner = subprocess.Popen(_joiner_command(job_store, out, quick))
    try:
        step_s: list[float] = []  # steps on 2 ranks while the joiner starts
        empty_s: list[float] = []  # the admits that found nobody
        step = 1
        while True:
            if joiner is not None and joiner.poll() is not None:
                raise RuntimeError(f"the joiner exited with {joiner.returncode} before joining")
            if time.time() - started > JOIN_TIMEOUT_S:
                raise RuntimeError(f"the joiner did not join within {JOIN_TIMEOUT_S:g} s")
            admit_began = time.time()
            grown = admit(zero, store, extra={"step": step})
            admit_s = time.time() - admit_began
            if grown is not None:
                break
            empty_s.append(admit_s)
            began = time.perf_counter()
            iteration(ddp, zero, batch(step * 16 + rank, quick))()
            step_s.append(time.perf_counter() - began)
            step += 1
        began = time.perf_counter()
        ddp = DDP(model)  # the new default group
        ddp_s = time.perf_counter() - began
        after_s = []
        for s in range(step, step + AFTER_JOIN):
            began = time.perf_counter()
            iteration(ddp, zero, batch(s * 16 + rank, quick))()
            after_s.append(time.perf_counter() - began)
        result = {
            "started": started,
            "admit_began": admit_began,
            "admit_s": admit_s,
            "ddp_s": ddp_s,
            "step_s": step_s,
            "empty_admit_s": empty_s,
            "after_s": after_s,
            "joined": grown.joined,
            "world_size": zero.world_size,
            "outbox": _grown_outbox(outboxes),
            "params": [p.detach().clone() for p in model.parameters()],
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "sizes": [p.numel() for p in model.parameters()],
        }
        if joiner is not None:
            if joiner.wait(timeout=JOIN_TIMEOUT_S) != 0:
                raise RuntimeError(f"the joiner exited with {joiner.returncode}")
            result["joiner"] = torch.load(out, weights_only=False)
        return result
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


@attrs.frozen
class Join:
    """One join, seen by the joiner and the running rank 0 (one machine's wall
    clock): seconds from the joiner's start, the running ranks' pause, and
    the bytes sent to the joiner."""

    start_s: float  # the joiner's process start, imports and model, until `join` is called
    wait_s: float  # from then until rank 0's `admit` that lets it in began
    grow_s: float  # from that `admit`'s start until `join` returned
    ddp_s: float  # the joiner's DDP built
    first_step_s: float  # its first step
    total_s: float  # the joiner's start to its first completed step
    admit_s: float  # rank 0's `admit` that let it in: the running ranks' pause
    running_ddp_s: float  # rank 0's DDP rebuilt
    empty_admit_s: tuple[float, ...]  # rank 0's `admit`s that found nobody
    step_before_s: float  # a step on the 2 running ranks (median): the boundary
    step_after_s: float  # a step on 3 ranks after the join (median, rank 0)
    param_bytes: int  # the model's parameters
    broadcasts: int  # the joiner's broadcasts inside `join` (`collective_traffic`)
    broadcast_bytes: int  # their payload
    shard_bytes: int  # state sent to the joiner for its shard (tensors in the outboxes)
    carried_bytes: int  # ... for its carried copy
    moved_bytes: int  # all the state the growth moved, to every rank
    gathered_bytes: int  # what the all-gather of the pickled outboxes brings the joiner
    shard_held: int  # its shard's state after `join` (`memory_bytes`)
    carried_held: int  # its carried copy's state after `join`
    shard_planned: int  # its shard's state, by the grown plan
    carried_planned: int  # its carried copy's state, by the grown plan
    max_diff: float  # the 3 ranks' parameters after the steps on 3 ranks

    @classmethod
    def of(cls, results: Sequence[Mapping[str, Any]]) -> Join:
        """From what the 2 running ranks returned (rank 0's holds the joiner's).

        Raises:
            RuntimeError: the world did not grow to 3 with one joiner as rank
                2, or state reached the joiner for parameters it neither
                owns nor carries.
        """
        r0 = results[0]
        joiner = r0.get("joiner")
        if (
            joiner is None
            or joiner["rank"] != 2
            or any(r["world_size"] != 3 or r["joined"] != 1 for r in results)
            or joiner["world_size"] != 3
        ):
            raise RuntimeError(f"the world did not grow as expected: {results}")
        to_joiner: dict[int, int] = {}
        for r in results:
            to_joiner.update(r["outbox"]["to"].get(joiner["rank"], {}))
        held = joiner["held"]
        owned, carried = set(held["owned"]), set(held["carried"])
        if not set(to_joiner) <= owned | carried:
            raise RuntimeError(
                f"state for parameters {sorted(set(to_joiner) - owned - carried)} reached the "
                "joiner, which neither owns nor carries them"
            )
        outboxes = [r["outbox"] for r in (*results, joiner)]
        sizes = r0["sizes"]
        return cls(
            start_s=joiner["called"] - r0["started"],
            wait_s=r0["admit_began"] - joiner["called"],
            grow_s=joiner["joined"] - r0["admit_began"],
            ddp_s=joiner["ddp"] - joiner["joined"],
            first_step_s=joiner["first"] - joiner["ddp"],
            total_s=joiner["first"] - r0["started"],
            admit_s=r0["admit_s"],
            running_ddp_s=r0["ddp_s"],
            empty_admit_s=tuple(r0["empty_admit_s"]),
            step_before_s=statistics.median(r0["step_s"]),
            step_after_s=statistics.median(r0["after_s"]),
            param_bytes=r0["param_bytes"],
            broadcasts=joiner["broadcasts"].get("broadcast", 0),
            broadcast_bytes=joiner["broadcast_bytes"].get("broadcast", 0),
            shard_bytes=sum(b for i, b in to_joiner.items() if i in owned),
            carried_bytes=sum(b for i, b in to_joiner.items() if i in carried),
            moved_bytes=sum(b for o in outboxes for s in o["to"].values() for b in s.values()),
            gathered_bytes=(len(outboxes) - 1) * max(o["pickled"] for o in outboxes),
            shard_held=held["shard_state"],
            carried_held=held["carried_state"],
            shard_planned=planned_state_bytes(sizes, held["owned"]),
            carried_planned=planned_state_bytes(sizes, held["carried"]),
            max_diff=max(
                (p - q).abs().max().item()
                for r in (results[1], joiner)
                for p, q in zip(r0["params"], r["params"], strict=True)
            ),
        )


def measure_joins(quick: bool, repeats: int) -> list[Join]:
    """``repeats`` joins, each of a fresh process to a fresh 2-rank job."""
    joins = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results = run_local_world(_running_rank, 2, quick, tmp, timeout_s=GROUP_TIMEOUT_S)
        joins.append(Join.of(results))
    return joins


def join_table(joins: Sequence[Join]) -> str:
    rows = [
        [
            f"{j.start_s:.2f}",
            f"{j.wait_s:.2f}",
            f"{j.grow_s:.2f}",
            f"{j.ddp_s:.2f}",
            f"{j.first_step_s:.2f}",
            f"{j.total_s:.2f}",
            f"{j.admit_s:.2f}",
            f"{j.running_ddp_s:.2f}",
            f"{j.step_before_s * 1e3:.0f}",
        ]
        for j in joins
    ]
    return md_table(
        [
            "joiner: start, imports, model → `join` (s)",
            "waiting to be admitted (s)",
            "growth: group, plan, parameters, moves, rebuild (s)",
            "DDP rebuilt (s)",
            "first step (s)",
            "start → first completed step (s)",
            "running ranks' pause: the `admit` that lets it in (s)",
            "their DDP rebuilt (s)",
            "their boundary: a step on 2 ranks as the joiner starts (ms)",
        ],
        rows,
    )


def _of(part: int, whole: int) -> str:
    return f"{fmt_bytes(part)} ({part / whole:.2f})"


def join_bytes_table(joins: Sequence[Join]) -> str:
    """What reached the joiner (the first join's: every join's are checked equal)."""
    j = joins[0]
    addressed = j.shard_bytes + j.carried_bytes
    return md_table(
        ["sent to the joiner", "bytes", "counted as", "against"],
        [
            [
                "parameters (broadcast from rank 0)",
                fmt_bytes(j.broadcast_bytes),
                f"`collective_traffic` on the joiner inside `join`: {j.broadcasts} broadcasts, "
                "their payload",
                f"the model's parameters, {_of(j.broadcast_bytes, j.param_bytes)}",
            ],
            [
                "optimizer state for its shard",
                fmt_bytes(j.shard_bytes),
                "the tensors addressed to it in the running ranks' outboxes (`outgoing_states`)",
                f"its shard's state by the grown plan, {_of(j.shard_bytes, j.shard_planned)}; "
                f"held after `join` (`memory_bytes`): {fmt_bytes(j.shard_held)}",
            ],
            [
                "optimizer state for its carried copy",
                fmt_bytes(j.carried_bytes),
                "the same",
                f"its carried copy's state by the grown plan, "
                f"{_of(j.carried_bytes, j.carried_planned)}; held after `join`: "
                f"{fmt_bytes(j.carried_held)}",
            ],
            [
                "all the outboxes, as the all-gather brings them",
                fmt_bytes(j.gathered_bytes),
                "pickled outboxes (`pickle.dumps`, as `all_gather_object` sends them), "
                "padded to the largest, from each of the 2 others",
                f"the state addressed to it, {_of(j.gathered_bytes, addressed)}",
            ],
        ],
    )


def join_summary(joins: Sequence[Join]) -> str:
    """The closing lines: the join's seconds and their parts, the running
    ranks' pause, an ``admit`` that finds nobody, the bytes."""
    empty = [s for j in joins for s in j.empty_admit_s]
    j = joins[0]
    same = all(
        (k.broadcast_bytes, k.shard_bytes, k.carried_bytes, k.moved_bytes)
        == (j.broadcast_bytes, j.shard_bytes, j.carried_bytes, j.moved_bytes)
        for k in joins
    )
    exact = all(
        k.broadcast_bytes == k.param_bytes
        and k.shard_bytes == k.shard_planned == k.shard_held
        and k.carried_bytes == k.carried_planned == k.carried_held
        for k in joins
    )
    to_joiner = j.shard_bytes + j.carried_bytes
    between = j.moved_bytes - to_joiner
    ring = (
        f"{fmt_bytes(between)} between the running ranks as the ring of carriers re-forms"
        if between
        else "nothing between the running ranks: each already held what the re-formed ring "
        "of carriers gives it"
    )
    return (
        f"From the joiner's start to its first completed step: "
        f"{span([k.total_s for k in joins], 2)} s, of which its start (the interpreter, "
        f"importing torch and the bench, the model) {span([k.start_s for k in joins], 2)} s, "
        f"waiting to be admitted {span([k.wait_s for k in joins], 2)} s (until the running "
        f"ranks' next boundary: they reach one every "
        f"{statistics.median(k.step_before_s for k in joins) * 1e3:.0f} ms here, a step on 2 "
        f"ranks as the joiner starts beside them, so the wait says where in a step the joiner "
        f"announced itself, not what joining costs), "
        f"the growth {span([k.grow_s for k in joins], 2)} s, DDP's rebuild "
        f"{span([k.ddp_s for k in joins], 2)} s and its first step "
        f"{span([k.first_step_s for k in joins], 2)} s. The running ranks pause for the "
        f"`admit` that lets it in, {span([k.admit_s for k in joins], 2)} s on rank 0, and "
        f"their DDP's rebuild, {span([k.running_ddp_s for k in joins], 2)} s; an `admit` that "
        f"finds nobody (one broadcast) takes {statistics.median(empty) * 1e3:.2f} ms "
        f"(median of {len(empty)} calls at the boundaries while the joiner started, "
        f"{min(empty) * 1e3:.2f} to {max(empty) * 1e3:.2f} ms). Sent to the joiner: the "
        f"parameters once ({fmt_bytes(j.broadcast_bytes)}) and the optimizer state of its "
        f"shard and carried copy ({fmt_bytes(to_joiner)}), "
        f"{'as planned' if exact else '**NOT as planned**'}"
        f"{'' if same else ' (**the joins sent different bytes**)'}; DDP's construction "
        f"broadcasts rank 0's parameters once more (its own broadcast from C++, which "
        f"`collective_traffic` does not see). The growth moved "
        f"{fmt_bytes(j.moved_bytes)} of state in all ({ring}), but the outboxes go "
        f"out by one all-gather of pickled objects, so each rank receives every rank's "
        f"outbox: {fmt_bytes(j.gathered_bytes)} reach the joiner. After the join a step takes "
        f"{statistics.median(k.step_after_s for k in joins) * 1e3:.0f} ms on 3 ranks; the "
        f"three ranks' parameters ended {max(k.max_diff for k in joins):.3g} apart."
    )
