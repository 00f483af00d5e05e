"""Collectives of picklable values (state dicts, file hashes, verdicts).

Blocking, and only for bookkeeping, so the core does not express them as
requests; they still fail the way every collective does: with a
:class:`zerofn.errors.CollectiveError` naming what they were for (see
:func:`zerofn_torch.collective_errors.guarded`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerofn_torch.collective_errors import guarded

__all__ = ["all_gather_objects", "broadcast_object", "gather_objects"]


def all_gather_objects(value: Any, group: Any, purpose: str) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with guarded("all_gather_object", purpose, group):
        dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_objects(value: Any, dst: int, group: Any, purpose: str) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on group rank ``dst``; ``None``
    on the other ranks.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    mine = dist.get_rank(group) == dst
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if mine else None
    with guarded("gather_object", purpose, group):
        dist.gather_object(value, gathered, dst=dist.get_global_rank(group, dst), group=group)
    return gathered


def broadcast_object(value: Any, src: int, group: Any, purpose: str) -> Any:
    """Group rank ``src``'s ``value``, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    box = [value]
    with guarded("broadcast_object_list", purpose, group):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]
