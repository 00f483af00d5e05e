"""One run on one rank: its DDP model and optimizer as its :class:`RunSpec`
says, stepped, timed, counted and measured.

What is timed: forward+backward (DDP's communication in backward included),
the same under ``no_sync`` (compute alone), ``optimizer.step()`` and the part
of it spent inside the AdamW that steps the tensors (through the optimizer's
step hooks), so the rest is the exchange after it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import attrs
import torch
from demo_model import lm_loss
from demo_runs import ADAMW, RunSpec
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import PowerSGDState, noop_hook, powerSGD_hook
from zerofn_torch.runtime.traffic import Traffic, collective_traffic


@attrs.frozen
class StepRecord:
    """One training step, measured.

    Attributes:
        loss: this rank's training loss.
        forward_backward: seconds of forward and backward (with DDP's
            communication in backward).
        optimizer_step: seconds of ``optimizer.step()``.
        local_step: seconds of that inside the AdamW that steps the tensors;
            the rest of ``optimizer_step`` is the exchange after it.
        backward: collectives issued in ``zero_grad``, forward and backward
            (DDP's built-in all-reduce included as its payload), if counted.
        after: collectives issued in ``optimizer.step()``, if counted.
    """

    loss: float
    forward_backward: float
    optimizer_step: float
    local_step: float
    backward: Traffic | None
    after: Traffic | None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every distinct tensor inside ``obj`` (attrs records, mappings,
    sequences), each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if attrs.has(type(obj)):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in attrs.fields(type(obj)))
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


class Trainer:
    """One run on this rank: its DDP model and optimizer, stepped, timed and counted."""

    def __init__(self, spec: RunSpec, model: nn.Module, lr: float) -> None:
        self.spec = spec
        self.ddp = DDP(model.to(spec.param_dtype))
        self.powersgd: PowerSGDState | None = None
        if spec.gradients == "powersgd":
            self.powersgd = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=spec.powersgd_rank,
                start_powerSGD_iter=spec.powersgd_start,
            )
            self.ddp.register_comm_hook(self.powersgd, powerSGD_hook)
        elif spec.gradients == "none":
            self.ddp.register_comm_hook(None, noop_hook)
        self.optimizer, self.local = self._build_optimizer(lr)
        self._local_seconds = self._local_started_at = 0.0
        self.local.register_step_pre_hook(self._local_started)
        self.local.register_step_post_hook(self._local_ended)

    def _build_optimizer(self, lr: float) -> tuple[Any, torch.optim.Optimizer]:
        """The optimizer ``step()`` is called on, and the AdamW inside it that
        steps the tensors (the same object for plain AdamW)."""
        spec, params = self.spec, list(self.ddp.parameters())
        if spec.optimizer == "zero":
            zero = ZeroRedundancyOptimizer(
                params,
                torch.optim.AdamW,
                parameters_as_bucket_view=True,
                partition="flat",
                master_dtype=spec.master_dtype,
                exchange_compression=spec.exchange_compression,
                lr=lr,
                **ADAMW,
            )
            return zero, zero.optim
        inner = torch.optim.AdamW(params, lr=lr, **ADAMW)
        if spec.optimizer == "diloco":
            # Imported here: the other runs do not need it.
            from zerofn_torch.averaging import DiLoCoOptimizer

            outer = None
            if spec.outer is not None:
                outer_lr, momentum = spec.outer

                def outer(tensors: Any) -> torch.optim.Optimizer:
                    return torch.optim.SGD(
                        tensors, lr=outer_lr, momentum=momentum, nesterov=momentum > 0
                    )

            diloco = DiLoCoOptimizer(
                inner,
                outer_optimizer=outer,
                sync_every=spec.sync_every,
                fragments=spec.fragments,
                delay=spec.delay,
                mixing=spec.mixing,
                compression=spec.sync_compression,
            )
            return diloco, inner
        return inner, inner

    def _local_started(self, *_: Any) -> None:
        self._local_started_at = time.perf_counter()

    def _local_ended(self, *_: Any) -> None:
        self._local_seconds += time.perf_counter() - self._local_started_at

    @property
    def module(self) -> nn.Module:
        """The model itself (for evaluation and sampling)."""
        module: nn.Module = self.ddp.module
        return module

    def _grad_bytes(self) -> int:
        return sum(_nbytes(p) for p in self.ddp.parameters() if p.requires_grad)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, count: bool) -> StepRecord:
        """One training step at learning rate ``lr``; with ``count``, its
        collectives are counted too."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with _counting(count) as backward:
            self.optimizer.zero_grad()
            t0 = time.perf_counter()
            loss = lm_loss(self.ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            t1 = time.perf_counter()
        if count and self.spec.gradients == "ddp":
            # DDP's built-in all-reduce is issued from C++, out of
            # collective_traffic's sight: it carries every gradient once.
            backward.payload_bytes["all_reduce"] = (
                backward.payload_bytes.get("all_reduce", 0) + self._grad_bytes()
            )
        self._local_seconds = 0.0
        with _counting(count) as after:
            t2 = time.perf_counter()
            self.optimizer.step()
            t3 = time.perf_counter()
        return StepRecord(
            loss=loss.item(),
            forward_backward=t1 - t0,
            optimizer_step=t3 - t2,
            local_step=self._local_seconds,
            backward=backward if count else None,
            after=after if count else None,
        )

    def compute_seconds(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Seconds of forward+backward without communication (DDP's ``no_sync``);
        the gradients it leaves are dropped."""
        with self.ddp.no_sync():
            t0 = time.perf_counter()
            lm_loss(self.ddp(x), y).backward()  # type: ignore[no-untyped-call]
            seconds = time.perf_counter() - t0
        self.optimizer.zero_grad()
        return seconds

    def finish(self) -> None:
        """Complete what the optimizer still has in flight (a delayed DiLoCo
        sync), so that no collective outlives training."""
        drain = getattr(self.optimizer, "drain", None)
        if drain is not None:
            drain()

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes by kind, from the live tensors (the kinds of
        ``ZeroRedundancyOptimizer.memory_bytes()``, plus the hook's and
        DiLoCo's own state)."""
        params = list(self.ddp.parameters())
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            out = self.optimizer.memory_bytes()
        else:
            out = {
                "parameters": sum(_nbytes(p) for p in params),
                "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer_state": tensor_bytes(dict(self.local.state)),
            }
        if self.powersgd is not None:
            out["hook_state"] = tensor_bytes(self.powersgd.hook_state)
        if self.spec.optimizer == "diloco":
            out["diloco_state"] = int(self.optimizer.memory_bytes())
        return out

    def fingerprint(self) -> int:
        """A CRC-32 of the parameters' bytes (equal on two ranks when, barring a
        collision, their parameters are bitwise equal)."""
        crc = 0
        for p in self.ddp.parameters():
            crc = zlib.crc32(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        return crc


@contextmanager
def _counting(count: bool) -> Iterator[Traffic]:
    with collective_traffic() if count else nullcontext(Traffic()) as traffic:
        yield traffic
