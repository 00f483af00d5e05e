"""Random-k with the iteration's shared random stream: its positions change
every iteration, agree on every rank, and, with error feedback, every entry
is sent eventually (where a codec with fixed positions never sends some);
the payload is the values alone; bad inputs are refused. Then the hook on a
real DDP model on 2 gloo ranks.

Several properties are statistical: each test's comment bounds the chance
that a correct hook fails it, far below one in a million per example.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from _draws import draws
from _world import run_world
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks import HookRunner

from zerofn.hooks.error_feedback import ErrorFeedbackState, error_feedback
from zerofn.hooks.gather import SharedStream, StreamState, next_iteration, shared_random_hook
from zerofn.hooks.hook import CommHook, HookState, cast
from zerofn.hooks.random_k import random_k, random_k_codec, random_positions
from zerofn.hooks.sparsify import kept_count
from zerofn.stats import comm_stats, with_stats
from zerofn.testing.world import simulate_iteration

pytestmark = pytest.mark.timeout(120)

Grads = list[list[torch.Tensor]]  # [rank][bucket]


def positive_grads(ranks: int, sizes: list[int], seed: int) -> Grads:
    """Gradients without zeros (so a result's support is exactly what was
    sent), different on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[0.5 + 1.5 * torch.rand(n, generator=g) for n in sizes] for _ in range(ranks)]


def support(result: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.nonzero(result).flatten().tolist())


def fixed_positions(hook: CommHook[StreamState, Any]) -> CommHook[StreamState, Any]:
    """The trap: the same hook with a stream that never moves on, so it
    draws iteration 0's positions every iteration (as a codec that seeds a
    generator of its own the same way on every call does)."""
    return attrs.evolve(hook, end_iteration=lambda state: state)


@st.composite
def sparse_sizes(draw: st.DrawFn, max_numel: int = 200) -> tuple[int, float]:
    """A bucket length and a fraction that keeps some but not all of it."""
    numel = draw(st.integers(2, max_numel))
    k_fraction = draw(st.floats(0.01, 0.95))
    assume(kept_count(numel, k_fraction) < numel)
    return numel, k_fraction


# ----- the positions ------------------------------------------------------------------


@settings(max_examples=draws(60), deadline=None)
@given(st.integers(0, 10_000), st.data())
def test_random_positions_are_distinct_and_one_per_stretch(numel: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, numel))
    positions = random_positions(
        numel, k, torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1)))
    )
    assert positions.dtype == torch.int64 and positions.numel() == k
    # Stretch j is [j * numel // k, (j + 1) * numel // k): one position in each.
    for j, position in enumerate(positions.tolist()):
        assert j * numel // k <= position < (j + 1) * numel // k


@settings(max_examples=draws(40), deadline=None)
@given(sparse_sizes(), st.integers(0, 2**40), st.integers(1, 3))
def test_positions_differ_across_iterations_and_buckets(
    sizes: tuple[int, float], seed: int, ranks: int
) -> None:
    # k < numel leaves a stretch of two or more entries, whose pick is
    # uniform: 30 iterations alike (or two buckets alike in all of them)
    # has a chance of at most 2**-29.
    numel, k_fraction = sizes
    hook = random_k(k_fraction, seed)
    grads = positive_grads(ranks, [numel, numel], seed)
    states: list[HookState[StreamState, None]] | None = None
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(30):
        outs, states = simulate_iteration(hook, grads, states)
        first, second = support(outs[0][0]), support(outs[0][1])
        assert len(first) == len(second) == kept_count(numel, k_fraction)
        seen.append((first, second))
    assert len({first for first, _ in seen}) > 1
    assert any(first != second for first, second in seen)
    assert states is not None and states[0].global_state == StreamState(30)


@settings(max_examples=draws(40), deadline=None)
@given(
    st.integers(2, 4),
    st.lists(st.integers(1, 120), min_size=1, max_size=3),
    st.floats(0.01, 1.0),
    st.integers(0, 2**40),
    st.integers(0, 3),
)
def test_positions_agree_across_ranks(
    ranks: int, sizes: list[int], k_fraction: float, seed: int, iterations: int
) -> None:
    # Every rank's gradient differs and has no zero, so a rank whose
    # positions differed would leave more than k entries in the average.
    grads = positive_grads(ranks, sizes, seed)
    states: list[HookState[StreamState, None]] | None = None
    for _ in range(iterations + 1):
        outs, states = simulate_iteration(random_k(k_fraction, seed), grads, states)
    for b, numel in enumerate(sizes):
        for rank_out in outs[1:]:
            assert torch.equal(rank_out[b], outs[0][b])
        kept = torch.tensor(support(outs[0][b]), dtype=torch.int64)
        assert kept.numel() == kept_count(numel, k_fraction)
        total = torch.zeros(numel)
        for rank_grads in grads:
            total += rank_grads[b]
        assert torch.equal(outs[0][b][kept], (total / ranks)[kept])


@settings(max_examples=draws(60), deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 10**6), st.integers(0, 50), st.integers(1, 500))
def test_a_draw_depends_on_seed_iteration_bucket_and_length_only(
    seed: int, iteration: int, bucket: int, numel: int
) -> None:
    codec = random_k_codec(0.3)
    stream = SharedStream(seed, iteration, bucket)
    one, other = torch.randn(numel), torch.randn(numel, dtype=torch.float64)
    # Bound to gradients of other values and dtypes, the codec picks the
    # same entries of a gradient.
    mine, theirs = codec.bind(stream, one), codec.bind(stream, other)
    assert torch.equal(mine.encode(one), theirs.encode(one))


# ----- with error feedback --------------------------------------------------------------

STEPS = 120


def run_steps(hook: CommHook[StreamState, Any], grads: Grads) -> tuple[torch.Tensor, torch.Tensor]:
    """``STEPS`` iterations with the same gradients: the sum of the averaged
    results, and the ranks' mean error left at the end."""
    states: list[HookState[StreamState, Any]] | None = None
    sent = torch.zeros_like(grads[0][0], dtype=torch.float64)
    for _ in range(STEPS):
        outs, states = simulate_iteration(hook, grads, states)
        sent += outs[0][0].double()
    assert states is not None
    errors = [s.bucket(0) for s in states]
    assert all(isinstance(e, ErrorFeedbackState) for e in errors)
    owed = torch.stack([e.error.double() for e in errors if e is not None]).mean(dim=0)
    return sent, owed


@settings(max_examples=draws(12), deadline=None)
@given(st.integers(2, 24), st.floats(0.25, 0.9), st.integers(1, 2), st.integers(0, 2**40))
def test_error_feedback_sends_every_entry_eventually(
    numel: int, k_fraction: float, ranks: int, seed: int
) -> None:
    assume(kept_count(numel, k_fraction) < numel)
    grads = positive_grads(ranks, [numel], seed)
    mean = torch.stack([g[0].double() for g in grads]).mean(dim=0)

    # Random positions: what was sent plus what is still owed is every
    # iteration's gradient (error feedback's identity, which needs the
    # replay to draw this iteration's positions); and what is owed is one
    # entry's gradient times the iterations since its position last came
    # up. A stretch is at most 4 entries long here, so an entry missed for
    # the last STEPS / 2 iterations has a chance of at most 0.75**60 (3e-8).
    sent, owed = run_steps(error_feedback(random_k(k_fraction, seed)), grads)
    torch.testing.assert_close(sent + owed, STEPS * mean, rtol=1e-5, atol=0.0)
    assert bool(((STEPS * mean - sent).abs() <= 0.5 * STEPS * mean).all())

    # The same codec with fixed positions: the entries it never picks are
    # never sent, however long it runs; error feedback only piles them up.
    sent, owed = run_steps(error_feedback(fixed_positions(random_k(k_fraction, seed))), grads)
    never = sent == 0
    assert int(never.sum()) == numel - kept_count(numel, k_fraction)
    torch.testing.assert_close(owed[never], STEPS * mean[never], rtol=1e-5, atol=0.0)


def test_error_feedback_replays_the_real_runs_positions_under_cast() -> None:
    # The replay that measures the error draws from the same stream as the
    # real run: the fp16 error is what the rank's fp16 input lost, exactly.
    hook = cast(error_feedback(random_k(0.25, seed=7)), torch.float16)
    grads = positive_grads(2, [40], 1)
    outs, states = simulate_iteration(hook, grads)
    for rank, state in enumerate(states):
        memory = state.bucket(0)
        assert isinstance(memory, ErrorFeedbackState)
        half = grads[rank][0].to(torch.float16)
        sent = support(outs[0][0])
        assert support(half - memory.error) == sent
        assert torch.equal(memory.error[list(sent)], torch.zeros(len(sent), dtype=torch.float16))


# ----- bytes and bad inputs ---------------------------------------------------------------


@settings(max_examples=draws(30), deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=3),
    st.floats(0.01, 1.0),
    st.sampled_from([torch.float32, torch.float16]),
)
def test_only_the_values_travel(sizes: list[int], k_fraction: float, dtype: torch.dtype) -> None:
    hook = with_stats(cast(random_k(k_fraction), dtype))
    _, states = simulate_iteration(hook, positive_grads(2, sizes, 0))
    expected = sum(kept_count(n, k_fraction) * dtype.itemsize for n in sizes)
    assert comm_stats(states[0]).bytes_per_iteration == expected


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_k_fraction_must_be_in_zero_one(bad: float) -> None:
    with pytest.raises(ValueError, match="k_fraction must be in"):
        random_k(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_seed_must_be_a_non_negative_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        random_k(0.1, seed=bad)


def test_streams_and_draws_refuse_bad_numbers() -> None:
    with pytest.raises(ValueError, match="iteration must be a non-negative int"):
        StreamState(-1)
    with pytest.raises(ValueError, match="bucket must be a non-negative int"):
        SharedStream(0, 0, -2)
    with pytest.raises(ValueError, match="cannot draw 5 distinct positions in 4"):
        random_positions(4, 5, torch.Generator())
    assert next_iteration(StreamState(4)) == StreamState(5)


def test_a_seed_is_checked_when_the_hook_is_made() -> None:
    codec = random_k_codec(0.5)
    with pytest.raises(ValueError, match="seed"):
        shared_random_hook(codec, -3, "bad")


# ----- under PyTorch's DDP, 2 gloo ranks ----------------------------------------------------

BUCKET_CAP_MB = 0.0005  # about 130 float32 gradients: several buckets
TRAIN_STEPS = 40


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )


def train(ddp: DDP) -> list[float]:
    """Full-batch SGD on a fixed regression problem (each rank its own half)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_world(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, hook in (
        ("random_k", error_feedback(random_k(0.25, seed=11))),
        ("fixed", error_feedback(fixed_positions(random_k(0.25, seed=11)))),
    ):
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        runner = HookRunner(with_stats(hook))
        runner.register(ddp)
        out[name] = train(ddp)
        out[f"{name}/params"] = [p.detach().clone() for p in ddp.parameters()]
        out[f"{name}/state"] = runner.state.global_state
        out[f"{name}/stats"] = comm_stats(runner.state)
    out["plain"] = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB))
    out["model_numel"] = sum(p.numel() for p in make_model().parameters())
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_world(ddp_world, 2)


def test_under_ddp_ranks_agree_and_random_k_trains(ranks: list[dict[str, Any]]) -> None:
    for a, b in zip(ranks[0]["random_k/params"], ranks[1]["random_k/params"], strict=True):
        assert torch.equal(a, b)
    assert [r["random_k/state"] for r in ranks] == [StreamState(TRAIN_STEPS)] * 2
    losses, plain, fixed = ranks[0]["random_k"], ranks[0]["plain"], ranks[0]["fixed"]
    assert losses[0] == plain[0] == fixed[0]
    # A quarter of the entries, at new positions every step, learns most of
    # what all of them do; at fixed positions the others never train.
    assert losses[0] - losses[-1] >= 0.7 * (plain[0] - plain[-1]) > 0.3
    assert fixed[-1] > losses[-1]


def test_under_ddp_only_a_quarter_of_the_values_travel(ranks: list[dict[str, Any]]) -> None:
    stats = ranks[0]["random_k/stats"]
    buckets = len(stats.collectives_per_bucket)
    assert buckets >= 3 and all(count == 1 for _, count in stats.collectives_per_bucket)
    # float32 values at ceil(numel / 4) positions per bucket, nothing else:
    # a quarter of the model's bytes, give or take 3 per bucket.
    numel = ranks[0]["model_numel"]
    assert numel <= stats.bytes_per_iteration <= numel + 3 * buckets
