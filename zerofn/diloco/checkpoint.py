"""DiLoCo's checkpoints: one rank's outer state, and the consolidated form.

A rank's state (what ``DiLoCoOptimizer.state_dict()`` keeps under
``"diloco"``) is a plain dict, safe for ``torch.load(weights_only=True)``::

    {
        "format": "zerofn.diloco/1",
        "sizes": [...], "fragments": P,
        "world_size": W, "rank": r,     # None, None when consolidated
        "state": {"step": t, "in_flight": None or {...}},   # DiLoCoState
        "result": the finished in-flight sync's values, or None,
        "anchor": [this rank's anchor slice of each fragment],
        "outer": the outer optimizer's state_dict() (tensor i is fragment i),
        "replica": None, or (compressed) the full anchor replica,
        "residual": None, or (compressed) this rank's error feedback,
    }

:func:`consolidate` joins every rank's dict into one that no world size is
written into: whole anchor fragments, whole outer-state tensors (1-D state
tensors are per element and are joined slice by slice; 0-D ones and other
values are the same on every owner and kept once), and the ranks' mean
residual (error feedback's invariant is about the mean over ranks: what
was sent plus the mean of what is still owed is the true mean).
:func:`shard` cuts a consolidated dict for one rank of any outer group, so a
run resumes on another number of workers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerofn.diloco.fragments import FragmentPlan
from zerofn.diloco.state import DiLoCoState

__all__ = ["FORMAT", "check_layout", "check_tensors", "consolidate", "rank_state_dict", "shard"]

FORMAT = "zerofn.diloco/1"
"""The format tag every DiLoCo state dict carries."""


def rank_state_dict(
    plan: FragmentPlan,
    rank: int,
    state: DiLoCoState,
    result: torch.Tensor | None,
    anchors: Sequence[torch.Tensor],
    outer: Mapping[str, Any],
    replica: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Rank ``rank``'s DiLoCo state dict, holding copies of the tensors given.

    Args:
        plan: how the run cuts its parameters.
        rank: this rank, in the outer group.
        state: the run's position.
        result: the values of the sync in flight, finished (``None`` when
            none is in flight).
        anchors: this rank's anchor slice of every fragment.
        outer: the outer optimizer's ``state_dict()``.
        replica: the compressed mode's replica of the anchor, or ``None``.
        residual: the compressed mode's error-feedback residual, or ``None``.
    """

    def copied(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().clone()

    return {
        "format": FORMAT,
        "sizes": list(plan.sizes),
        "fragments": len(plan.fragments),
        "world_size": plan.world_size,
        "rank": rank,
        "state": state.state_dict(),
        "result": copied(result),
        "anchor": [a.detach().clone() for a in anchors],
        "outer": copy.deepcopy(dict(outer)),
        "replica": copied(replica),
        "residual": copied(residual),
    }


def check_layout(
    plan: FragmentPlan, saved: Mapping[str, Any], rank: int | None, compressed: bool
) -> None:
    """Refuse a state dict that does not fit ``plan`` (and, for one rank's
    dict, this rank of this world size).

    Args:
        plan: how this run cuts its parameters.
        saved: the DiLoCo state dict.
        rank: this rank, or ``None`` to accept only a consolidated dict.
        compressed: whether this run compresses its syncs.

    Raises:
        ValueError: another format, other parameter sizes or fragment count,
            a per-rank dict of another rank or world size, or a dict saved
            with compression on where it is off (or the reverse); the
            message says how to load it instead.
    """
    if saved.get("format") != FORMAT:
        raise ValueError(
            f"not a DiLoCo state dict (format {saved.get('format')!r}, expected {FORMAT!r})"
        )
    if tuple(saved["sizes"]) != plan.sizes or saved["fragments"] != len(plan.fragments):
        raise ValueError(
            f"the state dict is for {len(saved['sizes'])} parameters in {saved['fragments']} "
            f"fragments; this optimizer has {len(plan.sizes)} parameters in "
            f"{len(plan.fragments)}: build it over the same parameters with the same fragments"
        )
    if (saved["replica"] is not None) != compressed:
        raise ValueError(
            f"the state dict was saved with compression {'on' if not compressed else 'off'}; "
            "resume with the compression it was saved with"
        )
    if saved["world_size"] is None:
        return
    if rank is None or saved["world_size"] != plan.world_size or saved["rank"] != rank:
        raise ValueError(
            f"this state dict is rank {saved['rank']}'s of an outer group of "
            f"{saved['world_size']} ranks; load it there, or save "
            "consolidated_state_dict() to resume on another rank or world size"
        )


def check_tensors(
    plan: FragmentPlan, rank: int, saved: Mapping[str, Any], state: DiLoCoState
) -> None:
    """Refuse a rank state dict whose tensors do not fit rank ``rank`` of
    ``plan`` (checked before anything is loaded).

    Raises:
        ValueError: anchor slices, a replica or residual of the wrong shape,
            or a sync result where none is in flight (or none where one is).
    """
    expected = [(f.lengths[rank],) for f in plan.fragments]
    got = [tuple(t.shape) for t in saved["anchor"]]
    if got != expected:
        raise ValueError(f"anchor slices of shapes {got}; this rank owns {expected}")
    for name in ("replica", "residual"):
        value = saved[name]
        if value is not None and tuple(value.shape) != (plan.numel,):
            raise ValueError(f"a {name} of shape {tuple(value.shape)} for {plan.numel}")
    result = saved["result"]
    if state.in_flight is None:
        if result is not None:
            raise ValueError("the state dict has a sync result but no sync in flight")
        return
    numel = plan.fragments[state.in_flight.fragment].numel
    if result is None or tuple(result.shape) != (numel,):
        raise ValueError(
            f"the sync in flight (fragment {state.in_flight.fragment}) needs its result "
            f"of {numel} elements in the state dict"
        )


def _owner_tensors(values: Sequence[Any]) -> bool:
    return all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values)


def consolidate(plan: FragmentPlan, per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Join every rank's DiLoCo state dict into the consolidated one.

    Args:
        plan: the run's plan.
        per_rank: each rank's dict, in rank order.

    Returns:
        The consolidated dict (new tensors; the inputs are only read).

    Raises:
        ValueError: a dict that is not rank ``i``'s of this plan, or an
            outer state whose per-element tensors do not fit the slices.
    """
    if len(per_rank) != plan.world_size:
        raise ValueError(f"{len(per_rank)} state dicts for an outer group of {plan.world_size}")
    compressed = per_rank[0]["replica"] is not None
    for rank, saved in enumerate(per_rank):
        check_layout(plan, saved, rank, compressed)
    first = per_rank[0]
    anchor = [torch.cat([saved["anchor"][f.index] for saved in per_rank]) for f in plan.fragments]
    state: dict[int, dict[str, Any]] = {}
    for index, fragment in enumerate(plan.fragments):
        entries = [saved["outer"]["state"].get(index) for saved in per_rank]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise ValueError(f"fragment {index}: some owners have outer state and some none")
        joined: dict[str, Any] = {}
        for key, value in entries[0].items():
            values = [e[key] for e in entries]
            if not _owner_tensors(values):
                joined[key] = value
                continue
            if tuple(v.numel() for v in values) != fragment.lengths:
                raise ValueError(
                    f"fragment {index}: outer state {key!r} has slices of "
                    f"{[v.numel() for v in values]} elements; the owners hold {fragment.lengths}"
                )
            joined[key] = torch.cat(values)
        state[index] = joined
    residual = None
    if compressed:
        residual = torch.stack([saved["residual"] for saved in per_rank]).mean(dim=0)
    return {
        "format": FORMAT,
        "sizes": list(plan.sizes),
        "fragments": len(plan.fragments),
        "world_size": None,
        "rank": None,
        "state": dict(first["state"]),
        "result": first["result"],
        "anchor": anchor,
        "outer": {"state": state, "param_groups": first["outer"]["param_groups"]},
        "replica": first["replica"],
        "residual": residual,
    }


def shard(plan: FragmentPlan, consolidated: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s DiLoCo state dict, cut from a consolidated one for
    ``plan``'s world size.

    Raises:
        ValueError: ``consolidated`` is not a consolidated dict fitting ``plan``.
    """
    check_layout(plan, consolidated, None, consolidated["replica"] is not None)
    state: dict[int, dict[str, Any]] = {}
    for index, entry in consolidated["outer"]["state"].items():
        fragment = plan.fragments[index]
        state[index] = {
            key: value[fragment.owned(rank)].clone()
            if isinstance(value, torch.Tensor) and value.dim() == 1
            else value
            for key, value in entry.items()
        }
    residual = consolidated["residual"]
    return {
        **consolidated,
        "world_size": plan.world_size,
        "rank": rank,
        "anchor": [consolidated["anchor"][f.index][f.owned(rank)].clone() for f in plan.fragments],
        "outer": {"state": state, "param_groups": consolidated["outer"]["param_groups"]},
        "residual": None if residual is None else residual.clone(),
    }
