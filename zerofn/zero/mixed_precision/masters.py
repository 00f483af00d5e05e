"""Master weights: wider copies of the tensors a rank steps.

A :class:`Masters` pairs each tensor the local optimizer would step (an owned
parameter, or a view of this rank's part of a flat buffer) with a master
copy in ``master_dtype``. The local optimizer steps the masters; these
functions move gradients up into them and results back down. Gradients
live on the masters from :meth:`Masters.write_grads` until the step is over, so that
clipping and unscaling in between work in the wide dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.zero.mixed_precision.precision import MASTER_KEY
from zerofn.zero.params import StateDict

__all__ = ["Masters", "make_masters", "with_masters", "without_masters"]


@attrs.frozen(eq=False)
class Masters:
    """Low-precision tensors and their master copies, in the local
    optimizer's parameter order.

    Attributes:
        low: what the exchange sends (parameters, or views of a buffer).
        master: their copies in ``dtype``, which the local optimizer steps.
        dtype: the masters' dtype.
    """

    low: tuple[torch.Tensor, ...]
    master: tuple[torch.Tensor, ...]
    dtype: torch.dtype

    def write_grads(self, grads: Sequence[torch.Tensor | None], unscale: float = 1.0) -> None:
        """Give every master without a gradient its low tensor's gradient
        (``grads``, one per master), upcast and multiplied by ``unscale``. A
        master keeps a gradient it already has: loading twice in a step is
        loading once."""
        for master, grad in zip(self.master, grads, strict=True):
            if master.grad is not None or grad is None:
                continue
            wide = grad.to(self.dtype)
            master.grad = wide.mul_(unscale) if unscale != 1.0 else wide

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Give the masters ``grads`` (one per master, ``None``: sit out), upcast."""
        for master, grad in zip(self.master, grads, strict=True):
            master.grad = None if grad is None else grad.to(self.dtype)

    def grads(self) -> list[torch.Tensor]:
        """The masters' gradients that are loaded."""
        return [m.grad for m in self.master if m.grad is not None]

    def write_back(self, only_stepped: bool = False) -> None:
        """Cast the masters into the low tensors and drop their gradients.

        Args:
            only_stepped: write back only masters that had a gradient.
        """
        with torch.no_grad():
            for low, master in zip(self.low, self.master, strict=True):
                if not only_stepped or master.grad is not None:
                    low.copy_(master)
                master.grad = None

    def drop_grads(self) -> None:
        """Forget loaded gradients (a skipped step)."""
        for master in self.master:
            master.grad = None

    def reseed(
        self, indices: Sequence[int] | None = None, *, keep_consistent: bool = False
    ) -> None:
        """Copy the low tensors up into the masters (all, or ``indices``).

        Args:
            indices: the masters to reseed (``None``: all).
            keep_consistent: keep each master element that casts to its low
                element exactly (it holds that value, more precisely).
        """
        chosen = range(len(self.master)) if indices is None else indices
        with torch.no_grad():
            for i in chosen:
                master, low = self.master[i], self.low[i]
                if keep_consistent:
                    master.copy_(torch.where(master.to(low.dtype) == low, master, low))
                else:
                    master.copy_(low)

    def load(self, saved: Mapping[int, torch.Tensor]) -> None:
        """Set the masters from ``saved`` (index -> value); a master not
        there is copied up from its low tensor."""
        self.reseed([i for i in range(len(self.master)) if i not in saved])
        with torch.no_grad():
            for index, value in saved.items():
                self.master[index].copy_(value)

    def extended(self, other: Masters) -> Masters:
        """These masters followed by ``other``'s (a param group was added)."""
        if other.dtype != self.dtype:
            raise ValueError(f"masters of {other.dtype} cannot join masters of {self.dtype}")
        return Masters(self.low + other.low, self.master + other.master, self.dtype)

    def nbytes(self) -> int:
        """The masters' bytes."""
        return sum(m.numel() * m.element_size() for m in self.master)


def make_masters(
    groups: Sequence[Mapping[str, Any]], dtype: torch.dtype
) -> tuple[list[dict[str, Any]], Masters]:
    """Master copies of every tensor in ``groups`` (param-group dicts).

    Returns:
        The same groups over the masters, and the :class:`Masters` pairing.
    """
    low: list[torch.Tensor] = []
    master: list[torch.Tensor] = []
    master_groups = []
    for group in groups:
        copies = [t.detach().to(dtype, copy=True) for t in group["params"]]
        low.extend(group["params"])
        master.extend(copies)
        master_groups.append({**group, "params": copies})
    return master_groups, Masters(tuple(low), tuple(master), dtype)


def with_masters(local: StateDict, masters: Masters) -> StateDict:
    """``local`` (the local optimizer's state dict) with every master under
    :data:`MASTER_KEY` of its local index; ``local`` is not modified."""
    state = {i: dict(entry) for i, entry in local["state"].items()}
    for index, master in enumerate(masters.master):
        state.setdefault(index, {})[MASTER_KEY] = master.detach()
    return {"state": state, "param_groups": local["param_groups"]}


def without_masters(local: StateDict) -> tuple[StateDict, dict[int, torch.Tensor]]:
    """``local`` with the masters taken out, and the masters by local index;
    entries left empty are dropped. ``local`` is not modified."""
    state: dict[int, dict[str, Any]] = {}
    found: dict[int, torch.Tensor] = {}
    for index, entry in local["state"].items():
        rest = {k: v for k, v in entry.items() if k != MASTER_KEY}
        if MASTER_KEY in entry:
            found[index] = entry[MASTER_KEY]
        if rest:
            state[index] = rest
    return {"state": state, "param_groups": local["param_groups"]}, found
