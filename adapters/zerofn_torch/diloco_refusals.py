"""What :class:`~zerofn_torch.diloco.DiLoCoOptimizer` refuses to wrap,
checked before it changes anything: parameters whose DDP model would
all-reduce across DiLoCo workers at every inner step, an inner ZeRO
optimizer with ``redundancy=2`` (whose survival DiLoCo cannot keep), and a
``Join`` context."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.nn.parallel import DistributedDataParallel

from zerofn_torch.hooks.default import noop_hook
from zerofn_torch.runtime.wrapped_optimizer import carries_copies, zero_rank_of

__all__ = ["NO_JOIN", "refuse_all_reducing_ddp", "refuse_carried_inner", "stepped_in_backward"]

_NOOP_HOOKS = (noop_hook, debugging_hooks.noop_hook)


def _is_noop(ddp: DistributedDataParallel) -> bool:
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks is None:  # a DDP that does not say which hook it runs: nothing to check
        return True
    return len(hooks) == 1 and hooks[0][0] in _NOOP_HOOKS


def _subclasses(kind: type) -> set[type]:
    found: set[type] = {kind}
    subs: list[type] = type.__subclasses__(kind)
    for sub in subs:
        found |= _subclasses(sub)
    return found


def refuse_all_reducing_ddp(params: list[torch.Tensor], group: Any) -> None:
    """Refuse parameters whose DDP model would all-reduce across DiLoCo workers."""
    mine = {id(p) for p in params}
    outer = set(dist.get_process_group_ranks(group))
    kinds = _subclasses(DistributedDataParallel)
    # Parameters do not point to the DDP model that wraps them; the models do.
    for obj in gc.get_objects():
        if type(obj) not in kinds:
            continue
        if not any(id(p) in mine for p in obj.module.parameters()):
            continue
        shared = outer & set(dist.get_process_group_ranks(obj.process_group))
        if len(shared) > 1 and not _is_noop(obj):
            raise ValueError(
                f"the inner optimizer's parameters belong to a DistributedDataParallel model "
                f"that averages gradients over DiLoCo workers (ranks {sorted(shared)}), so every "
                "inner step would all-reduce. Register a no-op hook "
                "(model.register_comm_hook(None, zerofn_torch.hooks.noop_hook)), do not wrap "
                "the model in DDP, or run DDP over a group of ranks inside each worker and pass "
                "the group across workers as process_group"
            )


NO_JOIN = (
    "DiLoCoOptimizer does not run under Join: a rank that runs out of inputs early would "
    "never reach the syncs the others wait in. Give every rank the same number of inner "
    "steps (drop or repeat batches), or train without DiLoCo under Join"
)


def refuse_carried_inner(optim: torch.optim.Optimizer) -> None:
    """Refuse an inner ZeRO optimizer with ``redundancy=2``.

    Raises:
        ValueError: its carried copies would promise a survival DiLoCo cannot keep.
    """
    if carries_copies(optim):
        raise ValueError(
            "DiLoCoOptimizer over a ZeroRedundancyOptimizer with redundancy=2: "
            "zerofn_torch.elastic.recover regroups the ZeRO optimizer's group but not DiLoCo's "
            "syncs, so a lost rank would still end the job. Build the ZeroRedundancyOptimizer "
            "with redundancy=1 and DiLoCoOptimizer(..., redundancy=2), whose workers go on "
            "without a lost one (each rank a worker, its inner optimizer its own)"
        )


def stepped_in_backward(optim: torch.optim.Optimizer) -> bool:
    """Whether DDP's backward steps ``optim`` (a ZeRO optimizer built with
    ``overlap_with_ddp=True``), so that its ``step`` does nothing."""
    return bool(getattr(zero_rank_of(optim), "stepped_by_hook", False))
