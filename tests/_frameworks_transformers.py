"""The Hugging Face ``Trainer`` with a ZeRO optimizer, run by
tests/test_frameworks.py under ``torchrun --nproc-per-node 2`` (gloo, CPU):
``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/_frameworks_transformers.py OUT``.

A tiny GPT-2 (built from a config, no download) trains 6 steps on random
tokens, checkpointing every 3; each run then resumes from the step-3
checkpoint in a fresh ``Trainer`` over a fresh model. Runs:

* ``zerofn``: zerofn's optimizer, ``optimizers=(...)`` and
  :class:`zerofn_torch.huggingface.ConsolidateBeforeSave`, nothing else;
* ``torch``: PyTorch's ``ZeroRedundancyOptimizer``, the same callback and
  Accelerate's device placement turned off (it cannot answer ``state_dict()``
  before consolidating);
* ``adamw``: the ``Trainer``'s own AdamW over the whole model.

Each rank writes what the tests read to ``OUT/transformers-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.huggingface import ConsolidateBeforeSave

STEPS, SAVE_EVERY, LR = 6, 3, 1e-3


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same on every rank (the sampler splits them)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (64, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def arguments(out: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        save_strategy="steps",
        per_device_train_batch_size=4,
        learning_rate=LR,
        lr_scheduler_type="linear",
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )


def trainer(run: str, out: str, seed: int) -> Trainer:
    args = arguments(out)  # starts the process group the optimizer needs
    net = model(seed)
    callbacks = [] if run == "adamw" else [ConsolidateBeforeSave()]
    optimizers: Any = (None, None)
    if run == "zerofn":
        optimizers = (
            ZeroRedundancyOptimizer(
                net.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.0, fused=True
            ),
            None,
        )
    elif run == "torch":
        optimizers = (
            TorchZero(net.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.0, fused=True),
            None,
        )
    built = Trainer(net, args, train_dataset=Tokens(), optimizers=optimizers, callbacks=callbacks)
    if run == "torch":
        built.accelerator.device_placement = False
    return built


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def one_run(run: str, out: str) -> dict[str, Any]:
    where = os.path.join(out, run)
    first = trainer(run, where, seed=0)
    first.train()
    found: dict[str, Any] = {"uninterrupted": params(first)}
    resumed = trainer(run, where, seed=1)
    found["fresh"] = params(resumed)
    resumed.train(resume_from_checkpoint=os.path.join(where, f"checkpoint-{SAVE_EVERY}"))
    found["resumed"] = params(resumed)
    if resumed.args.process_index == 0:
        found["saved_optimizer"] = torch.load(
            os.path.join(where, f"checkpoint-{STEPS}", "optimizer.pt"), weights_only=True
        )
    return found


def main(out: str) -> None:
    torch.set_num_threads(1)
    found: dict[str, Any] = {run: one_run(run, out) for run in ("zerofn", "torch", "adamw")}
    rank = torch.distributed.get_rank()
    torch.save(found, os.path.join(out, f"transformers-rank{rank}.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
