"""Which optimizers may step a flat shard that cuts through tensors."""

from __future__ import annotations

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_elementwise"]

# Each of these updates every element from that element's own gradient and
# state (plus scalars such as the step count), so stepping any concatenation
# of slices gives the same numbers as stepping the whole tensors.
ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


def check_elementwise(optimizer_class: type, declared_elementwise: bool = False) -> None:
    """Refuse an optimizer that is not known to be element-wise.

    Args:
        optimizer_class: the local optimizer class.
        declared_elementwise: the user vouches that the class is element-wise.

    Raises:
        ValueError: naming the class and the ways out.
    """
    if declared_elementwise or optimizer_class in ELEMENTWISE_OPTIMIZERS:
        return
    known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
    raise ValueError(
        f"partition='flat' splits tensors across ranks, which is only correct for an "
        f"element-wise optimizer; {getattr(optimizer_class, '__name__', optimizer_class)} "
        f"is not known to be one (known: {known}). Use partition='balanced' or 'greedy', "
        "or pass elementwise=True if every update of an element depends only on that "
        "element's gradient and state."
    )
