"""The restart soak's side of ``train_resumable.py``: kill one worker at a
planned point, and log every start of the job.

A *kill plan* (``--kill``) holds one :class:`Kill` per start of the job: on
the job's *n*-th start (``TORCHELASTIC_RESTART_COUNT`` is *n - 1*; torchrun
sets it), the worker of rank ``Kill.rank`` sends itself ``SIGKILL`` at
training step ``Kill.step``, at one of these points:

* ``step``: in the middle of the step (gradients reduced, not yet stepped);
* ``before-save``: just before ``save_sharded`` is called;
* ``save``: inside that step's background save, while
  ``torch.distributed.checkpoint`` writes this rank's data file (after the
  first item of it is written);
* ``after-save``: right after ``save_sharded`` returned, the save in flight;
* ``wait``: at the end of training, instead of waiting for the last save.

Nothing here changes what is trained: without a plan every point is a no-op.
The log (``--soak-log``, one JSON object a line, appended by every start) holds
``start`` records (rank 0: the step resumed from, the temporaries the last
start left, seconds from process start to training) and ``kill`` records (the
victim: where it died, how far it had trained, the newest whole checkpoint
on disk then). ``benchmarks/bench_soak_restart.py`` reads it back.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import attrs
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from zerofn_torch.checkpoint import latest_checkpoint

Point = Literal["step", "before-save", "save", "after-save", "wait"]
POINTS: tuple[str, ...] = get_args(Point)
# resolve_data is asked for each item as it is written into the open data
# file: on the second ask, the file is open and holds the first item only.
_ITEMS_BEFORE_KILL = 1


@attrs.frozen
class Kill:
    """On one start of the job, rank ``rank`` kills itself at ``step``, at ``point``."""

    rank: int
    step: int
    point: str

    def __attrs_post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"kill point {self.point!r} is not one of {POINTS}")
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"kill {self}: rank must be >= 0 and step >= 1")

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.point}"


def parse_plan(text: str) -> tuple[Kill, ...]:
    """The kills of a plan written ``rank:step:point,...``, one per start.

    Args:
        text: e.g. ``"1:6:step,0:12:save"`` (empty: no kills).

    Returns:
        The kills, in the order of the starts they apply to.

    Raises:
        ValueError: an entry is not ``rank:step:point`` with a known point.
    """
    kills = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            raise ValueError(f"kill plan entry {entry!r} is not rank:step:point")
        kills.append(Kill(int(parts[0]), int(parts[1]), parts[2]))
    return tuple(kills)


def format_plan(kills: Sequence[Kill]) -> str:
    """The ``--kill`` argument for ``kills`` (inverts :func:`parse_plan`)."""
    return ",".join(str(k) for k in kills)


def process_age() -> float | None:
    """Seconds since this process started (from ``/proc``; ``None`` where
    there is none): includes the interpreter's start and torch's import."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Fields after the command name, which may hold spaces; the
            # 22nd field of the line, the start time in clock ticks, is the 20th.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def append_record(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line to ``path``: one ``write`` of an ``O_APPEND``
    file, so lines of several processes never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)  # the next line this worker writes may be its last act
    finally:
        os.close(fd)


def read_records(path: str) -> list[dict[str, Any]]:
    """Every record appended to the log at ``path``, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Soak:
    """One worker's part in the soak: the kill this start plans for it (if
    any) and the log. A soak without a plan or a log does nothing.

    Args:
        kill: the kill planned for this start and this rank, or ``None``.
        log: the log file, or ``None``.
        rank: this worker's rank.
        restart: how many times torchrun has restarted the job.
        checkpoint_step: the training step a checkpoint directory holds.
    """

    def __init__(
        self,
        kill: Kill | None,
        log: str | None,
        rank: int,
        restart: int,
        checkpoint_step: Callable[[str], int],
    ) -> None:
        self.kill = kill
        self.log = log
        self.rank = rank
        self.restart = restart
        self.checkpoint_step = checkpoint_step
        self.trained = 0  # steps done so far, in this start or before it
        self.last_save: int | None = None  # the step of the last save begun

    @classmethod
    def of(
        cls, plan: str, log: str | None, rank: int, checkpoint_step: Callable[[str], int]
    ) -> Soak:
        """This worker's soak, from ``--kill`` and ``--soak-log`` and torchrun's
        restart count (0 outside torchrun)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kills = parse_plan(plan)
        kill = kills[restart] if restart < len(kills) else None
        mine = kill if kill is not None and kill.rank == rank else None
        return cls(mine, log, rank, restart, checkpoint_step)

    def started(self, resumed_from: int, leftovers: Sequence[str]) -> None:
        """Log this start (rank 0): the step resumed from, the temporaries
        found in the run directory, and the seconds it took to get here."""
        self.trained = resumed_from
        self.last_save = resumed_from  # the checkpoint resumed from counts as begun
        if self.log is None or self.rank != 0:
            return
        record = {
            "event": "start",
            "restart": self.restart,
            "resumed_from": resumed_from,
            "leftovers": sorted(leftovers),
            "startup_s": process_age(),
            "at": time.time(),
        }
        append_record(self.log, record)

    def stepped(self, step: int) -> None:
        """Record that training step ``step`` is done (for the kill's record)."""
        self.trained = step

    def finished(self) -> None:
        """Log the end of training (rank 0)."""
        if self.log is not None and self.rank == 0:
            append_record(
                self.log,
                {"event": "end", "restart": self.restart, "step": self.trained, "at": time.time()},
            )

    def point(self, where: Point, step: int, run_dir: str) -> None:
        """Pass a kill point: die here if the plan says so. Before a save,
        arm the ``save`` kill, which fires inside that save's writing."""
        if where == "after-save":
            self.last_save = step  # save_sharded returned: this save has begun
        kill = self.kill
        if kill is None:
            return
        if (kill.point, kill.step) == (where, step):
            self._die(run_dir)
        if (where, kill.point, kill.step) == ("before-save", "save", step):
            self._arm_in_save(step, run_dir)

    def _arm_in_save(self, step: int, run_dir: str) -> None:
        # The background save builds its own DefaultSavePlanner, whose
        # resolve_data hands torch.distributed.checkpoint each item as it
        # writes it into this rank's open data file: die in the middle of it.
        original = DefaultSavePlanner.resolve_data
        asked = itertools.count()

        def resolve_data(planner: DefaultSavePlanner, item: WriteItem) -> torch.Tensor | io.BytesIO:
            if next(asked) == _ITEMS_BEFORE_KILL:
                # The save being written has begun, whatever the main thread did since.
                self.last_save = step
                self._die(run_dir)
            return original(planner, item)

        DefaultSavePlanner.resolve_data = resolve_data  # type: ignore[method-assign,assignment]

    def _die(self, run_dir: str) -> None:
        """Log what is on disk now, then ``SIGKILL`` this process: no
        handler, no ``atexit``, no flush; as if the machine lost it."""
        assert self.kill is not None
        newest = latest_checkpoint(run_dir)
        if self.log is not None:
            record = {
                "event": "kill",
                "restart": self.restart,
                "rank": self.rank,
                "point": self.kill.point,
                "step": self.kill.step,
                "trained": self.trained,
                "last_save": self.last_save,
                "newest_complete": None if newest is None else self.checkpoint_step(newest),
                "at": time.time(),
            }
            append_record(self.log, record)
        os.kill(os.getpid(), signal.SIGKILL)
