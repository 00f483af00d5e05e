"""The exchange hidden behind the next forward (:mod:`zerofn.zero.forward_gather`):
pieces that tile every segment, an order that follows the forward's first
uses, and, in the simulated world, parameters that hold their updated values
as soon as the pieces they wait for have arrived, ending bitwise where the
plain exchange ends."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import (
    Broadcast,
    Collect,
    GatherSegments,
    Post,
    Program,
    recording_requests,
    request_bytes,
)
from zerofn.overlap.ddp_buckets import BucketPlan, assign_buckets
from zerofn.overlap.step import broadcast_in_forward_order, send_pieces
from zerofn.testing import strategies as zst
from zerofn.testing.overlap import simulate_overlapped_step
from zerofn.testing.world import run_programs
from zerofn.testing.zero import SimulatedRank, simulated_ranks
from zerofn.zero.forward_gather import (
    Arrivals,
    check_gather_during_forward,
    check_gather_with_hook,
    compressed_arrivals,
    first_uses,
    gather_pieces,
    in_forward_order,
    plan_forward_gather,
)
from zerofn.zero.planning.plan import ShardPlan, plan_shards

SETTINGS = settings(max_examples=draws(80), deadline=None)

sizes_lists = st.lists(st.integers(0, 30), min_size=1, max_size=7).filter(lambda s: sum(s) > 0)


@st.composite
def plans(draw: st.DrawFn) -> ShardPlan:
    sizes = draw(sizes_lists, label="sizes")
    trainable = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    # A flat plan needs a trained element (refused otherwise, as the optimizer does).
    trainable[next(i for i, n in enumerate(sizes) if n)] = True
    mode = draw(st.sampled_from(["greedy", "balanced", "flat"]), label="mode")
    world = draw(st.integers(1, 4), label="world")
    return plan_shards([sizes], ["k"] * len(sizes), trainable, world, mode)


@st.composite
def forward_orders(draw: st.DrawFn, num_params: int) -> list[list[int]]:
    """Module calls in forward order: each uses some parameters (a
    parameter may be used again later, or never)."""
    calls = st.lists(st.integers(0, num_params - 1), max_size=3)
    return draw(st.lists(calls, max_size=2 * num_params + 1), label="calls")


@SETTINGS
@given(plans(), st.integers(1, 12), st.data())
def test_pieces_tile_every_segment_and_travel_in_the_order_of_first_use(
    plan: ShardPlan, piece_numel: int, data: st.DataObject
) -> None:
    num_params = len(plan.keys)
    calls = data.draw(forward_orders(num_params))
    first = first_uses(calls, num_params)
    for p, use in enumerate(first):
        earlier = [i for i, used in enumerate(calls) if p in used]
        assert use == (earlier[0] if earlier else None)
    pieces = gather_pieces(plan.layouts, piece_numel)
    for index, layout in enumerate(plan.layouts):
        for segment in layout.segments:
            mine = [q for q in pieces if q.buffer == index and q.owner == segment.rank]
            covered = [(q.start, q.stop) for q in mine]
            stop = segment.offset + segment.length
            starts = list(range(segment.offset, stop, piece_numel))
            assert covered == [(s, min(s + piece_numel, stop)) for s in starts]
            for q in mine:
                inside = {
                    s.piece.param
                    for s in layout.slots[segment.rank]
                    if s.offset < q.stop and q.start < s.stop
                }
                assert set(q.params) == inside
    gather = plan_forward_gather(plan, first, piece_numel)
    assert sorted(gather.pieces, key=repr) == sorted(pieces, key=repr)
    for p in range(num_params):
        holding = [i for i, q in enumerate(gather.pieces) if p in q.params]
        assert gather.ready[p] == (max(holding) + 1 if holding else 0)
        slots = [s for layout in plan.layouts for rs in layout.slots for s in rs]
        has_elements = any(s.piece.param == p and s.piece.numel for s in slots)
        assert (gather.ready[p] > 0) == (plan.trainable[p] and has_elements)
    # A module never waits for a piece that holds only parameters first used later.
    for position, used in enumerate(calls):
        early = sum(
            1
            for q in gather.pieces
            if any(first[p] is not None and first[p] <= position for p in q.params)
        )
        assert gather.waits(used) <= early


def test_redundancy_with_the_overlapped_step_is_refused_naming_all_three() -> None:
    with pytest.raises(
        ValueError, match="gather_during_forward=True with redundancy=2 and overlap_with_ddp=True"
    ):
        check_gather_during_forward(2, True)
    for redundancy, overlap in ((1, False), (1, True), (2, False)):
        check_gather_during_forward(redundancy, overlap)


def test_the_interleaved_hook_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="interleaved .* gather_during_forward=True"):
        check_gather_with_hook(True, True)
    check_gather_with_hook(True, False)
    check_gather_with_hook(False, True)
    with pytest.raises(ValueError, match="interleaved .* gather_during_forward=True"):
        simulate_overlapped_step(
            [[0]], [torch.zeros(2)], [[[torch.zeros(2)]]], torch.optim.SGD,
            interleaved=True, forward_order=[0], lr=0.1,
        )  # fmt: skip


def test_bad_inputs_are_refused() -> None:
    plan = plan_shards([[4, 3]], ["k", "k"], [True, True], 2)
    with pytest.raises(ValueError, match="piece_numel must be at least 1"):
        gather_pieces(plan.layouts, 0)
    with pytest.raises(ValueError, match="first_use has 1 entries for 2 parameters"):
        plan_forward_gather(plan, [None])
    with pytest.raises(ValueError, match="used parameter 5 of 2"):
        first_uses([[0], [5]], 2)


def noting_arrivals(
    program: Program[Any], arrived: Callable[[int], None]
) -> Generator[Any, Any, Any]:
    """``program`` unchanged, calling ``arrived(k)`` once the ``k``-th
    collected piece has been taken in (and written into the parameters):
    as the driver counts it (:meth:`zerofn_torch.runtime.driver.PolledProgram.advance_until`),
    when the program next waits (a request not posted) or ends, since what
    it posts in between runs first."""
    count = 0
    pending = False  # a collect taken in, not yet counted
    try:
        request = next(program)
    except StopIteration as stop:  # nothing to send: no trained element
        return stop.value
    while True:
        response = yield request
        pending = pending or isinstance(request, Collect)
        try:
            request = program.send(response)
        except StopIteration as stop:
            if pending:
                arrived(count + 1)
            return stop.value
        if pending and not isinstance(request, Post):
            count, pending = count + 1, False
            arrived(count)


@SETTINGS
@given(
    plans(),
    st.integers(1, 12),
    st.booleans(),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.data(),
    st.integers(0, 2**16),
)
def test_each_parameter_holds_its_update_once_its_pieces_arrived_and_ends_as_the_plain_exchange(
    plan: ShardPlan,
    piece_numel: int,
    bucket_view: bool,
    dtype: torch.dtype,
    data: st.DataObject,
    seed: int,
) -> None:
    """Two steps of Adam on simulated ranks, the exchange in forward order
    against the plain one: at each arrival, every parameter whose pieces
    have all arrived holds the plain exchange's value, bit for bit; at the
    end every parameter does; and the bytes are the plain exchange's."""
    sizes = [n for group in plan.partition.group_sizes for n in group]
    num_params = len(sizes)
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    master = torch.float32 if dtype == torch.bfloat16 else None

    def world() -> list[SimulatedRank]:
        return simulated_ranks(
            plan, params, torch.optim.Adam, bucket_view=bucket_view, master_dtype=master, lr=0.1
        )

    plain, ordered = world(), world()
    calls = data.draw(forward_orders(num_params))
    gather = plan_forward_gather(plan, first_uses(calls, num_params), piece_numel)
    for _ in range(2):
        grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        plain_sent: list[Any] = []
        run_programs(
            [recording_requests(r.program(grads, "broadcasts"), plain_sent.append) for r in plain]
        )
        checked: list[int] = []

        def arrived(rank: int, checked: list[int]) -> Callable[[int], None]:
            def check(count: int) -> None:
                for p in range(num_params):
                    if 0 < gather.ready[p] <= count:
                        assert torch.equal(ordered[rank].params[p], plain[rank].params[p]), p
                checked.append(count)

            return check

        sent: list[Any] = []
        programs = [
            noting_arrivals(
                recording_requests(r.program(grads, "broadcasts", gather), sent.append),
                arrived(rank, checked),
            )
            for rank, r in enumerate(ordered)
        ]
        run_programs(programs)
        assert len(checked) == len(gather.pieces) * plan.world_size
        for ours, theirs in zip(ordered, plain, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params, strict=True))
        pieces = [r for r in sent if isinstance(r, Broadcast)]
        gathers = [r for r in plain_sent if isinstance(r, GatherSegments)]
        # Every rank takes part in every piece's broadcast: the plain exchange's elements.
        assert sum(r.tensor.numel() for r in pieces) == sum(
            sum(s.numel() for s in r.segments) for r in gathers
        )


def test_the_exact_exchange_behind_the_forward_needs_its_pieces_order() -> None:
    plan = plan_shards([[40, 30]], ["k", "k"], [True, True], 2)
    ranks = simulated_ranks(plan, [torch.randn(40), torch.randn(30)], torch.optim.SGD, lr=0.1)
    program = ranks[0].program([torch.randn(40), torch.randn(30)], "broadcasts", Arrivals((1, 1)))
    with pytest.raises(ValueError, match="needs its pieces' order"):
        next(program)


@SETTINGS
@given(
    plans(),
    st.integers(1, 12),
    st.builds(BlockQuantizer, st.sampled_from([8, 4]), st.sampled_from([2, 4, 8])),
    st.integers(0, 2**16),
)
def test_the_compressed_exchange_behind_the_forward_lands_each_parameter_at_its_arrival(
    plan: ShardPlan, piece: int, compression: BlockQuantizer, seed: int
) -> None:
    """Two steps of Adam on simulated ranks, the compressed exchange behind
    the forward (the local step whole, its pieces in their own order)
    against the same exchange inside the step (the update in parts): at
    each arrival every parameter whose wait is met holds its final value,
    bit for bit; at the end every parameter does."""
    sizes = [n for group in plan.partition.group_sizes for n in group]
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]

    def world() -> list[SimulatedRank]:
        return simulated_ranks(
            plan, params, torch.optim.Adam, exchange_compression=compression,
            piece_elements=piece, lr=0.1,
        )  # fmt: skip

    inside, behind = world(), world()
    exchange = behind[0].zero.compressed
    assert exchange is not None
    arrivals = compressed_arrivals(plan, exchange.exchange.piece)  # whole blocks
    for _ in range(2):
        grads = [torch.randn(n, generator=g) for n in sizes]
        run_programs([r.program(grads, "broadcasts") for r in inside])
        checked: list[int] = []

        def arrived(rank: int, checked: list[int]) -> Callable[[int], None]:
            def check(count: int) -> None:
                for p, ready in enumerate(arrivals.ready):
                    if 0 < ready <= count:
                        assert torch.equal(behind[rank].params[p], inside[rank].params[p]), p
                checked.append(count)

            return check

        run_programs(
            [
                noting_arrivals(r.program(grads, "broadcasts", arrivals), arrived(rank, checked))
                for rank, r in enumerate(behind)
            ]
        )
        # Every rank collects every piece: as many as the waits count.
        pieces = sum(
            -(-max(s.length for s in lay.segments) // exchange.exchange.piece) or 1
            for lay in plan.layouts
        )
        assert checked.count(pieces) == plan.world_size
        for ours, theirs in zip(behind, inside, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params, strict=True))


# ----- the overlapped step's sends behind the forward -------------------------------


@st.composite
def bucket_plans(draw: st.DrawFn) -> tuple[BucketPlan, list[list[int]], list[int]]:
    """A fixed bucket plan, DDP's buckets (global indices) and every parameter's size."""
    buckets, shapes = draw(zst.bucketed_models(max_numel=12))
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    bucket_sizes = [[sizes[i] for i in bucket] for bucket in buckets]
    world = draw(st.integers(1, 4), label="world")
    plan = assign_buckets(bucket_sizes, world, draw(st.booleans(), label="shard_buckets"))
    return plan, buckets, sizes


@SETTINGS
@given(bucket_plans(), st.one_of(st.none(), st.integers(1, 20)), st.data())
def test_send_pieces_hold_whole_parameters_of_one_shard_and_cover_every_shard(
    case: tuple[BucketPlan, list[list[int]], list[int]],
    piece_numel: int | None,
    data: st.DataObject,
) -> None:
    plan, buckets, sizes = case
    chosen = data.draw(st.lists(st.sampled_from(range(len(buckets))), unique=True), label="buckets")
    indices = dict(enumerate(buckets))
    pieces = send_pieces(plan, chosen, indices, piece_numel)
    for bucket in chosen:
        for shard in (s for s in plan.shards if s.bucket == bucket):
            mine = [q for q in pieces if q.buffer == bucket and q.owner == shard.rank]
            held = [p for q in mine for p in q.params]
            assert held == buckets[bucket][shard.offset : shard.offset + shard.count]
            for q in mine:
                numel = sum(sizes[p] for p in q.params)
                assert q.stop - q.start == numel
                assert piece_numel is None or numel <= piece_numel or len(q.params) == 1
            if piece_numel is None:
                assert len(mine) == 1
    assert {q.buffer for q in pieces} == set(chosen)


@SETTINGS
@given(bucket_plans(), st.integers(1, 20), st.data(), st.integers(0, 2**16))
def test_sends_behind_the_forward_write_each_parameter_once_its_pieces_arrived(
    case: tuple[BucketPlan, list[list[int]], list[int]],
    piece_numel: int,
    data: st.DataObject,
    seed: int,
) -> None:
    """Each rank starts from values of its own; at every arrival each
    parameter whose pieces have all arrived holds its owner's value, bit for
    bit, on every rank; the bytes are the model's, each sent once."""
    plan, buckets, sizes = case
    num_params = len(sizes)
    calls = data.draw(forward_orders(num_params))
    indices = dict(enumerate(buckets))
    pieces = send_pieces(plan, range(len(buckets)), indices, piece_numel)
    gather = in_forward_order(pieces, first_uses(calls, num_params))
    g = torch.Generator().manual_seed(seed)
    worlds = [[torch.randn(n, generator=g) for n in sizes] for _ in range(plan.world_size)]
    owner = {p: q.owner for q in pieces for p in q.params}
    final = [worlds[owner[p]][p].clone() for p in range(num_params)]
    checked: list[int] = []

    def arrived(rank: int) -> Callable[[int], None]:
        def check(count: int) -> None:
            for p in range(num_params):
                if 0 < gather.ready[p] <= count:
                    assert torch.equal(worlds[rank][p], final[p]), p
            checked.append(count)

        return check

    sent: list[Any] = []
    programs = [
        noting_arrivals(
            recording_requests(broadcast_in_forward_order(gather, rank, worlds[rank]), sent.append),
            arrived(rank),
        )
        for rank in range(plan.world_size)
    ]
    run_programs(programs)
    assert len(checked) == len(gather.pieces) * plan.world_size
    for params in worlds:
        assert all(torch.equal(a, b) for a, b in zip(params, final, strict=True))
    broadcasts = [r for r in sent if isinstance(r, Broadcast)]
    assert sum(r.tensor.numel() for r in broadcasts) == sum(sizes) * plan.world_size


@settings(max_examples=draws(40), deadline=None)
@given(
    st.sampled_from([None, "int8"]),
    st.booleans(),
    st.integers(0, 2),
    st.data(),
    st.integers(0, 2**16),
)
def test_the_overlapped_step_with_its_sends_behind_the_forward_ends_bitwise_as_without(
    compression: str | None, shard_buckets: bool, final_from: int, data: st.DataObject, seed: int
) -> None:
    """The simulated overlapped step, its owners' sends in the forward's
    order after the last bucket against the sends inside the hook: the same
    parameters on every rank, bit for bit, and the same bytes."""
    buckets, shapes = data.draw(zst.bucketed_models(max_numel=20), label="model")
    world = data.draw(st.integers(1, 4), label="world")
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [
        [[torch.randn(s, generator=g) for s in shapes] for _ in range(world)] for _ in range(3)
    ]
    calls = data.draw(forward_orders(len(params)))
    runs = [
        simulate_overlapped_step(
            buckets,
            params,
            grads,
            torch.optim.Adam,
            final_from=final_from,
            shard_buckets=shard_buckets,
            exchange_compression=compression,
            forward_order=order,
            lr=0.01,
        )
        for order in (None, first_uses(calls, len(params)))
    ]
    inside, behind = runs
    for ours, theirs in zip(behind.params, inside.params, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for ours, theirs in zip(behind.requests, inside.requests, strict=True):
        for mine, other in zip(ours, theirs, strict=True):
            assert sum(map(request_bytes, mine)) == sum(map(request_bytes, other))
