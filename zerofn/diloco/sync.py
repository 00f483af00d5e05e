"""One fragment's sync as a communication program (fp32).

On every rank of the outer group, :func:`sync_program`:

1. reduces the fragment's parameter values to the owners: one
   :class:`~zerofn.comm.Reduce` per owner's slice, to that owner (a
   reduce-scatter, which gloo lacks, as one reduce per segment; the same
   way :class:`~zerofn.comm.GatherSegments` sends one broadcast per segment);
2. asks for the outer step on its own slice (an
   :class:`~zerofn.diloco.outer.OuterStep`, answered by whoever runs the
   program with :func:`~zerofn.diloco.outer.outer_step`), whose gradient is
   ``anchor - sum / W``;
3. gathers every owner's new anchor slice into every rank
   (:class:`~zerofn.comm.GatherSegments`).

The result is the fragment's new anchor, the same on every rank. Its bytes
are those of one all-reduce of the fragment: a reduce-scatter and an
all-gather. :func:`run_sync` answers the outer step and leaves a program of
collectives only, for the adapter's driver or the simulated world.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from zerofn.comm import GatherSegments, Program, Reduce, Request, answered_locally
from zerofn.diloco.fragments import Fragment
from zerofn.diloco.outer import OuterStep, pseudo_gradient
from zerofn.zero.exchange import ExchangeCollective

__all__ = ["SyncProgram", "run_sync", "sync_bytes", "sync_program"]

SyncProgram = Generator[Request | OuterStep, Any, torch.Tensor]
"""A sync: collectives and one outer step; returns the fragment's new values."""


def sync_program(
    fragment: Fragment,
    rank: int,
    values: torch.Tensor,
    anchor: torch.Tensor,
    collective: ExchangeCollective = "broadcasts",
) -> SyncProgram:
    """Sync one fragment on rank ``rank``.

    Args:
        fragment: the fragment, with its owners' slices.
        rank: this rank's index in the outer group.
        values: this rank's values of the fragment (``float32``), handed
            over: reduced in place, then filled with the new anchor.
        anchor: this rank's anchor slice of the fragment (the outer
            optimizer's tensor); stepped by the answer to the outer step.
        collective: how the new anchor's slices move.

    Returns:
        A program whose result is ``values``, holding the new anchor.

    Raises:
        ValueError: ``values`` or ``anchor`` does not fit the fragment.
    """
    world_size = len(fragment.lengths)
    fragment.check_fits(rank, ("anchor", anchor), values=values)
    slices = fragment.slices(values)
    for owner, part in enumerate(slices):
        if part.numel():
            yield Reduce(part, dst=owner)
    own = slices[rank]
    mean = own / world_size
    stepped = yield OuterStep(fragment.index, pseudo_gradient(anchor, mean))
    own.copy_(stepped)
    yield GatherSegments(slices, rank, collective, last=True)
    return values


def run_sync(program: SyncProgram, answer: Callable[[OuterStep], torch.Tensor]) -> Program[Any]:
    """``program`` with its outer step answered by ``answer``: a program of
    collectives only, returning the fragment's new values."""
    return answered_locally(program, OuterStep, answer)


def sync_bytes(fragment: Fragment) -> int:
    """The bytes one rank hands to the collectives of an fp32 sync of
    ``fragment`` (:func:`zerofn.comm.request_bytes` summed): 4 per element
    for the reduces and 4 per element for the gather.

    Under ring algorithms a rank *sends* ``(W - 1) / W`` of each, together
    ``8 (W - 1) / W`` bytes per element: what one all-reduce of the fragment
    sends.
    """
    return 8 * fragment.numel
