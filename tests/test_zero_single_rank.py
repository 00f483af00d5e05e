"""The adapter on one rank, in process: input checks, state dicts, schedulers,
param groups and trainability changes. Numbers must equal the plain optimizer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.join import Joinable
from zerofn_torch import ZeroRedundancyOptimizer

pytestmark = pytest.mark.usefixtures("single_rank_group")

MODES = ["greedy", "balanced", "flat"]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def train(model: torch.nn.Module, opt: Any, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


def local_state_snapshot(opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.optim.state_dict())


# ----- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ([], ValueError),
        (torch.zeros(3), TypeError),
        (3, TypeError),
        ([torch.zeros(3, requires_grad=True), 3], TypeError),
        ([{"lr": 0.1}], ValueError),
        ([torch.zeros(3, requires_grad=True), torch.zeros(2, dtype=torch.float64)], ValueError),
        ([torch.zeros(3, 3).to_sparse().requires_grad_()], ValueError),
    ],
    ids=["empty", "tensor", "number", "non-tensor", "group-without-params", "mixed", "sparse"],
)
def test_bad_params_raise(params: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(
    ("optimizer_class", "message"),
    [
        ("adam", r"optimizer_class='adam' is a string; .*torch\.optim\.Adam\b"),
        ("lion", r"is a string; .*torch\.optim\.AdamW"),
        (torch.nn.Linear, r"torch\.nn\.modules\.linear\.Linear is not a torch\.optim\.Optimizer"),
        (3, r"must be a torch\.optim\.Optimizer subclass .*got a int"),
        (lambda params, **kw: params, r"built a list, not a torch\.optim\.Optimizer"),
    ],
    ids=[
        "name-of-an-optimizer",
        "unknown-name",
        "module-class",
        "number",
        "factory-of-no-optimizer",
    ],
)
def test_an_optimizer_class_that_is_none_is_refused_before_anything_is_built(
    optimizer_class: Any, message: str
) -> None:
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=message):
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class, lr=0.1)
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q) and p.grad is None


def test_a_factory_that_builds_an_optimizer_is_accepted() -> None:
    import functools

    model, twin = make_model(), make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), functools.partial(torch.optim.SGD, momentum=0.9), lr=0.1
    )
    train(model, opt, 3)
    train(twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9), 3)
    assert_same_params(model, twin)


def test_manual_partition_errors_name_the_problem() -> None:
    model = make_model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="one per rank"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=[params, []], lr=0.1)
    stranger = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="not passed"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=[[stranger]], lr=0.1)
    with pytest.raises(ValueError, match="both rank"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=[params + params[:1]], lr=0.1)


def test_manual_partition_of_indices_is_a_type_error() -> None:
    params = list(make_model().parameters())
    with pytest.raises(TypeError, match=r"partition\[0\] holds a int .*not their indices"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=[[0, 1]], lr=0.1)


def snapshot(model: torch.nn.Module) -> list[tuple[int, torch.Tensor]]:
    """Where each parameter lives and what it holds."""
    return [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]


def assert_unchanged(model: torch.nn.Module, before: list[tuple[int, torch.Tensor]]) -> None:
    for p, (ptr, value) in zip(model.parameters(), before, strict=True):
        assert p.data_ptr() == ptr
        assert torch.equal(p, value)


def test_manual_partition_must_give_every_trainable_parameter_an_owner() -> None:
    model = make_model()
    params = list(model.parameters())
    before = snapshot(model)
    # Leaving out trainable parameters (global indices 2 and 3) is refused,
    # before the parameters move into the exchange buffer.
    with pytest.raises(ValueError, match=r"global index 2, 3 .*require grad") as refused:
        ZeroRedundancyOptimizer(
            params, torch.optim.SGD, partition=[params[:2]], parameters_as_bucket_view=True, lr=0.1
        )
    assert "requires_grad=False" in str(refused.value)
    assert_unchanged(model, before)
    # Frozen parameters may be left out (the docs promise it): they stay as they are.
    for p in params[2:]:
        p.requires_grad_(False)
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=[params[:2]], lr=0.1)
    train(model, zero, 1)
    assert not torch.equal(params[0], before[0][1])
    assert all(torch.equal(p, value) for p, (_, value) in zip(params[2:], before[2:], strict=True))
    # A left-out parameter that starts requiring grad is refused at the next
    # step, before the step changes anything.
    params[3].requires_grad_(True)
    model(torch.randn(4, 5)).square().mean().backward()
    stepped = snapshot(model)
    with pytest.raises(ValueError, match=r"global index 3 .*now require grad"):
        zero.step()
    assert_unchanged(model, stepped)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"partition": "flat", "lr": -1.0}, ValueError, "Invalid learning rate"),
        ({"parameters_as_bucket_view": True, "lr": -1.0}, ValueError, "Invalid learning rate"),
        ({"partition": "flat", "lr": 0.1, "momentun": 0.9}, TypeError, "momentun"),
    ],
    ids=["flat-lr", "bucket-view-lr", "flat-typo"],
)
def test_refused_hyperparameters_leave_the_parameters_where_they_were(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = make_model()
    before = snapshot(model)
    with pytest.raises(error, match=message):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, **options)
    assert_unchanged(model, before)


def test_consolidating_on_a_rank_outside_the_group_is_refused_before_any_collective() -> None:
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    train(model, opt, 1)
    state = local_state_snapshot(opt)
    for to in (1, 5, -1):
        with pytest.raises(ValueError, match=r"to must be in 0\.\.0"):
            opt.consolidate_state_dict(to=to)
    for to in ("0", 0.0, True):
        with pytest.raises(TypeError, match="an int in 0..0"):
            opt.consolidate_state_dict(to=to)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not been consolidated"):
        opt.state_dict()  # nothing was gathered
    assert local_state_snapshot(opt)["param_groups"] == state["param_groups"]
    # The group is fine: the next call with a valid rank works.
    opt.consolidate_state_dict(to=0)
    assert opt.state_dict()["state"].keys() == state["state"].keys()


def test_flat_refuses_non_elementwise_optimizer() -> None:
    with pytest.raises(ValueError, match="element-wise"):
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.LBFGS, partition="flat")
    # ...unless the user vouches for it.
    ZeroRedundancyOptimizer(
        make_model().parameters(), torch.optim.SGD, partition="flat", elementwise=True, lr=0.1
    )


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown partition mode"):
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, partition="x", lr=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_foreign_state_dict_is_refused_and_nothing_changes(mode: str) -> None:
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition=mode, lr=0.01)
    train(model, opt, 2)
    before = local_state_snapshot(opt)
    groups_before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )

    other = torch.nn.Linear(4, 4)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    other(torch.randn(2, 4)).sum().backward()
    other_opt.step()
    foreign = other_opt.state_dict()
    foreign_copy = copy.deepcopy(foreign)
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(foreign)

    after = opt.optim.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for k, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["state"][k][name])
    assert groups_before == [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]
    assert foreign.keys() == foreign_copy.keys()
    assert foreign["param_groups"] == foreign_copy["param_groups"]


@pytest.mark.parametrize("options", [{}, {"master_dtype": torch.float32}])
def test_state_dict_before_any_step_answers_without_consolidating(options: Any) -> None:
    """What Accelerate's ``prepare`` reads and loads back on every rank: a
    fresh optimizer's empty state, which a plain ``torch.optim`` optimizer
    over the same parameters also reports and which loads back unchanged."""
    model = make_model()
    if options:
        model = model.to(torch.bfloat16)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1, **options)
    plain = torch.optim.Adam(make_model().parameters(), lr=0.1)
    fresh = opt.state_dict()
    assert fresh == plain.state_dict()
    kept = opt.zero_rank.masters
    masters = [] if kept is None else [m.clone() for m in kept.master]
    opt.load_state_dict(fresh)  # as Accelerate's device placement does
    assert opt.state_dict() == fresh
    after = opt.zero_rank.masters
    assert all(
        torch.equal(a, b)
        for a, b in zip(masters, [] if after is None else after.master, strict=True)
    )
    opt.param_groups[0]["lr"] = 0.5  # the live options, as after consolidating
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5


def test_state_dict_needs_consolidation_once_a_step_or_a_load_gave_it_state() -> None:
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    train(model, opt, 1)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict()
    loaded = ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.Adam, lr=0.1)
    loaded.load_state_dict(full)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        loaded.state_dict()


def test_overlap_mode_rules() -> None:
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    with pytest.raises(RuntimeError, match="single param group"):
        ZeroRedundancyOptimizer(groups, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(ValueError, match="DDP's buckets"):
        ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, overlap_with_ddp=True, partition="flat", lr=0.1
        )
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    # step() without a DDP hook: tests/test_overlap.py
    with pytest.raises(RuntimeError, match="not initialized"):
        zero.consolidate_state_dict()


# ----- behaviour on one rank ----------------------------------------------------------


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_matches_plain_optimizer(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], mode: str, bucket_view: bool
) -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(
        a.parameters(), cls, parameters_as_bucket_view=bucket_view, partition=mode, **kwargs
    )
    train(a, zero, 4)
    train(b, cls(b.parameters(), **kwargs), 4)
    assert_same_params(a, b)
    assert isinstance(zero, torch.optim.Optimizer)
    assert isinstance(zero, Joinable)


def test_flat_defaults_to_bucket_views_and_steps_the_same() -> None:
    nbytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    # Flat without the argument: the parameters live in the exchange buffer.
    a = make_model()
    flat = ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, partition="flat", lr=0.01)
    assert flat.parameters_as_bucket_view is True
    assert flat.memory_bytes()["exchange_buffers"] == 0
    # Every other mode keeps PyTorch's default: the buffer is a second copy.
    for mode in ("greedy", "balanced"):
        other = ZeroRedundancyOptimizer(
            make_model().parameters(), torch.optim.Adam, partition=mode, lr=0.01
        )
        assert other.parameters_as_bucket_view is False
        assert other.memory_bytes()["exchange_buffers"] == nbytes
    overlap = ZeroRedundancyOptimizer(
        make_model().parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    assert overlap.parameters_as_bucket_view is False
    # The views change where the parameters live, not what the steps compute.
    b = make_model()
    copies = ZeroRedundancyOptimizer(
        b.parameters(), torch.optim.Adam, parameters_as_bucket_view=False, partition="flat", lr=0.01
    )
    assert copies.memory_bytes()["exchange_buffers"] == nbytes
    train(a, flat, 4)
    train(b, copies, 4)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert flat.memory_bytes()["exchange_buffers"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_lr_scheduler_drives_the_local_optimizer(mode: str) -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(a.parameters(), torch.optim.SGD, partition=mode, lr=0.5)
    plain = torch.optim.SGD(b.parameters(), lr=0.5)
    sched_a = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    for _ in range(3):
        train(a, zero, 1)
        train(b, plain, 1)
        sched_a.step()
        sched_b.step()
    assert zero.param_groups[0]["lr"] == pytest.approx(0.5 * 0.5**3)
    train(a, zero, 1)
    train(b, plain, 1)
    assert zero.optim.param_groups[0]["lr"] == pytest.approx(0.5 * 0.5**3)
    assert_same_params(a, b)


def test_grad_scaler_steps_through() -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(b.parameters(), lr=0.01)
    for model, opt in ((a, zero), (b, plain)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 5, generator=g)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert_same_params(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_add_param_group_keeps_training_in_lockstep(mode: str) -> None:
    a, b = make_model(), make_model()
    first_a, second_a = list(a[0].parameters()), list(a[2].parameters())
    first_b, second_b = list(b[0].parameters()), list(b[2].parameters())
    zero = ZeroRedundancyOptimizer(first_a, torch.optim.Adam, partition=mode, lr=0.01)
    plain = torch.optim.Adam(first_b, lr=0.01)
    train(a, zero, 2)
    train(b, plain, 2)
    zero.add_param_group({"params": second_a, "lr": 0.02})
    plain.add_param_group({"params": second_b, "lr": 0.02})
    assert len(zero.param_groups) == 2
    train(a, zero, 3)
    train(b, plain, 3)
    assert_same_params(a, b)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_trainability_change_rebuilds_and_stays_correct(bucket_view: bool) -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(
        a.parameters(), torch.optim.SGD, parameters_as_bucket_view=bucket_view, lr=0.1
    )
    plain = torch.optim.SGD(b.parameters(), lr=0.1)
    train(a, zero, 1)
    train(b, plain, 1)
    for m in (a, b):
        m[0].weight.requires_grad_(False)
        m[0].weight.grad = None
    train(a, zero, 2)
    train(b, plain, 2)
    assert_same_params(a, b)


def test_flat_mode_refuses_trainability_change() -> None:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition="flat", lr=0.1)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        zero.step()


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trips_through_plain_optimizer(mode: str) -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, partition=mode, lr=0.01)
    plain = torch.optim.Adam(b.parameters(), lr=0.01)
    train(a, zero, 3)
    train(b, plain, 3)
    zero.consolidate_state_dict(to=0)
    ours = zero.state_dict()
    theirs = plain.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for k in theirs["state"]:
        for name, value in theirs["state"][k].items():
            torch.testing.assert_close(ours["state"][k][name], value, rtol=1e-6, atol=0)

    # Ours into a fresh plain optimizer, and the plain one's into a fresh ZeRO.
    c, d = copy.deepcopy(a), copy.deepcopy(b)
    plain_c = torch.optim.Adam(c.parameters(), lr=0.01)
    plain_c.load_state_dict(ours)
    zero_d = ZeroRedundancyOptimizer(d.parameters(), torch.optim.Adam, partition=mode, lr=0.01)
    zero_d.load_state_dict(theirs)
    for model, opt in ((a, zero), (b, plain), (c, plain_c), (d, zero_d)):
        train(model, opt, 2, seed=9)
    assert_same_params(a, b)
    assert_same_params(a, c)
    assert_same_params(a, d)


@pytest.mark.parametrize("mode", MODES)
def test_consolidated_state_loads_with_weights_only(mode: str, tmp_path: Any) -> None:
    a, b = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(a.parameters(), torch.optim.AdamW, partition=mode, lr=0.01)
    train(a, zero, 2)
    zero.consolidate_state_dict()
    torch.save(zero.state_dict(), tmp_path / "optim.pt")
    b.load_state_dict(a.state_dict())
    restored = ZeroRedundancyOptimizer(b.parameters(), torch.optim.AdamW, partition=mode, lr=0.01)
    restored.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    train(a, zero, 2, seed=5)
    train(b, restored, 2, seed=5)
    assert_same_params(a, b)


def test_flat_shard_stepped_in_chunks_is_bitwise_the_plain_optimizer() -> None:
    # 400 x 400 spans two 512 KiB chunks; the per-tensor Adam loop is element-wise.
    torch.manual_seed(0)
    ours_params = [torch.randn(400, 400), torch.randn(400), torch.randn(7, 3)]
    theirs_params = [p.clone() for p in ours_params]
    for p in (*ours_params, *theirs_params):
        p.requires_grad_(True)
    ours = ZeroRedundancyOptimizer(ours_params, torch.optim.Adam, partition="flat", lr=1e-2)
    theirs = torch.optim.Adam(theirs_params, lr=1e-2)
    # The 400 x 400 weight in two chunks, the others whole: no chunk spans
    # two parameters, so every chunk's gradient is a view of one .grad.
    assert [t.numel() for t in ours.optim.param_groups[0]["params"]] == [131072, 28928, 400, 21]
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours_params, theirs_params, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert torch.equal(a, b)
    ours.consolidate_state_dict()
    consolidated = ours.state_dict()
    assert torch.equal(
        consolidated["state"][0]["exp_avg"], theirs.state_dict()["state"][0]["exp_avg"]
    )
