"""The optimizer's part that goes on in another world: where this rank
stands in the step sequence, the local step it may have missed, and the
regroup that :mod:`zerofn_torch.elastic` drives after a loss or a join. What
moves and how the rank is rebuilt are the core's
(:func:`zerofn.zero.elastic.regroup.regroup_program`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerofn.zero.elastic.recovery_point import Position
from zerofn.zero.elastic.redundancy import Regrouping
from zerofn.zero.elastic.regroup import regroup_program
from zerofn.zero.local_step import LocalStep
from zerofn.zero.rank import answer_local_step, synced_hyperparameters
from zerofn_torch.runtime.driver import drive
from zerofn_torch.zero.forward_gather import ForwardGathering

__all__ = ["WorldChanges"]


class WorldChanges(ForwardGathering):
    """Going on without a lost rank, or with joiners (driven by
    :mod:`zerofn_torch.elastic`; see
    :class:`~zerofn_torch.zero.shell_state.ShellState`)."""

    @property
    def position(self) -> Position:
        """Where this rank stands in the step sequence: local steps taken
        since the world last changed, and whether the last one's exchange
        completed (what :func:`zerofn_torch.elastic.recover`'s roll call
        reports)."""
        return self._position

    @property
    def exchange_interrupted(self) -> bool:
        """The last :meth:`step` failed in its exchange, after this rank's
        local step: the step is to be finished, not redone."""
        return not self._position.exchanged

    def take_missed_local_step(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Take the local step this rank missed (it failed before it, while
        other survivors took it), from ``grads``: every parameter's averaged
        gradient of that step, which a survivor that took it hands over.
        Not for training loops: :func:`zerofn_torch.elastic.recover` calls it.
        """
        params = self._all_params
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param.grad = None if grad is None else grad.to(param.device, param.dtype).clone()
        answer = self._counted(answer_local_step(self._zero, params, lambda optim: optim.step()))
        with synced_hyperparameters(self.param_groups, self._zero):
            answer(LocalStep(self.rank))

    @property
    def regroups(self) -> int:
        """How many times the optimizer went on in another world
        (:mod:`zerofn_torch.elastic`: a loss, or a join)."""
        return self._regroups

    @property
    def generation(self) -> int:
        """This world's number in the job (``redundancy=2``): where its
        heartbeats, alarm and roll call live in the job's store. One more at
        each change of world; a new optimizer starts one past the last
        world this process was in, so it never meets an old world's keys."""
        return self._generation

    def enter_world(
        self, group: Any, new_rank: int, world_size: int, generation: int | None = None
    ) -> None:
        """Count this rank as ``new_rank`` of a new world of ``world_size``
        ranks over ``group`` from now on: its number in the job
        (``generation``: a joiner takes the job's; ``None``: one more than
        this optimizer's), and the heartbeat there. Called before the new
        group's first collective, which the old world's alarm would otherwise
        end. Not for training loops: :mod:`zerofn_torch.elastic` calls it
        before :meth:`regroup`."""
        self._generation = self._generation + 1 if generation is None else generation
        if self._heartbeat is not None:
            self._heartbeat.beat_as(self._generation, new_rank, world_size, group)

    def regroup(
        self,
        group: Any,
        regrouping: Regrouping,
        new_rank: int,
        *,
        finish_step: bool,
    ) -> None:
        """Go on as rank ``new_rank`` of ``group`` under ``regrouping``'s
        plan: the core's :func:`~zerofn.zero.elastic.regroup.regroup_program`, driven
        on ``group`` (the moves that restore redundancy, the optimizer
        rebuilt, and with ``finish_step`` the interrupted step finished).
        Not for training loops: :mod:`zerofn_torch.elastic` calls it on
        every rank of ``group``, once in the new world (:meth:`enter_world`).

        Args:
            group: the new world's process group.
            regrouping: the core's decision
                (:func:`~zerofn.zero.elastic.redundancy.plan_after_loss`,
                :func:`~zerofn.zero.elastic.redundancy.plan_after_join`).
            new_rank: this rank in ``group``.
            finish_step: finish the step whose exchange a loss interrupted
                (the lost shards' updates come from their carried copies).

        Raises:
            zerofn.errors.CollectiveError: a collective on ``group`` failed.
        """
        self._leave_world()
        program = regroup_program(
            self._zero, self.param_groups, regrouping, new_rank, finish_step=finish_step
        )
        self._zero = zero = drive(program, group, "regrouping the ZeRO optimizer").wait()
        self.process_group = group
        self.rank, self.world_size = zero.options.rank, zero.options.world_size
        self._regroups += 1
        self._position = Position(0)  # a new world counts its own steps
        self._versions = self._read_versions()
