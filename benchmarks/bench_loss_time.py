"""Held-out loss against training time across a WAN: the demo's model
(``examples/demo.py``, a byte-level transformer on the standard library's
docstrings) trained by DDP, zerofn's ZeRO, ZeRO with PowerSGD and DiLoCo side
by side on 2 gloo ranks, one on each of two nodes (network namespaces)
joined by a link shaped to :data:`RATE` whose each direction is held for
:data:`DELAY` (``zerofn_torch.runtime.links.two_nodes``; the delay is the
links module's delay line, so no ``netem`` is needed).

The runs take turns step by step (the demo's own loop), so each sees the same
link and the same machine; a run's time is the sum of its steps' forward,
backward (with what crosses the link in it) and optimizer step, evaluations
aside. The figure sets each held-out evaluation at the training time it was
taken after.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from report import Curve, Panel, md_table
from zerofn_torch.runtime import links

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(BENCH_DIR), "examples")
RATE = "100mbit"
"""Each direction's rate: a link between sites (DiLoCo's setting)."""
DELAY = "20ms"
"""Each direction's one-way delay: a 40 ms round trip between sites."""
PORT = 29531
"""Where rank 0 (node ``a``) meets rank 1, inside the two namespaces."""
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


def measure_rank(rank: int, quick: bool, init_method: str) -> dict[str, Any]:
    """Inside node ``rank``'s namespace: train the demo's runs as one of 2
    ranks; per run, this rank's held-out evaluations and each step's seconds."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import demo
    import demo_train
    from zerofn_torch.runtime.launch import run_rank

    cfg, world_size, _ = demo.parse(demo_args(quick))
    got_runs = run_rank(
        demo_train.train_rank, rank, world_size, cfg, init_method=init_method, timeout_s=1800
    )
    runs = {}
    for spec in cfg.runs:
        got = got_runs[spec.key]
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
        "rate": RATE,
        "delay": DELAY,
    }


def node_main(argv: Sequence[str]) -> None:
    """A node's process: ``rank quick init_method out`` (rank 0 writes ``out``)."""
    rank, quick, init_method, out = int(argv[0]), argv[1] == "1", argv[2], argv[3]
    measured = measure_rank(rank, quick, init_method)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(measured, f)


NODE = "import sys, bench_loss_time; bench_loss_time.node_main(sys.argv[1:])"


def run_across_link(quick: bool) -> dict[str, Any]:
    """Make :func:`~zerofn_torch.runtime.links.two_nodes` at :data:`RATE` and
    :data:`DELAY`, run rank 0 in node ``a`` and rank 1 in node ``b``, and
    return rank 0's measurement with the bytes that crossed the link.

    Raises:
        RuntimeError: a rank failed (the tail of its output says how).
    """
    with tempfile.TemporaryDirectory() as tmp, links.two_nodes(RATE, delay=DELAY) as pair:
        out = os.path.join(tmp, "loss_time.json")
        init_method = f"tcp://{pair.a.address}:{PORT}"
        env_path = os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH", "")) if p)
        start = pair.link_bytes()
        logs = [os.path.join(tmp, f"rank{rank}.log") for rank in range(2)]
        ranks = []
        for rank, node in enumerate(pair.nodes):
            env = node.env(os.environ) | {"PYTHONPATH": env_path}
            argv = [sys.executable, "-c", NODE, str(rank), str(int(quick)), init_method, out]
            with open(logs[rank], "w", encoding="utf-8") as log:
                ranks.append(
                    subprocess.Popen(
                        node.command(argv), env=env, cwd=BENCH_DIR, stdout=log, stderr=log
                    )
                )
        codes = _wait_all(ranks, 300 if quick else 1800)
        if any(code != 0 for code in codes) or not os.path.exists(out):
            failed = next((r for r, code in enumerate(codes) if code != 0), 0)
            with open(logs[failed], encoding="utf-8") as f:
                tail = "\n".join(f.read().strip().splitlines()[-15:])
            raise RuntimeError(
                f"the loss-against-time run across the link failed (exit codes {codes}; "
                f"rank {failed} said):\n{tail}"
            )
        crossed = pair.link_bytes().since(start)
        with open(out, encoding="utf-8") as f:
            measured: dict[str, Any] = json.load(f)
    measured["link_bytes"] = crossed.total
    return measured


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait for every process; once one fails or the time is up, kill the
    others (a rank left waiting on a dead peer would hold its namespace's
    link for the group's whole timeout). Returns their exit codes."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs]


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


def loss_time_part(raw: Mapping[str, Any], link_label: str) -> tuple[str, Panel]:
    """The table and the figure's panel: per run, seconds per step, the time
    to train every step, and its last held-out loss."""
    runs: Mapping[str, Any] = raw["runs"]
    delay_ms = links.parse_delay(raw["delay"]) / 1000
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
        f"**Held-out loss against training time at {link_label}** (the demo's model, "
        f"`examples/demo.py --runs {RUNS}`, {raw['steps']} steps on {raw['world_size']} "
        "gloo ranks, one on each of two nodes; each direction of the link between them "
        f"shaped to the rate and held {delay_ms:g} ms one way, a {2 * delay_ms:g} ms round trip). "
        "The runs take turns step by step; a run's time is the sum of its steps "
        "(forward, backward with what crosses the link in it, the optimizer step), "
        f"evaluations aside. {raw['link_bytes'] / 1e6:,.0f} MB crossed the link, both "
        "directions, evaluations included.\n\n"
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
        f"The demo's model at {link_label}: held-out loss against training time",
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
