"""Hugging Face Accelerate with zerofn, run by tests/test_frameworks.py under
``torchrun --nproc-per-node 2`` (gloo, CPU): ``python -m torch.distributed.run
--standalone --nproc-per-node 2 tests/_frameworks_accelerate.py OUT``.

Each rank writes what the tests read to ``OUT/accelerate-rank<r>.pt``.
``Accelerator(cpu=True)`` prepares a model, a ZeRO optimizer over Adam and a
dataloader; a DDP communication hook goes on the prepared (DDP) model.

* ``save_state``: what ``prepare`` with device placement and
  ``Accelerator.save_state`` do with zerofn's and with PyTorch's
  ``ZeroRedundancyOptimizer``, as they are and after
  ``consolidate_state_dict(to=0)``.
* ``round_trip``: train 3 steps, save inside
  :func:`zerofn_torch.compat.consolidated`, train 3 more; then a fresh model,
  optimizer and hook state (another seed) prepared, ``load_state``, and the
  same 3 steps through ``skip_first_batches``. Runs: zerofn's optimizer and
  ``allreduce_hook``; PyTorch's optimizer and hook; zerofn's optimizer with
  zerofn's PowerSGD, whose per-rank state is saved beside the checkpoint (and,
  as a control, a resume that drops it).
* ``sharded``: the same with zerofn's optimizer kept out of ``prepare`` and
  saved by ``zerofn_torch.checkpoint.save_sharded`` beside ``save_state``.

DDP inspects a hook's annotations at registration, so this module keeps them
as real objects: no ``from __future__ import annotations``.
"""

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.utils.data import DataLoader, TensorDataset
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.compat import consolidated
from zerofn_torch.hooks import PowerSGDState, allreduce_hook, powerSGD_hook

SAMPLES, BATCH, SAVE_AT = 48, 4, 3  # 6 steps on each of 2 ranks; save after 3


def plain_allreduce() -> tuple[Any, Callable[..., Any]]:
    return None, allreduce_hook


def torch_allreduce() -> tuple[Any, Callable[..., Any]]:
    return None, torch_hooks.allreduce_hook


def powersgd() -> tuple[Any, Callable[..., Any]]:
    return PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2), powerSGD_hook


RUNS: dict[
    str, tuple[type[torch.optim.Optimizer], Callable[[], tuple[Any, Callable[..., Any]]]]
] = {
    "zerofn": (ZeroRedundancyOptimizer, plain_allreduce),
    "torch": (TorchZero, torch_allreduce),
    "powersgd": (ZeroRedundancyOptimizer, powersgd),
}


def built(run: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    zero_class, _ = RUNS[run]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = zero_class(model.parameters(), torch.optim.Adam, lr=0.01)  # type: ignore[call-arg]
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))
    return model, optimizer, DataLoader(data, BATCH)


def prepared(
    accelerator: Accelerator, run: str, seed: int
) -> tuple[torch.nn.Module, Any, DataLoader[Any], Any]:
    """The run's model, optimizer and loader through ``prepare``, with its
    hook registered on the DDP model; and the hook's state. PyTorch's
    optimizer goes in without device placement: Accelerate's reads and
    reloads its full state dict, which it answers only once consolidated
    (zerofn's answers before the first step)."""
    placement = [True, False, True] if RUNS[run][0] is TorchZero else None
    model, optimizer, loader = accelerator.prepare(*built(run, seed), device_placement=placement)
    state, hook = RUNS[run][1]()
    model.register_comm_hook(state, hook)
    return model, optimizer, loader, state


def train(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, batches: Iterable[Any]
) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def error_of(action: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of what ``action`` raised, or ``None``."""
    try:
        action()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def what_save_state_does(accelerator: Accelerator, out: str, run: str) -> dict[str, Any]:
    # Every rank fails alike (before any collective of the optimizer's).
    found: dict[str, Any] = {"placed": error_of(lambda: accelerator.prepare(*built(run, 0)))}
    accelerator.free_memory()
    model, optimizer, loader, _ = prepared(accelerator, run, seed=0)
    train(accelerator, model, optimizer, list(loader)[:2])
    as_is = os.path.join(out, f"{run}-as-is")
    found["as_is"] = error_of(lambda: accelerator.save_state(as_is))
    accelerator.wait_for_everyone()
    found["as_is_files"] = sorted(os.listdir(as_is))
    optimizer.optimizer.consolidate_state_dict(to=0)
    to_rank_0 = os.path.join(out, f"{run}-consolidated-to-0")
    found["consolidated_to_0"] = error_of(lambda: accelerator.save_state(to_rank_0))
    accelerator.wait_for_everyone()
    # Checked before any collective, so no rank waits on the others here.
    found["wrapper_refused"] = error_of(lambda: consolidated(optimizer).__enter__())
    accelerator.free_memory()
    return found


def round_trip(accelerator: Accelerator, out: str, run: str) -> dict[str, Any]:
    ckpt = os.path.join(out, f"{run}-ckpt")
    hook_file = os.path.join(ckpt, f"powersgd-rank{accelerator.process_index}.pt")
    model, optimizer, loader, state = prepared(accelerator, run, seed=0)
    batches = list(loader)
    train(accelerator, model, optimizer, batches[:SAVE_AT])
    with consolidated(optimizer.optimizer):  # every rank
        accelerator.save_state(ckpt)
        inside = optimizer.optimizer.state_dict()
    found: dict[str, Any] = {
        "inside_keys": sorted(inside),
        "after_block": error_of(optimizer.optimizer.state_dict),
    }
    if state is not None:  # a hook's state is per rank: each rank saves its own
        torch.save(state.state_dict(), hook_file)
    train(accelerator, model, optimizer, batches[SAVE_AT:])
    found.update(continued=params(model), steps=len(batches), save_at=SAVE_AT)
    if state is not None:
        found["hook_iter"] = state.iter
    accelerator.free_memory()
    for keep_hook_state in (True, False) if state is not None else (True,):
        model, optimizer, loader, state = prepared(accelerator, run, seed=1)
        found.setdefault("fresh", params(model))
        accelerator.load_state(ckpt)
        if keep_hook_state and state is not None:
            state.load_state_dict(torch.load(hook_file, weights_only=True))
        train(accelerator, model, optimizer, accelerator.skip_first_batches(loader, SAVE_AT))
        found["resumed" if keep_hook_state else "resumed_without_hook_state"] = params(model)
        accelerator.free_memory()
    if accelerator.is_main_process:
        found["saved_optimizer"] = torch.load(
            os.path.join(ckpt, "optimizer.bin"), weights_only=True
        )
    return found


def sharded_round_trip(accelerator: Accelerator, out: str) -> dict[str, Any]:
    """``round_trip`` with the optimizer kept out of ``prepare`` (so
    ``save_state`` never asks it for its state), saved by ``save_sharded``
    inside the checkpoint directory: no rank gathers the whole state."""
    ckpt = os.path.join(out, "sharded-ckpt")
    shards = os.path.join(ckpt, "zero_optimizer")

    def start(seed: int) -> tuple[torch.nn.Module, Any, DataLoader[Any]]:
        model, optimizer, loader = built("zerofn", seed)
        model, loader = accelerator.prepare(model, loader)
        model.register_comm_hook(None, allreduce_hook)
        return model, optimizer, loader

    model, optimizer, loader = start(seed=0)
    batches = list(loader)
    train(accelerator, model, optimizer, batches[:SAVE_AT])
    accelerator.save_state(ckpt)
    save_sharded(optimizer, shards)
    train(accelerator, model, optimizer, batches[SAVE_AT:])
    found: dict[str, Any] = {"continued": params(model), "files": sorted(os.listdir(ckpt))}
    accelerator.free_memory()
    model, optimizer, loader = start(seed=1)
    found["fresh"] = params(model)
    accelerator.load_state(ckpt)
    load_sharded(optimizer, shards)
    train(accelerator, model, optimizer, accelerator.skip_first_batches(loader, SAVE_AT))
    found["resumed"] = params(model)
    accelerator.free_memory()
    return found


def main(out: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    result: dict[str, Any] = {
        "distributed_type": str(accelerator.distributed_type),
        "backend": torch.distributed.get_backend(),
        "save_state": {
            run: what_save_state_does(accelerator, out, run) for run in ("zerofn", "torch")
        },
        "round_trip": {run: round_trip(accelerator, out, run) for run in RUNS},
    }
    result["round_trip"]["sharded"] = sharded_round_trip(accelerator, out)
    torch.save(result, os.path.join(out, f"accelerate-rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
