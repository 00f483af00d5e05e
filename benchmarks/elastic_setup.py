"""What the parts of ``bench_elastic.py`` share: the model (an MLP in one of
``train_elastic.CONFIGS``' dtypes), its batches and one training iteration;
the process group's timeout; the tensor bytes of the state the moves send
(``_watch_outboxes``, ``_tensor_bytes``); a few runs' figures quoted as one
(``span``)."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer

from zerofn.zero.elastic import regroup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from train_elastic import PLAIN, Config

BATCH = 32
GROUP_TIMEOUT_S = 30.0
"""The process group's timeout in the loss runs: long, so that the figures
show the roll call's short deadline; a loss that gloo held to this timeout
is reported beside them (``examples/train_elastic.py`` keeps the deadline
above a short timeout instead, as docs/resilience.md advises)."""


def model_size(quick: bool) -> tuple[int, int]:
    """Width and depth of the MLP: ~4.2M parameters (``quick``: ~0.2M)."""
    return (256, 3) if quick else (1024, 4)


def make_model(quick: bool, config: Config = PLAIN) -> torch.nn.Module:
    torch.manual_seed(0)
    width, depth = model_size(quick)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(config.dtype)


def batch(seed: int, quick: bool, config: Config = PLAIN) -> torch.Tensor:
    width, _ = model_size(quick)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(seed))
    return x.to(config.dtype)


def iteration(ddp: DDP, zero: ZeroRedundancyOptimizer, x: torch.Tensor) -> Callable[[], None]:
    """One training iteration: forward, backward (DDP's all-reduce), ZeRO step."""

    def run() -> None:
        zero.zero_grad()
        ddp(x).square().mean().backward()
        zero.step()

    return run


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _watch_outboxes(seen: Callable[[Any], None]) -> None:
    """Hand ``seen`` every outbox this process sends in the moves (the
    core's ``regroup_program`` calls ``outgoing_states`` by name, in this
    process's copy of ``zerofn.zero.elastic.regroup``)."""
    outgoing = regroup.outgoing_states

    def watched(*args: Any, **kwargs: Any) -> Any:
        outbox = outgoing(*args, **kwargs)
        seen(outbox)
        return outbox

    setattr(regroup, "outgoing_states", watched)  # noqa: B010


def span(values: Sequence[float], digits: int) -> str:
    """``median (min to max)``, or the value alone when there is one."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f} to {max(values):.{digits}f})"
    )
