"""Posted requests (zerofn.comm.Post / Collect): a program starts a
collective, computes while it travels, and collects it later, in the
adapter's driver, in the simulated world and on one rank alone; a program
that leaves a posted request uncollected, or collects one it never posted,
is an error, never a silent hang."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from zerofn_torch.runtime.driver import drive

from zerofn.comm import AllReduce, Collect, Post, Program
from zerofn.hooks.error_feedback import run_alone
from zerofn.testing.world import CollectiveMismatch, run_programs


def _two_posted(rank: int) -> Generator[Any, Any, list[float]]:
    """Two all-reduces in flight at once, work between, collected in order."""
    first = AllReduce((torch.full((2,), float(rank + 1)),))
    second = AllReduce((torch.full((3,), 10.0 * (rank + 1)),))
    yield Post(first)
    yield Post(second)
    local = float(rank) * 100  # what the program computes while both travel
    (a,) = yield Collect(first)
    (b,) = yield Collect(second, last=True)
    return [*a.tolist(), *b.tolist(), local]


def test_the_simulated_world_answers_posted_requests_when_collected() -> None:
    results = run_programs([_two_posted(r) for r in range(3)])
    for rank, values in enumerate(results):
        assert values == [6.0, 6.0, 60.0, 60.0, 60.0, rank * 100.0]


def test_one_rank_alone_answers_posted_requests() -> None:
    assert run_alone(_two_posted(0)) == [1.0, 1.0, 10.0, 10.0, 10.0, 0.0]


@pytest.mark.usefixtures("single_rank_group")
def test_the_driver_issues_posted_requests_and_collects_them() -> None:
    assert drive(_two_posted(0), None, "a test").wait() == [1.0, 1.0, 10.0, 10.0, 10.0, 0.0]


def _forgets_one() -> Program[None]:
    yield Post(AllReduce((torch.ones(2),)))


def _collects_a_stranger() -> Program[None]:
    yield Collect(AllReduce((torch.ones(2),)))


@pytest.mark.usefixtures("single_rank_group")
def test_the_driver_fails_a_program_that_forgets_or_invents_a_posted_request() -> None:
    with pytest.raises(RuntimeError, match="1 posted request.* never collected"):
        drive(_forgets_one(), None, "a test").wait()
    with pytest.raises(RuntimeError, match="collected a request it had not posted"):
        drive(_collects_a_stranger(), None, "a test").wait()


def test_the_simulated_world_refuses_what_a_real_group_would_hang_on() -> None:
    with pytest.raises(CollectiveMismatch, match="never collected"):
        run_programs([_forgets_one() for _ in range(2)])

    def plain() -> Program[None]:
        yield AllReduce((torch.ones(2),))

    def posted() -> Program[None]:
        request = AllReduce((torch.ones(2),))
        yield Post(request)
        yield Collect(request)

    with pytest.raises(CollectiveMismatch, match="different steps"):
        run_programs([plain(), posted()])
