"""Join bookkeeping for uneven inputs, as pure functions.

When ranks have different numbers of batches, a rank that runs out *joins*:
it keeps answering the collectives the others still issue (shadowing them)
until every rank has joined. Each round, all ranks all-reduce a count of the
ranks still running: running ranks contribute 1 (when they announce an
iteration), joined ranks 0. This module decides, from that count, what a
joined rank does next; the adapter runs the collectives and the hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

__all__ = [
    "DISABLED",
    "SKEW_WARNING_ROUNDS",
    "JoinAction",
    "JoinConfig",
    "JoinProgress",
    "first_mismatch",
    "join_configs",
    "next_join_step",
]

SKEW_WARNING_ROUNDS = 1000
"""Shadowing rounds after which a joined rank warns of heavy input skew."""

JoinAction = Literal["finish", "shadow", "terminate"]


@attrs.frozen
class JoinConfig:
    """How one joinable takes part in a join context.

    Attributes:
        enable: whether uneven-input handling is on.
        throw_on_early_termination: raise on every rank as soon as one joins,
            instead of shadowing.
        is_first_joinable: only the first joinable announces iterations (one
            all-reduce per iteration, not one per joinable).
    """

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


DISABLED = JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)
"""The configuration of a joinable outside any join context."""


def join_configs(
    count: int, enable: bool, throw_on_early_termination: bool
) -> tuple[JoinConfig, ...]:
    """The configurations for ``count`` joinables, in the order given.

    Raises:
        ValueError: if ``count`` is not positive.
    """
    if count < 1:
        raise ValueError("a join context needs at least one joinable")
    return tuple(
        JoinConfig(enable, throw_on_early_termination, is_first_joinable=i == 0)
        for i in range(count)
    )


def first_mismatch(values: Sequence[Any]) -> int | None:
    """Index of the first value differing from ``values[0]`` (``None`` if all
    agree): every joinable must use the same process group."""
    for i, value in enumerate(values):
        if value != values[0]:
            return i
    return None


@attrs.frozen
class JoinProgress:
    """A joined rank's place in the shadowing loop.

    Attributes:
        rounds: shadowing rounds run so far.
        all_joined: every rank has joined; the loop is over.
        is_last_joiner: no other rank was still running when this one joined.
    """

    rounds: int = 0
    all_joined: bool = False
    is_last_joiner: bool = True

    @property
    def skewed(self) -> bool:
        """Whether this rank has shadowed long enough to warn about skew."""
        return self.rounds > SKEW_WARNING_ROUNDS


def next_join_step(
    progress: JoinProgress, still_running: int, throw_on_early_termination: bool
) -> tuple[JoinProgress, JoinAction]:
    """What a joined rank does after counting the ranks still running.

    Args:
        progress: where the rank stands.
        still_running: the all-reduced count of ranks that announced an
            iteration this round.
        throw_on_early_termination: the context's setting.

    Returns:
        The new progress and the action: ``"finish"`` (all joined: run the
        post-hooks), ``"terminate"`` (tell the others to stop, then raise), or
        ``"shadow"`` (run every main hook once more).
    """
    if still_running == 0:
        return attrs.evolve(progress, all_joined=True), "finish"
    if throw_on_early_termination:
        return progress, "terminate"
    return attrs.evolve(progress, rounds=progress.rounds + 1, is_last_joiner=False), "shadow"
