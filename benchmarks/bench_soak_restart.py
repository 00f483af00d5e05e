"""Kill-and-restart soak under torchrun: steps lost per kill, restart time.

Runs ``examples/train_resumable.py`` (DDP + zerofn's ZeroRedundancyOptimizer
(Adam) on 2 gloo ranks, a background save every 4 steps, ``keep_last=2``)
under the real elastic launcher twice: once uninterrupted, once with
``--max-restarts`` and a kill plan that has one worker ``SIGKILL`` itself at
each of the plan's points (mid-step, inside a save, just before and just
after a save, at the final wait; ``examples/kill_plan.py``). It reports, per
kill, how many steps were trained again (the steps done at the kill minus the
step the next start resumed from) and the seconds from the kill to training
again, and checks that the killed run's final parameters and optimizer state
equal the uninterrupted run's, bit for bit.

The table is also written between ``<!-- soak:begin -->`` and
``<!-- soak:end -->`` in ``docs/resilience.md`` (``--quick``: a short plan,
into a copy under ``benchmarks/out/``). ``tests/test_soak.py`` runs the same
jobs through :func:`run_job` and asserts on them.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from report import Headline, Section, Spread, environment, md_table, standalone_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from kill_plan import Kill, format_plan, parse_plan, read_records  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_resumable.py")
PAGE = os.path.join(ROOT, "docs", "resilience.md")
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
# torch 2.13's torchrun keeps one rendezvous store for all restarts, so a
# restarted worker can read its dead predecessor's gloo address and fail to
# connect; with this set, every restart gets a fresh store (docs/resilience.md).
LAUNCHER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


@attrs.frozen
class SoakConfig:
    """One soak: train to ``steps``, save every ``save_every`` steps, and on
    the job's *n*-th start apply ``kills[n]`` (one more start finishes)."""

    steps: int
    save_every: int
    kills: tuple[Kill, ...]


TEST = SoakConfig(
    24, 4, parse_plan("1:6:step,0:12:save,1:16:before-save,0:20:after-save,1:24:wait")
)
"""The plan ``tests/test_soak.py`` runs: the five kill points, once each."""

QUICK = SoakConfig(16, 4, parse_plan("1:6:step,0:12:save"))
"""``make bench BENCH_ARGS=--quick``: a smoke run of two kills."""

FULL = SoakConfig(
    48,
    4,
    parse_plan(
        "1:6:step,0:12:save,1:16:before-save,0:20:after-save,"
        "0:26:step,1:32:save,0:36:before-save,1:40:after-save,0:48:wait"
    ),
)
"""``make bench``: every point on both ranks (the final wait once: it can
fire only on a start that has a save left to wait for)."""


@attrs.frozen
class Job:
    """What one torchrun job left: its exit status, its log, the final state."""

    returncode: int
    records: tuple[dict[str, Any], ...]
    state: dict[str, Any] | None  # rank 0's final parameters and optimizer state
    run_dir: str
    output: str  # the launcher's and workers' output, for a failure's message
    seconds: float


def torchrun_command(config: SoakConfig, workdir: str, killed: bool) -> list[str]:
    """The launcher's command line for the uninterrupted (``killed=False``)
    or the killed job, writing under ``workdir``."""
    kills = config.kills if killed else ()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port for the rendezvous, chosen by torchrun
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(len(kills)),
        SCRIPT,
        "--run-dir",
        os.path.join(workdir, "run"),
        "--steps",
        str(config.steps),
        "--save-every",
        str(config.save_every),
        "--out",
        os.path.join(workdir, "final.pt"),
        "--soak-log",
        os.path.join(workdir, "log.jsonl"),
        "--kill",
        format_plan(kills),
    ]


def _launch(command: Sequence[str], output: str, timeout_s: float) -> int:
    """Run ``command`` in a session of its own; on timeout kill that whole
    session (the launcher and its workers), not just the launcher."""
    env = {**os.environ, **LAUNCHER_ENV}
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def run_job(config: SoakConfig, workdir: str, killed: bool, timeout_s: float = 240.0) -> Job:
    """Run the uninterrupted or the killed job of ``config`` under torchrun.

    Args:
        config: the soak.
        workdir: an empty directory for the run's checkpoints, log and output.
        killed: apply ``config.kills`` (with as many restarts allowed).
        timeout_s: kill the job after this many seconds.

    Returns:
        What the job left.

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout_s``.
    """
    log, final, output = (os.path.join(workdir, n) for n in ("log.jsonl", "final.pt", "out.txt"))
    started = time.perf_counter()
    returncode = _launch(torchrun_command(config, workdir, killed), output, timeout_s)
    seconds = time.perf_counter() - started
    with open(output, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return Job(
        returncode=returncode,
        records=tuple(read_records(log)) if os.path.exists(log) else (),
        state=torch.load(final, weights_only=False) if os.path.exists(final) else None,
        run_dir=os.path.join(workdir, "run"),
        output=text,
        seconds=seconds,
    )


# ----- reading the log -----------------------------------------------------------


@attrs.frozen
class Restart:
    """One kill and the start that followed it, from the job's log.

    Attributes:
        restart: the start the kill ended (torchrun's restart count then).
        kill: what the plan asked for.
        trained: steps done when the victim died.
        newest_complete: the step of the newest whole checkpoint on disk then
            (0: none).
        last_save: the step of the last save started then (0: none).
        resumed_from: the step the next start resumed from.
        leftovers: the temporaries the next start found in the run directory.
        restart_s: seconds from the kill to the next start's first step.
        startup_s: of those, seconds from the next start's process start.
    """

    restart: int
    kill: Kill
    trained: int
    newest_complete: int
    last_save: int
    resumed_from: int
    leftovers: tuple[str, ...]
    restart_s: float
    startup_s: float | None

    @property
    def steps_lost(self) -> int:
        """Steps trained before the kill that were trained again after it."""
        return self.trained - self.resumed_from


def starts(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The log's ``start`` records, in order."""
    return [r for r in records if r["event"] == "start"]


def restarts(records: Sequence[Mapping[str, Any]]) -> list[Restart]:
    """Every kill of the log with the start that followed it.

    Raises:
        ValueError: a kill has no later start in the log.
    """
    by_restart = {r["restart"]: r for r in starts(records)}
    out = []
    for kill in (r for r in records if r["event"] == "kill"):
        after = by_restart.get(kill["restart"] + 1)
        if after is None:
            raise ValueError(f"no start after the kill {kill}")
        out.append(
            Restart(
                restart=kill["restart"],
                kill=Kill(kill["rank"], kill["step"], kill["point"]),
                trained=kill["trained"],
                newest_complete=kill["newest_complete"] or 0,
                last_save=kill["last_save"] or 0,
                resumed_from=after["resumed_from"],
                leftovers=tuple(after["leftovers"]),
                restart_s=after["at"] - kill["at"],
                startup_s=after["startup_s"],
            )
        )
    return out


def compare_states(a: Any, b: Any, path: str = "") -> tuple[int, list[str]]:
    """Compare two nested states (dicts, lists, tuples, tensors, values).

    Returns:
        How many tensors were compared, and where ``a`` and ``b`` differ:
        a tensor not bitwise equal (dtype and shape included), a value not
        ``==``, a key or a length that differs.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
        return 1, [] if same else [path or "<root>"]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return 0, [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return _compare_items([(f"{path}/{k}", a[k], b[k]) for k in a])
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return 0, [f"{path}: length {len(a)} != {len(b)}"]
        return _compare_items(
            [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b, strict=True))]
        )
    return 0, [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _compare_items(items: Sequence[tuple[str, Any, Any]]) -> tuple[int, list[str]]:
    count, differences = 0, []
    for path, x, y in items:
        n, diff = compare_states(x, y, path)
        count += n
        differences += diff
    return count, differences


# ----- the report ------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _leftover(restart: Restart) -> str:
    """What the killed start left in the run directory, in a few words."""
    kinds = sorted({"staging" if ".zerofn-staging-" in n else "trash" for n in restart.leftovers})
    return ", ".join(f"a {k} directory" for k in kinds) or "nothing"


def restart_table(rows: Sequence[Restart]) -> str:
    """One row per kill: where, how far training had got, what was on disk,
    where the next start resumed, steps lost, seconds to train again."""
    header = [
        "start",
        "victim",
        "killed",
        "at step",
        "steps done",
        "newest whole checkpoint",
        "resumed from",
        "steps lost",
        "restart (s)",
        "of which process start (s)",
        "left behind",
    ]
    body = [
        [
            r.restart,
            f"rank {r.kill.rank}",
            f"`{r.kill.point}`",
            r.kill.step,
            r.trained,
            r.newest_complete or "-",
            r.resumed_from,
            r.steps_lost,
            _seconds(r.restart_s),
            _seconds(r.startup_s),
            _leftover(r),
        ]
        for r in rows
    ]
    return md_table(header, body)


def _span(values: Sequence[float], digits: int) -> str:
    """``median (min to max)``."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f} to {max(values):.{digits}f})"
    )


def summary(rows: Sequence[Restart], tensors: int, differences: Sequence[str]) -> str:
    """The block's closing lines: steps lost, restart time, bitwise equality."""
    equal = (
        f"**bitwise equal** to the uninterrupted run's ({tensors} tensors compared)"
        if not differences
        else f"**NOT bitwise equal** to the uninterrupted run's: {', '.join(differences[:5])}"
    )
    return (
        f"Steps lost per kill: {_span([r.steps_lost for r in rows], 0)}. "
        f"Restart, from the kill to training again: {_span([r.restart_s for r in rows], 1)} s. "
        f"Final parameters and optimizer state: {equal}."
    )


def block(config: SoakConfig, reference: Job, killed: Job) -> str:
    """The Markdown between the page's markers (without the markers)."""
    rows = restarts(killed.records)
    tensors, differences = compare_states(reference.state, killed.state)
    first = starts(reference.records)[0]
    end = next(r for r in reference.records if r["event"] == "end")
    plan = format_plan(config.kills)
    return "\n\n".join(
        [
            "<!-- Written by benchmarks/bench_soak_restart.py (make bench); edit that. -->",
            f"Measured on {environment()} 2 gloo ranks, {config.steps} steps, a background "
            f"save every {config.save_every} steps (`keep_last=2`), "
            f"`--max-restarts {len(config.kills)}`, kill plan `{plan}`. The uninterrupted "
            f"run took {reference.seconds:.0f} s: its workers {_seconds(first['startup_s'])} s "
            f"to their first step, then {end['at'] - first['at']:.1f} s for the "
            f"{config.steps} steps, saves included. The killed one took "
            f"{killed.seconds:.0f} s.",
            restart_table(rows),
            summary(rows, tensors, differences),
        ]
    )


def replace_block(text: str, content: str) -> str:
    """``text`` with what lies between its soak markers replaced by ``content``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} followed by one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{content}\n{END}{tail}"


def write_page(content: str, quick: bool) -> str:
    """Write the block into docs/resilience.md (``quick``: into a copy under
    benchmarks/out/, leaving the committed page alone); returns the path."""
    out = os.path.join(ROOT, "benchmarks", "out", "resilience.md") if quick else PAGE
    with open(PAGE, encoding="utf-8") as f:
        text = replace_block(f.read(), content)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out


def _headlines(config: SoakConfig, rows: Sequence[Restart], equal: bool) -> list[Headline]:
    name = f"restart soak (2 gloo ranks, {len(rows)} kills under torchrun, {config.steps} steps)"
    equality = Spread.exact(float(equal))
    bitwise = "final state bitwise equal to an uninterrupted run's"
    lost = Spread.of([float(r.steps_lost) for r in rows])
    seconds = Spread.of([r.restart_s for r in rows])
    return [
        Headline(name, bitwise, equality, "== 1", equal),
        Headline(name, "steps lost per kill", lost),
        Headline(name, "seconds from a kill to training again", seconds),
    ]


def _check(job: Job, what: str, kills: int, workdir: str) -> None:
    """Raise unless ``job`` exited 0 after one start per kill and one more.

    Raises:
        RuntimeError: naming the job's directory (left in place) and ending
            with its output's tail.
    """
    logged = [s["restart"] for s in starts(job.records)]
    if job.returncode == 0 and logged == list(range(kills + 1)):
        return
    raise RuntimeError(
        f"the {what} job exited {job.returncode} after the starts {logged} "
        f"(expected {list(range(kills + 1))}); its files are in {workdir}:\n{job.output[-4000:]}"
    )


def bench_restart(quick: bool) -> Section:
    """Run the soak (``QUICK`` or ``FULL``), write its block, return its section.

    Raises:
        RuntimeError: a job failed or a start failed unplanned (the jobs'
            directory is left in place and named).
    """
    config = QUICK if quick else FULL
    workdir = tempfile.mkdtemp(prefix="zerofn-soak-")
    jobs = []
    for what, killed in (("uninterrupted", False), ("killed", True)):
        directory = os.path.join(workdir, what)
        os.makedirs(directory)
        job = run_job(config, directory, killed=killed)
        _check(job, what, len(config.kills) if killed else 0, directory)
        jobs.append(job)
    shutil.rmtree(workdir, ignore_errors=True)
    reference, killed_job = jobs
    content = block(config, reference, killed_job)
    path = write_page(content, quick)
    _, differences = compare_states(reference.state, killed_job.state)
    body = content.split("\n\n", 1)[1] + f"\n\n(Also written to `{os.path.relpath(path, ROOT)}`.)"
    return Section(
        "Kill-and-restart soak (torchrun, 2 gloo ranks)",
        body,
        _headlines(config, restarts(killed_job.records), not differences),
    )


BENCHES = {"restart": bench_restart}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
