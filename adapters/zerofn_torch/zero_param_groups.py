"""A param group added to a running ZeRO optimizer: the new plan, and the
local optimizer grown by this rank's share (greedy keeps every owner) or
rebuilt with the old state moved to its new owners (other modes)."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from zerofn.zero.arguments import plan_for
from zerofn.zero.params import StateDict, hyperparameters
from zerofn_torch.zero_local import (
    extend_local_optimizer,
    new_local_optimizer,
    sync_hyperparameters,
)
from zerofn_torch.zero_setup import ZeroSetup, build_setup
from zerofn_torch.zero_state_dicts import load_global_state, regroup

__all__ = ["grown"]


def grown(
    setup: ZeroSetup, groups: list[dict[str, Any]], optim: Optimizer, old_state: StateDict | None
) -> tuple[ZeroSetup, Optimizer]:
    """The setup and local optimizer once ``groups`` got a new last group.

    Args:
        setup: the setup before the group was added.
        groups: the param groups, the new one last (its missing options are
            filled in from the local optimizer's defaults).
        optim: the local optimizer before the group was added.
        old_state: the global state gathered before the group was added, to
            move to the new owners; ``None`` with the greedy partition, which
            keeps every owner (``optim`` is then grown in place).

    Returns:
        The new setup and local optimizer; ``groups`` get the local
        optimizer's options back.
    """
    for name, default in optim.defaults.items():
        groups[-1].setdefault(name, default)
    plan = plan_for(groups, setup.options.world_size, setup.plan.mode)
    setup = build_setup(groups, setup.options, plan, setup.overlap, setup.masters, rebuilt=True)
    if old_state is not None:
        old_state["param_groups"].append({**hyperparameters(groups[-1]), "params": []})
        setup, optim = new_local_optimizer(setup, groups)
        load_global_state(setup, groups, optim, regroup(groups, old_state))
    else:
        setup = extend_local_optimizer(setup, groups, optim)
    sync_hyperparameters(optim.param_groups, groups)
    return setup, optim
