"""The survivors' roll call (``zerofn_torch.roll_call.roll_call``), in one
process: ranks are threads sharing one in-memory store. Everyone who
answers is alive; one that never answers is out, at once if its heartbeat
went silent, at the deadline if it never beat, and only at the patience's
end while it beats on (busy, not gone); one that answers too late finds itself declared
lost and raises rather than going on alone; every survivor learns where
each stood."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist
from zerofn_torch.elastic import SILENT_AFTER_S, RollCall, roll_call
from zerofn_torch.runtime.heartbeat import beat_key

from zerofn.errors import CollectiveError
from zerofn.zero.elastic.recovery_point import Position


def call_together(
    store: Any,
    ranks: list[int],
    world: int,
    interrupted: set[int],
    deadline_s: float,
    patience_s: float | None = None,
) -> dict[int, RollCall | BaseException]:
    """Ranks in ``interrupted`` took local step 1 and did not exchange it;
    the others stand after step 0."""
    out: dict[int, RollCall | BaseException] = {}

    def one(rank: int) -> None:
        try:
            position = Position(1, False) if rank in interrupted else Position(0)
            out[rank] = roll_call(
                store, "call", rank, world, position, deadline_s, patience_s=patience_s
            )
        except BaseException as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_everyone_who_answers_is_alive_and_every_position_is_everyones() -> None:
    answers = call_together(dist.HashStore(), [0, 1, 2], 3, {1}, deadline_s=5.0)
    expected = RollCall((0, 1, 2), (Position(0), Position(1, False), Position(0)))
    assert all(a == expected for a in answers.values())


def test_a_rank_that_never_answers_is_out() -> None:
    answers = call_together(dist.HashStore(), [0, 2], 3, set(), deadline_s=0.5)
    both = RollCall((0, 2), (Position(0), Position(0)))
    assert answers == {0: both, 2: both}


def test_a_rank_that_answers_too_late_raises_instead_of_going_on_alone() -> None:
    store = dist.HashStore()
    early = call_together(store, [0, 1], 3, set(), deadline_s=0.5)
    both = RollCall((0, 1), (Position(0), Position(0)))
    assert early == {0: both, 1: both}
    (late,) = call_together(store, [2], 3, set(), deadline_s=0.5).values()
    assert isinstance(late, CollectiveError)
    assert "rank 2 was declared lost before it answered" in str(late)
    # The same words as a rank that comes back after the others recovered:
    # whoever runs the job tells a rank left behind by them alone.
    assert "left behind" in str(late)


def timed_call(
    store: Any,
    beating: tuple[int, ...],
    deadline_s: float,
    patience_s: float | None = None,
    late: float | None = None,
) -> tuple[dict[int, RollCall | BaseException], float]:
    """Ranks 0 and 1 of 3 hold the roll call while the ranks of ``beating``
    beat (every 0.05 s), and rank 2 answers after ``late`` seconds (``None``:
    never); the answers of ranks 0 and 1 and the seconds they took."""
    stop = threading.Event()

    def beat(rank: int) -> None:
        while not stop.is_set():
            store.add(beat_key(0, rank), 1)
            time.sleep(0.05)

    def answer_late() -> None:
        time.sleep(late or 0.0)
        call_together(store, [2], 3, set(), deadline_s, patience_s)

    threads = [threading.Thread(target=beat, args=(r,)) for r in beating]
    if late is not None:
        threads.append(threading.Thread(target=answer_late))
    for t in threads:
        t.start()
    began = time.monotonic()
    try:
        answers = call_together(store, [0, 1], 3, set(), deadline_s, patience_s)
        return answers, time.monotonic() - began
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_rank_whose_heartbeat_stopped_is_out_long_before_the_deadline() -> None:
    store = dist.HashStore()
    store.add(beat_key(0, 2), 7)  # rank 2 beat, then died
    answers, took = timed_call(store, (0, 1), deadline_s=30.0)
    both = RollCall((0, 1), (Position(0), Position(0)))
    assert answers == {0: both, 1: both}
    assert SILENT_AFTER_S <= took < SILENT_AFTER_S + 1.0


def test_a_rank_never_seen_beating_is_out_at_the_deadline() -> None:
    answers, took = timed_call(dist.HashStore(), (0, 1), deadline_s=1.5, patience_s=30.0)
    assert answers[0] == answers[1] == RollCall((0, 1), (Position(0), Position(0)))
    assert 1.5 <= took < 1.5 + 1.0


def test_a_rank_still_beating_is_waited_for_past_the_deadline() -> None:
    """Alive but busy (a long forward before it hears the alarm): it answers
    after the deadline and is alive; one that beats on and never answers is
    out at the patience's end."""
    answers, took = timed_call(dist.HashStore(), (0, 1, 2), 0.3, patience_s=30.0, late=1.5)
    everyone = RollCall((0, 1, 2), (Position(0), Position(0), Position(0)))
    assert answers[0] == answers[1] == everyone
    assert 1.5 <= took < 30.0
    answers, took = timed_call(dist.HashStore(), (0, 1, 2), deadline_s=0.3, patience_s=1.5)
    assert answers[0] == answers[1] == RollCall((0, 1), (Position(0), Position(0)))
    assert took >= 1.5


def test_ranks_lost_together_are_not_waited_for_once_one_of_them_is_lost() -> None:
    """Ranks 2 and 3 make one DiLoCo worker: rank 3 died (its heartbeat
    stopped), and rank 2 beats on without answering (blocked): it is not
    waited for, though a rank that beats is otherwise waited for to the
    patience's end."""
    store = dist.HashStore()
    store.add(beat_key(0, 3), 7)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            store.add(beat_key(0, 2), 1)
            time.sleep(0.05)

    beating = threading.Thread(target=beat)
    beating.start()
    out: dict[int, RollCall | BaseException] = {}

    def one(rank: int) -> None:
        out[rank] = roll_call(
            store, "call", rank, 4, Position(0), 30.0, patience_s=30.0,
            together=((0, 1), (2, 3)),
        )  # fmt: skip

    began = time.monotonic()
    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    took = time.monotonic() - began
    stop.set()
    beating.join()
    both = RollCall((0, 1), (Position(0), Position(0)))
    assert out == {0: both, 1: both}
    assert took < SILENT_AFTER_S + 1.0
