"""Every shell command the docs and the README print runs as printed, or says
why it cannot.

A fenced ``bash``/``sh``/``shell``/``console`` block of ``docs/*.md`` or
``README.md`` is a command. The line before it may mark it:

* ``<!-- command: not run: WHY -->``: never run here (it installs packages,
  needs two machines, is the test suite itself); the why is required;
* ``<!-- command: slow -->``: run as printed by ``make test-slow``;
* ``<!-- command: slow, kill -9 a worker once it saved -->``: the same, and
  while it trains one of its workers is killed, as the page tells the reader
  to do: it must still exit 0, having resumed.

An unmarked command runs in ``make test``. Each runs with ``bash -e`` in a
fresh directory holding the repository's ``examples``, ``benchmarks`` and
``.venv`` (links), with this interpreter first on ``PATH``, so ``python``,
``.venv/bin/python`` and ``.venv/bin/torchrun`` are the test environment's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell", "console")
MARK = re.compile(r"<!--\s*command:\s*(?P<mark>.*?)\s*-->")


@attrs.frozen
class Command:
    page: str
    line: int
    text: str
    mark: str  # "" (make test), "slow", "slow, kill ...", or "not run: WHY"

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def documented_commands() -> list[Command]:
    """Every shell block of the pages, with the mark on the line before it."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            fence = line.strip()
            if not (fence.startswith("```") and fence[3:].strip() in SHELLS):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marked = MARK.search(before)
            text = "\n".join(lines[i + 1 : end])
            mark = marked.group("mark") if marked else ""
            found.append(Command(str(page.relative_to(ROOT)), i + 1, text, mark))
    return found


COMMANDS = documented_commands()


def _by_mark(kind: str) -> list[Command]:
    if kind == "fast":
        return [c for c in COMMANDS if c.mark == ""]
    return [c for c in COMMANDS if c.mark.split(",")[0].strip() == kind]


def test_every_command_is_run_or_says_why_not() -> None:
    assert len(COMMANDS) >= 10  # the parser found the pages' blocks
    for command in COMMANDS:
        mark = command.mark
        if mark.startswith("not run"):
            why = mark.removeprefix("not run").strip(": ")
            assert len(why) > 10, f"{command.name}: say why it is not run"
        else:
            assert mark in ("", "slow", "slow, kill -9 a worker once it saved"), (
                f"{command.name}: unknown mark {mark!r}"
            )


def workspace(tmp_path: Path) -> dict[str, str]:
    """A directory for a command and its environment: the repository's
    examples, benchmarks and virtual environment linked in, this
    interpreter's directory first on ``PATH``."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    venv = ROOT / ".venv"
    if venv.exists():
        (tmp_path / ".venv").symlink_to(venv)
    else:  # a test environment outside .venv: give its interpreter that name
        (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def run(command: Command, tmp_path: Path, timeout: float) -> str:
    env = workspace(tmp_path)
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command.text],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"{command.name} failed as printed:\n{command.text}\n{output[-4000:]}"
    )
    return output


@pytest.mark.parametrize("command", _by_mark("fast"), ids=lambda c: c.name)
def test_the_command_runs_as_printed(command: Command, tmp_path: Path) -> None:
    run(command, tmp_path, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", _by_mark("slow"), ids=lambda c: c.name)
def test_the_long_command_runs_as_printed(command: Command, tmp_path: Path) -> None:
    if "kill" in command.mark:
        run_and_kill_a_worker(command, tmp_path)
    else:
        run(command, tmp_path, timeout=500)


def _workers(launcher: int) -> list[int]:
    """The leaf processes below ``launcher`` (torchrun's workers, whether
    ``bash`` ran torchrun as a child or in its own place)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = (int(v) for v in line.split())
        children.setdefault(ppid, []).append(pid)
    below, leaves = list(children.get(launcher, [])), []
    while below:
        pid = below.pop()
        below.extend(children.get(pid, []))
        if pid not in children:
            leaves.append(pid)
    return sorted(leaves)


def run_and_kill_a_worker(command: Command, tmp_path: Path) -> None:
    """Start the command, ``kill -9`` one worker once a checkpoint is on
    disk, and require exit 0 and a start that resumed from a checkpoint."""
    env = workspace(tmp_path)
    with subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", command.text],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as job:
        try:
            deadline = time.monotonic() + 120
            while not list(tmp_path.glob("runs/*/step-*")) and job.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint within 120 s"
                time.sleep(0.05)
            workers = _workers(job.pid)
            assert workers and job.poll() is None, "the job ended before a worker could be killed"
            os.kill(workers[-1], signal.SIGKILL)
            output, _ = job.communicate(timeout=400)
        except BaseException:
            os.killpg(job.pid, signal.SIGKILL)
            raise
    assert job.returncode == 0, f"{command.name} did not survive the kill:\n{output[-4000:]}"
    assert re.search(r"resumed from step \d+ \(checkpoint ", output), output[-4000:]
