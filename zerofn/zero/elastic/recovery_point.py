"""Where survivors go on from after a lost rank: one point every survivor
agrees on, whatever collective happened to fail on which rank.

A ZeRO step on a rank is: the gradients averaged (DDP's backward), the local
step (this rank's shard and, with ``redundancy=2``, the shard it carries),
then the exchange of the updated shards. A rank lost at any moment leaves
each survivor somewhere in that sequence, and the survivors need not agree:
one may have got through the all-reduce and its local step while another
failed inside the all-reduce. Each survivor reports its :class:`Position`
(the local steps it has taken since the world last changed, and whether the
exchange of the last one completed); :func:`recovery_point` turns every
survivor's position into one :class:`RecoveryPoint`, or refuses.

The rule, with ``T`` the most local steps any survivor took:

* every survivor exchanged step ``T``: nothing is half done; each redoes the
  step call that failed on it (the next one);
* some survivor took local step ``T`` and did not finish its exchange: step
  ``T`` is finished on the survivors. A survivor still at ``T - 1`` (it
  failed before its local step: in the all-reduce, say) takes local step
  ``T`` first, from the averaged gradients a survivor that took it holds
  (the *source*); then the exchange runs on the survivors, the lost shards'
  updates coming from their carriers;
* anything else cannot happen in a consistent world (a survivor two steps
  behind, or one behind while another completed the exchange that needed
  its shard): every survivor raises.

A pure function of the positions: every survivor computes the same point
from the same roll call.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = [
    "InconsistentPositions",
    "Position",
    "RecoveryPoint",
    "exchanged",
    "recovery_point",
    "stepped",
]


@attrs.frozen
class Position:
    """Where one rank stood when its step failed.

    Attributes:
        steps: local steps it took since the world last changed (its
            construction, a loss or a join).
        exchanged: the exchange of its last local step completed.
    """

    steps: int = attrs.field(validator=attrs.validators.ge(0))
    exchanged: bool = True

    def to_text(self) -> str:
        """The position as the roll call's store keeps it."""
        return f"{self.steps}:{int(self.exchanged)}"

    @classmethod
    def from_text(cls, text: str) -> Position:
        """Read :meth:`to_text` back.

        Raises:
            ValueError: not a position.
        """
        steps, _, exchanged = text.partition(":")
        if exchanged not in ("0", "1") or not steps.isdigit():
            raise ValueError(f"not a recovery position: {text!r}")
        return cls(int(steps), exchanged == "1")


def stepped(position: Position) -> Position:
    """The position once a local step is over (its exchange not yet done)."""
    return Position(position.steps + 1, exchanged=False)


def exchanged(position: Position) -> Position:
    """The position once the exchange of its last local step completed."""
    return Position(position.steps, exchanged=True)


class InconsistentPositions(ValueError):
    """The survivors' positions admit no common point to go on from."""


@attrs.frozen
class RecoveryPoint:
    """What every survivor does before going on.

    Attributes:
        step: the local step every survivor has taken once it is done (``T``).
        finish: step ``T``'s exchange is to be finished on the survivors.
        behind: the survivors (indices into the positions) that take local
            step ``T`` first, from the source's gradients.
        source: a survivor holding step ``T``'s averaged gradients (``None``
            when nobody is behind).
    """

    step: int
    finish: bool
    behind: tuple[int, ...] = ()
    source: int | None = None

    def finished_step(self, position: Position) -> bool:
        """Whether the step call that failed on a survivor at ``position`` is
        complete once the point is reached (else: redo that call)."""
        return self.finish and not (position.steps == self.step and position.exchanged)


def recovery_point(positions: Sequence[Position]) -> RecoveryPoint:
    """The one point the survivors at ``positions`` go on from.

    Raises:
        InconsistentPositions: no such point (every survivor raises alike).
        ValueError: no positions.
    """
    if not positions:
        raise ValueError("recovery_point needs at least one survivor's position")
    top = max(p.steps for p in positions)
    midway = [i for i, p in enumerate(positions) if p.steps == top and not p.exchanged]
    behind = tuple(i for i, p in enumerate(positions) if p.steps < top)
    for i in behind:
        p = positions[i]
        if p.steps < top - 1 or not p.exchanged:
            raise InconsistentPositions(
                f"survivor {i} stands at local step {p.steps} "
                f"({'exchanged' if p.exchanged else 'not exchanged'}) while another took local "
                f"step {top}: no consistent point to go on from; restart from a checkpoint"
            )
    done = [i for i, p in enumerate(positions) if p.steps == top and p.exchanged]
    if behind and done:
        raise InconsistentPositions(
            f"survivors {list(behind)} did not take local step {top}, whose exchange "
            f"survivors {done} completed (which needs every rank's shard): no consistent "
            "point to go on from; restart from a checkpoint"
        )
    # Nobody midway means everyone at the top exchanged: nobody is behind (see above).
    return RecoveryPoint(top, bool(midway), behind, midway[0] if behind else None)
