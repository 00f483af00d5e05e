"""The demo's training runs: what each one builds, and how it steps and measures.

A run is a :class:`RunSpec`; :data:`RUNS` lists the two the demo trains side
by side, and ``--mixed-precision`` adds :data:`MIXED` (bf16 parameters, fp32
master shards). Adding a run is adding a spec.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from demo_model import lm_loss
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powerSGD_hook

from zerofn.footprint import Footprint, HookKind, plan_footprint

KINDS = ("parameters", "gradients", "optimizer_state", "exchange_buffers")
ADAMW: dict[str, Any] = {"betas": (0.9, 0.95), "weight_decay": 0.01}


@attrs.frozen
class RunSpec:
    """One training run.

    Attributes:
        key: a short name (plot legends, progress lines).
        title: what it is, for the table's header.
        zerofn: DDP + zerofn's ``ZeroRedundancyOptimizer`` (flat partition,
            parameters as bucket views) and zerofn's hook; otherwise DDP with
            its built-in all-reduce and ``torch.optim.AdamW``.
        param_dtype: the model's parameters' dtype.
        zero_kwargs: more arguments for ``ZeroRedundancyOptimizer``.
    """

    key: str
    title: str
    zerofn: bool
    param_dtype: torch.dtype = torch.float32
    zero_kwargs: Mapping[str, Any] = attrs.field(factory=dict)


RUNS = (
    RunSpec("plain", "DDP + torch.optim.AdamW", zerofn=False),
    RunSpec("zerofn", "DDP + zerofn (flat ZeRO + hook)", zerofn=True),
)
MIXED = RunSpec(
    "zerofn-bf16",
    "DDP + zerofn, bf16 + fp32 master shards",
    zerofn=True,
    param_dtype=torch.bfloat16,
    zero_kwargs={"master_dtype": torch.float32},
)
"""The third run of ``--mixed-precision``: bf16 parameters and gradients, fp32
master weights and AdamW state on this rank's shard only."""


@attrs.frozen
class HookConfig:
    """zerofn's DDP communication hook in the zerofn runs."""

    kind: HookKind = "powersgd"
    powersgd_rank: int = 4
    start_iter: int = 10

    def register(self, ddp: DDP) -> PowerSGDState | None:
        """Register the hook on ``ddp``; PowerSGD's state, if it is PowerSGD."""
        if self.kind == "powersgd":
            state = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.start_iter,
            )
            ddp.register_comm_hook(state, powerSGD_hook)
            return state
        hook = allreduce_hook if self.kind == "allreduce" else fp16_compress_hook
        ddp.register_comm_hook(None, hook)
        return None


def live_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes by kind from live tensors, counted as ``ZeroRedundancyOptimizer.memory_bytes``
    counts them (a plain optimizer has no exchange buffers)."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    return {
        "parameters": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(
            nbytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
        "exchange_buffers": 0,
    }


class Trainer:
    """One run on this rank: its DDP model and optimizer, stepped and timed."""

    def __init__(self, spec: RunSpec, model: nn.Module, hook: HookConfig, lr: float) -> None:
        self.spec = spec
        self.ddp = DDP(model.to(spec.param_dtype))
        self.powersgd: PowerSGDState | None = None
        self.optimizer: torch.optim.Optimizer
        if spec.zerofn:
            self.powersgd = hook.register(self.ddp)
            self.optimizer = ZeroRedundancyOptimizer(
                self.ddp.parameters(),
                torch.optim.AdamW,
                parameters_as_bucket_view=True,
                partition="flat",
                lr=lr,
                **ADAMW,
                **spec.zero_kwargs,
            )
        else:
            self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=lr, **ADAMW)

    @property
    def module(self) -> nn.Module:
        """The model itself (for evaluation and sampling)."""
        module: nn.Module = self.ddp.module
        return module

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[float, float, float]:
        """One training step; (loss, seconds of forward+backward, seconds of the
        optimizer step). Backward includes the hook's communication."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = lm_loss(self.ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        t1 = time.perf_counter()
        self.optimizer.step()
        return loss.item(), t1 - t0, time.perf_counter() - t1

    def compute_seconds(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Seconds of forward+backward without communication (DDP's ``no_sync``);
        the gradients it leaves are dropped."""
        with self.ddp.no_sync():
            t0 = time.perf_counter()
            lm_loss(self.ddp(x), y).backward()  # type: ignore[no-untyped-call]
            seconds = time.perf_counter() - t0
        self.optimizer.zero_grad()
        return seconds

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes by kind, from the live tensors."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self.optimizer.memory_bytes()
        return live_bytes(list(self.ddp.parameters()), self.optimizer)


def plan(spec: RunSpec, model: nn.Module, world_size: int, hook: HookConfig) -> Footprint | None:
    """The planner's prediction for a zerofn run (``None`` for a plain one)."""
    if not spec.zerofn:
        return None
    return plan_footprint(
        model,
        world_size,
        "flat",
        param_dtype=spec.param_dtype,
        master_dtype=spec.zero_kwargs.get("master_dtype"),
        optimizer="adamw",
        hook=hook.kind,
        powersgd_rank=hook.powersgd_rank,
        bucket_view=True,
    )


def lr_schedule(peak: float, steps: int, warmup: int = 10) -> Callable[[int], float]:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it."""
    import math

    def lr(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return lr
