"""zerofn's PowerSGD hooks under PyTorch's DistributedDataParallel, beside
PyTorch's own hooks: gradient parity on 2 gloo ranks across start_powerSGD_iter
(with and without warm start and error feedback, ranks 1, 2 and 4, batched
draws on and off), the batched hook PyTorch 2.13 cannot run, several buckets
(where PyTorch's hook cannot run on gloo), the collective count, checkpoints
and pickles that resume exactly, and bad input.

One spawned world runs all multi-rank checks (spawning costs seconds here); the
in-process tests use a one-rank group and hand-made buckets."""

from __future__ import annotations

import copy
import io
import itertools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

from zerofn.hooks import powersgd as core

START = 2
STEPS = 5
Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


def make_model(seed: int = 1) -> torch.nn.Module:
    """Matrices worth compressing (two of one shape, one 3-D), biases that are not."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Unflatten(1, (4, 8)),
        torch.nn.Conv1d(4, 6, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(36, 4),
    )


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 16, generator=g)


def ddp(model: torch.nn.Module, state: Any, hook: Hook, **kwargs: Any) -> DDP:
    wrapped = DDP(model, **kwargs)
    wrapped.register_comm_hook(state, hook)
    return wrapped


def train(model: DDP, opt: torch.optim.Optimizer, steps: range) -> Iterator[list[torch.Tensor]]:
    """Yield each step's averaged gradients, then take the step."""
    for step in steps:
        opt.zero_grad()
        model(batch(step)).square().mean().backward()
        yield [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        opt.step()


def rel_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(ours, theirs, strict=True)
    )


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def side_by_side(ours_hook: Hook, theirs_hook: Hook, **kwargs: Any) -> dict[str, Any]:
    """Train twin models with our hook and PyTorch's; report the gaps."""
    ours_state = PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
    theirs_state = torch_psgd.PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
    ours = ddp(make_model(), ours_state, ours_hook)
    theirs = ddp(make_model(), theirs_state, theirs_hook)
    gaps = [
        rel_diff(a, b)
        for a, b in zip(
            train(ours, sgd(ours), range(STEPS)),
            train(theirs, sgd(theirs), range(STEPS)),
            strict=True,
        )
    ]
    bucket = ours_state.hook_state.bucket(0)
    factors = {}
    if bucket is not None and bucket.q is not None:
        factors["q"] = rel_diff([bucket.q], [theirs_state.q_memory_dict[0]])
    if bucket is not None and bucket.error is not None:
        factors["error"] = rel_diff([bucket.error], [theirs_state.error_dict[0]])
    return {
        "grad_gaps": gaps,
        "param_gap": rel_diff(list(ours.parameters()), list(theirs.parameters())),
        "factor_gaps": factors,
        "stats": (ours_state.compression_stats(), theirs_state.compression_stats()),
        "iters": (ours_state.iter, theirs_state.iter),
    }


TORCH_ORTHOGONALIZE = torch_psgd._orthogonalize


def fixed_orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """PyTorch's orthogonalisation, also taking the 2-D factors its batched
    hook passes (the fix that hook needs: a batch of one, as a view)."""
    TORCH_ORTHOGONALIZE(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


def count_all_reduces(fn: Callable[[], None]) -> int:
    calls = 0
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        fn()
    finally:
        dist.all_reduce = original
    return calls


def one_step(model: DDP, step: int) -> Callable[[], None]:
    return lambda: model(batch(step)).square().mean().backward()


LAYERWISE_CASES = [
    {
        "matrix_approximation_rank": rank,
        "warm_start": warm,
        "use_error_feedback": feedback,
        "batch_tensors_with_same_shape": same_shape,
    }
    for rank, warm, feedback, same_shape in itertools.product(
        (1, 2), (True, False), (True, False), (False, True)
    )
] + [{"matrix_approximation_rank": 4, "batch_tensors_with_same_shape": b} for b in (False, True)]
BATCHED_CASES = [
    {"matrix_approximation_rank": rank, "warm_start": warm, "use_error_feedback": warm}
    for rank, warm in itertools.product((1, 2), (True, False))
]


def parity_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, kwargs in enumerate(LAYERWISE_CASES):
        out[("layerwise", i)] = side_by_side(powerSGD_hook, torch_psgd.powerSGD_hook, **kwargs)
    # PyTorch's batched hook as shipped, then with its orthogonalisation fixed.
    broken = ddp(
        make_model(),
        torch_psgd.PowerSGDState(None, start_powerSGD_iter=START),
        torch_psgd.batched_powerSGD_hook,
    )
    try:
        for _ in train(broken, sgd(broken), range(START + 1)):
            pass
        out["torch_batched_error"] = None
    except Exception as error:  # what PyTorch 2.13 raises on its first compressing step
        out["torch_batched_error"] = (type(error).__name__, str(error))
    torch_psgd._orthogonalize = fixed_orthogonalize  # in this spawned rank only
    for i, kwargs in enumerate(BATCHED_CASES):
        out[("batched", i)] = side_by_side(
            batched_powerSGD_hook, torch_psgd.batched_powerSGD_hook, **kwargs
        )
    return out


def collective_counts() -> dict[str, Any]:
    """All-reduces in one compressing iteration, one bucket and several."""
    out: dict[str, Any] = {}
    for name, state, hook in (
        ("ours", PowerSGDState(None, start_powerSGD_iter=START), powerSGD_hook),
        (
            "theirs",
            torch_psgd.PowerSGDState(None, start_powerSGD_iter=START),
            torch_psgd.powerSGD_hook,
        ),
    ):
        model = ddp(make_model(), state, hook)
        for step in range(START):
            one_step(model, step)()
        out[name] = count_all_reduces(one_step(model, START))
    return out


def several_buckets() -> dict[str, Any]:
    """Ours with many small buckets (PyTorch's hook mismatches collectives here)."""
    out: dict[str, Any] = {}
    for name, hook in (("layerwise", powerSGD_hook), ("batched", batched_powerSGD_hook)):
        state = PowerSGDState(None, start_powerSGD_iter=START, matrix_approximation_rank=2)
        model = ddp(make_model(), state, hook, bucket_cap_mb=0.0005)
        for _ in train(model, sgd(model), range(START)):
            pass
        calls = count_all_reduces(one_step(model, START))
        # Index -1 (core.UNCLAIMED) would hold memories no bucket claimed.
        buckets = [(i, b) for i, b in state.hook_state.buckets if i != core.UNCLAIMED]
        layouts = [core.bucket_layout(b.shapes, 2, 2) for _, b in buckets if b is not None]
        expected = (
            2 * len(layouts)
            if name == "batched"
            else sum(2 if lay.groups else 1 for lay in layouts)
        )
        for _ in train(model, sgd(model), range(START + 1, STEPS + 2)):
            pass
        out[name] = {
            "buckets": len(buckets),
            "calls": calls,
            "expected_calls": expected,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


def weights_only(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same_grads(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True)
    )


def plain_average(module: torch.nn.Module, step: int) -> list[torch.Tensor]:
    """What DDP without a hook would make of this step's gradients."""
    twin = copy.deepcopy(module)
    twin(batch(step)).square().mean().backward()
    grads = [p.grad for p in twin.parameters() if p.grad is not None]
    for g in grads:
        g.div_(dist.get_world_size())
        dist.all_reduce(g)
    return grads


def resume_checks() -> dict[str, Any]:
    """Stop after 3 steps; go back to that point from a weights-only state dict
    and from a pickle, in the same DDP model, and resume in a fresh one."""
    out: dict[str, Any] = {}
    for name, hook in (("layerwise", powerSGD_hook), ("batched", batched_powerSGD_hook)):
        state = PowerSGDState(None, start_powerSGD_iter=START, matrix_approximation_rank=2)
        model = ddp(make_model(), state, hook)
        opt = sgd(model)
        for _ in train(model, opt, range(3)):
            pass
        saved_model = copy.deepcopy(model.module.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        saved_state = weights_only(state.state_dict())
        unpickled = pickle.loads(pickle.dumps(state))
        uninterrupted = list(train(model, opt, range(3, STEPS + 1)))
        results: dict[str, Any] = {}
        for label, saved in (("state_dict", saved_state), ("pickle", unpickled.state_dict())):
            model.module.load_state_dict(saved_model)
            opt.load_state_dict(copy.deepcopy(saved_opt))  # it would alias the buffers
            state.load_state_dict(saved)
            results[label] = same_grads(list(train(model, opt, range(3, STEPS + 1))), uninterrupted)
        results["pickle_group_is_default"] = unpickled.process_group is dist.group.WORLD
        results["iter"] = state.iter

        # A fresh DDP model: its first iteration runs on provisional buckets,
        # compressed with the parameters' memories like the uninterrupted run.
        module = make_model()
        module.load_state_dict(saved_model)
        fresh_state = PowerSGDState(None)
        fresh_state.load_state_dict(saved_state)
        fresh = ddp(module, fresh_state, hook)
        fresh_opt = sgd(fresh)
        fresh_opt.load_state_dict(copy.deepcopy(saved_opt))
        plain = plain_average(module, 3)
        steps = list(train(fresh, fresh_opt, range(3, STEPS + 1)))
        results["fresh_first_step_vs_plain"] = rel_diff(steps[0], plain)
        results["fresh_vs_uninterrupted"] = [
            rel_diff(ours, want) for ours, want in zip(steps, uninterrupted, strict=True)
        ]
        results["fresh_params"] = [p.detach().clone() for p in fresh.parameters()]
        results["fresh_iter"] = fresh_state.iter
        out[name] = results
    return out


def shared_state_error() -> tuple[str, str]:
    """One state, two models with different buckets."""
    state = PowerSGDState(None, start_powerSGD_iter=START)
    first = ddp(make_model(), state, powerSGD_hook)
    for _ in train(first, sgd(first), range(START + 1)):
        pass
    torch.manual_seed(2)
    other = ddp(
        torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 4)), state, powerSGD_hook
    )
    try:
        other(batch(0)).sum().backward()
    except Exception as error:
        return type(error).__name__, str(error)
    return "no error", ""


def two_rank_world(rank: int, world: int) -> dict[str, Any]:
    return {
        "parity": parity_checks(),
        "counts": collective_counts(),
        "buckets": several_buckets(),
        "resume": resume_checks(),
        "shared": shared_state_error(),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(two_rank_world, 2)


@pytest.mark.timeout(180)
def test_layerwise_matches_pytorch_across_start(two_ranks: list[dict[str, Any]]) -> None:
    for rank_out in two_ranks:
        for i, kwargs in enumerate(LAYERWISE_CASES):
            case = rank_out["parity"][("layerwise", i)]
            assert len(case["grad_gaps"]) == STEPS
            assert case["grad_gaps"][:START] == [0.0] * START, kwargs  # plain averaging
            # Rounding differs from PyTorch's (our products run transposed, and
            # batched); at rank 4 the power iteration amplifies it step by step
            # in the weakest direction (measured: 5e-7, 2e-6, 8e-6), while the
            # parameters stay within 1e-7.
            bound = 5e-5 if kwargs["matrix_approximation_rank"] == 4 else 1e-5
            assert max(case["grad_gaps"]) <= bound, (kwargs, case["grad_gaps"])
            assert case["param_gap"] <= 1e-6, kwargs
            assert all(gap <= 1e-5 for gap in case["factor_gaps"].values()), kwargs
            ours, theirs = case["stats"]
            assert ours == pytest.approx(theirs) and ours[0] > 1, kwargs
            assert case["iters"] == (STEPS, STEPS)


@pytest.mark.timeout(180)
def test_batched_matches_pytorchs_once_fixed(two_ranks: list[dict[str, Any]]) -> None:
    for rank_out in two_ranks:
        kind, _ = rank_out["parity"]["torch_batched_error"]
        assert kind == "AssertionError"  # PyTorch 2.13's batched hook, as shipped
        for i, kwargs in enumerate(BATCHED_CASES):
            case = rank_out["parity"][("batched", i)]
            assert max(case["grad_gaps"]) <= 1e-5, (kwargs, case["grad_gaps"])
            assert case["param_gap"] <= 1e-6, kwargs
            assert all(gap <= 1e-5 for gap in case["factor_gaps"].values()), kwargs
            assert case["stats"][0] == pytest.approx(case["stats"][1])


@pytest.mark.timeout(180)
def test_two_all_reduces_per_bucket_instead_of_three(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["counts"] == {"ours": 2, "theirs": 3}


@pytest.mark.timeout(180)
def test_several_buckets_on_gloo_agree_across_ranks(two_ranks: list[dict[str, Any]]) -> None:
    for name in ("layerwise", "batched"):
        first, second = (r["buckets"][name] for r in two_ranks)
        assert first["buckets"] > 3
        assert first["calls"] == first["expected_calls"]
        for a, b in zip(first["params"], second["params"], strict=True):
            assert torch.equal(a, b)
            assert torch.isfinite(a).all()


@pytest.mark.timeout(180)
def test_resume_from_weights_only_state_dict_and_pickle(two_ranks: list[dict[str, Any]]) -> None:
    for rank_out in two_ranks:
        for name in ("layerwise", "batched"):
            results = rank_out["resume"][name]
            assert results["state_dict"] and results["pickle"], name
            assert results["pickle_group_is_default"]
            assert results["iter"] == STEPS + 1


@pytest.mark.timeout(180)
def test_resume_in_a_fresh_ddp_model(two_ranks: list[dict[str, Any]]) -> None:
    """Error and Q are kept per parameter, so a fresh DDP model's provisional
    first iteration is compressed as the uninterrupted run's was, not averaged
    plainly; the batched hook's bucket holds the same parameters in both
    layouts here (one bucket, in another order), so its square memory
    applies as well: both continue exactly."""
    for name in ("layerwise", "batched"):
        first, second = (r["resume"][name] for r in two_ranks)
        assert first["fresh_first_step_vs_plain"] > 1e-3, name  # compressed
        assert max(first["fresh_vs_uninterrupted"]) <= 1e-5, (name, first)
        assert first["fresh_iter"] == STEPS + 1
        for a, b in zip(first["fresh_params"], second["fresh_params"], strict=True):
            assert torch.equal(a, b) and torch.isfinite(a).all()


@pytest.mark.timeout(180)
def test_state_shared_by_models_with_other_parameters_is_refused(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank_out in two_ranks:
        kind, message = rank_out["shared"]
        assert kind == "ValueError", message
        assert "different parameters" in message and "made for shape" in message, message


# ----- in one process: a one-rank group and hand-made buckets ---------------------------


class HandMadeBucket:
    """What the hooks read of DDP's GradBucket, over a given flat buffer."""

    def __init__(self, index: int, shapes: list[tuple[int, ...]], flat: torch.Tensor, last: bool):
        self._index, self._shapes, self._flat, self._last = index, shapes, flat, last

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = torch.Size(shape).numel()
            out.append(self._flat[offset : offset + n].view(shape))
            offset += n
        return out


BUCKETS = [[(24, 12), (24,), (16, 16), (16, 16), (6, 4, 3), (4, 16)], [(20, 30), (30, 20)]]


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_one_rank_several_buckets_match_pytorch(rank: int) -> None:
    for warm, feedback, same_shape, seed in itertools.product(
        (True, False), (True, False), (True, False), (0, 7)
    ):
        kwargs = {
            "matrix_approximation_rank": rank,
            "start_powerSGD_iter": START,
            "warm_start": warm,
            "use_error_feedback": feedback,
            "batch_tensors_with_same_shape": same_shape,
            "random_seed": seed,
        }
        ours, theirs = PowerSGDState(None, **kwargs), torch_psgd.PowerSGDState(None, **kwargs)
        g = torch.Generator().manual_seed(seed)
        for _ in range(STEPS):
            # Ours as DDP calls it: every bucket's hook, then wait. (Ours issues
            # a bucket's second all-reduce in the next bucket's call, so none of
            # its futures is waited on before the last call.) PyTorch's bucket is
            # finished before the next one starts: its callbacks block one of the
            # group's two gloo worker threads on a nested all-reduce, so two of
            # its buckets in flight can leave no worker to run those all-reduces
            # (a deadlock), and with warm_start=False one bucket's
            # p_memory_dict.clear() races the other's lookup. The numbers are
            # the same either way.
            futures = []
            for i, shapes in enumerate(BUCKETS):
                flat = torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=g)
                last = i == len(BUCKETS) - 1
                a = powerSGD_hook(ours, HandMadeBucket(i, shapes, flat.clone(), last))
                b = torch_psgd.powerSGD_hook(theirs, HandMadeBucket(i, shapes, flat, last))
                b.wait()
                futures.append((a, b))
            for a, b in futures:
                torch.testing.assert_close(
                    a.wait(), b.wait(), rtol=1e-5, atol=1e-5, msg=str(kwargs)
                )
        assert ours.iter == theirs.iter == STEPS
        assert ours.compression_stats() == pytest.approx(theirs.compression_stats())
        assert ours.hook_state.global_state.seeds.pos == theirs.rng.get_state()[2]
        assert_same_views(ours, theirs, str(kwargs))


def assert_same_views(ours: PowerSGDState, theirs: Any, label: str) -> None:
    """Our read-only views under PyTorch's names equal PyTorch's attributes."""
    for name in ("total_numel_before_compression", "total_numel_after_compression"):
        assert getattr(ours, name) == getattr(theirs, name), (name, label)
    assert ours.next_stats_report == theirs.next_stats_report, label
    mine, its = ours.rng.get_state(), theirs.rng.get_state()
    assert mine[0] == its[0] and (mine[1] == its[1]).all() and mine[2:] == its[2:], label
    for name in ("error_dict", "q_memory_dict"):
        view, reference = getattr(ours, name), getattr(theirs, name)
        # PyTorch keeps an empty tensor for a bucket with nothing to compress.
        assert set(view) == {i for i, t in reference.items() if t.numel()}, (name, label)
        for index in view:
            torch.testing.assert_close(
                view[index], reference[index].reshape(view[index].shape), rtol=1e-5, atol=1e-5
            )


@pytest.mark.usefixtures("single_rank_group")
def test_pytorchs_attribute_names_are_read_only_views() -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2)
    assert state.__slots__ == torch_psgd.PowerSGDState.__slots__ or list(state.__slots__) == list(
        torch_psgd.PowerSGDState.__slots__
    )
    for name in state.__slots__:
        getattr(state, name)  # every name PyTorch lists can be read
    for name in ("rng", "error_dict", "p_memory_dict", "q_memory_dict", "next_stats_report"):
        with pytest.raises(
            AttributeError, match=f"PowerSGDState.{name} is a read-only view.*load_state_dict"
        ):
            setattr(state, name, None)
    with pytest.raises(TypeError, match="read-only view.*load_state_dict"):
        state.error_dict[0] = torch.zeros(1)
    assert state.p_memory_dict == {}


def test_constructor_takes_pytorchs_arguments_and_refuses_bad_ones() -> None:
    import inspect

    ours = inspect.signature(PowerSGDState.__init__).parameters
    theirs = inspect.signature(torch_psgd.PowerSGDState.__init__).parameters
    assert [(p.name, p.default) for p in ours.values()] == [
        (p.name, p.default) for p in theirs.values()
    ]
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        PowerSGDState(None, start_powerSGD_iter=1)  # PyTorch refuses this one too
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        torch_psgd.PowerSGDState(None, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDState(None, min_compression_rate=0.5)


def test_state_exposes_pytorchs_attributes() -> None:
    state = PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=7)
    theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=7)
    for name in (
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "orthogonalization_epsilon",
        "compression_stats_logging_frequency",
        "batch_tensors_with_same_shape",
        "iter",
        "process_group",
    ):
        assert getattr(state, name) == getattr(theirs, name), name
    assert state.compression_stats() == (0.0, 0, 0) == theirs.compression_stats()


def test_failed_load_leaves_the_state_alone() -> None:
    state = PowerSGDState(None, start_powerSGD_iter=5)
    before = state.state_dict()
    with pytest.raises(ValueError, match="not a PowerSGD state dict"):
        state.load_state_dict({"iteration": 3})
    damaged = copy.deepcopy(before)
    damaged["config"]["matrix_approximation_rank"] = 0
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        state.load_state_dict(damaged)
    assert state.state_dict()["config"] == before["config"]
    assert state.config.start_powerSGD_iter == 5


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_hooks_register_with_ddp(hook: Hook) -> None:
    model, alone = DDP(make_model()), make_model()
    state = PowerSGDState(None, start_powerSGD_iter=START)
    model.register_comm_hook(state, hook)
    for step in range(START + 1):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
        for m in (model, alone):
            m.zero_grad()
            m(x).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.isfinite().all() for g in grads)
        if step < START:  # plain averaging over one rank: the local gradients exactly
            assert all(map(torch.equal, grads, (p.grad for p in alone.parameters())))
    # DDP called the hook for every iteration, and the last one compressed.
    assert state.iter == START + 1
    _, before, after = state.compression_stats()
    assert before > after > 0


def _one_iteration(state: PowerSGDState, buckets: list[list[tuple[int, ...]]]) -> None:
    """Call the hook for every bucket of one iteration, then wait, as DDP does."""
    g = torch.Generator().manual_seed(state.iter)
    futures = [
        powerSGD_hook(
            state,
            HandMadeBucket(
                i,
                shapes,
                torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=g),
                i == len(buckets) - 1,
            ),
        )
        for i, shapes in enumerate(buckets)
    ]
    for fut in futures:
        fut.wait()


@pytest.mark.usefixtures("single_rank_group")
def test_logs_compression_stats_when_due(caplog: pytest.LogCaptureFixture) -> None:
    state = PowerSGDState(
        None,
        start_powerSGD_iter=START,
        min_compression_rate=1,
        compression_stats_logging_frequency=2,
    )
    with caplog.at_level("INFO", logger="zerofn_torch.hooks.powersgd"):
        for _ in range(START + 3):
            _one_iteration(state, BUCKETS)
    reports = [r for r in caplog.records if "compression stats" in r.getMessage()]
    assert reports, "no compression statistics were logged"
    assert state.iter == START + 3


class KeyedBucket(HandMadeBucket):
    """A hand-made bucket that names its parameters, as DDP's does."""

    def __init__(self, index: int, params: list[torch.Tensor], flat: torch.Tensor, last: bool):
        super().__init__(index, [tuple(p.shape) for p in params], flat, last)
        self._params = params

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def _keyed_iteration(
    state: PowerSGDState,
    params: list[torch.Tensor],
    layout: list[list[int]],
    grads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """One iteration on buckets of ``params`` (by index); each parameter's result."""
    futures = [
        powerSGD_hook(
            state,
            KeyedBucket(
                i,
                [params[j] for j in bucket],
                torch.cat([grads[j].reshape(-1) for j in bucket]),
                i == len(layout) - 1,
            ),
        )
        for i, bucket in enumerate(layout)
    ]
    out: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for bucket, fut in zip(layout, futures, strict=True):
        parts = fut.wait().split([params[j].numel() for j in bucket])
        for j, part in zip(bucket, parts, strict=True):
            out[j] = part
    return out


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("warm_start", [True, False])
def test_restored_state_on_other_buckets_trains_identically(warm_start: bool) -> None:
    """A state restored into a model whose first iteration runs on other
    buckets (DDP's provisional one: all parameters, reversed) gives what the
    uninterrupted run gives, without a warning, and so does every later one."""
    shapes = [s for bucket in BUCKETS for s in bucket]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    rebuilt = [list(range(len(BUCKETS[0]))), list(range(len(BUCKETS[0]), len(shapes)))]
    provisional = [list(reversed(range(len(shapes))))]
    kwargs = {"start_powerSGD_iter": START, "min_compression_rate": 1, "warm_start": warm_start}
    trained = PowerSGDState(None, matrix_approximation_rank=2, **kwargs)
    trained.track_parameters(params)
    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(START + 4)]
    for grads in steps[: START + 1]:
        _keyed_iteration(trained, params, rebuilt, grads)
    restored = PowerSGDState(None)
    restored.track_parameters(params)
    restored.load_state_dict(weights_only(trained.state_dict()))
    for i, grads in enumerate(steps[START + 1 :]):
        want = _keyed_iteration(trained, params, rebuilt, grads)
        got = _keyed_iteration(restored, params, provisional if i == 0 else rebuilt, grads)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert restored.iter == trained.iter


@pytest.mark.usefixtures("single_rank_group")
def test_the_parameters_keys_stay_with_the_live_state_not_its_state_dict() -> None:
    """Which live parameter has which key is the hook state's, learnt or
    tracked: loading a state dict keeps it (the model is the same), and a
    state built from the dict alone knows none (its parameters are others)."""
    shapes = [s for bucket in BUCKETS for s in bucket]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    layout = [list(reversed(range(len(shapes))))]
    state = PowerSGDState(None, start_powerSGD_iter=START, min_compression_rate=1)
    state.track_parameters(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(START + 1):
        _keyed_iteration(state, params, layout, [torch.randn(s, generator=g) for s in shapes])
    known = dict(state.hook_state.global_state.parameter_keys.known)
    assert known == {id(p): i for i, p in enumerate(params)}
    saved = weights_only(state.state_dict())
    state.load_state_dict(saved)
    assert state.hook_state.global_state.parameter_keys.known == known
    fresh = PowerSGDState(None)
    fresh.load_state_dict(saved)
    assert fresh.hook_state.global_state.parameter_keys.known == {}


@pytest.mark.slow
def test_runs_to_the_end_the_script_on_which_pytorchs_hook_aborts() -> None:
    """examples/powersgd_on_gloo.py: PyTorch 2.13's hook ends this run with
    SIGABRT some iterations after compression starts (gloo pairs collectives
    of different sizes); zerofn's runs well past that, replicas equal."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import powersgd_on_gloo as script

    steps = script.START + 25
    (losses0, params0), (losses1, params1) = run_world(script.train_rank, 2, "zerofn", steps, True)
    assert len(losses0) == len(losses1) == steps
    assert all(torch.isfinite(torch.tensor(losses0 + losses1)))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))
