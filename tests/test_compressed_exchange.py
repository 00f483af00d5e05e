"""The compressed ZeRO exchange in the pure core: the block codec's bounds and
bytes, and the production step program (``zerofn.zero.step.zero_step``, run
by ``zerofn.testing.zero`` on simulated ranks) keeping every replica
identical with a bounded, non-accumulating distance from the masters; and
the overlapped step's compressed sends (``zerofn.testing.overlap``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zerofn.blockquant import BlockQuantizer, quantizer_for
from zerofn.comm import Broadcast, GatherSegments
from zerofn.testing.compressed import master_replica_gap
from zerofn.testing.overlap import simulate_overlapped_step
from zerofn.testing.zero import SimulatedRank, simulated_ranks, step_simulated
from zerofn.zero.compressed.exchange import exchange_bytes, local_spans, update_parts
from zerofn.zero.compressed.payloads import piece_bounds, piece_numel
from zerofn.zero.optimizers import steps_in_parts
from zerofn.zero.options import compression_master_dtype, resolve_compression
from zerofn.zero.planning.plan import plan_shards

quantizers = st.builds(
    BlockQuantizer, st.sampled_from([8, 4]), st.sampled_from([2, 4, 16, 64, 128])
)


def block_scales(q: BlockQuantizer, payload: torch.Tensor, numel: int) -> torch.Tensor:
    """Each element's block scale, read back from a payload."""
    scales = payload[: q.blocks(numel) * 4].view(torch.float32)
    return scales.repeat_interleave(q.block)[:numel]


@settings(max_examples=draws(80), deadline=None)
@given(
    q=quantizers,
    numel=st.integers(0, 700),
    seed=st.integers(0, 2**16),
    spread=st.floats(1e-6, 1e4),
)
@example(q=BlockQuantizer(8, 2), numel=585, seed=258, spread=213.0)  # an error of 0.5000079 steps
def test_round_trip_error_is_within_half_a_step_per_block(
    q: BlockQuantizer, numel: int, seed: int, spread: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) * spread
    payload = torch.empty(q.payload_nbytes(numel), dtype=torch.uint8)
    q.encode(values, payload)
    decoded = q.decode(payload, numel)
    scales = block_scales(q, payload, numel)
    # Half a step, plus float32's own roundings: encoding's x * (1 / scale)
    # (two, 2**-24 each, relative to x) and decoding's code * scale (one,
    # relative to the decoded value, at most |x| + scale / 2). Near code 127
    # these reach 1e-5 of a half step, so no bound relative to the step alone holds.
    rounding = (values.abs() + scales) * 2.0**-22
    assert ((values - decoded).abs() <= scales / 2 + rounding).all()
    # Scales are the blocks' largest magnitudes over the largest code.
    if numel:
        first = values[: q.block].abs().max() / q.qmax
        assert torch.allclose(scales[0], first)
    # The bytes are the codes, the scales and padding to 4.
    codes = numel if q.bits == 8 else (numel + 1) // 2
    assert q.payload_nbytes(numel) - (q.blocks(numel) * 4 + codes) in range(4)


def test_an_all_zero_block_decodes_to_zeros() -> None:
    q = quantizer_for("int4", block=4)
    values = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5])
    payload = torch.empty(q.payload_nbytes(7), dtype=torch.uint8)
    q.encode(values, payload)
    decoded = q.decode(payload, 7)
    assert torch.equal(decoded[:4], torch.zeros(4))
    assert decoded[5] == -2.0


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: quantizer_for("int2"), ValueError),
        (lambda: BlockQuantizer(4, 127), ValueError),
        (lambda: BlockQuantizer(6, 128), ValueError),  # type: ignore[arg-type]
        (lambda: BlockQuantizer(8, 1), ValueError),
        (lambda: resolve_compression("int8", torch.int64), ValueError),
        (lambda: resolve_compression(8, torch.float32), TypeError),
        (lambda: compression_master_dtype(torch.float32, torch.bfloat16), ValueError),
    ],
)
def test_bad_compressions_are_refused(make: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()  # type: ignore[operator]


def test_a_payload_of_the_wrong_length_is_refused() -> None:
    q = quantizer_for("int8")
    with pytest.raises(ValueError, match="payload of"):
        q.encode(torch.zeros(10), torch.empty(3, dtype=torch.uint8))


def gap_and_bound(rank: SimulatedRank) -> tuple[torch.Tensor, torch.Tensor]:
    """|master - replica| and its bound, per element of the rank's segment."""
    return master_replica_gap(rank)


def distance(rank: SimulatedRank) -> torch.Tensor:
    """How far each element is inside (negative) or beyond its bound."""
    gap, bound = gap_and_bound(rank)
    return gap - bound


@settings(max_examples=draws(25), deadline=None)
@given(
    mode=st.sampled_from(["greedy", "balanced", "flat"]),
    world=st.integers(1, 4),
    compression=st.sampled_from(["int8", "int4"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    sizes=st.lists(st.integers(1, 90), min_size=1, max_size=5),
    bucket_view=st.booleans(),
    piece_elements=st.sampled_from([1, 200]),
    seed=st.integers(0, 1000),
)
def test_replicas_stay_identical_and_close_to_the_masters(
    mode: str,
    world: int,
    compression: str,
    dtype: torch.dtype,
    sizes: list[int],
    bucket_view: bool,
    piece_elements: int,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    plan = plan_shards([sizes], ["k"] * len(sizes), [True] * len(sizes), world, mode)  # type: ignore[arg-type]

    def world_of(piece: int) -> list[SimulatedRank]:
        return simulated_ranks(
            plan,
            params,
            torch.optim.Adam,
            bucket_view=bucket_view,
            exchange_compression=compression,
            piece_elements=piece,
            lr=0.05,
        )

    # Segments of up to 450 elements: one piece, and pieces of one or two
    # 128-element blocks, which must send the same codes.
    ranks, whole = world_of(piece_elements), world_of(10**6)
    planned = exchange_bytes(quantizer_for(compression), plan)
    for _ in range(12):
        grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        requests = step_simulated(ranks, grads)
        step_simulated(whole, grads)
        for other in [*ranks[1:], whole[0]]:
            assert all(
                torch.equal(a, b) for a, b in zip(ranks[0].params, other.params, strict=True)
            )
        for rank in ranks:
            if rank.shards.plan.layouts[0].segments[rank.shards.rank].length:
                assert (distance(rank) <= 0).all()
        sent = [r for r in requests[0] if isinstance(r, GatherSegments)]
        assert sum(sum(t.numel() for t in r.segments) for r in sent) == planned


def test_the_error_does_not_accumulate_over_many_steps() -> None:
    """A thousand steps of small updates: the replica's distance from the
    master stays at the size of one step's rounding, while the masters
    travel far further than that."""
    sizes = [300, 77]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g) for n in sizes]
    plan = plan_shards([sizes], ["k", "k"], [True, True], 2, "flat")
    ranks = simulated_ranks(plan, params, torch.optim.SGD, exchange_compression="int4", lr=1e-3)
    worst = []
    for _ in range(1000):
        step_simulated(ranks, [torch.randn(n, generator=g) for n in sizes])
        worst.append(max(gap_and_bound(r)[0].max().item() for r in ranks))
    moved = max((a - b).abs().max().item() for a, b in zip(ranks[0].params, params, strict=True))
    # int4 steps are 1/14 of a block's largest difference (about one SGD
    # update, 1e-3 * |grad|): the gap stays near that, flat over time.
    assert max(worst[500:]) <= 1.5 * max(worst[:500])
    assert max(worst) < 2e-3 < moved


def test_a_rank_without_gradients_still_sends_its_residual() -> None:
    """A step where nobody has gradients (Join's shadow step) leaves the
    masters where they are and moves the replicas towards them."""
    params = [torch.randn(50), torch.randn(30)]
    plan = plan_shards([[50, 30]], ["k", "k"], [True, True], 2, "greedy")
    ranks = simulated_ranks(plan, params, torch.optim.Adam, exchange_compression="int4", lr=0.1)
    step_simulated(ranks, [torch.randn(50), torch.randn(30)])
    before = [[m.clone() for m in r.masters.master] for r in ranks]  # type: ignore[union-attr]
    gap_before = max(d.max().item() for d in map(distance, ranks))
    step_simulated(ranks, [None, None])
    for r, kept in zip(ranks, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(r.masters.master, kept, strict=True))  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0].params, ranks[1].params, strict=True))
    assert max(d.max().item() for d in map(distance, ranks)) <= max(gap_before, 0.0)


@settings(max_examples=draws(15), deadline=None)
@given(
    shard_buckets=st.booleans(),
    interleaved=st.booleans(),
    compression=st.sampled_from(["int8", "int4"]),
    seed=st.integers(0, 1000),
)
def test_the_overlapped_step_keeps_replicas_identical(
    shard_buckets: bool, interleaved: bool, compression: str, seed: int
) -> None:
    """The overlapped step (``zerofn.overlap.orders``, the program the DDP hook
    runs) with compressed sends: every rank's parameters equal after every
    iteration, and close to the exact overlapped step's."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(40, generator=g), torch.randn(13, 3, generator=g), torch.randn(7)]
    grads = [
        [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)] for _ in range(5)
    ]
    runs = {
        name: simulate_overlapped_step(
            [[2, 1], [0]],
            params,
            grads,
            torch.optim.Adam,
            final_from=1,
            shard_buckets=shard_buckets,
            interleaved=interleaved,
            exchange_compression=name,
            lr=0.01,
        )
        for name in (None, compression)
    }
    squeezed = runs[compression]
    assert all(torch.equal(a, b) for a, b in zip(*squeezed.params, strict=True))
    gap = max(
        (a - b).abs().max().item()
        for a, b in zip(squeezed.params[0], runs[None].params[0], strict=True)
    )
    # Three overlapped iterations of Adam (lr 0.01): within a few steps' codes.
    assert gap < (1e-3 if compression == "int8" else 1e-2)
    sent = [r for r in squeezed.requests[-1][0] if isinstance(r, Broadcast)]
    assert sent and all(r.tensor.dtype == torch.uint8 for r in sent)


class _AdamInOneStep(torch.optim.Adam):
    """Adam's numbers; being a subclass, stepped whole (``steps_in_parts``)."""


@settings(max_examples=draws(25), deadline=None)
@given(
    mode=st.sampled_from(["greedy", "balanced", "flat"]),
    world=st.integers(1, 3),
    compression=st.sampled_from(["int8", "int4"]),
    sizes=st.lists(st.integers(0, 90), min_size=1, max_size=6).filter(any),
    piece_elements=st.sampled_from([1, 64, 10**6]),
    seed=st.integers(0, 1000),
)
def test_an_update_in_parts_gives_the_numbers_of_one_whole_step(
    mode: str, world: int, compression: str, sizes: list[int], piece_elements: int, seed: int
) -> None:
    """Adam steps its masters a part at a time beside the compressed
    exchange; its subclass, stepped whole before the exchange, ends every
    step with the same parameters, masters and optimizer state, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    plan = plan_shards([sizes], ["k"] * len(sizes), [True] * len(sizes), world, mode)  # type: ignore[arg-type]

    def world_of(optimizer: type[torch.optim.Optimizer]) -> list[SimulatedRank]:
        return simulated_ranks(
            plan, params, optimizer, exchange_compression=compression,
            piece_elements=piece_elements, elementwise=True, lr=0.05, weight_decay=0.01,
        )  # fmt: skip

    in_parts, whole = world_of(torch.optim.Adam), world_of(_AdamInOneStep)
    assert all(r.compressed is not None and r.compressed.in_parts for r in in_parts)
    assert not any(r.compressed is not None and r.compressed.in_parts for r in whole)
    calls = [0] * world
    for rank, sim in enumerate(in_parts):
        step = sim.optimizer.step

        def counted(*args: object, rank: int = rank, step: Any = step) -> object:
            calls[rank] += 1
            return step(*args)

        sim.optimizer.step = counted  # type: ignore[method-assign]
    for _ in range(3):
        grads = [torch.randn(n, generator=g) for n in sizes]
        step_simulated(in_parts, grads)
        step_simulated(whole, grads)
        for a, b in zip(in_parts, whole, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))
            assert a.masters is not None and b.masters is not None
            assert all(
                torch.equal(x, y) for x, y in zip(a.masters.master, b.masters.master, strict=True)
            )
            ours, theirs = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[i][k], theirs[i][k]) for i in ours for k in ours[i])
            assert all(m.grad is None for m in a.masters.master)
    # One part per piece that starts a tensor: more than one where the
    # tensors start in different pieces.
    for rank, sim in enumerate(in_parts):
        spans = local_spans(plan, rank, sim.shards.local_sources(sim.params))
        parts = update_parts(plan, spans, sim.zero.exchange.piece)  # type: ignore[union-attr]
        assert calls[rank] == 3 * len(parts)


@settings(max_examples=draws(80), deadline=None)
@given(
    mode=st.sampled_from(["greedy", "balanced", "flat"]),
    world=st.integers(1, 4),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8).filter(any),
    piece=st.sampled_from([2, 64, 128, 1024]),
)
def test_update_parts_step_every_tensor_once_before_its_first_piece(
    mode: str, world: int, sizes: list[int], piece: int
) -> None:
    plan = plan_shards([sizes], ["k"] * len(sizes), [True] * len(sizes), world, mode)  # type: ignore[arg-type]
    params = [torch.zeros(n) for n in sizes]
    for rank in range(world):
        sim = simulated_ranks(plan, params, torch.optim.SGD, exchange_compression="int8", lr=0.1)[
            rank
        ]
        spans = local_spans(plan, rank, sim.shards.local_sources(sim.params))
        parts = update_parts(plan, spans, piece)
        named = [t for tensors in parts.values() for t in tensors]
        assert sorted(named) == sorted(set(named))
        assert set(named) == {t for t, span in enumerate(spans) if span is not None}
        assert list(parts) == sorted(parts)
        for (layout, k), tensors in parts.items():
            length = plan.layouts[layout].segments[rank].length
            for t in tensors:
                span = spans[t]
                assert span is not None and span.layout == layout
                # The piece holding the tensor's first element (an empty
                # tensor at the segment's end: the last piece).
                assert k * piece <= max(span.offset, 0)
                assert span.offset < (k + 1) * piece or span.offset >= length - span.numel


def test_only_torch_optim_s_own_element_wise_classes_without_hooks_step_in_parts() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    assert steps_in_parts(torch.optim.Adam([param]))
    assert steps_in_parts(torch.optim.SGD([param], lr=0.1))
    assert not steps_in_parts(_AdamInOneStep([param]))
    assert not steps_in_parts(torch.optim.LBFGS([param]))
    hooked = torch.optim.AdamW([param])
    handle = hooked.register_step_post_hook(lambda *_: None)
    assert not steps_in_parts(hooked)
    handle.remove()
    assert steps_in_parts(hooked)
    handle = register_optimizer_step_pre_hook(lambda *_: None)
    try:
        assert not steps_in_parts(torch.optim.Adam([param]))
    finally:
        handle.remove()


@settings(max_examples=draws(80), deadline=None)
@given(
    q=st.builds(BlockQuantizer, st.sampled_from([8, 4]), st.integers(1, 40).map(lambda b: 2 * b)),
    elements=st.integers(1, 300),
    length=st.integers(0, 900),
)
def test_a_segments_pieces_lay_their_payloads_end_to_end(
    q: BlockQuantizer, elements: int, length: int
) -> None:
    # Pieces are whole blocks whose codes fill whole 4-byte words: only the
    # last pads, so the pieces' payloads fill the segment's exactly.
    piece = piece_numel(q, elements)
    assert piece >= elements and piece % q.block == 0
    count = max(1, -(-length // piece))
    ends = []
    for k in range(count):
        start, numel, at, nbytes = piece_bounds(q, piece, length, k)
        assert at == (ends[-1] if ends else 0)
        ends.append(at + nbytes)
        assert numel == min(piece, length - start)
    assert ends[-1] == q.payload_nbytes(length)
