"""Failure in the simulated world: a dropped rank gives every other rank a
CollectiveError (cause: PeerLost), never a result; the new requests
(broadcast, reduce, segment exchange) reduce as their real collectives do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.comm import (
    AllToAll,
    Broadcast,
    GatherSegments,
    Program,
    Reduce,
    Request,
    describe,
    request_bytes,
)
from zerofn.errors import CollectiveError, PeerLost
from zerofn.hooks import powersgd
from zerofn.hooks.error_feedback import error_feedback
from zerofn.hooks.hook import CommHook, allreduce_mean, cast
from zerofn.hooks.quantization import quantize_per_channel, quantize_per_tensor
from zerofn.hooks.sparsify import top_k
from zerofn.testing.world import (
    CollectiveMismatch,
    Dropout,
    fulfil,
    run_programs,
    simulate_iteration,
)

SETTINGS = settings(max_examples=draws(30), deadline=None)
pytestmark = pytest.mark.timeout(120)

HOOKS: dict[str, CommHook[Any, Any]] = {
    "allreduce": allreduce_mean(),
    "fp16": cast(allreduce_mean(), torch.float16),
    "quantize-per-tensor": quantize_per_tensor(),
    "quantize-per-channel": quantize_per_channel(4),
    "fp16+error-feedback+top-k": cast(error_feedback(top_k(0.25)), torch.float16),
    "powersgd": powersgd.layerwise(powersgd.PowerSGDConfig(1, start_powerSGD_iter=2)),
    "batched-powersgd": powersgd.batched(powersgd.PowerSGDConfig(1, start_powerSGD_iter=2)),
}
SHAPES = [[(6, 5), (7,)], [(4, 4)]]  # two buckets: a matrix and a vector, then a matrix


def grads_for(world_size: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(sum(torch.Size(s).numel() for s in bucket), generator=g) for bucket in SHAPES]
        for _ in range(world_size)
    ]


def warmed(hook: CommHook[Any, Any], grads: list[list[torch.Tensor]]) -> list[Any]:
    """Each rank's state after two clean iterations (PowerSGD compresses from then on)."""
    states = None
    for _ in range(2):
        _, states = simulate_iteration(hook, grads, states, shapes=SHAPES)
    assert states is not None
    return states


def requests_in_iteration(
    hook: CommHook[Any, Any], grads: list[list[torch.Tensor]], states: list[Any]
) -> int:
    """How many requests each rank makes in one iteration (counted by runs
    that drop a rank ever later, until one finishes)."""
    counted = 0
    while True:
        try:
            simulate_iteration(hook, grads, states, shapes=SHAPES, drop=Dropout(0, counted))
        except CollectiveError:
            counted += 1
            continue
        return counted


@SETTINGS
@given(
    name=st.sampled_from(sorted(HOOKS)),
    world_size=st.integers(2, 5),
    data=st.data(),
)
def test_a_dropped_rank_fails_the_others_and_never_yields_a_result(
    name: str, world_size: int, data: st.DataObject
) -> None:
    hook = HOOKS[name]
    grads = grads_for(world_size, data.draw(st.integers(0, 2**16)))
    states = warmed(hook, grads)
    total = requests_in_iteration(hook, grads, states)
    assert total >= len(SHAPES)
    if "powersgd" in name:  # some bucket compressed: its P and Q rounds are both droppable
        assert total > len(SHAPES)
    rank = data.draw(st.integers(0, world_size - 1))
    at = data.draw(st.integers(0, total - 1))
    with pytest.raises(CollectiveError) as caught:
        simulate_iteration(hook, grads, states, shapes=SHAPES, drop=Dropout(rank, at))
    error = caught.value
    assert isinstance(error.__cause__, PeerLost)
    assert f"rank {rank} was dropped" in str(error)
    assert f"collective #{at}" in str(error) and f"simulated world of {world_size}" in str(error)


@SETTINGS
@given(name=st.sampled_from(sorted(HOOKS)), world_size=st.integers(2, 4), seed=st.integers(0, 99))
def test_a_rank_dropped_after_the_last_collective_changes_nothing(
    name: str, world_size: int, seed: int
) -> None:
    hook = HOOKS[name]
    grads = grads_for(world_size, seed)
    states = warmed(hook, grads)
    total = requests_in_iteration(hook, grads, states)
    late, _ = simulate_iteration(hook, grads, states, shapes=SHAPES, drop=Dropout(1, total))
    clean, _ = simulate_iteration(hook, grads, states, shapes=SHAPES)
    for late_rank, clean_rank in zip(late, clean, strict=True):
        for a, b in zip(late_rank, clean_rank, strict=True):
            assert torch.equal(a, b)


def test_dropping_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot drop rank 3 from a world of 2"):
        simulate_iteration(allreduce_mean(), grads_for(2, 0), shapes=SHAPES, drop=Dropout(3))


def test_every_program_is_closed_when_a_rank_drops() -> None:
    closed: list[int] = []

    def program(rank: int) -> Program[None]:
        try:
            yield Reduce(torch.ones(2), dst=0)
        finally:
            closed.append(rank)

    with pytest.raises(CollectiveError, match="reduce to rank 0"):
        run_programs([program(r) for r in range(3)], drop=Dropout(2, 0))
    assert sorted(closed) == [0, 1, 2]


# ----- the requests the ZeRO step, the overlap and Join need ------------------------


@given(world_size=st.integers(1, 6), numel=st.integers(0, 9), data=st.data())
@SETTINGS
def test_broadcast_gives_every_rank_the_sources_payload(
    world_size: int, numel: int, data: st.DataObject
) -> None:
    src = data.draw(st.integers(0, world_size - 1))
    payloads = [torch.full((numel,), float(r)) for r in range(world_size)]
    responses = fulfil([Broadcast(p, src) for p in payloads])
    # Received in place, as a process group does.
    assert all(
        r[0] is p and torch.equal(p, torch.full((numel,), float(src)))
        for r, p in zip(responses, payloads, strict=True)
    )


@given(world_size=st.integers(1, 6), numel=st.integers(0, 9), data=st.data())
@SETTINGS
def test_reduce_sums_onto_its_destination_only(
    world_size: int, numel: int, data: st.DataObject
) -> None:
    dst = data.draw(st.integers(0, world_size - 1))
    payloads = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(world_size)]
    before = [p.clone() for p in payloads]
    responses = fulfil([Reduce(p, dst) for p in payloads])
    # As a process group does: the handed-over tensor on dst holds the sum.
    assert responses[dst][0] is payloads[dst]
    assert torch.equal(payloads[dst], torch.stack(before).sum(0))
    for rank, response in enumerate(responses):
        if rank != dst:  # unspecified in general; here: the rank's own payload
            assert torch.equal(response[0], before[rank])


@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    collective=st.sampled_from(["all_gather", "broadcasts"]),
)
@SETTINGS
def test_segment_exchange_fills_each_segment_from_its_owner(
    sizes: list[int], collective: Any
) -> None:
    world_size = len(sizes)

    def segments_of(rank: int) -> tuple[torch.Tensor, ...]:
        # A rank knows only its own segment; the others are stale buffers.
        return tuple(
            torch.full((n,), float(owner if owner == rank else -1)) for owner, n in enumerate(sizes)
        )

    requests: list[Request] = [
        GatherSegments(segments_of(r), r, collective) for r in range(world_size)
    ]
    for response in fulfil(requests):
        for owner, segment in enumerate(response):
            assert torch.equal(segment, torch.full((sizes[owner],), float(owner)))


@given(
    sizes=st.integers(1, 5).flatmap(
        lambda w: st.lists(
            st.lists(st.integers(0, 4), min_size=w, max_size=w), min_size=w, max_size=w
        )
    )
)
@SETTINGS
def test_all_to_all_delivers_each_part_to_its_rank_alone(sizes: list[list[int]]) -> None:
    """``sizes[src][dst]``: how many elements rank src sends rank dst."""
    world_size = len(sizes)

    def part(src: int, dst: int) -> torch.Tensor:
        return torch.full((sizes[src][dst],), float(10 * src + dst))

    requests: list[Request] = [
        AllToAll(
            tuple(part(r, dst) for dst in range(world_size)),
            tuple(torch.full((sizes[src][r],), -1.0) for src in range(world_size)),
            r,
        )
        for r in range(world_size)
    ]
    for rank, response in enumerate(fulfil(requests)):
        assert response is requests[rank].receives  # received in place
        for src, received in enumerate(response):
            assert torch.equal(received, part(src, rank))
        sent = sum(sizes[rank]) - sizes[rank][rank]
        assert request_bytes(requests[rank]) == 4 * sent  # its own part does not leave


def test_an_all_to_all_that_does_not_fit_together_is_refused() -> None:
    with pytest.raises(ValueError, match="one send and one receive per rank"):
        AllToAll((torch.ones(1),), (torch.ones(1), torch.ones(1)), 0)
    with pytest.raises(ValueError, match="one dtype"):
        AllToAll((torch.ones(1),), (torch.ones(1, dtype=torch.uint8),), 0)
    with pytest.raises(ValueError, match="rank 1"):
        AllToAll((torch.ones(1),), (torch.ones(1),), 1)


@pytest.mark.parametrize(
    "requests",
    [
        [Broadcast(torch.ones(2), 0), Broadcast(torch.ones(2), 1)],
        [Reduce(torch.ones(2), 0), Reduce(torch.ones(3), 0)],
        [
            GatherSegments((torch.ones(2), torch.ones(1)), 0),
            GatherSegments((torch.ones(1), torch.ones(2)), 1),
        ],
        [Broadcast(torch.ones(2), 0), Reduce(torch.ones(2), 0)],
        [
            AllToAll((torch.ones(1), torch.ones(2)), (torch.ones(1), torch.ones(1)), 0),
            AllToAll((torch.ones(1), torch.ones(1)), (torch.ones(1), torch.ones(1)), 1),
        ],
    ],
    ids=["broadcast-root", "reduce-shape", "segment-sizes", "kind", "all-to-all-sizes"],
)
def test_ranks_disagreeing_on_the_new_requests_are_caught(requests: list[Request]) -> None:
    with pytest.raises(CollectiveMismatch):
        fulfil(requests)


def test_describe_names_the_collective_and_its_size() -> None:
    assert describe(Broadcast(torch.ones(256), 1)) == "broadcast from rank 1 of 1.0 KiB"
    assert describe(Reduce(torch.ones(3), 0)) == "reduce to rank 0 of 12 B"
    exchange = GatherSegments((torch.ones(2), torch.ones(2)), 0, "all_gather")
    assert describe(exchange) == "exchange of 2 segments by all-gather, 16 B in all"
    parts = (torch.ones(2), torch.ones(3))
    assert describe(AllToAll(parts, parts, 1)) == "all_to_all among 2 ranks, 8 B sent"
