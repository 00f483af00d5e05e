"""The local step as a request: a ZeRO step program asks whoever runs it to
step this rank's shard (all of it, or some of its tensors), between its
collectives."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

import attrs

from zerofn.comm import ProgramStep

__all__ = ["LocalStep", "StepProgram"]

R = TypeVar("R")


@attrs.frozen
class LocalStep:
    """Step the local optimizer on this rank's shard, now.

    Not a collective: the program's runner answers it itself (see
    :func:`zerofn.comm.answered_locally`), with whatever the local step returned
    (the loss, when a closure was given).

    Attributes:
        rank: the rank whose shard to step (the simulated world runs many).
        tensors: which of the local optimizer's tensors (indices in its
            order) to step now, the others' gradients hidden from it;
            ``None``: all of them. A program that steps in parts names every
            tensor exactly once over the step's requests.
        last: the step's last request: once it is answered, the step is
            over (the masters are finished, the carried copy stepped).
    """

    rank: int
    tensors: tuple[int, ...] | None = None
    last: bool = True


StepProgram = Generator[ProgramStep | LocalStep, Any, R]
"""A program that asks for collectives and for local steps."""
