"""Run a function on N gloo ranks in spawned processes (the shipped launcher,
with a one-minute collective timeout so a failing rank cannot hang a test)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerofn_torch.runtime.launch import run_local_world


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; what each returned."""
    return run_local_world(fn, world_size, *args, timeout_s=60.0)
