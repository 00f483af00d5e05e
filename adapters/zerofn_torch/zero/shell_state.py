"""What the parts of ``ZeroRedundancyOptimizer`` share: the live state the
shell holds, declared once, and the few readings of it every part needs.

The optimizer is one class assembled from parts, one per concern, each in
the module of that concern: the step and the param groups
(:mod:`~zerofn_torch.zero.optimizer`), the gradients' global checks
(:class:`~zerofn_torch.zero.gradients.GradientChecks`), the state dicts
(:class:`~zerofn_torch.zero.state_dicts.StateDicts`), going on in another
world (:class:`~zerofn_torch.zero.world_changes.WorldChanges`), being driven
by DDP's overlap hook (:class:`~zerofn_torch.zero.overlap_binding.HookDriven`),
the exchange behind the forward
(:class:`~zerofn_torch.zero.forward_gather.ForwardGathering`) and ``Join``
(:class:`~zerofn_torch.zero.joining.Joining`).
Every part reads and replaces the same record of the core's
(:class:`~zerofn.zero.rank.ZeroRank`); none holds state of its own. The
parts that finish or leave the exchange behind the forward (state dicts, a
change of world, the overlap hook) build on
:class:`~zerofn_torch.zero.forward_gather.ForwardGathering`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerofn.zero.elastic.recovery_point import Position, stepped
from zerofn.zero.local_step import LocalStep
from zerofn.zero.outside_writes import owned_parameters, parameter_versions
from zerofn.zero.params import StateDict
from zerofn.zero.rank import ZeroRank, flat_params
from zerofn_torch.runtime.heartbeat import Heartbeat

__all__ = ["ShellState"]


class ShellState:
    """The live state of one ``ZeroRedundancyOptimizer``, as its parts see it.

    Attributes:
        param_groups: the live param groups (``torch.optim``'s).
        process_group: the group the optimizer shards across.
        rank: this rank in it.
        world_size: its ranks.
    """

    param_groups: list[dict[str, Any]]
    process_group: Any
    rank: int
    world_size: int
    _zero: ZeroRank  # the core's record of this rank, replaced whole when it changes
    _position: Position  # where this rank stands in the step sequence
    _untouched: bool  # no step nor load gave it state yet
    _consolidated: StateDict | None  # the last consolidate_state_dict's result
    _versions: dict[int, int]  # the owned parameters' versions after the last step
    _regroups: int
    _generation: int
    _heartbeat: Heartbeat | None
    # The step past its checks (the optimizer's; the overlap hook's whole step runs it).
    _step_and_exchange: Callable[..., Any]

    @property
    def _all_params(self) -> list[torch.Tensor]:
        return flat_params(self.param_groups)

    def _counted(self, answer: Callable[[LocalStep], Any]) -> Callable[[LocalStep], Any]:
        """``answer``, and the position moved on once the local step is over."""

        def counted(request: LocalStep) -> Any:
            self._untouched = False
            out = answer(request)
            if request.last:
                self._position = stepped(self._position)
            return out

        return counted

    def _read_versions(self) -> dict[int, int]:
        return parameter_versions(self._all_params, owned_parameters(self._zero))
