"""Checking that every rank holds the same parameters: digests equal exactly
when tensors are (value, dtype, shape), the first disagreement found with the
ranks grouped by version; on 2 gloo ranks, agreeing replicas pass and one
perturbed element makes both ranks raise, naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from zerofn_torch import verify_replicas
from zerofn_torch.runtime.launch import run_local_world

from zerofn.replicas import Disagreement, ReplicaMismatch, digests, first_disagreement


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(0, 2**16))
@settings(max_examples=draws(100), deadline=None)
def test_digests_change_with_any_element_and_agree_on_copies(sizes: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=generator) for n in sizes]
    copies = [t.clone() for t in tensors]
    assert torch.equal(digests(tensors), digests(copies))
    for i, t in enumerate(copies):
        if t.numel():
            t.view(-1)[seed % t.numel()] = torch.nextafter(
                t.view(-1)[seed % t.numel()], torch.tensor(1e9)
            )
            assert digests(copies)[i] != digests(tensors)[i]


def test_digests_tell_dtype_and_shape_apart() -> None:
    zeros = torch.zeros(4)
    assert len({int(digests([t])[0]) for t in (zeros, zeros.view(2, 2), zeros.double())}) == 3


def test_the_first_disagreement_names_the_tensor_and_groups_the_ranks() -> None:
    same = torch.tensor([1, 2, 3])
    assert first_disagreement([same, same.clone()]) is None
    odd = torch.tensor([1, 9, 3])
    assert first_disagreement([same, odd, same]) == Disagreement(1, ((0, 2), (1,)))


def _check(rank: int, world_size: int, perturb: bool) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if perturb and rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1e-6
    assert not verify_replicas(model, every=10, step=3)  # not due: no collective
    try:
        return verify_replicas(model, every=10, step=20)
    except ReplicaMismatch as e:
        return str(e)


def test_agreeing_replicas_pass_and_a_perturbed_one_fails_on_every_rank() -> None:
    assert run_local_world(_check, 2, False) == [True, True]
    for message in run_local_world(_check, 2, True):
        assert "1.bias differ across ranks" in message and "[0]" in message and "[1]" in message
    with pytest.raises(ValueError, match="every must be at least 1"):
        verify_replicas([torch.zeros(1)], every=0)


def test_the_copies_check_names_a_diverged_copy_and_a_parameter_counted_twice() -> None:
    """Carried copies are compared piece by piece with their owners'; step
    counts are compared per parameter, as a parameter's pieces step
    together while parameters may count different steps (a group added
    later)."""
    from zerofn.replicas import copies_disagreement, state_digest
    from zerofn.zero.planning.partition import Piece

    def digest(step: int, value: float) -> Any:
        return state_digest({"step": torch.tensor(float(step)), "exp_avg": torch.full((2,), value)})

    low, high, later = Piece(0, 0, 2), Piece(0, 2, 4), Piece(1, 0, 2)
    fine = [
        ({low: digest(3, 1.0), later: digest(1, 5.0)}, {high: digest(3, 2.0)}),
        ({high: digest(3, 2.0)}, {low: digest(3, 1.0), later: digest(1, 5.0)}),
    ]
    assert copies_disagreement(fine) is None
    diverged = [fine[0], ({high: digest(3, 2.0)}, {low: digest(3, 1.5), later: digest(1, 5.0)})]
    assert "rank 1's copy of the optimizer state of parameter 0 (elements 0..2)" in str(
        copies_disagreement(diverged)
    )
    behind = [
        ({low: digest(3, 1.0)}, {high: digest(2, 2.0)}),
        ({high: digest(2, 2.0)}, {low: digest(3, 1.0)}),
    ]
    assert copies_disagreement(behind) == (
        "the pieces of parameter 0 (on ranks [0, 1]) count 2 different steps"
    )
