"""Join: the pure bookkeeping (hypothesis) and uneven inputs on 2 gloo ranks,
against PyTorch's Join, with PyTorch's DDP and both ZeRO optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.join import Join, Joinable, JoinHook

from zerofn.errors import CollectiveError
from zerofn.join import JoinProgress, first_mismatch, join_configs, next_join_step

# ----- pure bookkeeping ----------------------------------------------------------------


@given(st.integers(1, 20), st.booleans(), st.booleans())
def test_only_the_first_joinable_announces(count: int, enable: bool, throw: bool) -> None:
    configs = join_configs(count, enable, throw)
    assert [c.is_first_joinable for c in configs] == [True] + [False] * (count - 1)
    assert all(c.enable == enable and c.throw_on_early_termination == throw for c in configs)


def test_no_joinables_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        join_configs(0, True, False)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.booleans())
def test_join_loop_decisions(counts: list[int], throw: bool) -> None:
    progress = JoinProgress()
    for shadowed, count in enumerate(counts):
        before = progress
        progress, action = next_join_step(progress, count, throw)
        if count == 0:
            assert action == "finish" and progress.all_joined
            assert progress.is_last_joiner == (shadowed == 0)
            return
        if throw:
            assert action == "terminate" and progress == before
            return
        assert action == "shadow"
        assert progress.rounds == before.rounds + 1 and not progress.is_last_joiner


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_first_mismatch(values: list[int]) -> None:
    index = first_mismatch(values)
    if index is None:
        assert len(set(values)) == 1
    else:
        assert values[index] != values[0] and len(set(values[:index])) == 1


# ----- on 2 ranks ------------------------------------------------------------------------


class CountingJoinable(Joinable):
    """Records how its join hook is driven."""

    def __init__(self) -> None:
        super().__init__()
        self.main_calls = 0
        self.post_calls: list[bool] = []
        self.kwargs: dict[str, Any] = {}

    def iteration(self) -> None:
        Join.notify_join_context(self)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.kwargs = kwargs
        owner = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                owner.main_calls += 1

            def post_hook(self, is_last_joiner: bool) -> None:
                owner.post_calls.append(is_last_joiner)

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def make_model() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def uneven_training(rank: int, join_cls: Any, zero_cls: Any) -> torch.nn.Module:
    model = DDP(make_model())
    zero = zero_cls(model.parameters(), torch.optim.Adam, lr=0.01)
    with join_cls([model, zero]):
        for step in range(3 + 2 * rank):  # rank 1 has two more batches
            g = torch.Generator().manual_seed(100 * step + rank)
            zero.zero_grad()
            model(torch.randn(5, 6, generator=g)).square().mean().backward()
            zero.step()
    return model.module


def join_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ours = uneven_training(rank, Join, ZeroRedundancyOptimizer)
    theirs = uneven_training(rank, TorchJoin, TorchZero)
    out["vs_torch"] = max(
        (p - q).abs().max().item()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    out["ddp_is_joinable"] = isinstance(DDP(make_model()), Joinable)

    counting = CountingJoinable()
    with Join([counting], flavour="test"):
        for _ in range(2 + 3 * rank):
            counting.iteration()
    out["main_calls"], out["post_calls"], out["kwargs"] = (
        counting.main_calls,
        counting.post_calls,
        counting.kwargs,
    )

    throwing = CountingJoinable()
    try:
        with Join([throwing], throw_on_early_termination=True):
            for _ in range(2 + 3 * rank):
                throwing.iteration()
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)

    disabled = CountingJoinable()
    with Join([disabled], enable=False):
        for _ in range(3):
            disabled.iteration()
    out["disabled_calls"] = (disabled.main_calls, disabled.post_calls)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(join_world, 2)


@pytest.mark.timeout(120)
def test_uneven_inputs_train_like_pytorchs_join(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["vs_torch"] <= 1e-6
        assert out["ddp_is_joinable"]


def test_hooks_run_until_everyone_joined(two_ranks: list[dict[str, Any]]) -> None:
    early, late = two_ranks
    assert early["main_calls"] == 3 and early["post_calls"] == [False]
    assert late["main_calls"] == 0 and late["post_calls"] == [True]
    assert early["kwargs"] == late["kwargs"] == {"flavour": "test"}


def test_throw_on_early_termination_raises_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    assert "exhausted all inputs" in two_ranks[0]["raised"]
    assert "Throwing across all ranks" in two_ranks[1]["raised"]


def test_disabled_context_does_nothing(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["disabled_calls"] == (0, [])


# ----- failures inside a hook, on one rank in process ----------------------------------


class FailingJoinable(CountingJoinable):
    """A joinable whose post-hook raises ``error`` (on one rank the main hook
    never runs: the count of running ranks is 0 at once)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def join_hook(self, **kwargs: Any) -> JoinHook:
        error = self.error

        class Hook(JoinHook):
            def post_hook(self, is_last_joiner: bool) -> None:
                raise error

        return Hook()


@pytest.mark.usefixtures("single_rank_group")
def test_a_failing_join_hook_raises_a_collective_error_naming_it() -> None:
    transport = RuntimeError("[gloo/pair.cc:534] Connection closed by peer\nmore detail")
    joinables = [CountingJoinable(), FailingJoinable(transport)]
    with pytest.raises(CollectiveError) as failure, Join(joinables):
        pass
    assert failure.value.__cause__ is transport
    assert failure.value.collective == "the join hook of FailingJoinable (post_hook)"
    assert failure.value.purpose == "Join: rank 0 finishing after every rank joined"
    assert failure.value.reason == "[gloo/pair.cc:534] Connection closed by peer"
    assert "gloo group of 1 ranks (this is rank 0)" in str(failure.value)


@pytest.mark.usefixtures("single_rank_group")
def test_a_hooks_own_collective_error_passes_through_unchanged() -> None:
    own = CollectiveError("exchange", "the ZeRO step", "a group", "timeout")
    with pytest.raises(CollectiveError) as failure, Join([FailingJoinable(own)]):
        pass
    assert failure.value is own
