"""The face of an optimizer that wraps another: ``torch.optim.Optimizer``'s
attributes read through to the wrapped one."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "WrappedOptimizer",
    "carries_copies",
    "innermost",
    "parameters_written",
    "zero_rank_of",
]


class WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer over another's parameters and state (``optim``): its param
    groups are the wrapped optimizer's, and so are :attr:`state` and
    :attr:`defaults`. Subclasses set ``optim`` and ``param_groups`` and do not
    call ``Optimizer.__init__`` (the wrapped optimizer owns the parameters)."""

    optim: torch.optim.Optimizer
    join_refusal: str = (
        "this optimizer communicates at its own step, which a rank that ran out of inputs "
        "would not reach; give every rank the same number of steps instead of Join"
    )
    """Why ``Join`` refuses the wrapper (its own collectives cannot be shadowed)."""

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's default hyperparameters."""
        return self.optim.defaults

    def wrapper_state_dict(self) -> dict[str, Any]:
        """This wrapper's own state, without the wrapped optimizer's (what a
        sharded checkpoint keeps beside a ZeRO optimizer's shards)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state of its own to save")

    def load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`wrapper_state_dict`'s state."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state of its own to load")

    # Join asks a joinable for its group first: refusing there refuses the
    # whole context at its construction, before anything runs.
    @property
    def join_process_group(self) -> Any:
        """Refused: see :attr:`join_refusal`.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.join_refusal)

    @property
    def join_device(self) -> torch.device:
        """Refused: see :attr:`join_refusal`.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.join_refusal)

    def join_hook(self, **kwargs: Any) -> Any:
        """Refused: see :attr:`join_refusal`.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.join_refusal)


def innermost(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer at the bottom of a chain of wrappers (``optim`` itself
    when it wraps nothing)."""
    while isinstance(optim, WrappedOptimizer):
        optim = optim.optim
    return optim


def zero_rank_of(optim: torch.optim.Optimizer) -> Any:
    """The ZeRO rank record of the ZeRO optimizer at the bottom of ``optim``'s
    wrappers (``ZeroRedundancyOptimizer.zero_rank``), or ``None``: another
    optimizer there."""
    return getattr(innermost(optim), "zero_rank", None)


def carries_copies(optim: torch.optim.Optimizer) -> bool:
    """Whether the ZeRO optimizer at the bottom of ``optim``'s wrappers keeps
    copies of other ranks' shards (``redundancy=2``)."""
    zero_rank = zero_rank_of(optim)
    return zero_rank is not None and zero_rank.carried is not None


def parameters_written(optim: torch.optim.Optimizer) -> None:
    """Tell ``optim`` (or the optimizer it wraps) that its parameters were
    set from outside its step: a ZeRO optimizer re-derives its masters and
    copies from them (``ZeroRedundancyOptimizer.refresh_from_parameters``);
    any other optimizer keeps nothing derived from the values."""
    refresh = getattr(innermost(optim), "refresh_from_parameters", None)
    if refresh is not None:
        refresh()
