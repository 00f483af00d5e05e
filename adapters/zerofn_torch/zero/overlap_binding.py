"""The optimizer's part that DDP's overlap hook drives
(``overlap_with_ddp=True``): what the hook may do to the optimizer, bound
once (:class:`~zerofn.zero.hook_driven.OverlapBinding`), each handle the
core's (:mod:`zerofn.zero.hook_driven`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zerofn.comm import Program
from zerofn.overlap.orders import OverlapBinding, SendCompressed, StepGradients
from zerofn.zero import hook_driven
from zerofn.zero.forward_gather import ForwardGather
from zerofn.zero.replan import sharded_by_owners
from zerofn_torch.zero.forward_gather import ForwardGathering

__all__ = ["HookDriven"]


class HookDriven(ForwardGathering):
    """Being stepped by DDP's overlap hook
    (:func:`zerofn_torch.hooks.hook_with_zero_step`; see
    :class:`~zerofn_torch.zero.shell_state.ShellState`)."""

    def bind_overlap_hook(self) -> OverlapBinding:
        """Let one overlap hook (``zerofn_torch.hooks.overlap``) drive this optimizer:
        what it may do to it, and nothing else. Not for training loops.

        Returns:
            The hook's handles: step given gradients, adopt the owners.

        Raises:
            ValueError: the optimizer was not built with ``overlap_with_ddp=True``.
            RuntimeError: another hook drives it already.
        """
        self._zero = zero = hook_driven.attach(self._zero)
        whole = self._step_whole if zero.steps_whole_in_hook else None
        return OverlapBinding(
            self._step_with_gradients,
            self._adopt_owners,
            self._send_compressed,
            whole,
            self._sends_order,
            self._sends_behind_forward,
        )

    def _sends_order(self) -> Sequence[int | None] | None:
        return self._agreed_first_use() if self._gathers_now() else None

    def _sends_behind_forward(self, gather: ForwardGather, program: Program[None]) -> None:
        purpose = "the overlapped ZeRO step: sending updated parameters from their owners"
        self._behind_forward(gather, program, purpose)

    def _step_with_gradients(self, request: StepGradients) -> None:
        self._untouched = False
        hook_driven.step_rank_with_gradients(self._zero, self.param_groups, request)

    def _step_whole(self, grads: Mapping[int, torch.Tensor]) -> None:
        """The plain step, exchange included, from the hook's averaged
        gradients, written into ``.grad`` first as DDP writes them after
        backward (where a loss finds them: a survivor that missed the local
        step takes it from another's ``.grad``)."""
        params = self._all_params
        with torch.no_grad():
            for index, grad in grads.items():
                param = params[index]
                if param.grad is None:
                    param.grad = grad.detach().clone()
                else:
                    param.grad.copy_(grad)
        self._untouched = False
        self._step_and_exchange(None)

    def _adopt_owners(self, owned: Sequence[Sequence[int]]) -> None:
        self._zero = sharded_by_owners(self._zero, self.param_groups, owned)

    def _send_compressed(self) -> SendCompressed | None:
        return hook_driven.send_compressed(self._zero, self._all_params)
