"""The ``ZeroRedundancyOptimizer`` part that ``Join`` (uneven inputs) drives:
a rank that ran out of inputs shadows the others' step, so its collectives
match theirs (see :class:`~zerofn_torch.zero.shell_state.ShellState`)."""

from __future__ import annotations

from typing import Any

import torch

from zerofn_torch.join import JoinHook
from zerofn_torch.zero.shell_state import ShellState

__all__ = ["Joining"]


class _ZeroJoinHook(JoinHook):
    """Shadows a joined rank's share of the step's collectives."""

    def __init__(self, zero: Joining) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        # The joined rank answered the others' announcement with Join's count:
        # its shadow step announces nothing (either Join, PyTorch's included).
        if not self.zero._zero.stepped_by_hook:
            self.zero._step_and_exchange(None)


class Joining(ShellState):
    """What ``Join`` asks of the optimizer: its hook, device and group."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A hook that runs :meth:`step` on a rank that ran out of inputs, so
        its collectives match the ranks still training.

        Raises:
            ValueError: with ``redundancy=2``: a rank that ran out of inputs
                steps its shard with the gradients it last had, which its
                carrier does not hold, so the carried copy would leave its
                owner's state (raised as ``Join`` is built, before any step).
        """
        if self._zero.carried is not None:
            raise ValueError(
                "Join (uneven inputs) cannot run a ZeroRedundancyOptimizer with redundancy=2: "
                "a rank that ran out of inputs steps its shard with the gradients it last had, "
                "which its carrier does not hold, so the carried copy would leave its owner's "
                "state; give every rank the same number of batches, or use redundancy=1"
            )
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the parameters, where Join's collectives run."""
        return self._zero.options.device

    @property
    def join_process_group(self) -> Any:
        """The process group the optimizer shards across."""
        return self.process_group
