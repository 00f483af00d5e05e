"""The face of an optimizer that wraps another: ``torch.optim.Optimizer``'s
attributes read through to the wrapped one."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WrappedOptimizer"]


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
