"""Going on without a lost rank: the survivors agree on who is alive, form a
process group of their own in-process, take the lost ranks' shards from
their carriers (``ZeroRedundancyOptimizer(redundancy=2)``) and continue from a
step boundary, with no restart and no checkpoint read::

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                   redundancy=2, lr=1e-3)
    ddp = DistributedDataParallel(model)
    for step in range(steps):
        while True:
            try:
                train_step(ddp, zero, batch(step, rank, world_size))
                break
            except (CollectiveError, RuntimeError) as error:  # DDP raises RuntimeError
                survivors = recover(zero, error)
                ddp = DistributedDataParallel(model, process_group=survivors.group)
                rank, world_size = survivors.rank, survivors.world_size
                if survivors.finished_step:  # lost inside the step's exchange
                    break  # the step was finished from the carried copies

Which decisions are made where: the roll call is this module's (the job's
store, a deadline); who owns and carries what afterwards, what moves, and
the rebuilt rank are the core's (:func:`zerofn.zero.redundancy.plan_after_loss`,
:mod:`zerofn.zero.regroup`), the same functions the simulated world runs
(:func:`zerofn.testing.zero.survivors_of`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from zerofn.errors import CollectiveError
from zerofn.zero.redundancy import plan_after_loss
from zerofn.zero.regroup import adopt_carried_values, known_states, outgoing_states
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["Recovered", "RollCall", "recover", "roll_call"]

DEADLINE_S = 5.0
"""How long the roll call waits for a rank to say it is alive."""


@attrs.frozen
class RollCall:
    """Who answered the roll call, as every survivor saw it.

    Attributes:
        alive: the group ranks that answered, in order.
        interrupted: some survivor's last step failed in its exchange (after
            its local step): the step is to be finished, not redone.
    """

    alive: tuple[int, ...]
    interrupted: bool


@attrs.frozen
class Recovered:
    """What :func:`recover` made of the job.

    Attributes:
        group: the survivors' process group (the optimizer's from now on;
            build DDP on it).
        rank: this rank in ``group``.
        world_size: ranks in ``group``.
        lost: the ranks of the old group that are gone.
        finished_step: the step that failed was finished from the carried
            copies (do not redo it); ``False``: redo it on the survivors.
    """

    group: Any
    rank: int
    world_size: int
    lost: tuple[int, ...]
    finished_step: bool


def _wait_for(store: Any, keys: Sequence[str], deadline: float) -> list[str]:
    """The keys of ``keys`` present by ``deadline`` (all of them, as soon as they are)."""
    while True:
        present = [k for k in keys if store.check([k])]
        if len(present) == len(keys) or time.monotonic() >= deadline:
            return present
        time.sleep(0.01)


def roll_call(
    store: Any, prefix: str, rank: int, world_size: int, interrupted: bool, deadline_s: float
) -> RollCall:
    """Every rank that can, says it is alive under ``prefix`` in ``store``;
    those that did by the deadline are alive (a rank that cannot prove it
    is alive is out). Then each says whom it saw, and all must agree.

    Raises:
        zerofn.errors.CollectiveError: the survivors saw different ranks
            (one answered too late for some): nobody can go on safely.
    """
    store.set(f"{prefix}/here/{rank}", "1" if interrupted else "0")
    keys = [f"{prefix}/here/{r}" for r in range(world_size)]
    present = _wait_for(store, keys, time.monotonic() + deadline_s)
    alive = tuple(r for r in range(world_size) if f"{prefix}/here/{r}" in present)
    store.set(f"{prefix}/seen/{rank}", ",".join(map(str, alive)))
    seen = [f"{prefix}/seen/{r}" for r in alive]
    store.wait(seen, timedelta(seconds=deadline_s))
    views = {store.get(k).decode() for k in seen}
    if len(views) != 1:
        raise CollectiveError(
            "the roll call",
            "going on without the lost ranks",
            prefix,
            f"the survivors disagree on who is alive ({sorted(views)}): a rank answered "
            "too late for some",
        )
    flags = [store.get(f"{prefix}/here/{r}") for r in alive]
    return RollCall(alive, any(flag == b"1" for flag in flags))


def recover(
    zero: ZeroRedundancyOptimizer,
    error: BaseException,
    *,
    store: Any | None = None,
    deadline_s: float = DEADLINE_S,
) -> Recovered:
    """Go on without the ranks that are gone, after ``error`` (a failed
    collective: DDP's backward, the ZeRO step's exchange). Call it on every
    surviving rank, in the ``except`` of the failed step.

    The survivors agree on who is alive (:func:`roll_call`), form a process
    group in-process (``new_group(..., use_local_synchronization=True)``), re-plan
    (:func:`zerofn.zero.redundancy.plan_after_loss`), send the copies that
    restore redundancy (the only bytes that move), and rebuild the optimizer
    on the new group. A step whose exchange failed (every local step taken)
    is finished: the lost shards' updates come from their carriers' copies
    and the exchange runs on the new group.

    Args:
        zero: the optimizer (built with ``redundancy=2``).
        error: what the failed step raised; raised again if no rank is lost.
        store: where the roll call is held (default: the default process
            group's store, which the launcher keeps).
        deadline_s: how long a rank has to answer the roll call.

    Returns:
        The new group and this rank's place in it.

    Raises:
        ValueError: ``zero`` keeps one copy of each shard (``redundancy=1``),
            or what :func:`~zerofn.zero.redundancy.plan_after_loss` refuses (a
            shard and its carrier both lost): restart from a checkpoint.
        BaseException: ``error`` itself, when every rank answered.
        zerofn.errors.CollectiveError: the survivors disagree, or a
            collective on the new group failed.
    """
    old = zero.zero_rank
    if old.carried is None:
        raise ValueError(
            "recover needs ZeroRedundancyOptimizer(..., redundancy=2): with one copy of "
            "each shard a lost rank's optimizer state is gone; restart from a checkpoint"
        )
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    prefix = f"zerofn/elastic/{zero.regroups}"
    call = roll_call(
        store, prefix, zero.rank, zero.world_size, zero.exchange_interrupted, deadline_s
    )
    lost = tuple(r for r in range(zero.world_size) if r not in call.alive)
    if not lost:
        raise error
    regrouping = plan_after_loss(old.plan, lost)
    group = dist.new_group(
        [dist.get_global_rank(zero.process_group, r) for r in regrouping.survivors],
        use_local_synchronization=True,
    )
    if call.interrupted:
        for gone in lost:
            adopt_carried_values(old, [p for g in zero.param_groups for p in g["params"]], gone)
    new_rank = regrouping.new_rank(zero.rank)
    known = known_states(old)
    sent = all_gather_objects(
        outgoing_states(regrouping, new_rank, known), group, "restoring redundancy after a loss"
    )
    for outbox in sent:
        known.update(outbox.get(new_rank, {}))
    zero.regroup(group, regrouping, new_rank, known, finish_step=call.interrupted)
    return Recovered(group, new_rank, len(regrouping.survivors), lost, call.interrupted)
