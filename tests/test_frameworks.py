"""zerofn inside training frameworks, with the real packages: PyTorch
Lightning and Hugging Face Accelerate on 2 gloo ranks started by ``torchrun``
(a subprocess per framework; tests/_frameworks_lightning.py and
tests/_frameworks_accelerate.py say what each rank runs), and the
``isinstance`` opt-in of :mod:`zerofn_torch.compat` in this process.

Parameters are compared bitwise: zerofn's runs and PyTorch's own use the same
partition (the same rank steps the same tensors), the same local Adam over
them and, in the hooks, the same arithmetic in the same order (fp16: cast,
divide by the world size, all-reduce, cast back), on the same batches, so
every floating-point operation is the same; and a resume that restores
model, optimizer and hook state continues the very same sequence. A
difference of one rounding would be a real divergence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.compat import TorchTypedZeroRedundancyOptimizer, consolidated

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["param_groups"] == b["param_groups"]
        and a["state"].keys() == b["state"].keys()
        and all(
            a["state"][i].keys() == b["state"][i].keys()
            and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
            for i in a["state"]
        )
    )


def launch(script: str, *args: str) -> tuple[int, str]:
    """Run ``script ARGS`` on 2 ranks under torchrun; the launcher's exit
    code (0 only if every rank exited with 0) and its output with the ranks'.

    The launcher runs in its own session, so a timeout ends it and its ranks
    together rather than leaving them waiting on each other.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={RANKS}",
        os.path.join(HERE, script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    ) as launcher:
        try:
            output, _ = launcher.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output, _ = launcher.communicate()
            pytest.fail(f"{script} did not finish in 180 s:\n{output[-6000:]}")
    return launcher.returncode, output


def torchrun(script: str, out: str, prefix: str) -> list[dict[str, Any]]:
    """Run ``script OUT`` on 2 ranks under torchrun; what each rank saved."""
    code, output = launch(script, out)
    assert code == 0, f"{script} failed:\n{output[-6000:]}"
    return [
        torch.load(os.path.join(out, f"{prefix}-rank{r}.pt"), weights_only=False)
        for r in range(RANKS)
    ]


# ----- PyTorch Lightning ------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("pytorch_lightning")
    out = str(tmp_path_factory.mktemp("lightning"))
    return torchrun("_frameworks_lightning.py", out, "lightning")


def test_lightning_trains_zerofn_as_it_trains_pytorchs_zero(
    lightning: list[dict[str, Any]],
) -> None:
    for rank in lightning:
        assert same(rank["zerofn"]["saved"], rank["torch"]["saved"])
        assert same(rank["zerofn"]["resumed"], rank["torch"]["resumed"])


def test_lightning_resumes_zerofn_exactly(lightning: list[dict[str, Any]]) -> None:
    for rank in lightning:
        assert same(rank["zerofn"]["resumed"], rank["uninterrupted"])
        # The resumed fit trained on: it did not just reload the checkpoint.
        assert not same(rank["zerofn"]["resumed"], rank["zerofn"]["saved"])
    assert same(lightning[0]["zerofn"]["resumed"], lightning[1]["zerofn"]["resumed"])


@pytest.mark.parametrize("family", ["zerofn", "typed"])
def test_lightning_checkpoints_hold_the_consolidated_state(
    lightning: list[dict[str, Any]], family: str
) -> None:
    """Lightning consolidates any optimizer that has ``consolidate_state_dict``
    (it asks ``hasattr``, not ``isinstance``), so with or without the typed
    class the file holds every rank's shard, equal to PyTorch's."""
    run = lightning[0][family]
    ours = torch.load(run["ckpt"], weights_only=True)["optimizer_states"][0]
    theirs = torch.load(lightning[0]["torch"]["ckpt"], weights_only=True)["optimizer_states"][0]
    assert same_optimizer_state(ours, theirs)
    n_params = len(run["saved"])
    assert sorted(ours["state"]) == list(range(n_params))
    assert all(int(s["step"]) == run["saved_at_step"] for s in ours["state"].values())


def test_lightning_trains_the_typed_optimizer_as_zerofns(lightning: list[dict[str, Any]]) -> None:
    for rank in lightning:
        assert rank["typed"]["optimizer_class"] == "TorchTypedZeroRedundancyOptimizer"
        assert same(rank["typed"]["resumed"], rank["zerofn"]["resumed"])


@pytest.mark.parametrize("family", ["zerofn", "torch", "typed"])
def test_the_comm_hook_reduces_every_step(lightning: list[dict[str, Any]], family: str) -> None:
    for rank in lightning:
        run = rank[family]
        first, second = run["hook_calls"]
        # At least one bucket per step, as many steps in the resumed fit.
        assert first >= run["saved_at_step"] and second >= run["saved_at_step"]


def test_lightning_26_skips_ddp_comm_hook_on_cpu(lightning: list[dict[str, Any]]) -> None:
    """Why the hook goes on through a callback: DDPStrategy registers its
    ``ddp_comm_hook`` only on CUDA. Should Lightning register it on CPU too,
    this fails, and the callback would then register a second hook."""
    assert [rank["ignored_hook_calls"] for rank in lightning] == [0] * RANKS


def test_lightning_refuses_model_averaging_only_for_the_typed_class(
    lightning: list[dict[str, Any]],
) -> None:
    for rank in lightning:
        refused = rank["averaging_refused"]
        assert (
            refused["typed"] is not None and "TorchTypedZeroRedundancyOptimizer" in refused["typed"]
        )
        assert refused["zerofn"] is None  # Lightning's isinstance check misses it


EXIT_RUNS = int(os.environ.get("ZEROFN_LIGHTNING_EXIT_RUNS", "12"))


@pytest.mark.slow
def test_the_lightning_run_exits_cleanly_every_time(tmp_path: Any) -> None:
    """Fit, checkpoint and resume with zerofn's ZeRO and PowerSGD hook
    (``_frameworks_lightning.py OUT exit``), :data:`EXIT_RUNS` times; every
    rank must finish the run and exit with 0, and no ``terminate called``.

    Without what :mod:`zerofn_torch.runtime.futures` and :mod:`zerofn_torch.runtime.issue` do
    at exit, 9 runs of 35 aborted (SIGABRT: a gloo worker thread still in a
    completion callback, or letting go of a collective, asked for the GIL once
    the interpreter finalized); with it, 0 of 150 (docs/failures.md has the
    table; PyTorch's own ZeRO and PowerSGD hook in the same run: 15 of 30).
    About 7 s a run.
    """
    pytest.importorskip("pytorch_lightning")
    failures = []
    for run in range(EXIT_RUNS):
        out = tmp_path / f"run{run}"
        out.mkdir()
        code, output = launch("_frameworks_lightning.py", str(out), "exit")
        finished = sorted(p.name for p in out.glob("exit-rank*.done"))
        if code != 0 or "terminate called" in output or len(finished) != RANKS:
            failures.append(f"run {run}: exit {code}, finished {finished}\n{output[-3000:]}")
    assert not failures, f"{len(failures)} of {EXIT_RUNS} runs:\n" + "\n".join(failures)


# ----- Hugging Face Accelerate ------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("accelerate")
    out = str(tmp_path_factory.mktemp("accelerate"))
    return torchrun("_frameworks_accelerate.py", out, "accelerate")


def test_accelerate_runs_multi_cpu_on_gloo(accelerate: list[dict[str, Any]]) -> None:
    for rank in accelerate:
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU"
        assert rank["backend"] == "gloo"


@pytest.mark.parametrize("family", ["zerofn", "torch"])
def test_accelerate_cannot_save_a_zero_optimizer_as_it_is(
    accelerate: list[dict[str, Any]], family: str
) -> None:
    """``save_state`` calls ``state_dict()`` on every rank: it raises on every
    rank, for PyTorch's optimizer as for zerofn's, and the failed save leaves
    a directory with the model and no optimizer."""
    for r, rank in enumerate(accelerate):
        found = rank["save_state"][family]
        assert found["as_is"].startswith("RuntimeError: Optimizer state has not been consolidated")
        assert f"consolidate_state_dict(to={r})" in found["as_is"]
        assert "optimizer.bin" not in found["as_is_files"] and found["as_is_files"]


def test_accelerate_places_zerofns_optimizer_and_not_pytorchs(
    accelerate: list[dict[str, Any]],
) -> None:
    """``prepare`` with device placement reads and reloads the optimizer's
    full state dict: zerofn's answers before the first step (the state is
    empty everywhere), PyTorch's raises on every rank."""
    for r, rank in enumerate(accelerate):
        assert rank["save_state"]["zerofn"]["placed"] is None
        refused = rank["save_state"]["torch"]["placed"]
        assert refused.startswith("RuntimeError: Optimizer state has not been consolidated")
        assert f"consolidate_state_dict(to={r})" in refused


@pytest.mark.parametrize("family", ["zerofn", "torch"])
def test_accelerate_save_state_after_consolidating_fails_on_the_other_ranks(
    accelerate: list[dict[str, Any]], family: str
) -> None:
    outcomes = [rank["save_state"][family]["consolidated_to_0"] for rank in accelerate]
    assert outcomes[0] is None
    assert all(o is not None and o.startswith("RuntimeError") for o in outcomes[1:])


def test_consolidated_answers_on_every_rank_only_inside_the_block(
    accelerate: list[dict[str, Any]],
) -> None:
    for r, rank in enumerate(accelerate):
        found = rank["round_trip"]["zerofn"]
        assert found["inside_keys"] == (["param_groups", "state"] if r == 0 else [])
        if r == 0:  # still consolidated here, as after consolidate_state_dict
            assert found["after_block"] is None
        else:
            assert (
                found["after_block"] is not None and "not been consolidated" in found["after_block"]
            )


def test_consolidated_refuses_accelerates_wrapper(accelerate: list[dict[str, Any]]) -> None:
    for rank in accelerate:
        message = rank["save_state"]["zerofn"]["wrapper_refused"]
        assert message.startswith("TypeError") and "AcceleratedOptimizer" in message
        assert ".optimizer" in message


@pytest.mark.parametrize("run", ["zerofn", "torch", "powersgd"])
def test_accelerate_resumes_exactly_from_save_state(
    accelerate: list[dict[str, Any]], run: str
) -> None:
    for rank in accelerate:
        found = rank["round_trip"][run]
        assert not same(found["fresh"], found["continued"])  # load_state did the work
        assert same(found["resumed"], found["continued"])


def test_accelerate_resumes_exactly_with_a_sharded_optimizer_checkpoint(
    accelerate: list[dict[str, Any]],
) -> None:
    for rank in accelerate:
        found = rank["round_trip"]["sharded"]
        assert "optimizer.bin" not in found["files"]  # save_state never saw the optimizer
        assert not same(found["fresh"], found["continued"])
        assert same(found["resumed"], found["continued"])
        assert same(found["continued"], rank["round_trip"]["zerofn"]["continued"])


def test_accelerate_trains_zerofn_as_pytorchs_zero_and_saves_the_same_file(
    accelerate: list[dict[str, Any]],
) -> None:
    for rank in accelerate:
        assert same(
            rank["round_trip"]["zerofn"]["continued"], rank["round_trip"]["torch"]["continued"]
        )
    ours = accelerate[0]["round_trip"]["zerofn"]
    assert same_optimizer_state(
        ours["saved_optimizer"], accelerate[0]["round_trip"]["torch"]["saved_optimizer"]
    )
    state = ours["saved_optimizer"]["state"]
    assert sorted(state) == list(range(len(ours["continued"])))
    assert all(int(s["step"]) == ours["save_at"] for s in state.values())


def test_powersgd_needs_its_per_rank_state_to_resume_exactly(
    accelerate: list[dict[str, Any]],
) -> None:
    for rank in accelerate:
        found = rank["round_trip"]["powersgd"]
        assert found["hook_iter"] == found["steps"]
        assert not same(found["resumed_without_hook_state"], found["continued"])


# ----- isinstance: zerofn_torch.compat, in this process ---------------------------


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def trained(zero_class: type[Any], steps: int = 3) -> tuple[torch.nn.Module, Any]:
    net = model()
    opt = zero_class(net.parameters(), torch.optim.Adam, lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
    return net, opt


def checkpoint_like_a_script(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """How training scripts and checkpoint handlers decide to consolidate."""
    if isinstance(opt, TorchZero):
        opt.consolidate_state_dict(to=0)
    return opt.state_dict()


def test_the_typed_class_passes_both_type_checks() -> None:
    assert issubclass(TorchTypedZeroRedundancyOptimizer, TorchZero)
    assert issubclass(TorchTypedZeroRedundancyOptimizer, ZeroRedundancyOptimizer)
    assert not issubclass(ZeroRedundancyOptimizer, TorchZero)  # the opt-in stays explicit


def test_no_name_reaches_pytorchs_zero_code() -> None:
    """Every name PyTorch's class defines resolves elsewhere, from the typed
    class and from the class after zerofn's (where zerofn's ``super()``
    calls look): PyTorch's constructor and methods cannot run."""
    mro = TorchTypedZeroRedundancyOptimizer.__mro__
    after_zerofn = mro[mro.index(ZeroRedundancyOptimizer) + 1 :]
    bookkeeping = {"__module__", "__doc__", "__abstractmethods__", "_abc_impl"}
    for name in set(vars(TorchZero)) - bookkeeping:
        for chain in (mro, after_zerofn):
            owner = next(k for k in chain if name in vars(k))
            assert owner is not TorchZero, name


def test_the_typed_class_trains_as_zerofns(single_rank_group: None) -> None:
    plain_net, plain = trained(ZeroRedundancyOptimizer)
    typed_net, typed = trained(TorchTypedZeroRedundancyOptimizer)
    assert same(list(plain_net.parameters()), list(typed_net.parameters()))
    plain.consolidate_state_dict(to=0)
    typed.consolidate_state_dict(to=0)
    assert same_optimizer_state(plain.state_dict(), typed.state_dict())


def test_pytorchs_private_names_are_absent(single_rank_group: None) -> None:
    _, typed = trained(TorchTypedZeroRedundancyOptimizer, steps=1)
    for name in ("_partition_parameters", "_param_to_rank", "_sync_param_groups"):
        assert not hasattr(typed, name)
    with pytest.raises(AttributeError, match="shard_plan"):
        typed._param_to_rank  # noqa: B018


def test_isinstance_checks_consolidate_the_typed_class(single_rank_group: None) -> None:
    net, typed = trained(TorchTypedZeroRedundancyOptimizer, steps=3)
    saved = checkpoint_like_a_script(typed)
    assert sorted(saved["state"]) == list(range(len(list(net.parameters()))))
    assert all(int(s["step"]) == 3 for s in saved["state"].values())


def test_without_the_opt_in_such_checks_get_an_error_not_a_checkpoint(
    single_rank_group: None,
) -> None:
    _, plain = trained(ZeroRedundancyOptimizer)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=0\)"):
        checkpoint_like_a_script(plain)


def test_consolidated_on_the_receiving_rank(single_rank_group: None) -> None:
    net, opt = trained(ZeroRedundancyOptimizer)
    with consolidated(opt):
        inside = opt.state_dict()
    assert sorted(inside["state"]) == list(range(len(list(net.parameters()))))
    assert "state_dict" not in vars(opt)


@pytest.mark.parametrize(("to", "error"), [(1, ValueError), ("0", TypeError)])
def test_consolidated_refuses_a_bad_rank_and_changes_nothing(
    single_rank_group: None, to: Any, error: type[Exception]
) -> None:
    _, opt = trained(ZeroRedundancyOptimizer)
    with pytest.raises(error), consolidated(opt, to=to):
        pass
    assert "state_dict" not in vars(opt)
    with pytest.raises(RuntimeError, match="not been consolidated"):
        opt.state_dict()


def test_consolidated_refuses_a_plain_optimizer() -> None:
    opt = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="SGD"), consolidated(opt):  # type: ignore[arg-type]
        pass


# ----- Hugging Face Trainer ---------------------------------------------------------


@pytest.fixture(scope="module")
def hf_trainer(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    out = str(tmp_path_factory.mktemp("transformers"))
    return torchrun("_frameworks_transformers.py", out, "transformers")


@pytest.mark.parametrize("run", ["zerofn", "torch", "adamw"])
def test_the_trainer_resumes_exactly_from_its_checkpoint(
    hf_trainer: list[dict[str, Any]], run: str
) -> None:
    for rank in hf_trainer:
        found = rank[run]
        assert not same(found["fresh"], found["uninterrupted"])  # the resume did the work
        assert same(found["resumed"], found["uninterrupted"])


def test_the_trainer_trains_zerofn_as_pytorchs_zero_and_its_own_adamw(
    hf_trainer: list[dict[str, Any]],
) -> None:
    for rank in hf_trainer:
        assert same(rank["zerofn"]["uninterrupted"], rank["torch"]["uninterrupted"])
        assert same(rank["zerofn"]["uninterrupted"], rank["adamw"]["uninterrupted"])
    assert same(hf_trainer[0]["zerofn"]["resumed"], hf_trainer[1]["zerofn"]["resumed"])


def test_the_trainer_checkpoint_holds_the_whole_optimizer_state(
    hf_trainer: list[dict[str, Any]],
) -> None:
    ours = hf_trainer[0]["zerofn"]["saved_optimizer"]
    assert same_optimizer_state(ours, hf_trainer[0]["torch"]["saved_optimizer"])
    assert sorted(ours["state"]) == list(range(len(hf_trainer[0]["zerofn"]["resumed"])))


def test_consolidate_before_save_refuses_what_it_cannot_prepare() -> None:
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from zerofn_torch.huggingface import ConsolidateBeforeSave

    callback = ConsolidateBeforeSave()
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    plain = torch.optim.AdamW(model().parameters())
    with pytest.raises(TypeError, match="optimizers=\\(ZeroRedundancyOptimizer"):
        callback.on_train_begin(args, TrainerState(), TrainerControl(), optimizer=plain)
    state = TrainerState(global_step=3)
    with pytest.raises(RuntimeError, match="list ConsolidateBeforeSave last"):
        callback.on_save(args, state, TrainerControl())
