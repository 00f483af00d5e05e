"""Held-out loss against training time on a slow link: the demo's model
(``examples/demo.py``, a byte-level transformer on the standard library's
docstrings) trained by DDP, zerofn's ZeRO, ZeRO with PowerSGD and DiLoCo side
by side on 2 gloo ranks inside a namespace whose loopback is shaped to
:data:`RATE` (``bench_links`` makes it and runs :func:`measure` inside).

The runs take turns step by step (the demo's own loop), so each sees the same
link and the same machine; a run's time is the sum of its steps' forward,
backward (with what crosses the link in it) and optimizer step, evaluations
aside. The figure sets each held-out evaluation at the training time it was
taken after.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from report import Curve, Panel, md_table

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
RATE = "100mbit"
"""A link between sites (DiLoCo's setting); without netem here, no delay."""
RUNS = "ddp,zero+powersgd,diloco"
"""The demo's runs (``--runs``; the demo adds their baselines: ``zero``)."""
ARGS = {
    False: ["--steps", "60", "--eval-every", "10"],
    True: ["--steps", "20", "--eval-every", "10", "--width", "32", "--layers", "1"],
}
"""The demo's size: its default model, 60 steps (``quick``: a tiny model,
20 steps, the fewest the demo counts with DiLoCo's syncs every 10)."""


def demo_args(quick: bool) -> list[str]:
    """The demo's command line for this measurement."""
    return ["--runs", RUNS, "--world-size", "2", "--data-mb", "1", *ARGS[quick]]


def measure(quick: bool) -> dict[str, Any]:
    """Inside the shaped namespace: train the demo's runs on 2 ranks; per run,
    rank 0's held-out evaluations and each step's seconds."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import demo
    import demo_train
    from zerofn_torch.runtime.launch import run_local_world

    cfg, world_size, _ = demo.parse(demo_args(quick))
    results = run_local_world(demo_train.train_rank, world_size, cfg, timeout_s=1800)
    runs = {}
    for spec in cfg.runs:
        got = results[0][spec.key]
        runs[spec.key] = {
            "title": spec.title,
            "held_out": [list(point) for point in got.held_out],
            "step_s": [
                a + b for a, b in zip(got.forward_backward, got.optimizer_step, strict=True)
            ],
        }
    return {
        "runs": runs,
        "steps": cfg.steps,
        "world_size": world_size,
        "eval_every": cfg.eval_every,
    }


def curve_points(run: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """A run's held-out losses, each at the training seconds of the steps
    before it (evaluation ``(k, loss)`` follows step ``k``)."""
    elapsed, total = [], 0.0
    for seconds in run["step_s"]:
        total += seconds
        elapsed.append(total)
    xs = [elapsed[step - 1] for step, _ in run["held_out"]]
    ys = [loss for _, loss in run["held_out"]]
    return xs, ys


def loss_time_part(raw: Mapping[str, Any], rate_label: str) -> tuple[str, Panel]:
    """The table and the figure's panel: per run, seconds per step, the time
    to train every step, and its last held-out loss."""
    runs: Mapping[str, Any] = raw["runs"]
    rows: list[list[object]] = []
    curves = []
    for key, run in runs.items():
        xs, ys = curve_points(run)
        curves.append(Curve(key, tuple(xs), tuple(ys)))
        rows.append(
            [
                key,
                f"{statistics.median(run['step_s']) * 1e3:.0f}",
                f"{sum(run['step_s']):.1f}",
                f"{ys[-1]:.3f}" if ys else "-",
            ]
        )
    body = (
        f"**Held-out loss against training time at {rate_label}** (the demo's model, "
        f"`examples/demo.py --runs {RUNS}`, {raw['steps']} steps on {raw['world_size']} "
        "gloo ranks in the shaped namespace; the link's rate alone, no added delay). The runs "
        "take turns step by step; a run's time is the sum of its steps (forward, backward "
        "with what crosses the link in it, the optimizer step), evaluations aside.\n\n"
        + md_table(
            [
                "run",
                "ms per step (median)",
                f"seconds for {raw['steps']} steps",
                "last held-out loss",
            ],
            rows,
        )
    )
    goal = common_loss(runs)
    if goal is not None:
        reached = fastest_to(runs, goal)
        body += (
            f"\n\nTraining seconds until the held-out loss first reached {goal:.3f}, the "
            f"lowest every run reached (evaluations every {raw['eval_every']} steps): "
            + ", ".join(f"{key} {seconds:.1f} s" for key, seconds in reached)
            + "."
        )
    panel = Panel(
        f"The demo's model at {rate_label}: held-out loss against training time",
        "training seconds (evaluations aside)",
        "held-out loss",
        curves,
    )
    return body, panel


def common_loss(runs: Mapping[str, Any]) -> float | None:
    """The lowest held-out loss every run reached: the highest of the runs'
    best losses (``None`` without evaluations)."""
    bests = [min(loss for _, loss in run["held_out"]) for run in runs.values() if run["held_out"]]
    return max(bests) if bests and len(bests) == len(runs) else None


def fastest_to(runs: Mapping[str, Any], loss: float) -> Sequence[tuple[str, float]]:
    """Per run, the training seconds until its held-out loss first reached
    ``loss`` (runs that never did are left out), fastest first."""
    reached = []
    for key, run in runs.items():
        xs, ys = curve_points(run)
        first = next((x for x, y in zip(xs, ys, strict=True) if y <= loss), None)
        if first is not None:
            reached.append((key, first))
    return sorted(reached, key=lambda item: item[1])
