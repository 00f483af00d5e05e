"""A ZeRO rank rebuilt when its world changes (``redundancy=2``): what
optimizer state it knows, what it sends to restore redundancy, the rank it
becomes under :func:`zerofn.zero.redundancy.plan_after_loss`'s or
:func:`~zerofn.zero.redundancy.plan_after_join`'s plan, and a lost shard's
update finished from the carried copy. The adapter
(``zerofn_torch.elastic``) and the simulated world run the same functions.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.zero.precision import MASTER_KEY
from zerofn.zero.rank import ZeroRank, placed
from zerofn.zero.rank_state import load_states
from zerofn.zero.redundancy import Regrouping, carried_owner

__all__ = [
    "Outbox",
    "ParamState",
    "adopt_carried_values",
    "known_states",
    "moves_program",
    "outgoing_states",
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
    masters = rank.masters is not None
    known = _states_by_global(rank.optim, own, masters)
    if rank.carried is not None:
        known.update(_states_by_global(rank.carried.optim, rank.carried.indices, masters))
    return known


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


def moves_program(
    rank: ZeroRank, regrouping: Regrouping, new: int
) -> Generator[Outbox, Sequence[Outbox], dict[int, ParamState]]:
    """The moves of a changing world, as rank ``new`` of it takes part: it
    yields what it sends (:func:`outgoing_states` of what it knows), is sent
    back every rank's outbox (an all-gather, in the adapter; handed over, in
    the simulated world), and returns every parameter's state it knows then,
    for :func:`regrouped`. A joiner knows nothing yet and sends nothing."""
    known = known_states(rank)
    every = yield outgoing_states(regrouping, new, known)
    for outbox in every:
        known.update(outbox.get(new, {}))
    return known


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
    fresh = placed(groups, options, regrouping.plan, "off", masters=None, optim=None, rebuilt=True)
    partition = regrouping.plan.partition
    own = partition.params_of(new)  # type: ignore[union-attr]
    load_states(fresh.optim, own, known, fresh.masters)
    if fresh.carried is not None:
        carried = partition.params_of(carried_owner(new, world))  # type: ignore[union-attr]
        load_states(fresh.carried.optim, carried, known, fresh.carried.masters)
    return fresh
