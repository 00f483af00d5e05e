"""PyTorch Lightning with zerofn, run by tests/test_frameworks.py under
``torchrun --nproc-per-node 2`` (gloo, CPU): ``python -m torch.distributed.run
--standalone --nproc-per-node 2 tests/_frameworks_lightning.py OUT``.

Each rank writes what the tests read to ``OUT/lightning-rank<r>.pt``. Every
run trains the same model on the same data with Adam (stateful, so a resume
that lost the optimizer's state would show) under an fp16-compression DDP
hook; the runs differ only in whose classes they use:

* ``zerofn``: zerofn's ``ZeroRedundancyOptimizer`` and ``fp16_compress_hook``;
* ``torch``: PyTorch's optimizer and hook;
* ``typed``: :class:`zerofn_torch.compat.TorchTypedZeroRedundancyOptimizer`
  and zerofn's hook.

Each fits two epochs, saves through ``Trainer.save_checkpoint``, and a new
Trainer with a differently initialised model resumes from that file for two
more; ``zerofn`` also trains four epochs uninterrupted.

Lightning 2.6 registers ``DDPStrategy(ddp_comm_hook=...)`` only when the root
device is CUDA, so on CPU the hook goes on through a callback; the script
records that Lightning's own argument is ignored here (``ignored_hook_calls``).

``... _frameworks_lightning.py OUT exit`` runs instead the flow most exposed to
an abort at exit (docs/failures.md): fit, checkpoint and resume with
zerofn's ``ZeroRedundancyOptimizer`` and PowerSGD hook, the process ending
right after zerofn's last step (see :func:`exit_run`); tests/test_frameworks.py
runs it repeatedly.

DDP inspects a hook's annotations at registration (the bucket parameter must
be annotated ``GradBucket`` or not at all), so this module keeps them as real
objects: no ``from __future__ import annotations``.
"""

import os
import sys
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local_sgd
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.utils.data import DataLoader, TensorDataset
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.compat import TorchTypedZeroRedundancyOptimizer
from zerofn_torch.hooks import PowerSGDState, fp16_compress_hook, powerSGD_hook

Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]

FAMILIES: dict[str, tuple[type[torch.optim.Optimizer], Hook]] = {
    "zerofn": (ZeroRedundancyOptimizer, fp16_compress_hook),
    "torch": (TorchZero, torch_hooks.fp16_compress_hook),
    "typed": (TorchTypedZeroRedundancyOptimizer, fp16_compress_hook),
}
SAMPLES, BATCH = 32, 4  # 4 steps per epoch on each of 2 ranks


class Regressor(pl.LightningModule):
    """A small MLP whose ``configure_optimizers`` returns a ZeRO optimizer."""

    def __init__(self, zero_class: type[torch.optim.Optimizer], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        )
        self.zero_class = zero_class

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.zero_class(self.parameters(), torch.optim.Adam, lr=0.01)  # type: ignore[call-arg]

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g)
        )
        return DataLoader(data, batch_size=BATCH, shuffle=True)


class CommHook(pl.Callback):
    """Registers a DDP communication hook on the strategy's DDP model once it
    is wrapped, and counts the buckets it reduces."""

    def __init__(self, hook: Hook, state: Any = None) -> None:
        self.hook, self.state, self.calls = hook, state, 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def counted(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.calls += 1
            return self.hook(state, bucket)

        trainer.strategy.model.register_comm_hook(self.state, counted)  # type: ignore[union-attr]


def trainer(
    out: str, epochs: int, strategy: DDPStrategy | None = None, **kwargs: Any
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or DDPStrategy(process_group_backend="gloo"),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **kwargs,
    )


def params(module: pl.LightningModule) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def fit_save_resume(out: str, family: str) -> dict[str, Any]:
    zero_class, hook = FAMILIES[family]
    ckpt = os.path.join(out, f"{family}.ckpt")
    first, second = CommHook(hook), CommHook(hook)
    module = Regressor(zero_class, seed=0)
    run = trainer(out, 2, callbacks=[first])
    run.fit(module)
    run.save_checkpoint(ckpt)  # every rank: Lightning consolidates the optimizer first
    saved = params(module)
    resumed = Regressor(zero_class, seed=7)
    # weights_only: the checkpoint, optimizer state included, holds no pickled objects
    trainer(out, 4, callbacks=[second]).fit(resumed, ckpt_path=ckpt, weights_only=True)
    return {
        "ckpt": ckpt,
        "saved_at_step": run.global_step,
        "saved": saved,
        "resumed": params(resumed),
        "hook_calls": (first.calls, second.calls),
        "optimizer_class": type(module.optimizers(use_pl_optimizer=False)).__name__,  # type: ignore[union-attr]
    }


def uninterrupted(out: str) -> list[torch.Tensor]:
    module = Regressor(ZeroRedundancyOptimizer, seed=0)
    trainer(out, 4, callbacks=[CommHook(fp16_compress_hook)]).fit(module)
    return params(module)


def ignored_hook_calls(out: str) -> int:
    """Buckets Lightning's own ``ddp_comm_hook`` argument reduced on CPU."""
    calls = []

    def counted(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        return fp16_compress_hook(state, bucket)

    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_hook=counted)
    trainer(out, 1, strategy=strategy, limit_train_batches=2).fit(
        Regressor(ZeroRedundancyOptimizer, seed=0)
    )
    return len(calls)


def model_averaging_refusal(out: str, family: str) -> str | None:
    """What Lightning says when a ZeRO optimizer meets post-local SGD model
    averaging (it refuses PyTorch's ZeroRedundancyOptimizer by ``isinstance``):
    the error's message, or ``None`` if it trained."""
    zero_class, _ = FAMILIES[family]
    state = torch_local_sgd.PostLocalSGDState(
        process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=1
    )
    strategy = DDPStrategy(
        process_group_backend="gloo",
        ddp_comm_state=state,
        ddp_comm_hook=torch_local_sgd.post_localSGD_hook,
        model_averaging_period=2,
    )
    try:
        trainer(out, 1, strategy=strategy, limit_train_batches=1).fit(Regressor(zero_class, seed=0))
    except ValueError as e:
        return str(e)
    return None


def main(out: str) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any] = {family: fit_save_resume(out, family) for family in FAMILIES}
    result["uninterrupted"] = uninterrupted(out)
    result["ignored_hook_calls"] = ignored_hook_calls(out)
    result["averaging_refused"] = {
        family: model_averaging_refusal(out, family) for family in ("zerofn", "typed")
    }
    torch.save(result, os.path.join(out, f"lightning-rank{dist.get_rank()}.pt"))


def exit_run(out: str) -> None:
    """Fit, checkpoint and resume with zerofn's ZeRO and PowerSGD hook, and
    end the process right after zerofn's last step, each rank writing
    ``OUT/exit-rank<r>.done`` as its last act.

    The GIL changes hands at most every 50 ms here (as under a main thread
    busy in Python): a rank then reaches the interpreter's teardown before a
    gloo worker thread still running a completion callback of that last step,
    or letting go of its collective, gets the GIL back, whenever one still
    is. Before the fix (docs/failures.md, "A worker thread that needs the GIL
    while the interpreter finalizes") CPython ended that thread there:
    ``terminate called without an active exception``, SIGABRT.
    """
    sys.setswitchinterval(0.05)
    torch.set_num_threads(1)
    ckpt = os.path.join(out, "powersgd.ckpt")

    def hook() -> CommHook:
        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return CommHook(powerSGD_hook, state)  # type: ignore[arg-type]

    module = Regressor(ZeroRedundancyOptimizer, seed=0)
    run = trainer(out, 2, callbacks=[hook()])
    run.fit(module)
    run.save_checkpoint(ckpt)
    resumed = Regressor(ZeroRedundancyOptimizer, seed=7)
    trainer(out, 4, callbacks=[hook()]).fit(resumed, ckpt_path=ckpt, weights_only=True)
    with open(os.path.join(out, f"exit-rank{dist.get_rank()}.done"), "w"):
        pass


if __name__ == "__main__":
    if sys.argv[2:] == ["exit"]:
        exit_run(sys.argv[1])
    else:
        main(sys.argv[1])
