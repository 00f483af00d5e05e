"""Properties of the flat exchange buffers laid out from a partition."""

from __future__ import annotations

from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn import (
    FlatPartition,
    Partition,
    Piece,
    balanced_partition,
    buffer_layouts,
    flat_partition,
    greedy_partition,
)
from zerofn.testing import strategies as zst

SETTINGS = settings(max_examples=draws(100), deadline=None)

KEYS = ["cpu:float32", "cpu:float16", "cuda:0:float32"]


@st.composite
def _case(draw: st.DrawFn) -> tuple[Partition | FlatPartition, list[str], list[bool]]:
    groups = draw(zst.group_sizes(max_numel=64, large_numel=512))
    world_size = draw(zst.world_sizes(max_size=8))
    mode = draw(st.sampled_from(["greedy", "balanced", "flat"]))
    make = {"greedy": greedy_partition, "balanced": balanced_partition, "flat": flat_partition}
    partition = make[mode](groups, world_size)
    n = len(partition.sizes)
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n))
    trainable = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return partition, keys, trainable


def _pieces(partition: Partition | FlatPartition) -> list[tuple[Piece, ...]]:
    return [partition.pieces_of(r) for r in range(partition.world_size)]


@SETTINGS
@given(_case())
def test_segments_tile_buffer_and_slots_pack_segments(
    case: tuple[Partition | FlatPartition, list[str], list[bool]],
) -> None:
    partition, keys, trainable = case
    pieces = _pieces(partition)
    layouts = buffer_layouts(pieces, keys, trainable)
    for layout in layouts:
        # segments tile [0, numel) in rank order, without overlap
        assert [s.rank for s in layout.segments] == list(range(partition.world_size))
        position = 0
        for segment in layout.segments:
            assert segment.offset == position
            assert segment.length >= 0
            position += segment.length
        assert position == layout.numel
        assert len(layout.slots) == partition.world_size
        for rank, (segment, slots) in enumerate(zip(layout.segments, layout.slots, strict=True)):
            # slots contiguous inside their rank's segment, in local order
            offset = segment.offset
            for slot in slots:
                assert slot.offset == offset
                offset = slot.stop
            assert offset == segment.offset + segment.length
            expected = [
                p for p in pieces[rank] if keys[p.param] == layout.key and trainable[p.param]
            ]
            assert [slot.piece for slot in slots] == expected


@SETTINGS
@given(_case())
def test_every_trainable_piece_in_exactly_one_layout(
    case: tuple[Partition | FlatPartition, list[str], list[bool]],
) -> None:
    partition, keys, trainable = case
    pieces = _pieces(partition)
    layouts = buffer_layouts(pieces, keys, trainable)
    placed = [
        (rank, slot.piece, layout.key)
        for layout in layouts
        for rank, slots in enumerate(layout.slots)
        for slot in slots
    ]
    expected = [
        (rank, p, keys[p.param])
        for rank, rank_pieces in enumerate(pieces)
        for p in rank_pieces
        if trainable[p.param]
    ]
    assert sorted(placed, key=repr) == sorted(expected, key=repr)
    # frozen parameters are absent
    assert all(trainable[piece.param] for _, piece, _ in placed)
    # one layout per key with a trainable piece, ordered by first appearance
    with_pieces = {keys[p.param] for _, p, _ in expected}
    first_seen = list(dict.fromkeys(keys))
    assert [layout.key for layout in layouts] == [k for k in first_seen if k in with_pieces]


@SETTINGS
@given(zst.group_sizes(max_numel=64, large_numel=512), zst.world_sizes(max_size=8))
def test_flat_single_key_spans_are_global_offsets(groups: list[list[int]], world_size: int) -> None:
    partition = flat_partition(groups, world_size)
    sizes = partition.sizes
    layouts = buffer_layouts(_pieces(partition), ["k"] * len(sizes), [True] * len(sizes))
    if sum(sizes) == 0:  # zero-element parameters make no piece, so no buffer
        assert layouts == ()
        return
    (layout,) = layouts
    assert layout.numel == sum(sizes)
    start = 0
    for index, numel in enumerate(sizes):
        if numel:
            assert layout.span_of(index) == (start, numel)
        else:
            assert layout.span_of(index) is None
        start += numel


@SETTINGS
@given(zst.group_sizes(max_numel=64, large_numel=512), zst.world_sizes(max_size=8))
def test_whole_tensor_spans_are_slots(groups: list[list[int]], world_size: int) -> None:
    partition = greedy_partition(groups, world_size)
    sizes = partition.sizes
    (layout,) = buffer_layouts(_pieces(partition), ["k"] * len(sizes), [True] * len(sizes))
    for rank, slots in enumerate(layout.slots):
        assert [s.piece.param for s in slots] == list(partition.params_of(rank))
        for slot in slots:
            assert layout.span_of(slot.piece.param) == (slot.offset, sizes[slot.piece.param])


def test_span_of_refuses_split_out_of_order_pieces() -> None:
    # rank 0 holds the tail of parameter 0, rank 1 its head: not one view.
    pieces = [(Piece(0, 2, 4),), (Piece(0, 0, 2),)]
    (layout,) = buffer_layouts(pieces, ["k"], [True])
    assert layout.span_of(0) is None
    assert layout.span_of(1) is None


def test_a_plans_layouts_are_derived_never_passed() -> None:
    import pytest

    from zerofn.zero.planning.plan import ShardPlan, plan_shards

    plan = plan_shards([[3, 4]], ["cpu"] * 2, [True, False], 2, "greedy")
    rebuilt = ShardPlan(plan.mode, plan.partition, plan.keys, plan.trainable)
    assert rebuilt.layouts == plan.layouts
    with pytest.raises(TypeError):
        ShardPlan(plan.mode, plan.partition, plan.keys, plan.trainable, plan.layouts)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="a key and a trainable flag for each of its 2"):
        ShardPlan(plan.mode, plan.partition, ["cpu"], plan.trainable)
