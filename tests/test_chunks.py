"""Cache-sized chunks of a flat shard (zerofn.zero.planning.chunks): the cut covers the
tensor as torch.split does, and the state-dict conversions are inverses."""

from __future__ import annotations

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.zero.planning.chunks import (
    FLAT_CHUNK_BYTES,
    chunk_sizes,
    chunk_sources,
    merge_chunk_state,
    split_chunk_state,
)
from zerofn.zero.planning.layout import Slot
from zerofn.zero.planning.partition import Piece


@settings(max_examples=draws(100), deadline=None)
@given(numel=st.integers(0, 5000), itemsize=st.sampled_from([2, 4, 8]), chunk=st.integers(1, 4096))
def test_chunks_cover_the_tensor_as_split_does(numel: int, itemsize: int, chunk: int) -> None:
    sizes = chunk_sizes(numel, itemsize, chunk)
    assert sum(sizes) == numel
    per = max(1, chunk // itemsize)
    assert sizes == tuple(t.numel() for t in torch.zeros(numel).split(per)) or sizes == (0,)
    assert all(0 < s <= per for s in sizes) or sizes == (0,)


@settings(max_examples=draws(60), deadline=None)
@given(
    groups=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    chunk=st.integers(4, 256),
    seed=st.integers(0, 999),
)
def test_split_then_merge_is_the_identity(groups: list[int], chunk: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state = {
        i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(n, generator=g)}
        for i, n in enumerate(groups)
        if n
    }
    merged = {
        "state": state,
        "param_groups": [{"lr": 0.1, "params": [i]} for i in range(len(groups))],
    }
    sizes = [chunk_sizes(n, 4, chunk) for n in groups]
    split = split_chunk_state(merged, sizes)
    assert [len(grp["params"]) for grp in split["param_groups"]] == [len(s) for s in sizes]
    back = merge_chunk_state(split)
    assert back["param_groups"] == merged["param_groups"]
    assert back["state"].keys() == state.keys()
    for i, entry in state.items():
        assert torch.equal(back["state"][i]["exp_avg"], entry["exp_avg"])
        assert torch.equal(back["state"][i]["step"], entry["step"])


def test_conversions_refuse_what_does_not_fit() -> None:
    merged = {"state": {0: {"exp_avg": torch.zeros(5)}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(ValueError, match="has 5 elements, its chunks 4"):
        split_chunk_state(merged, [(2, 2)])
    with pytest.raises(ValueError, match="1 groups, 2 chunkings"):
        split_chunk_state(merged, [(5,), (1,)])
    partial = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match="some chunks have optimizer state"):
        merge_chunk_state(partial)
    with pytest.raises(ValueError, match="bad chunking"):
        chunk_sizes(-1, 4)


@settings(max_examples=draws(200), deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), min_size=0, max_size=6),
    st.booleans(),
)
def test_chunk_sources_tile_the_slots_without_spanning_parameters(
    pieces: list[tuple[int, int]], cache_sized: bool
) -> None:
    slots, offset = [], 0
    for param, numel in pieces:
        slots.append(Slot(Piece(param, 7, 7 + numel), offset))
        offset += numel
    sources = chunk_sources(slots, 4096, cache_sized)  # 128 elements per chunk
    # In buffer order, each slot's elements exactly once, each chunk in one parameter.
    expected = [(s.piece.param, e) for s in slots for e in range(s.piece.start, s.piece.stop)]
    got = [(param, e) for param, start, n in sources for e in range(start, start + n)]
    assert got == expected
    assert all(n > 0 for _, _, n in sources)
    if cache_sized:
        assert all(n * 4096 <= FLAT_CHUNK_BYTES for _, _, n in sources)
    else:
        assert len(sources) == sum(1 for s in slots if s.piece.numel)
