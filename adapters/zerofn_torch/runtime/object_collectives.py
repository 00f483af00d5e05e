"""Collectives of picklable values (state dicts, file hashes, verdicts).

Blocking, and only for bookkeeping, so the core does not express them as
requests; each is one request of the adapter's own
(:class:`~zerofn.comm.GatherObjects`,
:class:`~zerofn.comm.AllGatherObjects`,
:class:`~zerofn.comm.BroadcastObject`) run by the driver like
every other, so it fails the way every collective does: with a
:class:`zerofn.errors.CollectiveError` naming what it was for.
"""

from __future__ import annotations

from typing import Any

from zerofn.comm import AllGatherObjects, BroadcastObject, GatherObjects
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.issue import Step

__all__ = ["all_gather_objects", "broadcast_object", "gather_objects"]


def _run_request(request: Step, group: Any, purpose: str) -> Any:
    def program() -> Any:
        (answer,) = yield request
        return answer

    return drive(program(), group, purpose).wait()


def all_gather_objects(value: Any, group: Any, purpose: str) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    gathered: list[Any] = _run_request(AllGatherObjects(value), group, purpose)
    return gathered


def gather_objects(value: Any, dst: int, group: Any, purpose: str) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on group rank ``dst``; ``None``
    on the other ranks.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    gathered: list[Any] | None = _run_request(GatherObjects(value, dst), group, purpose)
    return gathered


def broadcast_object(value: Any, src: int, group: Any, purpose: str) -> Any:
    """Group rank ``src``'s ``value``, on every rank.

    Raises:
        zerofn.errors.CollectiveError: the collective failed.
    """
    return _run_request(BroadcastObject(value, src), group, purpose)
