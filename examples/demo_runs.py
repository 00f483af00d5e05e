"""The demo's training runs: what each one is, and what it is compared with.

A run is a :class:`RunSpec`: which optimizer steps the model, what crosses the
ranks during backward, and which other run its loss is judged against.
:data:`CATALOGUE` holds every run the demo knows, :data:`DEFAULT_RUNS` the
ones it trains unless told otherwise. Adding a run is adding a spec (and, for
a new kind of optimizer, a branch in ``demo_trainer.Trainer``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import attrs
import torch

from zerofn.diloco.config import Compression as DiLoCoCompression
from zerofn.diloco.config import DiLoCoConfig
from zerofn.topk import TopK

OptimizerKind = Literal["adamw", "zero", "diloco"]
GradientExchange = Literal["ddp", "powersgd", "none"]
Compression = Literal["int8", "int4"]
ADAMW: dict[str, Any] = {"betas": (0.9, 0.95), "weight_decay": 0.01}


@attrs.frozen
class Target:
    """How close a run's held-out loss must stay to its baseline's.

    Attributes:
        relative: the largest ``|loss - baseline| / baseline`` that meets it.
        why_missed: one line on the mechanism, printed when it is missed.
    """

    relative: float
    why_missed: str


@attrs.frozen
class RunSpec:
    """One training run.

    Attributes:
        key: a short name (legends, progress lines, ``--runs``).
        title: what it is, one line.
        optimizer: ``"adamw"`` (``torch.optim.AdamW``), ``"zero"``
            (``zerofn_torch.ZeroRedundancyOptimizer`` running AdamW on flat
            shards) or ``"diloco"`` (``DiLoCoOptimizer`` around AdamW).
        gradients: what DDP does with the gradients in backward: ``"ddp"``
            (its built-in all-reduce), ``"powersgd"`` (zerofn's PowerSGD hook)
            or ``"none"`` (the no-op hook: nothing crosses the ranks; one of
            the ways ``docs/diloco.md`` gives to run DiLoCo under DDP).
        exchange_compression: the ZeRO exchange's ``exchange_compression``.
        sync_every: DiLoCo's inner steps between syncs of a fragment (H).
        fragments: DiLoCo's fragments, synced in turn (Streaming DiLoCo's P).
        delay: inner steps a DiLoCo sync overlaps before its result is applied.
        mixing: the weight of the local values when a DiLoCo result is applied.
        sync_compression: DiLoCo's ``compression`` (``None``: fp32 syncs).
        outer: DiLoCo's outer SGD as ``(lr, momentum)``, Nesterov when the
            momentum is positive; ``None``: DiLoCo's default (0.7, 0.9).
        baseline: the run this one's loss is compared with (``None``: none).
        exact: its losses must equal the baseline's bitwise.
        target: the held-out gap it must stay within, if any.
        param_dtype: the model's parameters' dtype.
        master_dtype: ZeRO's ``master_dtype``.
        powersgd_rank: PowerSGD's matrix rank.
        powersgd_start: PowerSGD's first compressing step.

    Raises:
        ValueError: options that do not fit together (said which).
    """

    key: str
    title: str
    optimizer: OptimizerKind = "adamw"
    gradients: GradientExchange = "ddp"
    exchange_compression: Compression | None = None
    sync_every: int = 0
    fragments: int = 1
    delay: int = 0
    mixing: float = 0.0
    sync_compression: DiLoCoCompression = None
    outer: tuple[float, float] | None = None
    baseline: str | None = None
    exact: bool = False
    target: Target | None = None
    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    powersgd_rank: int = 4
    powersgd_start: int = 10

    def __attrs_post_init__(self) -> None:
        zero_only = self.exchange_compression is not None or self.master_dtype is not None
        if zero_only and self.optimizer != "zero":
            raise ValueError(f"{self.key}: exchange_compression and master_dtype need 'zero'")
        if (self.optimizer == "diloco") != (self.sync_every > 0):
            raise ValueError(f"{self.key}: give sync_every > 0 exactly when optimizer='diloco'")
        if self.optimizer == "diloco" and self.gradients != "none":
            raise ValueError(
                f"{self.key}: DiLoCo's inner steps must not average gradients: gradients='none'"
            )
        if self.optimizer == "diloco":
            try:  # the optimizer's own rules, checked before any rank spawns
                DiLoCoConfig(
                    self.sync_every,
                    self.fragments,
                    self.delay,
                    self.mixing,
                    self.sync_compression,
                )
            except (TypeError, ValueError) as error:
                raise ValueError(f"{self.key}: {error}") from None
        elif (self.fragments, self.delay, self.mixing, self.sync_compression) != (1, 0, 0.0, None):
            raise ValueError(
                f"{self.key}: fragments, delay, mixing and sync_compression need 'diloco'"
            )
        elif self.outer is not None:
            raise ValueError(f"{self.key}: outer needs 'diloco'")
        if (self.exact or self.target is not None) and self.baseline is None:
            raise ValueError(f"{self.key}: exact or target needs a baseline run")
        if self.powersgd_rank < 1 or self.powersgd_start < 2:
            raise ValueError(f"{self.key}: PowerSGD needs rank >= 1 and a start step >= 2")


DDP_ADAMW = RunSpec("ddp", "DDP + torch.optim.AdamW")
ZERO = RunSpec("zero", "DDP + zerofn ZeRO (AdamW, flat shards)", "zero", baseline="ddp", exact=True)
POWERSGD = RunSpec(
    "zero+powersgd", "ZeRO + PowerSGD hook (rank 4)", "zero", "powersgd", baseline="zero"
)
INT8 = RunSpec(
    "zero+int8",
    'ZeRO + exchange_compression="int8"',
    "zero",
    exchange_compression="int8",
    baseline="zero",
    target=Target(
        0.005, "the replica trails the exact masters by up to lr/254 per element every step"
    ),
)
INT4 = RunSpec(
    "zero+int4",
    'ZeRO + exchange_compression="int4"',
    "zero",
    exchange_compression="int4",
    baseline="zero",
    target=Target(
        0.02, "int4's codes resolve a step's update only to 1/14: the forward pass sees that"
    ),
)
BF16 = RunSpec(
    "zero+bf16",
    "ZeRO, bf16 parameters + fp32 master shards",
    "zero",
    baseline="zero",
    param_dtype=torch.bfloat16,
    master_dtype=torch.float32,
)
DILOCO = RunSpec(
    "diloco",
    "DiLoCo (inner AdamW, sync every 10 steps)",
    "diloco",
    "none",
    sync_every=10,
    baseline="ddp",
)
DILOCO_H50 = RunSpec(
    "diloco-h50",
    "DiLoCo (inner AdamW, sync every 50 steps)",
    "diloco",
    "none",
    sync_every=50,
    baseline="ddp",
)
DILOCO_STREAMING = RunSpec(
    "diloco-streaming",
    "Streaming DiLoCo (inner AdamW, H=20, 4 fragments, delay 1, mixing 0.5)",
    "diloco",
    "none",
    sync_every=20,
    fragments=4,
    delay=1,
    mixing=0.5,
    baseline="ddp",
)


def _diloco_codec(
    name: str,
    compression: DiLoCoCompression,
    target: Target | None = None,
    outer: tuple[float, float] | None = None,
) -> RunSpec:
    """DiLoCo every 10 steps with its syncs compressed, judged against ``diloco``."""
    extra = "" if outer is None else f", outer SGD lr {outer[0]:g} momentum {outer[1]:g}"
    return RunSpec(
        f"diloco+{name}",
        f"DiLoCo (sync every 10 steps), compression={compression!r}{extra}",
        "diloco",
        "none",
        sync_every=10,
        sync_compression=compression,
        outer=outer,
        baseline="diloco",
        target=target,
    )


SPARSE_OUTER = (1.0, 0.0)
"""Top-k's outer optimizer: SGD at lr 1 without momentum (as SparseLoCo's).
With Nesterov momentum the owners' exact anchor moves on every element at
every sync while its change reaches the workers 2% of a chunk at a time: the
gap grows, and arrives in jumps."""
DILOCO_INT8 = _diloco_codec("int8", "int8")
DILOCO_INT4 = _diloco_codec("int4", "int4")
DILOCO_INT2 = _diloco_codec(
    "int2",
    "int2",
    Target(
        0.01,
        "2-bit codes resolve each block's pseudo-gradient to a third of its largest "
        "element; what they drop waits a whole sync in the residual",
    ),
)
DILOCO_TOPK = _diloco_codec(
    "topk",
    TopK(density=0.02, bits=2),
    Target(
        0.02,
        "2% of each chunk travels per sync: the rest of every worker's progress waits "
        "in its residual, and the workers restart from an anchor that moved only there",
    ),
    outer=SPARSE_OUTER,
)
DILOCO_TOPK_NESTEROV = _diloco_codec("topk-nesterov", TopK(density=0.02, bits=2))
DILOCO_SGD1 = RunSpec(
    "diloco-sgd1",
    "DiLoCo (sync every 10 steps), outer SGD lr 1 momentum 0",
    "diloco",
    "none",
    sync_every=10,
    outer=SPARSE_OUTER,
    baseline="diloco",
)
CATALOGUE = (
    DDP_ADAMW,
    ZERO,
    POWERSGD,
    INT8,
    INT4,
    BF16,
    DILOCO,
    DILOCO_H50,
    DILOCO_STREAMING,
    DILOCO_INT8,
    DILOCO_INT4,
    DILOCO_INT2,
    DILOCO_TOPK,
    DILOCO_TOPK_NESTEROV,
    DILOCO_SGD1,
)
DEFAULT_RUNS = (DDP_ADAMW, ZERO, POWERSGD, INT8, INT4, DILOCO)
# ``--diloco``: DDP and the DiLoCo runs, at equal inner steps.
DILOCO_RUNS = (DDP_ADAMW, DILOCO, DILOCO_H50, DILOCO_STREAMING)


def select(keys: Iterable[str], catalogue: tuple[RunSpec, ...] = CATALOGUE) -> tuple[RunSpec, ...]:
    """The runs named by ``keys`` and, transitively, their baselines, in catalogue order.

    Raises:
        ValueError: a key the catalogue does not hold (the known keys listed).
    """
    by_key = {spec.key: spec for spec in catalogue}
    wanted: set[str] = set()
    for first in keys:
        key: str | None = first
        while key is not None and key not in wanted:
            if key not in by_key:
                raise ValueError(f"unknown run {key!r}; known runs: {', '.join(by_key)}")
            wanted.add(key)
            key = by_key[key].baseline
    return tuple(spec for spec in catalogue if spec.key in wanted)
