"""Optimizer state by piece of a parameter (:mod:`zerofn.zero.elastic.piece_state`):
property tests of cutting and joining, on states cut at random points."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.zero.elastic.piece_state import state_of, whole_pieces
from zerofn.zero.planning.partition import Piece

SETTINGS = settings(max_examples=draws(80), deadline=None)


@st.composite
def cut_states(draw: st.DrawFn) -> tuple[dict[str, Any], dict[Piece, dict[str, Any]], int]:
    """An Adam-like state of a parameter of ``n`` elements, and the same
    state cut into pieces at random points (as ranks of a flat partition hold it)."""
    n = draw(st.integers(1, 60))
    cuts = sorted({*draw(st.lists(st.integers(1, max(1, n - 1)), max_size=6)), 0, n})
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    whole = {"step": torch.tensor(7.0), "exp_avg": torch.randn(n, generator=generator)}
    known = {
        Piece(0, a, b): {"step": whole["step"].clone(), "exp_avg": whole["exp_avg"][a:b].clone()}
        for a, b in itertools.pairwise(cuts)
        if a < b
    }
    return whole, known, n


@given(cut_states(), st.data())
@SETTINGS
def test_any_piece_is_cut_and_joined_from_the_pieces_that_cover_it(
    cut: tuple[dict[str, Any], dict[Piece, dict[str, Any]], int], data: st.DataObject
) -> None:
    whole, known, n = cut
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    state = state_of(known, Piece(0, start, stop), (stop - start,))
    assert state is not None
    assert torch.equal(state["exp_avg"], whole["exp_avg"][start:stop])
    assert torch.equal(state["step"], whole["step"])  # a scalar, from the first piece


@given(cut_states())
@SETTINGS
def test_the_whole_parameter_comes_back_in_its_shape(
    cut: tuple[dict[str, Any], dict[Piece, dict[str, Any]], int],
) -> None:
    whole, known, n = cut
    state = state_of(known, Piece(0, 0, n), (1, n))
    assert state is not None and state["exp_avg"].shape == (1, n)
    assert torch.equal(state["exp_avg"].reshape(-1), whole["exp_avg"])
    # A global state dict's entry (whole, shaped as its parameter) cut back.
    shaped = whole_pieces({0: {**whole, "exp_avg": whole["exp_avg"].reshape(1, n)}}, [n])
    again = state_of(shaped, Piece(0, n // 2, n), (n - n // 2,))
    assert again is not None and torch.equal(again["exp_avg"], whole["exp_avg"][n // 2 :])


def test_what_is_known_nowhere_starts_fresh_and_half_known_is_refused() -> None:
    known = {Piece(0, 0, 4): {"exp_avg": torch.zeros(4)}}
    assert state_of(known, Piece(1, 0, 4), (4,)) is None
    with pytest.raises(ValueError, match="elements 4 onwards of 2..6 is known nowhere"):
        state_of(known, Piece(0, 2, 6), (4,))
    rows = {Piece(0, 0, 6): {"exp_avg_sq_row": torch.zeros(2)}}  # not one value per element
    rows[Piece(0, 6, 12)] = {"exp_avg_sq_row": torch.zeros(2)}
    with pytest.raises(ValueError, match="not one value per element"):
        state_of(rows, Piece(0, 3, 9), (6,))
