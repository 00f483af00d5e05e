"""Which parameter is which: the keys PowerSGD's state is kept under (a
parameter's index in the model), learned by :class:`KeyFinder` from the
parameter objects DDP's buckets hold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

__all__ = ["KeyFinder", "bucket_keys", "finish_key_iteration", "tracked"]


@attrs.frozen
class KeyFinder:
    """What is known of the parameters' keys.

    A parameter's key is its index in the model. The driver identifies the
    parameter objects a bucket holds by opaque integers (``id(p)`` in the
    adapter); a finder maps those to keys. Given the model's parameters
    (:func:`tracked`), that is a lookup. Otherwise the keys are learned from
    the first iteration seen: DDP runs it on provisional buckets that hold the
    parameters in reverse order of definition, the last ones in bucket 0, so
    each parameter's position counted from the model's end is known as the
    buckets come, and its index once the parameter count is known (from a
    restored layout, or at the end of that first iteration). The finder is
    advanced by :func:`claim_parameters` before each bucket and by
    :func:`end_iteration` after the last.

    Attributes:
        known: parameter identity -> key (index in the model).
        from_end: parameters seen this iteration whose key is not known yet
            -> position counted from the model's last parameter.
    """

    known: Mapping[int, int] = attrs.field(factory=dict)
    from_end: Mapping[int, int] = attrs.field(factory=dict)


def tracked(identities: Sequence[int]) -> KeyFinder:
    """Keys given by the model: parameter ``i`` of ``identities`` has key ``i``."""
    return KeyFinder({pid: i for i, pid in enumerate(identities)})


def bucket_keys(
    finder: KeyFinder, identities: Sequence[int], count: int | None
) -> tuple[KeyFinder, tuple[int, ...] | None]:
    """The keys of a bucket's parameters, in bucket order.

    Args:
        finder: what is known so far.
        identities: the bucket's parameters, in bucket order.
        count: the model's parameter count, if known.

    Returns:
        The finder after this bucket, and the keys, or ``None`` while some
        are still unknown (the core then keys the bucket by position).
    """
    if all(pid in finder.known for pid in identities):
        return finder, tuple(finder.known[pid] for pid in identities)
    base = len(finder.from_end)
    from_end = {**finder.from_end}
    for j, pid in enumerate(identities):
        from_end[pid] = base + len(identities) - 1 - j
    known = dict(finder.known)
    if count is not None:
        known.update({pid: count - 1 - e for pid, e in from_end.items()})
    finder = KeyFinder(known, from_end)
    if any(pid not in known for pid in identities):
        return finder, None
    return finder, tuple(known[pid] for pid in identities)


def finish_key_iteration(finder: KeyFinder) -> KeyFinder:
    """After an iteration's last bucket: the parameters seen in it, if their
    keys are still unknown, were all of the model's."""
    if not finder.from_end:
        return finder
    known = dict(finder.known)
    if not all(pid in known for pid in finder.from_end):
        count = len(finder.from_end)
        known.update({pid: count - 1 - e for pid, e in finder.from_end.items()})
    return KeyFinder(known, {})
