"""Communication hooks in the simulated world (no processes): the built-in hooks
against their definitions and PyTorch's arithmetic, error feedback's identity,
exact byte counts, collective mismatch detection and pure state transitions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_quant

from zerofn.comm import AllGather, AllReduce, Program
from zerofn.hooks.error_feedback import ErrorFeedbackState, error_feedback
from zerofn.hooks.gather import pack_bytes, unpack_bytes
from zerofn.hooks.hook import (
    BucketInfo,
    CommHook,
    HookState,
    allreduce_mean,
    begin_bucket,
    cast,
    finish_bucket,
    finish_iteration,
    init_hook_state,
    noop,
)
from zerofn.hooks.quantization import (
    channel_qparams,
    quantize_per_channel,
    quantize_per_tensor,
    tensor_qparams,
    to_channels,
)
from zerofn.hooks.sparsify import kept_count, top_k
from zerofn.stats import comm_stats, with_stats
from zerofn.testing.world import CollectiveMismatch, run_programs, simulate_iteration

SETTINGS = settings(max_examples=draws(40), deadline=None)
pytestmark = pytest.mark.timeout(60)

Grads = list[list[torch.Tensor]]  # [rank][bucket]


def make_grad(numel: int, kind: str, seed: int) -> torch.Tensor:
    """A gradient of a given character: what quantization and top-k find hard."""
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(numel)
    if kind == "constant":
        return torch.full((numel,), float(torch.randn((), generator=g)))
    if kind == "positive":
        return torch.rand(numel, generator=g) * 3
    scale = 10.0 ** float(torch.empty(()).uniform_(-4, 3, generator=g))
    return torch.randn(numel, generator=g) * scale


@st.composite
def worlds(draw: st.DrawFn, max_ranks: int = 4, max_buckets: int = 3) -> Grads:
    """``grads[rank][bucket]``: every rank has the same bucket sizes."""
    ranks = draw(st.integers(1, max_ranks))
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=max_buckets))
    kinds = st.sampled_from(["normal", "normal", "positive", "constant", "zeros"])
    return [
        [make_grad(n, draw(kinds), draw(st.integers(0, 2**31))) for n in sizes]
        for _ in range(ranks)
    ]


def assert_ranks_agree(outs: Grads) -> None:
    for rank_out in outs[1:]:
        for mine, theirs in zip(rank_out, outs[0], strict=True):
            assert torch.equal(mine, theirs)


def mean_over_ranks(grads: Grads, bucket: int) -> torch.Tensor:
    return torch.stack([g[bucket] for g in grads]).mean(dim=0)


def first_requests(hook: CommHook[Any, Any], grads: Grads, bucket: int) -> list[Any]:
    """The first request each rank's program makes for ``bucket``."""
    info = BucketInfo(bucket, ((grads[0][bucket].numel(),),), len(grads))
    requests = []
    for rank_grads in grads:
        _, program = begin_bucket(hook, init_hook_state(hook), rank_grads[bucket], info)
        requests.append(next(program))
    return requests


# ----- default hooks ------------------------------------------------------------


@SETTINGS
@given(worlds())
def test_allreduce_mean_is_the_mean_on_every_rank(grads: Grads) -> None:
    outs, _ = simulate_iteration(allreduce_mean(), grads)
    assert_ranks_agree(outs)
    for b in range(len(grads[0])):
        # Equal up to the rounding of the division and the sum, which may cancel.
        scale = torch.stack([g[b] for g in grads]).abs().max()
        tolerance = 4 * torch.finfo(torch.float32).eps * scale
        assert (outs[0][b] - mean_over_ranks(grads, b)).abs().max() <= tolerance


@SETTINGS
@given(worlds(), st.sampled_from([torch.float16, torch.bfloat16]))
def test_cast_allreduce_is_pytorchs_compress_arithmetic(grads: Grads, dtype: torch.dtype) -> None:
    hook = cast(allreduce_mean(), dtype)
    world = len(grads)
    outs, _ = simulate_iteration(hook, grads)
    assert_ranks_agree(outs)
    for b in range(len(grads[0])):
        # Each rank sends its gradient cast, then divided by the world size ...
        for rank, request in enumerate(first_requests(hook, grads, b)):
            assert isinstance(request, AllReduce) and request.op == "sum"
            assert torch.equal(request.tensors[0], grads[rank][b].to(dtype) / world)
        # ... and the sum comes back cast to the input dtype. The order of a sum over
        # more than two ranks is the collective's choice, so compare exactly up to two.
        if world <= 2:
            total = grads[0][b].to(dtype) / world
            for rank_grads in grads[1:]:
                total = total + rank_grads[b].to(dtype) / world
            assert outs[0][b].dtype == grads[0][b].dtype
            assert torch.equal(outs[0][b], total.to(grads[0][b].dtype))


@SETTINGS
@given(worlds())
def test_noop_returns_each_ranks_local_gradient(grads: Grads) -> None:
    outs, _ = simulate_iteration(noop(), grads)
    for rank_outs, rank_grads in zip(outs, grads, strict=True):
        for out, grad in zip(rank_outs, rank_grads, strict=True):
            assert torch.equal(out, grad)


# ----- quantization -----------------------------------------------------------------


def pytorch_per_tensor(grads: list[torch.Tensor]) -> torch.Tensor:
    """PyTorch's per-tensor hook's arithmetic, from its own observer and helpers."""
    qparams = []
    for grad in grads:
        observer = torch.ao.quantization.MinMaxObserver()
        observer(grad)
        scale, zero = observer.calculate_qparams()
        qparams.append(torch.FloatTensor([scale, zero]))
    total = torch.zeros_like(grads[0])
    for grad, (scale, zero) in zip(grads, qparams, strict=True):
        codes = torch_quant._quantize_per_tensor_backend(grad, scale, zero)
        total += torch_quant._dequantize_per_tensor_backend(codes, scale, zero)
    return total / len(grads)


def pytorch_per_channel(grads: list[torch.Tensor], bucket_size: int) -> torch.Tensor:
    """PyTorch's per-channel hook's arithmetic, padding included."""
    numel = grads[0].numel()
    pad = (0, bucket_size - numel % bucket_size)
    channels = [torch.nn.functional.pad(g, pad).view(-1, bucket_size) for g in grads]
    qparams = []
    for c in channels:
        observer = torch.ao.quantization.PerChannelMinMaxObserver()
        observer(c)
        qparams.append(torch.stack(observer.calculate_qparams()))
    total = torch.zeros_like(channels[0])
    for c, (scale, zero) in zip(channels, qparams, strict=True):
        codes = torch_quant._quantize_per_channel_backend(c, scale, zero)
        total += torch_quant._dequantize_per_channel_backend(codes, scale, zero)
    return total.flatten()[:numel] / len(grads)


@SETTINGS
@given(worlds())
def test_quantize_per_tensor_gives_pytorchs_numbers_within_a_step_of_the_mean(
    grads: Grads,
) -> None:
    outs, _ = simulate_iteration(quantize_per_tensor(), grads)
    assert_ranks_agree(outs)
    for b in range(len(grads[0])):
        bucket = [g[b] for g in grads]
        assert torch.equal(outs[0][b], pytorch_per_tensor(bucket))
        step = torch.stack([tensor_qparams(g)[0] for g in bucket]).mean()
        mean = mean_over_ranks(grads, b)
        assert ((outs[0][b] - mean).abs() <= step + 1e-6 * mean.abs()).all()


@SETTINGS
@given(worlds(), st.integers(1, 64))
def test_quantize_per_channel_gives_pytorchs_numbers_within_a_step_of_the_mean(
    grads: Grads, bucket_size: int
) -> None:
    outs, _ = simulate_iteration(quantize_per_channel(bucket_size), grads)
    assert_ranks_agree(outs)
    for b in range(len(grads[0])):
        bucket = [g[b] for g in grads]
        assert torch.equal(outs[0][b], pytorch_per_channel(bucket, bucket_size))
        numel = bucket[0].numel()
        steps = [
            channel_qparams(to_channels(g, bucket_size))[0].repeat_interleave(bucket_size)[:numel]
            for g in bucket
        ]
        step = torch.stack(steps).mean(dim=0)
        mean = mean_over_ranks(grads, b)
        assert ((outs[0][b] - mean).abs() <= step + 1e-6 * mean.abs()).all()


def test_per_channel_bucket_size_must_be_positive() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="bucket_size"):
            quantize_per_channel(bad)  # type: ignore[arg-type]


# ----- top-k and packing ------------------------------------------------------------


@SETTINGS
@given(worlds(max_ranks=1, max_buckets=1), st.floats(0.001, 1.0))
def test_top_k_alone_keeps_exactly_the_largest_entries(grads: Grads, k_fraction: float) -> None:
    grad = grads[0][0]
    outs, _ = simulate_iteration(top_k(k_fraction), grads)
    out = outs[0][0]
    kept = out != 0
    assert int(kept.sum()) <= kept_count(grad.numel(), k_fraction)
    assert torch.equal(out[kept], grad[kept])
    if (~kept).any() and kept.any():
        assert grad[~kept].abs().max() <= grad[kept].abs().min()


def test_top_k_fraction_must_be_in_zero_one() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="k_fraction"):
            top_k(bad)


@SETTINGS
@given(st.lists(st.integers(0, 20), min_size=1, max_size=4), st.integers(0, 2**31))
def test_pack_bytes_round_trips_mixed_dtypes(numels: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.uint8, torch.float16, torch.int64]
    tensors = [
        (torch.randn(n, generator=g) * 100).to(dtypes[i % len(dtypes)])
        for i, n in enumerate(numels)
    ]
    payload = pack_bytes(tensors)
    assert payload.dtype == torch.uint8
    back = unpack_bytes(payload, [(t.dtype, t.numel()) for t in tensors])
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))
    with pytest.raises(ValueError, match="bytes"):
        unpack_bytes(payload, [(torch.uint8, payload.numel() + 1)])


# ----- error feedback ---------------------------------------------------------------

LOSSY: dict[str, Callable[[], CommHook[Any, Any]]] = {
    "quantize_per_tensor": quantize_per_tensor,
    "quantize_per_channel": lambda: quantize_per_channel(16),
    "top_k": lambda: top_k(0.2),
    "fp16_allreduce": lambda: cast(allreduce_mean(), torch.float16),
}
GATHERING = ["quantize_per_tensor", "quantize_per_channel", "top_k"]


def iterations(grads: Grads, count: int) -> Iterator[Grads]:
    """``count`` iterations of gradients: the drawn ones, then shifted copies."""
    for i in range(count):
        yield [[g * (1 + i) + i for g in rank] for rank in grads]


def errors(states: list[HookState[Any, Any]], bucket: int) -> list[torch.Tensor]:
    return [s.bucket(bucket).error for s in states]


def assert_identity(
    lhs: torch.Tensor, rhs: torch.Tensor, terms: Sequence[torch.Tensor] = ()
) -> None:
    # Equal up to the rounding of one subtraction (and, across ranks, of a
    # mean), relative to the largest value that was rounded: the result, or
    # one of the ``terms`` it was computed from (a rank's error may be far
    # larger than the mean it contributes to).
    scale = torch.stack([t.abs().max() for t in (rhs, *terms)]).max().clamp_min(1e-30)
    tolerance = 4 * torch.finfo(torch.float32).eps * scale
    assert (lhs - rhs).abs().max() <= tolerance


@SETTINGS
@given(worlds(max_ranks=1), st.sampled_from(sorted(LOSSY)))
def test_error_feedback_alone_loses_nothing(grads: Grads, name: str) -> None:
    hook = error_feedback(LOSSY[name]())
    states = None
    for step in iterations(grads, 3):
        old = errors(states, 0)[0] if states else torch.zeros_like(step[0][0])
        outs, states = simulate_iteration(hook, step, states)
        # decoded + new error == gradient + old error
        assert_identity(outs[0][0] + errors(states, 0)[0], step[0][0] + old)


@SETTINGS
@given(worlds(), st.sampled_from(GATHERING))
def test_error_feedback_over_ranks_sends_the_mean_eventually(grads: Grads, name: str) -> None:
    hook = error_feedback(LOSSY[name]())
    states = None
    for step in iterations(grads, 2):
        old = [torch.zeros_like(g) for g in step[0]]
        old_terms: list[list[torch.Tensor]] = [[] for _ in old]
        if states is not None:
            old_terms = [errors(states, b) for b in range(len(old))]
            old = [torch.stack(terms).mean(dim=0) for terms in old_terms]
        outs, states = simulate_iteration(hook, step, states)
        assert_ranks_agree(outs)
        for b in range(len(old)):
            owed = torch.stack(errors(states, b)).mean(dim=0)
            # decoded + mean(new errors) == mean(gradients) + mean(old errors)
            terms = [*errors(states, b), *old_terms[b], *(rank[b] for rank in step)]
            assert_identity(outs[0][b] + owed, mean_over_ranks(step, b) + old[b], terms)


def test_error_feedback_restarts_a_bucket_whose_layout_changed() -> None:
    hook = error_feedback(top_k(0.25))
    grad = torch.arange(1.0, 9.0)
    _, states = simulate_iteration(hook, [[grad]], shapes=[[(8,)]])
    assert states[0].bucket(0).error.abs().sum() > 0
    # Same bucket index, other gradients (DDP rebuilt its buckets): no stale error.
    outs, _ = simulate_iteration(hook, [[grad]], states, shapes=[[(2, 4)]])
    fresh, _ = simulate_iteration(hook, [[grad]], shapes=[[(2, 4)]])
    assert torch.equal(outs[0][0], fresh[0][0])


def test_cast_error_feedback_top_k_composes() -> None:
    hook = cast(error_feedback(top_k(0.1)), torch.float16)
    grads = [[make_grad(50, "normal", r), make_grad(7, "normal", 9 + r)] for r in range(3)]
    outs, states = simulate_iteration(hook, grads)
    assert_ranks_agree(outs)
    assert all(o.dtype == torch.float32 for o in outs[0])
    state = states[0].bucket(0)
    assert isinstance(state, ErrorFeedbackState) and state.error.dtype == torch.float16


# ----- statistics -------------------------------------------------------------------


def expected_bytes(name: str, numel: int) -> int:
    """Bytes one rank hands to the bucket's one collective."""
    channels = -(-numel // 16)
    return {
        "allreduce": 4 * numel,
        "fp16": 2 * numel,
        "quantize_per_tensor": 2 * 4 + numel,
        "quantize_per_channel": 2 * 4 * channels + 16 * channels,
        "top_k": kept_count(numel, 0.2) * (4 + 4),
    }[name]


STATS_HOOKS: dict[str, Callable[[], CommHook[Any, Any]]] = {
    "allreduce": allreduce_mean,
    "fp16": lambda: cast(allreduce_mean(), torch.float16),
    "quantize_per_tensor": quantize_per_tensor,
    "quantize_per_channel": lambda: quantize_per_channel(16),
    "top_k": lambda: top_k(0.2),
}


@SETTINGS
@given(worlds(), st.sampled_from(sorted(STATS_HOOKS)))
def test_with_stats_counts_bytes_exactly_and_changes_no_number(grads: Grads, name: str) -> None:
    plain, _ = simulate_iteration(STATS_HOOKS[name](), grads)
    hook = with_stats(STATS_HOOKS[name]())
    outs, states = simulate_iteration(hook, grads)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], plain[0], strict=True))
    per_bucket = [expected_bytes(name, g.numel()) for g in grads[0]]
    stats = comm_stats(states[0])
    assert stats.bytes_per_iteration == stats.total_bytes == sum(per_bucket)
    assert stats.collectives_per_bucket == tuple((b, 1) for b in range(len(per_bucket)))
    _, states = simulate_iteration(hook, grads, states)
    again = comm_stats(states[0])
    assert (again.bytes_per_iteration, again.total_bytes) == (sum(per_bucket), 2 * sum(per_bucket))
    assert [states[0].bucket(b).runs for b in range(len(per_bucket))] == [2] * len(per_bucket)


def test_noop_with_stats_requests_nothing() -> None:
    _, states = simulate_iteration(with_stats(noop()), [[torch.ones(3)], [torch.ones(3)]])
    assert comm_stats(states[0]).bytes_per_iteration == 0
    assert comm_stats(states[0]).collectives_per_bucket == ((0, 0),)


def test_comm_stats_needs_with_stats_outermost() -> None:
    _, states = simulate_iteration(error_feedback(with_stats(top_k(0.5))), [[torch.ones(4)]])
    with pytest.raises(TypeError, match="StatsState"):
        comm_stats(states[0])


# ----- collective mismatches --------------------------------------------------------


def one_request(request: Any) -> Program[None]:
    yield request


def finished() -> Program[None]:
    return None
    yield  # a program that makes no request


@pytest.mark.parametrize(
    "requests",
    [
        [AllReduce((torch.ones(3),)), AllReduce((torch.ones(4),))],
        [AllReduce((torch.ones(3),)), AllReduce((torch.ones(3, dtype=torch.float16),))],
        [AllReduce((torch.ones(3),), "sum"), AllReduce((torch.ones(3),), "avg")],
        [AllReduce((torch.ones(3),)), AllReduce((torch.ones(3), torch.ones(1)))],
        [AllReduce((torch.ones(3),)), AllGather(torch.ones(3))],
        [AllGather(torch.ones(3)), AllGather(torch.ones(2))],
        [AllGather(torch.ones(3)), None],
    ],
    ids=["shape", "dtype", "op", "count", "kind", "gather-shape", "one-rank-done"],
)
def test_ranks_asking_for_different_collectives_are_caught(requests: list[Any]) -> None:
    programs = [finished() if r is None else one_request(r) for r in requests]
    with pytest.raises(CollectiveMismatch):
        run_programs(programs)


def test_a_hook_fed_different_bucket_sizes_is_caught() -> None:
    with pytest.raises(CollectiveMismatch):
        simulate_iteration(quantize_per_tensor(), [[torch.ones(5)], [torch.ones(6)]])


# ----- purity of the state transitions ----------------------------------------------


@SETTINGS
@given(worlds(max_ranks=1, max_buckets=2))
def test_hook_state_transitions_leave_their_inputs_unchanged(grads: Grads) -> None:
    hook = with_stats(error_feedback(quantize_per_tensor()))
    state = init_hook_state(hook)
    for index, grad in enumerate(grads[0]):
        info = BucketInfo(index, ((grad.numel(),),), 1, is_last=index == len(grads[0]) - 1)
        grad_before, buckets_before = grad.clone(), state.buckets
        started, program = begin_bucket(hook, state, grad, info)
        assert state.buckets is buckets_before and started is not state
        [(_, bucket_state)] = run_programs([program])
        assert torch.equal(grad, grad_before)
        finished_state = finish_bucket(started, index, bucket_state)
        assert started.buckets is buckets_before
        assert finished_state.bucket(index) is bucket_state
        state = finished_state
    last = finish_iteration(hook, state)
    assert last is not state and last.buckets == state.buckets
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.global_state = 1  # type: ignore[misc]


def test_finish_bucket_replaces_only_its_own_bucket() -> None:
    state: HookState[None, str] = HookState(None, ((0, "a"), (1, "b")))
    new = finish_bucket(state, 0, "c")
    assert (new.bucket(0), new.bucket(1)) == ("c", "b")
    assert (state.bucket(0), state.bucket(1)) == ("a", "b")
