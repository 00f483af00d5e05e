"""DiLoCo's evolving position: the inner step count and the sync in flight.

:class:`DiLoCoState` is all that changes from one inner step to the next
apart from tensors; :func:`take_inner_step` is its one transition, and says
what the step must do: start a fragment's sync, apply a sync's result, both
(``delay=0``) or neither. The configuration's invariant ``delay < sync_every
// fragments`` keeps at most one sync in flight, so the state holds at most
one :class:`InFlight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.schedule import applied_at, fragment_synced_at
from zerofn.validators import int_at_least

__all__ = [
    "DiLoCoState",
    "InFlight",
    "StepActions",
    "check_state",
    "state_from_dict",
    "take_inner_step",
]


_non_negative = int_at_least(0)


@attrs.frozen
class InFlight:
    """A sync that has started and whose result is not applied yet.

    Attributes:
        fragment: the fragment being synced.
        started: the completed-step count it started at.
        due: the completed-step count its result is applied at.
    """

    fragment: int = attrs.field(validator=_non_negative)
    started: int = attrs.field(validator=_non_negative)
    due: int = attrs.field(validator=_non_negative)

    def state_dict(self) -> dict[str, int]:
        """Plain ints (safe for ``torch.load(weights_only=True)``)."""
        return {"fragment": self.fragment, "started": self.started, "due": self.due}


@attrs.frozen
class DiLoCoState:
    """Where a DiLoCo run stands.

    Attributes:
        step: inner steps completed.
        in_flight: the sync started and not yet applied, if any.
    """

    step: int = attrs.field(default=0, validator=_non_negative)
    in_flight: InFlight | None = None

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and ``None`` (safe for ``torch.load(weights_only=True)``)."""
        flight = None if self.in_flight is None else self.in_flight.state_dict()
        return {"step": self.step, "in_flight": flight}


@attrs.frozen
class StepActions:
    """What one inner step must do once the inner optimizer has stepped.

    Attributes:
        start: the fragment whose sync starts now, or ``None``.
        apply: the sync whose result is merged into the parameters now, or
            ``None``; with ``delay=0`` the one that just started.
    """

    start: int | None
    apply: InFlight | None


def take_inner_step(config: DiLoCoConfig, state: DiLoCoState) -> tuple[DiLoCoState, StepActions]:
    """Count one inner step and say what it must do.

    Args:
        config: the run's configuration.
        state: the position before the step.

    Returns:
        ``(position after the step, actions)``; a result due now is applied
        before any sync starts (with ``delay >= 1`` the two never coincide).

    Raises:
        ValueError: ``state`` cannot come from ``config`` (see :func:`check_state`).
    """
    check_state(config, state)
    t = state.step + 1
    in_flight = state.in_flight
    apply = None
    if in_flight is not None and in_flight.due == t:
        apply, in_flight = in_flight, None
    start = fragment_synced_at(config, t)
    if start is not None:
        started = InFlight(start, t, applied_at(config, t))
        if config.delay == 0:
            apply = started
        else:
            in_flight = started
    return DiLoCoState(t, in_flight), StepActions(start, apply)


def check_state(config: DiLoCoConfig, state: DiLoCoState) -> None:
    """Refuse a position that ``config``'s schedule cannot reach.

    Raises:
        ValueError: a sync in flight that did not start at one of its
            fragment's sync steps, is not due ``delay`` steps later, or is
            already past due; or one in flight with ``delay=0``.
    """
    flight = state.in_flight
    if flight is None:
        return
    if (
        fragment_synced_at(config, flight.started) != flight.fragment
        or flight.due != applied_at(config, flight.started)
        or not flight.started <= state.step < flight.due
    ):
        raise ValueError(
            f"a sync of fragment {flight.fragment} started at step {flight.started} and due at "
            f"step {flight.due} cannot be in flight at step {state.step} with sync_every="
            f"{config.sync_every}, fragments={config.fragments}, delay={config.delay}; "
            "resume with the configuration the state was saved under"
        )


def state_from_dict(config: DiLoCoConfig, state_dict: Mapping[str, Any]) -> DiLoCoState:
    """The position saved by :meth:`DiLoCoState.state_dict`, checked against ``config``.

    Raises:
        ValueError: a missing entry, a negative count, or a position that
            ``config`` cannot reach.
    """
    missing = {"step", "in_flight"} - set(state_dict)
    if missing:
        raise ValueError(f"a DiLoCo state dict needs {sorted(missing)}; got {sorted(state_dict)}")
    flight = state_dict["in_flight"]
    in_flight = None
    if flight is not None:
        in_flight = InFlight(flight["fragment"], flight["started"], flight["due"])
    state = DiLoCoState(state_dict["step"], in_flight)
    check_state(config, state)
    return state
