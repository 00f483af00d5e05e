"""The heartbeat and the job's alarm (``zerofn_torch.runtime.heartbeat``), in
one process: two heartbeats over one in-memory TCP store stand for two ranks.
The alarm ends a wait in progress and fails the futures handed to DDP; a rank
whose counter stops is noticed by the other, which raises the alarm; a rank
that ends cleanly is not; a world that changed does not see the old alarm;
a job's store that a loss can tear (a ``FileStore``) is warned of."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from zerofn_torch.runtime import heartbeat
from zerofn_torch.runtime.heartbeat import WATCH_SILENT_S, Heartbeat, beat_key

from zerofn.errors import CollectiveError


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def until(condition: object, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_the_alarm_ends_a_wait_and_fails_the_futures_ddp_waits_for(
    store: dist.TCPStore,
) -> None:
    mine, theirs = Heartbeat(store, 0, 0, 2), Heartbeat(store, 0, 1, 2)
    try:
        never: torch.futures.Future[int] = torch.futures.Future()
        handed = mine.interruptible(never)
        theirs.raise_alarm("rank 1 of 2: RuntimeError")
        began = time.monotonic()
        with pytest.raises(CollectiveError, match="another rank raised the alarm"):
            mine.wait(never, "the ZeRO step's exchange")
        assert time.monotonic() - began < 1.0  # within a few beats
        assert handed.done()
        with pytest.raises(CollectiveError, match="rank 1 of 2"):
            handed.wait()
        assert mine.alarm == "rank 1 of 2: RuntimeError"
    finally:
        mine.stop()
        theirs.stop()


def test_a_completed_future_is_waited_for_as_it_is(store: dist.TCPStore) -> None:
    beat = Heartbeat(store, 0, 0, 1)
    try:
        done: torch.futures.Future[int] = torch.futures.Future()
        handed = beat.interruptible(done)
        done.set_result(7)
        assert beat.wait(done, "a wait") == 7 and handed.wait() == 7
        assert beat.alarm is None
    finally:
        beat.stop()


def test_a_silent_rank_raises_the_alarm_and_one_that_ended_cleanly_does_not() -> None:
    """Rank 0 of 2 watches rank 1 (the next around the ring): in one job rank 1
    beat once and went silent, in another it ended cleanly."""
    jobs = [dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10)) for _ in "ab"]
    silent_job, clean_job = jobs
    silent_job.add(beat_key(0, 1), 1)
    Heartbeat(clean_job, 0, 1, 2).stop()  # it says so as it ends
    watchers = [Heartbeat(job, 0, 0, 2) for job in jobs]
    try:
        assert until(lambda: watchers[0].alarm is not None, WATCH_SILENT_S + 2.0)
        assert watchers[0].alarm == f"rank 1 silent for {WATCH_SILENT_S} s"
        time.sleep(0.3)  # as long again for the other watcher: still nothing
        assert watchers[1].alarm is None
    finally:
        for watcher in watchers:
            watcher.stop()


def test_a_new_world_does_not_see_the_old_worlds_alarm(store: dist.TCPStore) -> None:
    beat = Heartbeat(store, 0, 0, 1)
    try:
        beat.raise_alarm("old")
        beat.beat_as(1, 0, 1)
        assert beat.alarm is None
        time.sleep(0.3)  # a few beats: the old key stays where it was
        assert beat.alarm is None
        fresh: torch.futures.Future[int] = torch.futures.Future()
        fresh.set_result(3)
        assert beat.wait(fresh, "a wait") == 3
    finally:
        beat.stop()


def test_a_rank_that_moved_to_a_new_world_is_not_silent_in_the_old_one() -> None:
    """Rank 1 goes on in world 1 while rank 0 is still in world 0 (about to
    follow): rank 0 is not to mistake rank 1's moving on for silence."""
    job = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    mover, stayer = Heartbeat(job, 0, 1, 2), Heartbeat(job, 0, 0, 2)
    try:
        mover.beat_as(1, 0, 1)
        time.sleep(WATCH_SILENT_S + 0.5)
        assert stayer.alarm is None and mover.alarm is None
    finally:
        mover.stop()
        stayer.stop()


def test_a_rank_has_beaten_in_its_world_once_it_is_placed_there(store: dist.TCPStore) -> None:
    """A rank that dies right after joining a world must already have beaten
    there, or the roll call would find it missing (never silent) and wait
    for its deadline."""
    beat = Heartbeat(store, 0, 0, 2)
    try:
        assert store.check([beat_key(0, 0)])
        beat.beat_as(1, 1, 2)
        assert store.check([beat_key(1, 1)])
    finally:
        beat.stop()


def test_a_job_store_a_loss_can_tear_is_warned_of(store: dist.TCPStore, tmp_path: Path) -> None:
    file_store = dist.FileStore(str(tmp_path / "store"), -1)
    for torn in (file_store, dist.PrefixStore("default_pg", file_store)):
        with pytest.warns(RuntimeWarning, match="FileStore"):
            heartbeat._warn_if_torn_by_a_loss(torn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heartbeat._warn_if_torn_by_a_loss(dist.PrefixStore("default_pg", store))
