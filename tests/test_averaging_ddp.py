"""Model averaging and post-local SGD on 4 real gloo ranks, beside PyTorch's own
classes in the same process group: parameter averaging, the periodic and
hierarchical averagers (levels of 2 and 4 ranks), PostLocalSGDOptimizer with
DDP and the post-local SGD hook, and checkpoints resumed through
``torch.load(weights_only=True)``. Spawning is slow on 2 cores, so one world
runs every check; the single-rank tests below need no spawning."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from _world import run_world
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_hook_module
from torch.distributed.algorithms.model_averaging.averagers import (
    PeriodicModelAverager as TorchPeriodic,
)
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager as TorchHierarchical,
)
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.averaging import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)
from zerofn_torch.hooks.post_local_sgd import PostLocalSGDState, post_localSGD_hook

pytestmark = pytest.mark.timeout(180)  # the spawned world must never hang the suite

WORLD = 4
STEPS = 9


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def backward(model: torch.nn.Module, step: int) -> None:
    """Each rank draws its own batch, so local models drift apart."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    model(torch.randn(4, 5, generator=g)).square().mean().backward()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    x, y = flat(a), flat(b)
    return float(((x - y).abs() / y.abs().clamp_min(1e-3)).max())


def local_sgd(
    model: torch.nn.Module, averager: Any, steps: Iterable[int], opt: Any = None
) -> list[torch.Tensor]:
    """Train locally, averaging after each step; the parameters after each."""
    opt = opt if opt is not None else sgd(model)
    after = []
    for step in steps:
        opt.zero_grad()
        backward(model, step)
        opt.step()
        averager.average_parameters(model.parameters())
        after.append(flat(model))
    return after


def quiet(make: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def weights_only_copy(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ----- the checks each rank runs --------------------------------------------------


def check_average_parameters(rank: int, out: dict[str, Any]) -> None:
    def tensors() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [
            torch.randn(3, 2, generator=g),
            torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn(1, generator=g).half(),
        ]

    pair = dist.new_group([0, 1])  # ranks 2 and 3 are outside it
    for name, group in (("world", None), ("pair", pair)):
        ours, theirs = tensors(), tensors()
        storage = [t.data_ptr() for t in ours]
        average_parameters(ours, group)
        torch_utils.average_parameters(iter(theirs), group)
        out[f"average/{name}/equal"] = all(
            torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, theirs, strict=True)
        )
        out[f"average/{name}/in_place"] = storage == [t.data_ptr() for t in ours]
        out[f"average/{name}/value"] = [t.clone() for t in ours]

    # Param groups, and only the parameters that have gradients.
    m_ours, m_theirs = make_model(), make_model()
    for m in (m_ours, m_theirs):
        backward(m, 0)
        m[2].bias.grad = None
        with torch.no_grad():
            for p in m.parameters():
                p.add_(rank)
    average_parameters_or_parameter_groups(sgd(m_ours).param_groups, None)
    torch_utils.average_parameters_or_parameter_groups(sgd(m_theirs).param_groups, dist.group.WORLD)
    out["average/groups"] = rel_diff(m_ours, m_theirs)
    # Each rank shifted its parameters by its rank; the bias had no gradient.
    out["average/bias_shift"] = float(m_ours[2].bias.detach()[0] - make_model()[2].bias.detach()[0])


def check_periodic(rank: int, out: dict[str, Any]) -> None:
    ours_m, theirs_m = make_model(), make_model()
    ours = local_sgd(ours_m, PeriodicModelAverager(3, warmup_steps=2), range(STEPS))
    local_sgd(theirs_m, TorchPeriodic(3, warmup_steps=2), range(STEPS))
    out["periodic/vs_torch"] = rel_diff(ours_m, theirs_m)
    out["periodic/after_each_step"] = ours


def check_hierarchical(rank: int, out: dict[str, Any]) -> None:
    levels = {2: 2, 4: 4}
    ours_m, theirs_m = make_model(), make_model()
    ours_avg = HierarchicalModelAverager(levels, warmup_steps=1)
    theirs_avg = TorchHierarchical(levels, warmup_steps=1)
    ours = local_sgd(ours_m, ours_avg, range(STEPS))
    local_sgd(theirs_m, theirs_avg, range(STEPS))
    out["hierarchical/vs_torch"] = rel_diff(ours_m, theirs_m)
    out["hierarchical/after_each_step"] = ours
    out["hierarchical/group_sizes"] = {
        period: dist.get_world_size(group)
        for period, group in ours_avg.period_process_group_dict.items()
    }


def ddp_run(
    hook: Callable[..., Any],
    hook_state: Any,
    make_optimizer: Callable[[torch.nn.Module], Any],
    steps: Iterable[int],
    model: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, Any]:
    ddp = DDP(model if model is not None else make_model())
    ddp.register_comm_hook(hook_state, hook)
    opt = make_optimizer(ddp.module)
    for step in steps:
        opt.zero_grad()
        backward(ddp, step)
        opt.step()
    return ddp.module, opt


def check_post_local_sgd(rank: int, out: dict[str, Any], subgroup: Any) -> None:
    """DDP + hook + PostLocalSGDOptimizer, ours against PyTorch's, with and
    without gradient averaging in the subgroup after the switch."""
    for post_local in (True, False):
        ours_m, _ = ddp_run(
            post_localSGD_hook,
            PostLocalSGDState(None, subgroup, 3, post_local),
            lambda m: PostLocalSGDOptimizer(sgd(m), PeriodicModelAverager(2, warmup_steps=3)),
            range(STEPS),
        )
        theirs_m, _ = ddp_run(
            torch_hook_module.post_localSGD_hook,
            torch_hook_module.PostLocalSGDState(None, subgroup, 3, post_local),
            lambda m: TorchPostLocalSGDOptimizer(sgd(m), TorchPeriodic(2, warmup_steps=3)),
            range(STEPS),
        )
        out[f"post_local/{post_local}/vs_torch"] = rel_diff(ours_m, theirs_m)
        out[f"post_local/{post_local}/params"] = flat(ours_m)

    # Each optimizer accepts the other's averagers.
    runs = {}
    for name, opt_cls, avg_cls in (
        ("ours/ours", PostLocalSGDOptimizer, PeriodicModelAverager),
        ("ours/torch", PostLocalSGDOptimizer, TorchPeriodic),
        ("torch/ours", TorchPostLocalSGDOptimizer, PeriodicModelAverager),
    ):
        m = make_model()
        opt = opt_cls(sgd(m), avg_cls(2, warmup_steps=1))
        for step in range(STEPS):
            opt.zero_grad()
            backward(m, step)
            opt.step()
        runs[name] = m
    out["interop/ours_torch"] = rel_diff(runs["ours/torch"], runs["ours/ours"])
    out["interop/torch_ours"] = rel_diff(runs["torch/ours"], runs["ours/ours"])


def check_averager_checkpoint(rank: int, out: dict[str, Any]) -> None:
    """Stop after 5 steps, save model, optimizer and averager, resume in fresh
    objects from a weights-only load: the same as training straight through."""
    straight = make_model()
    local_sgd(straight, HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=1), range(STEPS))

    m, avg = make_model(), HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=1)
    opt = sgd(m)
    local_sgd(m, avg, range(5), opt)
    saved = weights_only_copy(
        {"model": m.state_dict(), "optim": opt.state_dict(), "averager": avg.state_dict()}
    )
    out["checkpoint/averager_sd"] = saved["averager"]
    m2, avg2 = make_model(), HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=1)
    opt2 = sgd(m2)
    m2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    avg2.load_state_dict(saved["averager"])
    local_sgd(m2, avg2, range(5, STEPS), opt2)
    out["checkpoint/averager_resumed"] = rel_diff(m2, straight)


def check_optimizer_checkpoint(rank: int, out: dict[str, Any]) -> None:
    """PostLocalSGDOptimizer's state dict: PyTorch's format (with the averager's
    step), weights-only, and loadable by PyTorch's optimizer and back."""

    def run(opt_cls: Any, avg_cls: Any, steps: range, sd: Any = None, model_sd: Any = None) -> Any:
        m = make_model()
        if model_sd is not None:
            m.load_state_dict(model_sd)
        opt = opt_cls(sgd(m), avg_cls(3, warmup_steps=2))
        if sd is not None:
            opt.load_state_dict(copy.deepcopy(sd))
        for step in steps:
            opt.zero_grad()
            backward(m, step)
            opt.step()
        return m, opt

    straight, _ = run(PostLocalSGDOptimizer, PeriodicModelAverager, range(STEPS))
    m, ours = run(PostLocalSGDOptimizer, PeriodicModelAverager, range(4))
    _, theirs = run(TorchPostLocalSGDOptimizer, TorchPeriodic, range(4))
    ours_sd = weights_only_copy(ours.state_dict())
    theirs_sd = theirs.state_dict()
    out["checkpoint/optim_same_keys"] = ours_sd.keys() == theirs_sd.keys()
    out["checkpoint/optim_step"] = (ours_sd["step"], theirs_sd["step"])
    model_sd = weights_only_copy(m.state_dict())
    for name, opt_cls, avg_cls, sd in (
        ("ours_into_torch", TorchPostLocalSGDOptimizer, TorchPeriodic, ours_sd),
        ("torch_into_ours", PostLocalSGDOptimizer, PeriodicModelAverager, theirs_sd),
        ("ours_into_ours", PostLocalSGDOptimizer, PeriodicModelAverager, ours_sd),
    ):
        resumed, _ = run(opt_cls, avg_cls, range(4, STEPS), sd, model_sd)
        out[f"checkpoint/{name}"] = rel_diff(resumed, straight)


def check_hook_checkpoint(rank: int, out: dict[str, Any], subgroup: Any) -> None:
    """Resume DDP with the hook after 2 of 3 global iterations: the restored
    counter must switch to the subgroup one iteration later, as straight
    training does."""

    def make_opt(m: torch.nn.Module) -> Any:
        return PostLocalSGDOptimizer(sgd(m), PeriodicModelAverager(2, warmup_steps=3))

    straight, _ = ddp_run(
        post_localSGD_hook, PostLocalSGDState(None, subgroup, 3), make_opt, range(STEPS)
    )
    hook_state = PostLocalSGDState(None, subgroup, 3)
    m, opt = ddp_run(post_localSGD_hook, hook_state, make_opt, range(2))
    saved = weights_only_copy(
        {"model": m.state_dict(), "optim": opt.state_dict(), "hook": hook_state.state_dict()}
    )
    out["checkpoint/hook_sd"] = saved["hook"]
    resumed_state = PostLocalSGDState(None, subgroup, 3)
    resumed_state.load_state_dict(saved["hook"])
    model = make_model()
    model.load_state_dict(saved["model"])
    resumed, _ = ddp_run(
        post_localSGD_hook,
        resumed_state,
        lambda mod: _loaded(make_opt(mod), saved["optim"]),
        range(2, STEPS),
        model,
    )
    out["checkpoint/hook_resumed"] = rel_diff(resumed, straight)
    out["checkpoint/hook_iter"] = resumed_state.iter


def _loaded(opt: Any, state_dict: Any) -> Any:
    opt.load_state_dict(copy.deepcopy(state_dict))
    return opt


def four_rank_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    subgroup, _ = dist.new_subgroups(group_size=2)
    check_average_parameters(rank, out)
    check_periodic(rank, out)
    check_hierarchical(rank, out)
    check_post_local_sgd(rank, out, subgroup)
    check_averager_checkpoint(rank, out)
    check_optimizer_checkpoint(rank, out)
    check_hook_checkpoint(rank, out, subgroup)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return quiet(lambda: run_world(four_rank_world, WORLD))


# ----- what the world found -------------------------------------------------------

EXACT = 1e-6  # the spec's parity bound; the runs are in fact bitwise equal


def test_average_parameters_matches_pytorch_in_place(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        for name in ("world", "pair"):
            assert out[f"average/{name}/equal"], name
            assert out[f"average/{name}/in_place"], name
        assert out["average/groups"] <= EXACT
        assert out["average/bias_shift"] == pytest.approx(rank)  # no gradient: not averaged
    world_values = [out["average/world/value"] for out in ranks]
    pair_values = [out["average/pair/value"] for out in ranks]
    for values in world_values[1:]:
        assert all(torch.equal(a, b) for a, b in zip(values, world_values[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pair_values[0], pair_values[1], strict=True))
    # Outside the pair, ranks 2 and 3 keep their own tensors.
    assert not torch.equal(pair_values[2][0], pair_values[3][0])


def test_periodic_averager_matches_pytorch(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["periodic/vs_torch"] <= EXACT
    # Warm-up 2, period 3: steps 2, 5 and 8 average; ranks agree right after them.
    for step in range(STEPS):
        agree = all(
            torch.equal(
                out["periodic/after_each_step"][step], ranks[0]["periodic/after_each_step"][step]
            )
            for out in ranks
        )
        assert agree == (step in (2, 5, 8)), step


def test_hierarchical_averager_matches_pytorch(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["hierarchical/vs_torch"] <= EXACT
        assert out["hierarchical/group_sizes"] == {2: 2, 4: 4}

    def same(a: int, b: int, step: int) -> bool:
        after = [out["hierarchical/after_each_step"][step] for out in ranks]
        return torch.equal(after[a], after[b])

    # Warm-up 1: steps 4 and 8 average all four ranks, steps 2 and 6 the pairs.
    for step in range(1, STEPS):
        assert same(0, 2, step) == (step % 4 == 0), step
        assert same(0, 1, step) == same(2, 3, step) == (step % 2 == 0), step


def test_post_local_sgd_with_ddp_matches_pytorch(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for post_local in (True, False):
            assert out[f"post_local/{post_local}/vs_torch"] <= EXACT
        assert out["interop/ours_torch"] <= EXACT
        assert out["interop/torch_ours"] <= EXACT
    # The last step (8) is no averaging step, so the pairs (or every rank,
    # without subgroup averaging) have drifted apart; averaging is still real.
    with_sub = [out["post_local/True/params"] for out in ranks]
    assert torch.equal(with_sub[0], with_sub[1]) and torch.equal(with_sub[2], with_sub[3])
    assert not torch.equal(with_sub[0], with_sub[2])
    without = [out["post_local/False/params"] for out in ranks]
    assert not torch.equal(without[0], without[1])


def test_checkpoints_resume_exactly_through_weights_only_loads(
    ranks: list[dict[str, Any]],
) -> None:
    for out in ranks:
        assert out["checkpoint/averager_sd"] == {"step": 5}
        assert out["checkpoint/averager_resumed"] <= EXACT
        assert out["checkpoint/optim_same_keys"]
        assert out["checkpoint/optim_step"] == (4, 4)
        for name in ("ours_into_torch", "torch_into_ours", "ours_into_ours"):
            assert out[f"checkpoint/{name}"] <= EXACT, name
        assert out["checkpoint/hook_sd"] == {"iter": 2}
        assert out["checkpoint/hook_iter"] == 3
        assert out["checkpoint/hook_resumed"] <= EXACT


# ----- single rank: the adapter's own checks --------------------------------------


@pytest.mark.usefixtures("single_rank_group")
class TestSingleRank:
    def test_optimizer_state_without_step_warns_and_restarts_the_averager(self) -> None:
        m = make_model()
        opt = PostLocalSGDOptimizer(sgd(m), PeriodicModelAverager(2))
        opt.averager.step = 7
        with pytest.warns(UserWarning, match="step"):
            opt.load_state_dict(sgd(make_model()).state_dict())
        assert opt.averager.step == 0

    def test_a_bad_step_changes_nothing(self) -> None:
        m = make_model()
        averager = PeriodicModelAverager(2)
        opt = PostLocalSGDOptimizer(sgd(m), averager)
        backward(m, 0)
        opt.step()
        before = copy.deepcopy(opt.state_dict())
        bad = copy.deepcopy(before)
        bad["step"] = -1
        bad["param_groups"][0]["lr"] = 5.0
        with pytest.raises(ValueError, match="step"):
            opt.load_state_dict(bad)
        with pytest.raises(ValueError, match="step"):
            averager.load_state_dict({"step": -2})
        with pytest.raises(TypeError):
            averager.load_state_dict({"step": "3"})
        assert opt.state_dict()["param_groups"] == before["param_groups"]
        assert averager.step == 1

    def test_closure_schedulers_and_repr_pass_through(self) -> None:
        m = make_model()
        opt = PostLocalSGDOptimizer(sgd(m), PeriodicModelAverager(2))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        def closure() -> float:
            opt.zero_grad()
            loss = m(torch.ones(2, 5)).sum()
            loss.backward()
            return float(loss.detach())

        assert isinstance(opt.step(closure), float)
        scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        assert opt.defaults["lr"] == 0.1
        assert repr(opt) == repr(opt.optim)
        assert opt.averager.step == 1

    def test_only_tensors_and_param_groups_are_averaged(self) -> None:
        with pytest.raises(NotImplementedError, match="str"):
            get_params_to_average(["weight"])  # type: ignore[list-item]
        with pytest.raises(NotImplementedError):
            torch_utils.get_params_to_average(["weight"])

    def test_hook_state_saves_its_counter_only(self) -> None:
        state = PostLocalSGDState(None, None, start_localSGD_iter=5)
        state.iter = 4
        restored = PostLocalSGDState(None, None, start_localSGD_iter=5)
        restored.load_state_dict(weights_only_copy(state.state_dict()))
        assert restored.iter == 4
        with pytest.raises(ValueError, match="iter"):
            restored.load_state_dict({"iter": -1})
        assert restored.iter == 4
