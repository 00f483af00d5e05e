"""Who is alive, from heartbeats rather than timeouts.

Every rank of a job that can go on without a lost rank (``redundancy=2``)
adds one to its own counter in the job's store every tenth of a second
(``zerofn_torch.runtime.heartbeat``). A watcher cannot compare clocks across
machines, so it judges by its own: a rank is *silent* once its counter has
not moved for ``silent_after_s`` seconds of the watcher's watching. A rank
that never beat where the watcher looks is never silent (the watcher knows
nothing of it and waits for the roll call's deadline instead). Nor does
silence count while the watcher itself was not looking: a reading that comes
long after the one before (the watcher's own process starved of CPU, as on an
overloaded machine, where the watched one starves too) times every counter
afresh, so a busy machine delays a verdict rather than making a false one.

:class:`BeatView` is what one watcher has seen; :func:`seen_beats` takes one
more reading; :func:`silent_ranks` says who has gone quiet. The roll call
(``zerofn_torch.roll_call.roll_call``) declares a silent rank lost, which is
what lets it end within a second of a death rather than at its deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["BeatView", "seen_beats", "silent_ranks"]


@attrs.frozen
class BeatView:
    """What one watcher has seen of every rank's heartbeat counter.

    Attributes:
        counts: each rank's last counter read (``None``: no beat seen).
        since: when (the watcher's clock, seconds) each counter was first
            read at its current value.
        read_at: when the watcher last read the counters.
    """

    counts: tuple[int | None, ...]
    since: tuple[float, ...] = attrs.field()
    read_at: float = 0.0

    @since.validator
    def _one_time_per_rank(self, _: object, since: tuple[float, ...]) -> None:
        if len(since) != len(self.counts):
            raise ValueError(f"{len(self.counts)} counters but {len(since)} times")


def seen_beats(
    previous: BeatView | None,
    counts: Sequence[int | None],
    now: float,
    max_gap_s: float = float("inf"),
) -> BeatView:
    """``previous`` with one more reading of every rank's counter at ``now``:
    a counter that moved (or appeared) is timed from ``now``; so is every
    counter when the previous reading is more than ``max_gap_s`` old (the
    watcher was away: what it missed is no evidence of silence).

    Raises:
        ValueError: ``counts`` covers another number of ranks than
            ``previous``, or ``max_gap_s`` is not positive.
    """
    if max_gap_s <= 0:
        raise ValueError(f"max_gap_s must be positive, got {max_gap_s}")
    if previous is not None and len(counts) != len(previous.counts):
        raise ValueError(f"{len(counts)} counters read, {len(previous.counts)} watched")
    if previous is None or now - previous.read_at > max_gap_s:
        return BeatView(tuple(counts), tuple(now for _ in counts), now)
    since = tuple(
        then if new == old else now
        for new, old, then in zip(counts, previous.counts, previous.since, strict=True)
    )
    return BeatView(tuple(counts), since, now)


def silent_ranks(view: BeatView, now: float, silent_after_s: float) -> tuple[int, ...]:
    """The ranks whose counter has stood still for more than
    ``silent_after_s`` at ``now`` (ranks never seen beating are not among
    them), in order."""
    return tuple(
        r
        for r, (count, since) in enumerate(zip(view.counts, view.since, strict=True))
        if count is not None and now - since > silent_after_s
    )
