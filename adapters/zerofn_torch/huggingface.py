"""A ZeRO optimizer under the Hugging Face ``Trainer``: one callback.

The ``Trainer`` writes its checkpoint's optimizer state on the saving rank
alone (``torch.save(optimizer.state_dict())`` where ``args.should_save``), and
a ZeRO optimizer's state lives in shards, one per rank: gathering them is a
collective that every rank must enter, which the ``Trainer`` never asks for.
:class:`ConsolidateBeforeSave` enters it on every rank just before each save,
so that the saving rank's ``state_dict()`` returns the whole state::

    trainer = Trainer(
        model, args, train_dataset=data,
        optimizers=(ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3), None),
        callbacks=[ConsolidateBeforeSave()],
    )

Resuming needs nothing: every rank loads the whole state and keeps its shard.
It works for PyTorch's ``ZeroRedundancyOptimizer`` too, which also needs
``trainer.accelerator.device_placement = False`` before training (Accelerate's
``prepare`` reads its state dict, which PyTorch's answers only once
consolidated; zerofn's answers before the first step).

Importing this module needs ``transformers``.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

__all__ = ["ConsolidateBeforeSave"]


def _zero_optimizer(optimizer: Any) -> Any:
    """The optimizer that consolidates, under any wrappers that hold it as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``)."""
    found = optimizer
    while found is not None and not hasattr(found, "consolidate_state_dict"):
        found = getattr(found, "optimizer", None)
    if found is None:
        raise TypeError(
            "ConsolidateBeforeSave needs a ZeroRedundancyOptimizer (zerofn's or PyTorch's) as the "
            f"Trainer's optimizer, got {type(optimizer).__name__}; pass "
            "optimizers=(ZeroRedundancyOptimizer(...), None) to the Trainer, or drop the callback"
        )
    return found


class ConsolidateBeforeSave(TrainerCallback):  # type: ignore[misc]
    """Gathers a ZeRO optimizer's shards on global rank 0 on every rank
    just before the ``Trainer`` saves a checkpoint, so the saved
    ``optimizer.pt`` holds the whole state in ``torch.optim``'s format.

    A save it did not prepare raises in ``on_save`` (another callback listed
    after this one decided to save; list this one last), rather than let a
    later checkpoint hold an earlier step's optimizer state.
    """

    def __init__(self) -> None:
        self._consolidated_at: int | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        _zero_optimizer(kwargs.get("optimizer"))
        nodes = args.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
        if args.save_on_each_node and nodes > 1:
            raise ValueError(
                "save_on_each_node=True with a ZeRO optimizer on several nodes: the whole "
                "optimizer state is gathered on global rank 0 only; save to a shared directory "
                "with save_on_each_node=False"
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_save:
            self._consolidate(state, kwargs.get("optimizer"))

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_save:
            self._consolidate(state, kwargs.get("optimizer"))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # With save_strategy="best" the Trainer decides to save after the
        # evaluation, with no callback in between: gather on every one.
        if args.save_strategy == "best":
            self._consolidate(state, kwargs.get("optimizer"))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._consolidated_at != state.global_step:
            raise RuntimeError(
                f"the Trainer saved a checkpoint at step {state.global_step} that "
                "ConsolidateBeforeSave did not prepare (the optimizer state in it is from step "
                f"{self._consolidated_at}): a callback after it set should_save; list "
                "ConsolidateBeforeSave last in callbacks="
            )

    def _consolidate(self, state: TrainerState, optimizer: Any) -> None:
        zero = _zero_optimizer(optimizer)
        # Global rank 0 saves; the optimizer numbers ranks within its group.
        group = zero.process_group
        to = 0 if group in (None, dist.group.WORLD) else dist.get_group_rank(group, 0)
        zero.consolidate_state_dict(to=to)
        self._consolidated_at = state.global_step
