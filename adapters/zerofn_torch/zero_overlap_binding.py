"""What the overlap hook (:mod:`zerofn_torch.overlap`) may do to the ZeRO
optimizer it drives: step given gradients, read what compressed sends need,
and keep only this rank's parameters once DDP fixed its buckets; and the
checks that refuse to train, or to save, before a hook made that possible."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.optim import Optimizer

from zerofn.overlap.obey import SendCompressed, StepGradients, step_with_gradients
from zerofn.zero.arguments import plan_for
from zerofn_torch.zero_local import new_local_optimizer, synced_hyperparameters
from zerofn_torch.zero_setup import OverlapStatus, ZeroSetup, build_setup, flat_params
from zerofn_torch.zero_state_dicts import load_global_state, local_state_dict

__all__ = [
    "OverlapBinding",
    "adopt_owners",
    "attach",
    "check_overlap_attached",
    "check_overlap_initialized",
    "send_compressed",
    "step_with_grads",
]


@attrs.frozen
class OverlapBinding:
    """What the overlap hook may do to the optimizer it drives
    (:meth:`zerofn_torch.zero.ZeroRedundancyOptimizer.bind_overlap_hook`).

    Attributes:
        step: answer a :class:`~zerofn.overlap.obey.StepGradients`: step the
            local optimizer with its gradients; the parameters not named sit out.
        adopt_owners: keep only this rank's parameters (global indices per
            rank) and their state from now on.
        compressed: what compressed sends read (``None``: no compression).
    """

    step: Callable[[StepGradients], None]
    adopt_owners: Callable[[Sequence[Sequence[int]]], None]
    compressed: Callable[[], SendCompressed | None]


def attach(setup: ZeroSetup) -> ZeroSetup:
    """``setup`` driven by a hook.

    Raises:
        ValueError: the optimizer was not built with ``overlap_with_ddp=True``.
        RuntimeError: another hook drives it already.
    """
    if not setup.shards.stepped_by_hook:
        raise ValueError(
            "the ZeroRedundancyOptimizer must be built with overlap_with_ddp=True to be "
            "stepped by this hook"
        )
    if setup.overlap != "unattached":
        raise RuntimeError("this ZeroRedundancyOptimizer is already driven by a DDP hook")
    return attrs.evolve(setup, overlap="attached")


def check_overlap_attached(overlap: OverlapStatus) -> None:
    """Refuse to train with ``overlap_with_ddp=True`` and no hook: the hook
    is what steps the optimizer, so without one nothing would change.

    Raises:
        RuntimeError: no overlap hook was made for this optimizer.
    """
    if overlap == "unattached":
        raise RuntimeError(
            "this ZeroRedundancyOptimizer was built with overlap_with_ddp=True, so DDP's "
            "backward steps it through a communication hook, and no such hook was made "
            "for it: nothing would ever be updated. Register one before training, "
            "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero)) "
            "(or hook_with_zero_step_interleaved; both in zerofn_torch.hooks), and drop "
            "zero.step() from the loop; or build the optimizer with overlap_with_ddp=False"
        )


def check_overlap_initialized(setup: ZeroSetup) -> None:
    """Refuse to read or load the state before DDP fixed its buckets.

    Raises:
        RuntimeError: with ``overlap_with_ddp=True``, before the bucket plan
            is fixed (every rank still holds every parameter's state).
    """
    if setup.shards.stepped_by_hook and setup.overlap != "sharded":
        raise RuntimeError(
            "this ZeroRedundancyOptimizer (overlap_with_ddp=True) is not initialized yet: "
            "DDP fixes its buckets during the first iterations"
        )


def send_compressed(setup: ZeroSetup, params: list[torch.Tensor]) -> SendCompressed | None:
    """What the overlap hook's compressed sends read: the quantizer and
    this rank's masters by global parameter index (``None``: no
    compression)."""
    if setup.options.quantizer is None:
        return None
    assert setup.masters is not None
    index_of = {id(p): i for i, p in enumerate(params)}
    masters: list[torch.Tensor | None] = [None] * len(params)
    for low, master in zip(setup.masters.low, setup.masters.master, strict=True):
        masters[index_of[id(low)]] = master
    return SendCompressed(setup.options.quantizer, masters)


def step_with_grads(
    setup: ZeroSetup, groups: list[dict[str, Any]], optim: Optimizer, request: StepGradients
) -> None:
    """Answer the overlapped step's :class:`~zerofn.overlap.obey.StepGradients`
    with the local optimizer (:func:`zerofn.overlap.obey.step_with_gradients`),
    its hyperparameters synced from the param groups first."""
    local = [p for g in optim.param_groups for p in g["params"]]

    def step() -> None:
        with synced_hyperparameters(groups, optim):
            optim.step()

    step_with_gradients(request, flat_params(groups), local, setup.masters, step)


def adopt_owners(
    setup: ZeroSetup, groups: list[dict[str, Any]], optim: Optimizer, owned: Sequence[Sequence[int]]
) -> tuple[ZeroSetup, Optimizer]:
    """Keep only this rank's parameters and their state from now on
    (every rank held all of it until the bucket plan was fixed).

    Args:
        owned: global parameter indices each rank owns.

    Returns:
        The sharded setup and the local optimizer over this rank's share.
    """
    full_state = local_state_dict(setup, optim)  # global indices: it held every parameter
    params = flat_params(groups)
    # DDP's buckets hold what required grad when DDP was built; only those
    # are stepped in this mode, so only those need an owner.
    synced = {i for ranks in owned for i in ranks}
    trainable = tuple(i in synced for i in range(len(params)))
    partition = [[params[i] for i in ranks] for ranks in owned]
    plan = plan_for(groups, setup.options.world_size, partition, trainable)
    sharded = build_setup(groups, setup.options, plan, "sharded", setup.masters, rebuilt=False)
    sharded, local = new_local_optimizer(sharded, groups)
    load_global_state(sharded, groups, local, full_state)
    return sharded, local
