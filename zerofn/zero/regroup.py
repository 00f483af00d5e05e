"""A ZeRO rank rebuilt when its world changes (``redundancy=2``), as one
communication program (:func:`regroup_program`): a lost shard's update
finished from the carried copy, what the rank knows of the optimizer state
sent where redundancy needs it, the rank it becomes under
:func:`zerofn.zero.redundancy.plan_after_loss`'s or
:func:`~zerofn.zero.redundancy.plan_after_join`'s plan, and the interrupted
step's exchange on the new world. The adapter (``zerofn_torch.elastic``,
through the optimizer's ``regroup``) drives it on a process group, the
simulated world (:mod:`zerofn.testing.zero`) on simulated ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
import torch

from zerofn.comm import AllGatherObjects, Program
from zerofn.zero.precision import MASTER_KEY
from zerofn.zero.rank import ZeroRank, flat_params, placed_rank
from zerofn.zero.rank_state import load_states
from zerofn.zero.redundancy import Regrouping, carried_owner
from zerofn.zero.step import run_zero_step

__all__ = [
    "Outbox",
    "ParamState",
    "adopt_carried_values",
    "carried_states",
    "known_states",
    "outgoing_states",
    "regroup_program",
    "regrouped",
]

ParamState = dict[str, Any]
"""One parameter's optimizer state, as ``torch.optim`` keeps it."""

Outbox = dict[int, dict[int, ParamState]]
"""What one rank sends when the world changes: per target rank, the state of
each parameter moved to it."""


def _copied(state: Mapping[str, Any]) -> ParamState:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _states_by_global(
    optim: torch.optim.Optimizer, indices: Sequence[int], masters: bool
) -> dict[int, Any]:
    """Copies of ``optim``'s per-parameter states by global index; with
    ``masters`` (its tensors are master copies) each with its master's value."""
    local = [t for g in optim.param_groups for t in g["params"]]
    known = {}
    for index, tensor in zip(indices, local, strict=True):
        state = _copied(optim.state.get(tensor, {}))
        if masters:
            state[MASTER_KEY] = tensor.detach().clone()
        if state:
            known[index] = state
    return known


def known_states(rank: ZeroRank) -> dict[int, ParamState]:
    """Every parameter's optimizer state this rank holds (copies), by global
    index: its own shard's and the carried shard's, each with its master's
    value under ``"master_param"`` where there are master copies. A
    parameter never stepped has no optimizer state."""
    partition = rank.plan.partition
    own = partition.params_of(rank.options.rank)  # type: ignore[union-attr]
    known = _states_by_global(rank.optim, own, rank.masters is not None)
    known.update(carried_states(rank))
    return known


def carried_states(rank: ZeroRank) -> dict[int, ParamState]:
    """The carried copy's per-parameter states (copies), by global index,
    with their masters' values where there are master copies; empty
    without a carried copy."""
    carried = rank.carried
    if carried is None:
        return {}
    return _states_by_global(carried.optim, carried.indices, carried.masters is not None)


def outgoing_states(
    regrouping: Regrouping, new_rank: int, known: Mapping[int, ParamState]
) -> dict[int, dict[int, ParamState]]:
    """What ``new_rank`` sends to restore redundancy: per target rank, the
    state of each moved parameter (one never stepped has none to send)."""
    out: dict[int, dict[int, ParamState]] = {}
    for move in regrouping.moves:
        if move.source == new_rank:
            out.setdefault(move.target, {}).update(
                {i: known[i] for i in move.indices if i in known}
            )
    return out


def adopt_carried_values(rank: ZeroRank, params: Sequence[torch.Tensor], lost: int) -> None:
    """Write the carried copy's values into the parameters, when it is the
    lost rank's: its step was taken here too, so what the lost owner would
    have sent is here (the step is finished from it)."""
    carried = rank.carried
    if carried is None or carried.owner != lost:
        return
    with torch.no_grad():
        for tensor, index in zip(carried.tensors(), carried.indices, strict=True):
            params[index].copy_(tensor)


def regrouped(
    rank: ZeroRank,
    groups: Sequence[dict[str, Any]],
    regrouping: Regrouping,
    new: int,
    known: Mapping[int, ParamState],
) -> ZeroRank:
    """This rank as rank ``new`` of the regrouped world (a survivor, a
    running rank the world grew around, or a joiner): its options' rank and
    world size the new ones, its local optimizer holding the state of every
    parameter it now owns and its carried copy that of the new carried
    owner, all from ``known`` (its own, and what it received), master
    values too.

    A parameter whose state is nowhere in ``known`` starts fresh, as one
    never stepped does (its state exists nowhere to be had).
    """
    world = len(regrouping.old_ranks)
    options = attrs.evolve(rank.options, rank=new, world_size=world)
    fresh = placed_rank(
        groups, options, regrouping.plan, "off", masters=None, optim=None, rebuilt=True
    )
    partition = regrouping.plan.partition
    own = partition.params_of(new)  # type: ignore[union-attr]
    load_states(fresh.optim, own, known, fresh.masters)
    if fresh.carried is not None:
        carried = partition.params_of(carried_owner(new, world))  # type: ignore[union-attr]
        load_states(fresh.carried.optim, carried, known, fresh.carried.masters)
    return fresh


def regroup_program(
    rank: ZeroRank,
    groups: Sequence[dict[str, Any]],
    regrouping: Regrouping,
    new: int,
    *,
    finish_step: bool = False,
) -> Program[ZeroRank]:
    """The whole change of world, as rank ``new`` of the new one takes part
    (a survivor, a running rank the world grew around, or a joiner).

    1. With ``finish_step`` (a loss inside a step's exchange, every local
       step taken): the lost ranks' carried copies become the parameters
       (:func:`adopt_carried_values`).
    2. The moves: every rank's outbox (:func:`outgoing_states` of what it
       knows) is all-gathered; this rank keeps what was sent to it.
    3. The rank rebuilt from what it knows then (:func:`regrouped`).
    4. With ``finish_step``: the step's exchange, run again on the new world.

    Args:
        rank: this rank as it was (a joiner: as its own optimizer built it).
        groups: the param groups, in the optimizer's order (their parameters
            are written by steps 1 and 4).
        regrouping: the core's decision (the same on every rank).
        new: this rank in the new world.
        finish_step: finish an interrupted step (a loss only).

    Returns:
        The rebuilt rank.
    """
    params = flat_params(groups)
    if finish_step:
        lost = [r for r in range(rank.options.world_size) if r not in regrouping.survivors]
        for gone in lost:
            adopt_carried_values(rank, params, gone)
    known = known_states(rank)
    (every,) = yield AllGatherObjects(outgoing_states(regrouping, new, known))
    for outbox in cast(list[Outbox], every):
        known.update(outbox.get(new, {}))
    fresh = regrouped(rank, groups, regrouping, new, known)
    if finish_step:
        yield from run_zero_step(fresh.shards, params, fresh.options.via, lambda _: None)
    return fresh
