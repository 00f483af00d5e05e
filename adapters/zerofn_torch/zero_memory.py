"""A ZeRO optimizer's bytes on this rank by kind, read from the live
tensors: what :func:`zerofn.footprint.plan_footprint` predicts."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from zerofn_torch.zero_setup import ZeroSetup

__all__ = ["memory_bytes"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_bytes(setup: ZeroSetup, params: list[torch.Tensor], optim: Optimizer) -> dict[str, int]:
    """This rank's bytes by kind (see
    :meth:`zerofn_torch.zero.ZeroRedundancyOptimizer.memory_bytes`).

    Returns:
        ``parameters``, ``gradients``, ``master_weights``,
        ``optimizer_state`` and ``exchange_buffers`` (buffer bytes no
        parameter lives in, plus the compressed exchange's payloads). With
        ``overlap_with_ddp`` no exchange buffer is held between iterations,
        exact or compressed (the hook's messages live during backward only),
        so ``exchange_buffers`` is 0.
    """
    aliased = 0
    for buffer in setup.shards.buffers:
        lo = buffer.data_ptr()
        hi = lo + buffer.numel() * buffer.element_size()
        aliased += sum(_nbytes(p) for p in params if lo <= p.data_ptr() < hi)
    return {
        "parameters": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "master_weights": setup.masters.nbytes() if setup.masters is not None else 0,
        "optimizer_state": sum(
            _nbytes(v)
            for state in optim.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
        "exchange_buffers": sum(_nbytes(b) for b in setup.shards.buffers)
        - aliased
        + (setup.exchange.nbytes() if setup.exchange is not None else 0),
    }
