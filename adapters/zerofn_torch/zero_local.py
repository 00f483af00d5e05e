"""The local optimizer over this rank's shard: built from the setup's local
groups, grown by a param group, and its hyperparameters kept in step with
the optimizer's ``param_groups``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
from torch.optim import Optimizer

from zerofn.zero.masters import make_masters
from zerofn.zero.params import hyperparameters
from zerofn_torch.zero_setup import ZeroSetup, flat_params

__all__ = [
    "extend_local_optimizer",
    "new_local_optimizer",
    "sync_hyperparameters",
    "synced_hyperparameters",
]


def sync_hyperparameters(
    source: Sequence[Mapping[str, Any]], target: Sequence[dict[str, Any]]
) -> None:
    """Copy each group's options (all but ``params``) from ``source`` into ``target``.

    The one way options move between ``param_groups`` and the local
    optimizer's groups: a scheduler's edits of ``param_groups`` reach the
    local optimizer, and what the local optimizer sets comes back.

    Raises:
        ValueError: the two differ in their number of groups.
    """
    for s, d in zip(source, target, strict=True):
        d.update(hyperparameters(s))


@contextmanager
def synced_hyperparameters(groups: Sequence[dict[str, Any]], optim: Optimizer) -> Iterator[None]:
    """``groups``' options reach ``optim`` on entry; ``optim``'s come back
    when the block ends without an error (as after ``torch.optim``'s step)."""
    sync_hyperparameters(groups, optim.param_groups)
    yield
    sync_hyperparameters(optim.param_groups, groups)


def new_local_optimizer(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]]
) -> tuple[ZeroSetup, Optimizer]:
    """A fresh local optimizer over this rank's shard of ``groups``.

    Returns:
        ``setup`` with new masters (when it keeps them), and the optimizer
        stepping them (or the owned parameters, or a flat shard's chunks).
    """
    local = setup.shards.local_groups(groups, flat_params(groups))
    masters = setup.masters
    if setup.options.master_dtype is not None:
        local, masters = make_masters(local, setup.options.master_dtype)
    optim = setup.options.optimizer_class(local, **setup.options.defaults)
    return attrs.evolve(setup, masters=masters), optim


def extend_local_optimizer(
    setup: ZeroSetup, groups: Sequence[dict[str, Any]], optim: Optimizer
) -> ZeroSetup:
    """Add this rank's share of ``groups``' last group to ``optim`` (the
    other groups' shards are unchanged).

    Returns:
        ``setup`` with masters for the new group's share added.
    """
    new_local = setup.shards.local_groups(groups, flat_params(groups))[-1]
    masters = setup.masters
    if masters is not None:
        (new_local,), added = make_masters([new_local], masters.dtype)
        masters = masters.extended(added)
    optim.add_param_group(new_local)
    return attrs.evolve(setup, masters=masters)
