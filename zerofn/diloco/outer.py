"""The owner's outer step: the pseudo-gradient, and the outer optimizer on a slice.

Each rank keeps, for every fragment, the anchor's slice it owns (see
:mod:`zerofn.diloco.fragments`) as one tensor, and one ``torch.optim``
optimizer over those tensors (one per fragment, in fragment order): the
*outer* optimizer. A sync program asks for the outer step with an
:class:`OuterStep` request (not a collective: whoever runs the program
answers it, see :func:`zerofn.comm.answered_locally`); :func:`outer_step` is the
answer, the same for the adapter and the simulated world: the slice's
gradient is the pseudo-gradient ``anchor - mean over ranks of the
parameters``, and the outer optimizer steps that slice alone.

Because the outer optimizer must be element-wise (each element's update
depends on that element's gradient and state only), stepping the owners'
slices is the same as stepping the whole anchor on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from zerofn.zero.optimizers import ELEMENTWISE_OPTIMIZERS

__all__ = [
    "OuterOptimizerFactory",
    "OuterStep",
    "check_outer_optimizer",
    "default_outer_optimizer",
    "outer_step",
    "pseudo_gradient",
]

OuterOptimizerFactory = Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the tensors it is given."""


@attrs.frozen(eq=False)
class OuterStep:
    """Step the outer optimizer on this rank's slice of one fragment, now.

    Attributes:
        fragment: the fragment whose slice to step.
        gradient: the slice's pseudo-gradient (``float32``, the slice's length).
        carried: step this rank's copy of the carried rank's slice instead
            (``redundancy=2``, :mod:`zerofn.diloco.redundancy`).

    The answer is the slice's anchor tensor, stepped.
    """

    fragment: int
    gradient: torch.Tensor
    carried: bool = False


def pseudo_gradient(anchor: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``anchor - mean``: how far the workers' mean moved from the anchor,
    with the sign of a gradient (the outer step descends it).

    Args:
        anchor: the anchor's slice.
        mean: the mean over ranks of the parameters' same slice.

    Returns:
        A new tensor.
    """
    return anchor - mean


def default_outer_optimizer(tensors: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(list(tensors), lr=0.7, momentum=0.9, nesterov=True)


def check_outer_optimizer(
    optimizer: object, anchors: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """Refuse an outer optimizer that cannot step sharded anchor slices.

    Args:
        optimizer: what the user's ``outer_optimizer`` returned.
        anchors: the tensors it was given.

    Returns:
        ``optimizer``, checked.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: not over exactly ``anchors`` in order, or not known to be
            element-wise (the names of the known ones are in the message).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    # Checkpoints number the optimizer's tensors as fragments, so the order matters too.
    if list(map(id, held)) != list(map(id, anchors)):
        raise ValueError(
            "outer_optimizer must build its optimizer over exactly the tensors it is given, "
            "in that order (the anchor slices this rank owns, one per fragment), e.g. "
            "lambda ts: torch.optim.SGD(ts, lr=0.7)"
        )
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
        raise ValueError(
            f"the outer state is sharded by element ranges, which is only correct for an "
            f"element-wise optimizer; {type(optimizer).__name__} is not known to be one. "
            f"Use one of: {known}"
        )
    return optimizer


def outer_step(
    optimizer: torch.optim.Optimizer, anchors: Sequence[torch.Tensor], request: OuterStep
) -> torch.Tensor:
    """Answer ``request``: step ``optimizer`` on the fragment's anchor slice alone.

    Args:
        optimizer: the outer optimizer, over ``anchors``.
        anchors: this rank's anchor slice of every fragment, in fragment order.
        request: which fragment, and its slice's pseudo-gradient.

    Returns:
        The fragment's anchor slice, stepped in place.

    Raises:
        ValueError: the gradient does not match the slice.
    """
    anchor = anchors[request.fragment]
    if request.gradient.shape != anchor.shape:
        raise ValueError(
            f"fragment {request.fragment}: a pseudo-gradient of shape "
            f"{tuple(request.gradient.shape)} for an anchor slice of shape {tuple(anchor.shape)}"
        )
    # Only this slice has a gradient, so the optimizer skips every other one
    # (torch.optim steps parameters whose .grad is set).
    anchor.grad = request.gradient
    try:
        optimizer.step()
    finally:
        anchor.grad = None
    return anchor
