"""DiLoCo's workers of several ranks (``zerofn.diloco.workers``): the layout
read from each rank's outer group, what a lost rank leaves of the workers,
and which rank's state each surviving worker takes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerofn.diloco.redundancy import SyncPosition, sync_recovery
from zerofn.diloco.workers import Workers, after_loss, progress


@st.composite
def layouts(draw: st.DrawFn) -> Workers:
    """``count`` workers of ``size`` ranks each, their job ranks shuffled."""
    count = draw(st.integers(2, 5))
    size = draw(st.integers(1, 3))
    ranks = draw(st.permutations(range(count * size)))
    return Workers(tuple(tuple(ranks[i * count : (i + 1) * count]) for i in range(size)))


@given(layouts(), st.randoms(use_true_random=False))
def test_every_rank_has_one_place_and_the_layout_reads_back_from_any_order(
    workers: Workers, rnd: random.Random
) -> None:
    assert sorted(workers.ranks) == list(range(workers.count * workers.ranks_per_worker))
    for rank in workers.ranks:
        worker, local = workers.place(rank)
        assert workers.outer[local][worker] == rank
        assert workers.inner(worker)[local] == rank
        assert workers.ranks[workers.together()[worker][local]] == rank
    # What every rank names (its outer group), in any order: the same layout
    # up to the order of the outer groups, which keeps each worker whole.
    named = [workers.outer[workers.place(r)[1]] for r in workers.ranks]
    rnd.shuffle(named)
    again = Workers.from_outer_groups(named)
    assert sorted(again.outer) == sorted(workers.outer)
    assert {frozenset(again.inner(k)) for k in range(again.count)} == {
        frozenset(workers.inner(k)) for k in range(workers.count)
    }


def test_groups_that_are_no_grid_are_refused() -> None:
    with pytest.raises(ValueError, match="different sizes"):
        Workers(((0, 2), (1,)))
    with pytest.raises(ValueError, match="share ranks"):
        Workers(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="no rank of these workers"):
        Workers(((0, 2), (1, 3))).place(7)


def position(steps: int, sync: int, summed: bool, taken: bool = False) -> SyncPosition:
    return SyncPosition(steps, sync, sync, summed, taken)


def through_a_step(n: int) -> list[SyncPosition]:
    """A rank's positions as inner step ``n + 1`` runs, its sync included:
    taken, the sync entered, its sum held, the step done."""
    return [
        position(n, n, True),
        position(n, n, True, taken=True),
        position(n, n + 1, False, taken=True),
        position(n, n + 1, True, taken=True),
        position(n + 1, n + 1, True),
    ]


@given(st.integers(0, 20))
def test_progress_orders_a_rank_s_positions_as_its_step_runs(n: int) -> None:
    seen = through_a_step(n) + through_a_step(n + 1)[1:]
    keys = [progress(p) for p in seen]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)


@given(layouts(), st.data())
def test_a_lost_rank_takes_its_worker_and_each_survivor_takes_its_furthest_sibling(
    workers: Workers, data: st.DataObject
) -> None:
    places = range(len(workers.ranks))
    gone = data.draw(st.sets(st.sampled_from(places), max_size=2), label="gone")
    alive = [p for p in places if p not in gone]
    n = data.draw(st.integers(0, 9), label="n")
    steps = through_a_step(n)
    positions = [data.draw(st.sampled_from(steps), label=f"at {p}") for p in alive]
    lost_workers = sorted({p // workers.ranks_per_worker for p in gone})
    if workers.count - len(lost_workers) < 2:
        with pytest.raises(ValueError, match="needs 2 workers"):
            after_loss(workers, alive, positions)
        return
    loss = after_loss(workers, alive, positions)
    assert list(loss.lost) == lost_workers
    assert sorted(loss.kept + loss.lost) == list(range(workers.count))
    assert loss.survivors.count == len(loss.kept)
    at = dict(zip(alive, positions, strict=True))
    for i, k in enumerate(loss.kept):
        assert loss.survivors.inner(i) == workers.inner(k)
        siblings = [at[p] for p in workers.together()[k]]
        assert loss.positions[i] == siblings[loss.sources[i]]
        assert all(progress(s) <= progress(loss.positions[i]) for s in siblings)
        # The first of the furthest: every survivor names the same source.
        assert loss.sources[i] == [progress(s) for s in siblings].index(progress(loss.positions[i]))


def test_siblings_a_sync_apart_decide_as_their_furthest() -> None:
    """Worker 0's second rank stopped before its step (the alarm) while its
    first completed the step's sync in the other outer group: the worker
    goes on from the completed sync, and so does every outer group."""
    workers = Workers(((0, 2, 4), (1, 3, 5)))  # worker k: ranks 2k and 2k + 1
    done, stopped = position(4, 4, True), position(3, 2, True)
    in_sync = position(3, 4, False, taken=True)
    # Worker 2 (ranks 4, 5) is lost; workers 0 and 1 answer.
    loss = after_loss(workers, [0, 1, 2, 3], [done, stopped, in_sync, stopped])
    assert loss.kept == (0, 1) and loss.lost == (2,)
    assert loss.positions == (done, in_sync)
    assert loss.sources == (0, 0)
    recovery = sync_recovery(loss.positions)
    assert recovery.forward and recovery.sync == 4 and recovery.source == 0
