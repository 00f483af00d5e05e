"""Parameters written from outside the step: seeing it, and re-deriving what
the rank keeps from them.

A ZeRO rank keeps state derived from the parameters' values: master copies
(``master_dtype``, and the compressed exchange's exact values), a flat
shard's segment of the exchange buffer, and the copy of another rank's
shard it carries (``redundancy=2``). Whatever replaces parameter values
between steps (DiLoCo's sync, model averaging, a load of the model's state
dict, a user's ``param.copy_``) leaves that state stale: the next step
would step the old masters and write them back, and the write would be lost.

:func:`rederive_from_parameters` is the one re-derivation, for every mode;
:func:`parameter_versions` and :func:`written_since` let a caller notice
in-place writes by themselves (PyTorch bumps a tensor's version on every
in-place write it tracks; a write through ``.data`` it does not track).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zerofn.zero.elastic.redundancy import reseed_carried
from zerofn.zero.rank import ZeroRank
from zerofn.zero.rank_state import held_pieces

__all__ = ["owned_parameters", "parameter_versions", "rederive_from_parameters", "written_since"]


def owned_parameters(rank: ZeroRank) -> tuple[int, ...]:
    """Global indices of the parameters ``rank`` keeps derived state for:
    those it owns (all or in part) and, with ``redundancy=2``, those it carries."""
    return tuple(sorted({piece.param for piece in held_pieces(rank)}))


def parameter_versions(params: Sequence[torch.Tensor], indices: Sequence[int]) -> dict[int, int]:
    """The version counter of ``params[i]`` for each ``i`` in ``indices``:
    PyTorch advances one on every tracked in-place write."""
    return {i: params[i]._version for i in indices}


def written_since(versions: Mapping[int, int], params: Sequence[torch.Tensor]) -> bool:
    """Whether any parameter in ``versions`` (:func:`parameter_versions`)
    was written in place since they were read."""
    return any(params[i]._version != v for i, v in versions.items())


def rederive_from_parameters(
    rank: ZeroRank, params: Sequence[torch.Tensor], *, keep_consistent: bool = False
) -> None:
    """Make everything ``rank`` derives from the parameters' values agree
    with their current values: a flat shard's segment is packed from them,
    the masters (and with a compressed exchange, the exact values it sends
    differences of) are copied up from them, and a carried copy's values
    are taken from them.

    Args:
        rank: the rank whose derived state to re-derive (written in place).
        params: every parameter, in the optimizer's order (read only).
        keep_consistent: keep each master element that already rounds to
            its parameter's value (only its parameter's precision was
            written, or nothing was): what a write noticed after the fact
            re-derives, so that writing a checkpoint's model state after
            loading the optimizer's keeps the loaded masters.

    Optimizer state (moments, step counts) is kept: only values change.
    With a compressed exchange, a master element taken from its parameter
    drops the difference still unsent there (masters minus replica).
    """
    rank.shards.refresh(params)
    if rank.masters is not None:
        rank.masters.reseed(keep_consistent=keep_consistent)
    if rank.carried is not None:
        reseed_carried(rank.carried, params, keep_consistent=keep_consistent)
