"""Optimizer state by piece of a parameter: what a rank knows, cut to the
pieces another rank needs, and loaded into a local optimizer.

When the world changes (``redundancy=2``), each rank knows the optimizer
state of what it owned and what it carried, and needs that of what it owns
and carries in the new world. Under a whole-tensor partition those are whole
parameters; under a flat one they are element ranges, which need not line
up: a new owner's range may join pieces that two ranks held, and a chunk of
its local optimizer may be cut from a piece another rank sent. So state is
keyed by :class:`~zerofn.zero.planning.partition.Piece` (a whole parameter is the
piece of all its elements), and :func:`state_of` cuts and joins it:
element-wise entries (moments, master values) by elements, per-parameter
scalars (Adam's ``step``) from the first piece, as every piece of a group
steps together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerofn.zero.mixed_precision.masters import Masters, without_masters
from zerofn.zero.mixed_precision.precision import MASTER_KEY
from zerofn.zero.planning.partition import Piece
from zerofn.zero.shard_state import is_elementwise

__all__ = [
    "ParamState",
    "PieceStates",
    "load_states",
    "state_of",
    "states_by_piece",
    "whole_pieces",
]

ParamState = dict[str, Any]
"""One tensor's optimizer state, as ``torch.optim`` keeps it."""

PieceStates = dict[Piece, ParamState]
"""Optimizer state by the piece of a parameter it belongs to."""


def whole_pieces(
    states: Mapping[int, Mapping[str, Any]], sizes: Sequence[int]
) -> dict[Piece, Mapping[str, Any]]:
    """Per-parameter states (by global index, as a global state dict keeps
    them) keyed by the piece of all of each parameter's elements."""
    return {Piece(i, 0, sizes[i]): state for i, state in states.items()}


def _copied(state: Mapping[str, Any]) -> ParamState:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def states_by_piece(optim: Optimizer, pieces: Sequence[Piece | None], masters: bool) -> PieceStates:
    """Copies of ``optim``'s per-tensor states, keyed by the piece each of its
    tensors holds (``pieces``, in its order; ``None``: a placeholder with
    nothing to send); with ``masters`` (its tensors are master copies) each
    with its master's value under ``"master_param"``. A tensor never stepped
    has no state, and is left out (its master, if any, is its parameter's
    value: the loader copies it up from there)."""
    local = [t for g in optim.param_groups for t in g["params"]]
    known = {}
    for piece, tensor in zip(pieces, local, strict=True):
        if piece is None or not piece.numel or not optim.state.get(tensor):
            continue
        state = _copied(optim.state[tensor])
        if masters:
            state[MASTER_KEY] = tensor.detach().clone()
        known[piece] = state
    return known


def _covering(known: Mapping[Piece, Mapping[str, Any]], piece: Piece) -> list[Piece]:
    """Known pieces of ``piece``'s parameter that together cover it, in
    order (each the one reaching furthest from where the last ended); empty
    when none overlaps it.

    Raises:
        ValueError: the known pieces cover part of it only.
    """
    mine = [
        p for p in known if p.param == piece.param and p.start < piece.stop and piece.start < p.stop
    ]
    if not mine:
        return []
    chosen, at = [], piece.start
    while at < piece.stop:
        reaching = [p for p in mine if p.start <= at < p.stop]
        if not reaching:
            raise ValueError(
                f"parameter {piece.param}: the optimizer state of elements {at} onwards of "
                f"{piece.start}..{piece.stop} is known nowhere, the rest is"
            )
        best = max(reaching, key=lambda p: p.stop)
        chosen.append(best)
        at = best.stop
    return chosen


def state_of(
    known: Mapping[Piece, Mapping[str, Any]], piece: Piece, shape: Sequence[int]
) -> ParamState | None:
    """The optimizer state of ``piece``, for a tensor of ``shape``, from the
    pieces in ``known``: a known piece equal to it as it is (element-wise
    entries reshaped), else its elements cut from the pieces that cover it;
    ``None`` when nothing of it is known (never stepped). Its tensors may
    be views of ``known``'s: copy them before changing them
    (:func:`load_states` does).

    Raises:
        ValueError: only part of ``piece`` is known.
    """
    if piece in known:
        return {
            name: value.reshape(tuple(shape)) if _cuttable(value, name, piece) else value
            for name, value in known[piece].items()
        }
    parts = _covering(known, piece)
    if not parts:
        return None
    joined: ParamState = {}
    for name, value in known[parts[0]].items():
        if not is_elementwise(value, name, parts[0].numel):
            joined[name] = value
            continue
        cut = []
        for p in parts:
            entry = known[p][name]
            if not _cuttable(entry, name, p):
                raise ValueError(
                    f"parameter {piece.param}: state {name!r} is not one value per element, "
                    "so it cannot be cut into pieces (use an element-wise optimizer)"
                )
            lo, hi = max(piece.start, p.start) - p.start, min(piece.stop, p.stop) - p.start
            cut.append(entry.reshape(-1)[lo:hi])
        joined[name] = (cut[0] if len(cut) == 1 else torch.cat(cut)).reshape(tuple(shape))
    return joined


def _cuttable(value: Any, name: str, piece: Piece) -> bool:
    """An element-wise entry of ``piece``'s state: one value per element."""
    return is_elementwise(value, name, piece.numel) and value.numel() == piece.numel


def load_states(
    optim: Optimizer,
    pieces: Sequence[Piece | None],
    known: Mapping[Piece, Mapping[str, Any]],
    masters: Masters | None = None,
) -> None:
    """Load ``optim`` (its tensors hold ``pieces``, in its order; ``None``: a
    placeholder) with copies of the states :func:`state_of` cuts from
    ``known``; a tensor whose piece is known nowhere starts fresh. With
    ``masters`` (over the same tensors) each state's ``"master_param"``
    becomes its master's value; a master without one is copied up from its
    low tensor.

    Raises:
        ValueError: a piece is known only in part.
    """
    saved = optim.state_dict()
    local = [t for g in optim.param_groups for t in g["params"]]
    chosen = {}
    for index, (piece, tensor) in enumerate(zip(pieces, local, strict=True)):
        state = None if piece is None or not piece.numel else state_of(known, piece, tensor.shape)
        if state is not None:
            chosen[index] = _copied(state)
    rest, found = without_masters({"state": chosen, "param_groups": saved["param_groups"]})
    saved["state"] = rest["state"]
    optim.load_state_dict(saved)
    if masters is not None:
        masters.load(found)
