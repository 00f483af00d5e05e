"""Who is silent, from heartbeat counters read by one watcher
(:mod:`zerofn.zero.elastic.liveness`): property tests over readings at random times."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from zerofn.zero.elastic.liveness import BeatView, seen_beats, silent_ranks

readings = st.lists(
    st.tuples(
        st.floats(0.0, 1.0, allow_nan=False),
        st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=3, max_size=3),
    ),
    min_size=1,
    max_size=12,
)


def watched(
    steps: list[tuple[float, list[int | None]]], max_gap: float = float("inf")
) -> tuple[BeatView, float]:
    view, now = None, 0.0
    for gap, counts in steps:
        now += gap
        view = seen_beats(view, counts, now, max_gap)
    assert view is not None
    return view, now


@given(
    readings,
    st.floats(0.0, 2.0, allow_nan=False),
    st.one_of(st.just(float("inf")), st.floats(0.05, 1.0)),
)
@example([(0.1111904061294329, [None, None, 0])] * 3, 0.0, 0.1111904061294329)
def test_silent_means_unchanged_for_longer_than_the_limit_while_watched(
    steps: list[tuple[float, list[int | None]]], limit: float, max_gap: float
) -> None:
    """A rank is silent exactly when its counter stood still over more than
    ``limit`` of readings, none of them more than ``max_gap`` after the one
    before (a watcher that was away knows nothing of that time)."""
    view, now = watched(steps, max_gap)
    silent = silent_ranks(view, now, limit)
    for r in range(3):
        # When rank r's last value was first read in an unbroken watch, from
        # the readings themselves. A gap is the difference of two clock
        # readings, as the watcher sees it: it can round above the drawn gap.
        times, t = [], 0.0
        for gap, counts in steps:
            times.append((t + gap, t + gap - t, counts[r]))
            t += gap
        last, first_at = times[-1][2], times[-1][0]
        for i in range(len(times) - 1, -1, -1):
            at, gap, value = times[i]
            if value != last:
                break
            first_at = at
            if i == 0 or gap > max_gap:  # the watch began (again) here
                break
        assert (r in silent) == (last is not None and now - first_at > limit)


def test_a_watcher_that_was_away_declares_nobody_silent() -> None:
    """Standing still across one long gap in the watching is no silence; the
    same stillness watched closely is."""
    close = seen_beats(seen_beats(None, [5], 0.0, 0.5), [5], 0.4, 0.5)
    close = seen_beats(close, [5], 0.8, 0.5)
    assert silent_ranks(close, 0.8, 0.75) == (0,)
    away = seen_beats(seen_beats(None, [5], 0.0, 0.5), [5], 0.8, 0.5)
    assert silent_ranks(away, 0.8, 0.75) == ()
    with pytest.raises(ValueError, match="max_gap_s must be positive"):
        seen_beats(None, [5], 0.0, 0.0)


@given(readings)
def test_a_rank_that_keeps_beating_is_never_silent(
    steps: list[tuple[float, list[int | None]]],
) -> None:
    view, now = None, 0.0
    for i, (gap, _) in enumerate(steps):
        now += gap
        view = seen_beats(view, [i, i, i], now)  # every reading a new count
        assert silent_ranks(view, now, 0.0) == ()


def test_a_reading_of_another_world_size_is_refused() -> None:
    view = seen_beats(None, [1, 2], 0.0)
    with pytest.raises(ValueError, match="3 counters read, 2 watched"):
        seen_beats(view, [1, 2, 3], 1.0)
    with pytest.raises(ValueError, match="2 counters but 1 times"):
        BeatView((1, 2), (0.0,))
