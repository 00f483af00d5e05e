"""Held-out loss against training time across a WAN: the demo's model
(``examples/demo.py``, a byte-level transformer on the standard library's
docstrings) trained by DDP, zerofn's ZeRO, ZeRO with PowerSGD and DiLoCo side
by side on 2 gloo ranks, one on each of two nodes (network namespaces)
joined by a link shaped to :data:`RATE` whose each direction is held for
:data:`DELAY` (``testbed.links.two_nodes``; the delay is the testbed's
delay line, so no ``netem`` is needed).

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

# The shaped-link testbed is a package of the repository, not of the library:
# it imports from the repository's root.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from report import Curve, Headline, Panel, Spread, md_table

from testbed import links

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(BENCH_DIR), "examples")
RATE = "100mbit"
"""Each direction's rate: a link between sites (DiLoCo's setting)."""
DELAY = "20ms"
"""Each direction's one-way delay: a 40 ms round trip between sites."""
PORT = 29531
"""Where rank 0 (node ``a``) meets rank 1, inside the two namespaces."""
RUNS = "ddp,zero+powersgd,diloco,diloco+int8,diloco+int2,diloco+topk"
"""The demo's runs (``--runs``; the demo adds their baselines: ``zero``):
DiLoCo with fp32 syncs and with int8, 2-bit and top-k (2%, 2-bit) ones."""
ARGS = {
    False: ["--steps", "60", "--eval-every", "10"],
    True: ["--steps", "20", "--eval-every", "10", "--width", "32", "--layers", "1"],
}
"""The demo's size: its default model, 60 steps (``quick``: a tiny model,
20 steps, the fewest the demo counts with DiLoCo's syncs every 10)."""


def demo_args(quick: bool, runs: str = RUNS, size: Sequence[str] | None = None) -> list[str]:
    """The demo's command line for this measurement (``size``: the steps and
    model arguments, :data:`ARGS` by default)."""
    sized = ARGS[quick] if size is None else list(size)
    return ["--runs", runs, "--world-size", "2", "--data-mb", "1", *sized]


def measure_rank(
    rank: int, quick: bool, init_method: str, runs: str = RUNS, size: Sequence[str] | None = None
) -> dict[str, Any]:
    """Inside node ``rank``'s namespace: train the demo's ``runs`` as one of 2
    ranks; per run, this rank's held-out evaluations and each step's seconds."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import demo
    import demo_train
    from zerofn_torch.runtime.launch import run_rank

    cfg, world_size, _ = demo.parse(demo_args(quick, runs, size))
    got_runs = run_rank(
        demo_train.train_rank, rank, world_size, cfg, init_method=init_method, timeout_s=1800
    )
    return measured_from(cfg, world_size, got_runs, runs)


def measured_from(
    cfg: Any, world_size: int, got_runs: Mapping[str, Any], runs: str
) -> dict[str, Any]:
    """One rank's measurement of the demo's ``runs`` (its ``Config`` and what
    ``demo_train.train_rank`` returned), as plain JSON-ready values."""
    measured = {}
    for spec in cfg.runs:
        got = got_runs[spec.key]
        measured[spec.key] = {
            "title": spec.title,
            "held_out": [list(point) for point in got.held_out],
            "step_s": [
                a + b for a, b in zip(got.forward_backward, got.optimizer_step, strict=True)
            ],
        }
    return {
        "runs": measured,
        "steps": cfg.steps,
        "world_size": world_size,
        "eval_every": cfg.eval_every,
        "rate": RATE,
        "delay": DELAY,
        "runs_arg": runs,
        "sync_every": {spec.key: spec.sync_every for spec in cfg.runs},
    }


def node_main(argv: Sequence[str]) -> None:
    """A node's process: ``rank quick init_method out runs [size...]`` (rank
    0 writes ``out``)."""
    rank, quick, init_method, out = int(argv[0]), argv[1] == "1", argv[2], argv[3]
    size = argv[5:] or None
    measured = measure_rank(rank, quick, init_method, argv[4], size)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(measured, f)


NODE = "import sys, bench_loss_time; bench_loss_time.node_main(sys.argv[1:])"


def run_across_link(
    quick: bool, runs: str = RUNS, size: Sequence[str] | None = None
) -> dict[str, Any]:
    """Make :func:`~testbed.links.two_nodes` at :data:`RATE` and
    :data:`DELAY`, run rank 0 in node ``a`` and rank 1 in node ``b`` (the
    demo's ``runs``, sized by ``size``: :data:`ARGS` by default), and return
    rank 0's measurement with the bytes that crossed the link.

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
            argv = [sys.executable, "-c", NODE, str(rank), str(int(quick)), init_method, out, runs]
            argv += list(size or ())
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
        f"`examples/demo.py --runs {raw.get('runs_arg', RUNS)}`, {raw['steps']} steps on "
        f"{raw['world_size']} "
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


SPARSER = ("diloco+int2", "diloco+topk")
"""The codec runs held to reaching int8 DiLoCo's final loss sooner than it."""


def time_to(run: Mapping[str, Any], loss: float) -> float | None:
    """The training seconds until ``run``'s held-out loss first reached
    ``loss`` (``None``: never)."""
    xs, ys = curve_points(run)
    return next((x for x, y in zip(xs, ys, strict=True) if y <= loss), None)


def sync_seconds(run: Mapping[str, Any], sync_every: int) -> tuple[float, float]:
    """``(seconds the syncs added, seconds of every other step)``: each sync
    step's time beyond the median step without a sync, summed, and the sum
    of the steps without one."""
    steps = run["step_s"]
    plain = [s for k, s in enumerate(steps, 1) if k % sync_every]
    quiet = statistics.median(plain) if plain else 0.0
    synced = [s for k, s in enumerate(steps, 1) if not k % sync_every]
    return sum(max(s - quiet, 0.0) for s in synced), sum(plain)


def codec_part(raw: Mapping[str, Any], link_label: str) -> tuple[str, list[Headline]]:
    """DiLoCo's codecs at the link: per DiLoCo run, its last held-out loss,
    the training seconds until it first reached the loss int8 DiLoCo ends
    at, what its syncs added and what its other steps took; and, for the
    2-bit and top-k runs, that time against int8's, held to at most 1 (""
    and no rows when the runs lack int8 DiLoCo)."""
    runs: Mapping[str, Any] = raw["runs"]
    if "diloco+int8" not in runs or not runs["diloco+int8"]["held_out"]:
        return "", []
    goal = runs["diloco+int8"]["held_out"][-1][1]
    every: Mapping[str, int] = raw.get("sync_every", {})
    rows, parts = [], {}
    for key, run in runs.items():
        if not key.startswith("diloco") or not run["held_out"]:
            continue
        reached = time_to(run, goal)
        parts[key] = sync_seconds(run, every.get(key, 10))
        rows.append(
            [
                key,
                f"{run['held_out'][-1][1]:.3f}",
                "never" if reached is None else f"{reached:.1f}",
                f"{parts[key][0]:.2f}",
                f"{parts[key][1]:.1f}",
            ]
        )
    body = (
        f"**DiLoCo's codecs at {link_label}**: training seconds until the held-out loss first "
        f"reached {goal:.3f}, where int8 DiLoCo ends, and what the syncs added (each sync "
        "step beyond the median step without one: the bytes on the link and the codec's "
        "arithmetic) beside the other steps.\n\n"
        + md_table(
            [
                "run",
                "last held-out loss",
                f"seconds to {goal:.3f}",
                "seconds the syncs added",
                "seconds of the other steps",
            ],
            rows,
        )
    )
    int8 = time_to(runs["diloco+int8"], goal)
    headlines = []
    for key in SPARSER:
        if key not in runs or int8 is None:
            continue
        reached = time_to(runs[key], goal)
        ratio = None if reached is None else reached / int8
        met = ratio is not None and ratio <= 1.0
        headlines.append(
            Headline(
                f"DiLoCo {key.split('+')[1]}, demo's model at {link_label}",
                f"seconds to int8 DiLoCo's final held-out loss: {key} / diloco+int8",
                Spread.unmeasured() if ratio is None else Spread.exact(ratio),
                "<= 1.0",
                met,
                short=f"{key} time to loss",
                why="" if met else _codec_why(runs, key, goal, parts),
            )
        )
    return body, headlines


def _codec_why(
    runs: Mapping[str, Any], key: str, goal: float, parts: Mapping[str, tuple[float, float]]
) -> str:
    """Which part of the cost keeps ``key`` from reaching ``goal`` before int8 DiLoCo."""
    run = runs[key]
    if time_to(run, goal) is None:
        best = min(loss for _, loss in run["held_out"])
        return (
            f"loss: its held-out loss never reached {goal:.3f} (its best {best:.3f}), so no "
            "saving of bytes can make up for it"
        )
    (sync, other), (sync8, other8) = parts[key], parts["diloco+int8"]
    if sync > sync8:
        return f"bytes and codec time: its syncs added {sync:.2f} s against int8's {sync8:.2f} s"
    return (
        f"loss: it reached {goal:.3f} at a later evaluation than int8, its syncs adding "
        f"{sync:.2f} s against int8's {sync8:.2f} s and its other steps {other:.1f} s "
        f"against {other8:.1f} s"
    )
