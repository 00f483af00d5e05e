"""What may serve as the local optimizer: an optimizer class at all, and which
of them may step a flat shard that cuts through tensors."""

from __future__ import annotations

import torch
import torch.optim.optimizer as optimizer_module

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "check_elementwise",
    "check_optimizer_class",
    "steps_in_parts",
]

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


def check_optimizer_class(optimizer_class: object) -> None:
    """Refuse an ``optimizer_class`` that cannot build an optimizer.

    A ``torch.optim.Optimizer`` subclass passes, and so does any other
    callable that is not a class (a ``functools.partial`` or a factory
    function): what it builds is checked once it is called.

    Args:
        optimizer_class: what the caller passed as the local optimizer.

    Raises:
        TypeError: a string (naming the class it probably meant), another
            object that is not callable, or a class that is not a
            ``torch.optim.Optimizer`` subclass (a module, say).
    """
    if isinstance(optimizer_class, str):
        meant = _optimizer_named(optimizer_class)
        hint = f"torch.optim.{meant.__name__}" if meant is not None else "torch.optim.AdamW"
        raise TypeError(
            f"optimizer_class={optimizer_class!r} is a string; pass the optimizer class "
            f"itself, e.g. optimizer_class={hint}"
        )
    if isinstance(optimizer_class, type):
        if not issubclass(optimizer_class, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_class={optimizer_class.__module__}.{optimizer_class.__qualname__} "
                "is not a torch.optim.Optimizer subclass; pass an optimizer class such as "
                "torch.optim.AdamW (the model's parameters go in params)"
            )
        return
    if not callable(optimizer_class):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW, got a {type(optimizer_class).__name__} ({optimizer_class!r})"
        )


def _optimizer_named(name: str) -> type[torch.optim.Optimizer] | None:
    wanted = name.lower().replace("_", "")
    named = (getattr(torch.optim, a) for a in dir(torch.optim) if a.lower() == wanted)
    return next(
        (c for c in named if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)), None
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


def steps_in_parts(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim`` may step its tensors a few at a time (the others'
    gradients hidden) and end with the numbers one whole step gives: it is
    exactly one of :data:`ELEMENTWISE_OPTIMIZERS` (a subclass may change
    ``step``), with no step hooks of its own or global ones (they would run
    once per part)."""
    if type(optim) not in ELEMENTWISE_OPTIMIZERS:
        return False
    hooks = (
        getattr(optim, "_optimizer_step_pre_hooks", {}),
        getattr(optim, "_optimizer_step_post_hooks", {}),
        getattr(optimizer_module, "_global_optimizer_pre_hooks", {}),
        getattr(optimizer_module, "_global_optimizer_post_hooks", {}),
    )
    return not any(hooks)
