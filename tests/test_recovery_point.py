"""The survivors' agreement on where to go on from after a lost rank
(:func:`zerofn.zero.elastic.recovery_point.recovery_point`), over every combination of
positions the survivors of a step can report, and the impossible ones."""

from __future__ import annotations

import pytest
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.zero.elastic.recovery_point import (
    InconsistentPositions,
    Position,
    RecoveryPoint,
    recovery_point,
)

PHASES = ("backward", "stepped", "exchanged")
"""Where a survivor of step ``T`` can have stopped: before its local step
(in the all-reduce, or before it), after its local step inside the
exchange, or after the exchange (in the next step's backward)."""


def position_of(phase: str, t: int) -> Position:
    return {
        "backward": Position(t - 1, True),
        "stepped": Position(t, False),
        "exchanged": Position(t, True),
    }[phase]


def consistent(phases: list[str]) -> bool:
    """Whether a world can leave its survivors at ``phases`` of one step:
    a survivor exchanged step T only if every survivor took local step T."""
    return not ("exchanged" in phases and "backward" in phases)


@given(
    st.lists(st.sampled_from(PHASES), min_size=1, max_size=8),
    st.integers(1, 1000),
)
@settings(max_examples=draws(400), deadline=None)
def test_every_consistent_combination_gives_one_point_that_completes_step_t_once(
    phases: list[str], t: int
) -> None:
    positions = [position_of(p, t) for p in phases]
    if not consistent(phases):
        with pytest.raises(InconsistentPositions):
            recovery_point(positions)
        return
    point = recovery_point(positions)
    assert point == recovery_point(list(reversed(positions))) or point.source is not None
    if "stepped" in phases:  # step T is finished: every survivor ends at T, exchanged
        assert point.finish and point.step == t
        assert set(point.behind) == {i for i, p in enumerate(phases) if p == "backward"}
        if point.behind:
            assert point.source is not None and phases[point.source] == "stepped"
    else:  # nothing half done: each redoes the call that failed on it
        assert not point.finish and not point.behind
    for phase, position in zip(phases, positions, strict=True):
        # After the point, a survivor redoes its failed call, or moves on
        # past it: either way its next call is step T + 1's, exactly once.
        next_call = t + 1 if point.finished_step(position) else position.steps + 1
        if point.finish:
            assert next_call == t + 1, phase
        else:
            assert next_call == position.steps + 1


@given(st.integers(0, 50), st.integers(2, 5), st.booleans())
@settings(max_examples=draws(100), deadline=None)
def test_a_survivor_two_steps_behind_or_midway_behind_is_refused(
    t: int, gap: int, exchanged: bool
) -> None:
    ahead = Position(t + gap, False)
    with pytest.raises(InconsistentPositions):
        recovery_point([ahead, Position(t, exchanged)])
    with pytest.raises(InconsistentPositions):
        recovery_point([Position(t + 1, False), Position(t, False)])


def test_positions_read_back_from_the_roll_call() -> None:
    for position in (Position(0), Position(7, False), Position(123, True)):
        assert Position.from_text(position.to_text()) == position
    for bad in ("", "x:1", "3:2", "-1:0"):
        with pytest.raises(ValueError):
            Position.from_text(bad)


def test_the_cases_of_the_issue() -> None:
    # Rank 0 failed in DDP's all-reduce, rank 2 inside the exchange: rank 0
    # takes the local step from rank 2's gradients, then both finish it.
    point = recovery_point([Position(59, True), Position(60, False)])
    assert point == RecoveryPoint(60, finish=True, behind=(0,), source=1)
    assert point.finished_step(Position(59, True)) and point.finished_step(Position(60, False))
    # Every survivor exchanged: each redoes the call that failed on it.
    assert recovery_point([Position(60), Position(60)]) == RecoveryPoint(60, finish=False)
