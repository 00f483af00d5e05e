"""The face of an optimizer that wraps another: ``torch.optim.Optimizer``'s
attributes read through to the wrapped one."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WrappedOptimizer", "innermost", "parameters_written"]


class WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer over another's parameters and state (``optim``): its param
    groups are the wrapped optimizer's, and so are :attr:`state` and
    :attr:`defaults`. Subclasses set ``optim`` and ``param_groups`` and do not
    call ``Optimizer.__init__`` (the wrapped optimizer owns the parameters)."""

    optim: torch.optim.Optimizer

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's default hyperparameters."""
        return self.optim.defaults


def innermost(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer at the bottom of a chain of wrappers (``optim`` itself
    when it wraps nothing)."""
    while isinstance(optim, WrappedOptimizer):
        optim = optim.optim
    return optim


def parameters_written(optim: torch.optim.Optimizer) -> None:
    """Tell ``optim`` (or the optimizer it wraps) that its parameters were
    set from outside its step: a ZeRO optimizer re-derives its masters and
    copies from them (``ZeroRedundancyOptimizer.refresh_from_parameters``);
    any other optimizer keeps nothing derived from the values."""
    refresh = getattr(innermost(optim), "refresh_from_parameters", None)
    if refresh is not None:
        refresh()
