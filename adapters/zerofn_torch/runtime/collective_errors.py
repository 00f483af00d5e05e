"""Where a failed collective becomes an error that names it.

A failure (a dead peer, a timeout, a broken transport) is reported as a
:class:`zerofn.errors.CollectiveError` naming the collective, what it was
for and the group, with the transport's error as its cause:
:func:`collective_error` builds it for requests the driver issues
(:func:`zerofn_torch.runtime.issue.issue`), :func:`guarded` for blocking collectives
the core does not express as requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from zerofn.errors import CollectiveError

__all__ = ["collective_error", "describe_group", "guarded"]


def describe_group(group: Any) -> str:
    """The group for messages: backend, size and this rank's place in it.

    Callbacks that may report a failure close over this string, taken when
    the request is issued, never over the group: a callback runs, and is
    freed, on one of the group's own worker threads, and if it held the last
    reference the group's destructor would run there and join that very
    thread (``std::system_error``: resource deadlock avoided, then abort).

    Args:
        group: the process group.

    Returns:
        E.g. ``"gloo group of 2 ranks (this is rank 0)"``.
    """
    try:
        return (
            f"{dist.get_backend(group)} group of {dist.get_world_size(group)} ranks "
            f"(this is rank {dist.get_rank(group)})"
        )
    except Exception:  # a group torn down under us still gets named
        return "a process group that is no longer usable"


def collective_error(
    collective: str, purpose: str, group_name: str, cause: BaseException
) -> CollectiveError:
    """The error for a failed collective.

    Args:
        collective: what was sent (e.g. ``"all_reduce (sum) of 1 tensor, 4 B"``).
        purpose: what it was for.
        group_name: the group, as :func:`describe_group` named it.
        cause: the transport's error, kept as ``__cause__``.

    Returns:
        The :class:`zerofn.errors.CollectiveError` to raise or fail a future with.
    """
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    error = CollectiveError(collective, purpose, group_name, reason)
    error.__cause__ = cause
    return error


@contextmanager
def guarded(collective: str, purpose: str, group: Any) -> Iterator[None]:
    """Turn an error raised by a blocking collective inside the block into a
    :class:`zerofn.errors.CollectiveError` naming ``collective`` and ``purpose``.

    For collectives the core does not express as requests (object
    collectives, ``torch.distributed.checkpoint``).
    """
    try:
        yield
    except (CollectiveError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    # BaseException: torch.distributed.checkpoint's CheckpointException is one.
    except BaseException as e:
        raise collective_error(collective, purpose, describe_group(group), e) from e
