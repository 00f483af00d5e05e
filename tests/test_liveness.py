"""Who is silent, from heartbeat counters read by one watcher
(:mod:`zerofn.zero.liveness`): property tests over readings at random times."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerofn.zero.liveness import BeatView, seen_beats, silent_ranks

readings = st.lists(
    st.tuples(
        st.floats(0.0, 1.0, allow_nan=False),
        st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=3, max_size=3),
    ),
    min_size=1,
    max_size=12,
)


def watched(steps: list[tuple[float, list[int | None]]]) -> tuple[BeatView, float]:
    view, now = None, 0.0
    for gap, counts in steps:
        now += gap
        view = seen_beats(view, counts, now)
    assert view is not None
    return view, now


@given(readings, st.floats(0.0, 2.0, allow_nan=False))
def test_silent_means_unchanged_for_longer_than_the_limit(
    steps: list[tuple[float, list[int | None]]], limit: float
) -> None:
    view, now = watched(steps)
    silent = silent_ranks(view, now, limit)
    for r in range(3):
        # When rank r's last value was first read, from the readings themselves.
        times, t = [], 0.0
        for gap, counts in steps:
            t += gap
            times.append((t, counts[r]))
        last, first_at = times[-1][1], times[-1][0]
        for at, value in reversed(times):
            if value != last:
                break
            first_at = at
        assert (r in silent) == (last is not None and now - first_at > limit)


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
