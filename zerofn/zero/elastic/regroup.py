"""A ZeRO rank rebuilt when its world changes (``redundancy=2``), as one
communication program (:func:`regroup_program`): a lost shard's update
finished from the carried copy, what the rank knows of the optimizer state
sent where redundancy needs it, the rank it becomes under
:func:`zerofn.zero.elastic.redundancy.plan_after_loss`'s or
:func:`~zerofn.zero.elastic.redundancy.plan_after_join`'s plan, and the interrupted
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
from zerofn.zero.compressed.finish import finish_compressed_program
from zerofn.zero.elastic.carried import write_pieces
from zerofn.zero.elastic.piece_state import (
    ParamState,
    PieceStates,
    load_states,
    state_of,
    states_by_piece,
)
from zerofn.zero.elastic.redundancy import Regrouping
from zerofn.zero.planning.partition import Piece
from zerofn.zero.rank import OverlapMode, ZeroRank, flat_params, rank_for_plan
from zerofn.zero.step import run_zero_step

__all__ = [
    "VALUE_KEY",
    "Outbox",
    "adopt_carried_values",
    "carried_states",
    "known_states",
    "outgoing_states",
    "regroup_program",
    "regrouped",
    "take_moved_values",
]

Outbox = dict[int, PieceStates]
"""What one rank sends when the world changes: per target rank, the state
of each piece moved to it."""

VALUE_KEY = "zerofn_moved_value"
"""Where a moved piece's parameter values ride with its state, for a target
that becomes its owner without holding its last update (never in a
checkpoint: :func:`regroup_program` writes them into the parameters)."""


def known_states(rank: ZeroRank, params: Sequence[torch.Tensor]) -> PieceStates:
    """Every optimizer state this rank holds (copies), by the piece each
    belongs to: its own shard's and the carried shard's, each with its
    master's value under ``"master_param"`` where there are master copies.
    A tensor never stepped has no optimizer state."""
    known = states_by_piece(rank.optim, rank.shards.local_pieces(params), rank.masters is not None)
    known.update(carried_states(rank))
    return known


def carried_states(rank: ZeroRank) -> PieceStates:
    """The carried copy's states (copies), by piece, with their masters'
    values where there are master copies; empty without a carried copy."""
    carried = rank.carried
    if carried is None:
        return {}
    return states_by_piece(carried.optim, carried.pieces, carried.masters is not None)


def outgoing_states(
    regrouping: Regrouping,
    new_rank: int,
    known: Mapping[Piece, ParamState],
    params: Sequence[torch.Tensor],
) -> Outbox:
    """What ``new_rank`` sends to restore redundancy: per target rank, the
    state of each moved piece (one never stepped has none to send), with
    its parameter values where the move says so (under :data:`VALUE_KEY`)."""
    out: Outbox = {}
    for move in regrouping.moves:
        if move.source != new_rank:
            continue
        box = out.setdefault(move.target, {})
        for piece in move.pieces:
            state = state_of(known, piece, (piece.numel,))
            entry = {} if state is None else dict(state)
            if move.values:
                flat = params[piece.param].detach().reshape(-1)
                entry[VALUE_KEY] = flat[piece.start : piece.stop].clone()
            if entry:
                box[piece] = entry
    return out


def take_moved_values(known: PieceStates, params: Sequence[torch.Tensor]) -> None:
    """Write the parameter values that rode with moved states into the
    parameters, and take them out of ``known`` (written in place)."""
    moved = {piece: state.pop(VALUE_KEY) for piece, state in known.items() if VALUE_KEY in state}
    write_pieces(params, list(moved), list(moved.values()))
    for piece in [p for p, state in known.items() if not state]:
        del known[piece]


def adopt_carried_values(rank: ZeroRank, params: Sequence[torch.Tensor], lost: int) -> None:
    """Write the carried copy's values into the parameters, when it is the
    lost rank's: its step was taken here too, so what the lost owner would
    have sent is here (the step is finished from it)."""
    carried = rank.carried
    if carried is None or carried.owner != lost:
        return
    write_pieces(params, carried.pieces, carried.tensors())


def regrouped(
    rank: ZeroRank,
    groups: Sequence[dict[str, Any]],
    regrouping: Regrouping,
    new: int,
    known: Mapping[Piece, ParamState],
) -> ZeroRank:
    """This rank as rank ``new`` of the regrouped world (a survivor, a
    running rank the world grew around, or a joiner): its options' rank and
    world size the new ones, its local optimizer holding the state of every
    piece it now owns and its carried copy that of the new carried owner,
    all from ``known`` (its own, and what it received), master values too.

    A piece whose state is nowhere in ``known`` starts fresh, as one never
    stepped does (its state exists nowhere to be had).
    """
    world = len(regrouping.old_ranks)
    options = attrs.evolve(rank.options, rank=new, world_size=world)
    # A rank DDP's hook stepped waits for a hook on the new world's DDP.
    overlap: OverlapMode = "unattached" if rank.stepped_by_hook else "off"
    fresh = rank_for_plan(groups, options, regrouping.plan, overlap, rebuilt=True)
    load_states(fresh.optim, fresh.shards.local_pieces(flat_params(groups)), known, fresh.masters)
    if fresh.carried is not None:
        load_states(fresh.carried.optim, fresh.carried.pieces, known, fresh.carried.masters)
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
       (:func:`adopt_carried_values`); with a compressed exchange, the
       exchange is finished instead, in the old world's terms
       (:func:`~zerofn.zero.compressed.finish.finish_compressed_program`).
    2. The moves: every rank's outbox (:func:`outgoing_states` of what it
       knows) is all-gathered; this rank keeps what was sent to it.
    3. The rank rebuilt from what it knows then (:func:`regrouped`).
    4. With ``finish_step`` and the exact exchange: the step's exchange,
       run again on the new world.

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
    compressed = rank.exchange is not None
    if finish_step and compressed:  # every replica as the whole exchange leaves it
        yield from finish_compressed_program(rank, params, regrouping)
    elif finish_step:
        lost = [r for r in range(rank.options.world_size) if r not in regrouping.survivors]
        for gone in lost:
            adopt_carried_values(rank, params, gone)
    known = known_states(rank, params)
    (every,) = yield AllGatherObjects(outgoing_states(regrouping, new, known, params))
    for outbox in cast(list[Outbox], every):
        known.update(outbox.get(new, {}))
    take_moved_values(known, params)
    fresh = regrouped(rank, groups, regrouping, new, known)
    if finish_step and not compressed:
        yield from run_zero_step(fresh.shards, params, fresh.options.collective, lambda _: None)
    return fresh
