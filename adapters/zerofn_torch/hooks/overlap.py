"""Overlap the ZeRO step with DDP's backward: ``hook_with_zero_step`` and
``hook_with_zero_step_interleaved``.

Wrap any DDP communication hook so that a ``ZeroRedundancyOptimizer`` built
with ``overlap_with_ddp=True`` steps inside backward::

    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW,
                                   overlap_with_ddp=True, lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    for x, y in loader:
        loss_fn(ddp(x), y).backward()      # no zero.step(): backward did it

What differs from PyTorch's version:

* No iteration is vacuous: until DDP fixes its buckets, every rank steps all
  parameters with the averaged gradients (the same numbers as a plain ZeRO
  step); then the optimizer state is cut down to each rank's buckets.
* With the plain averaging hook (``allreduce_hook``, ours or PyTorch's), each
  bucket's gradients are *reduced to their owner* instead of all-reduced, and
  the owner's updated parameters are broadcast back: one all-reduce's worth of
  bytes per step, not one and a half. ``.grad`` on a rank that does not own a
  bucket is then not the average (the step does not need it there). Any other
  hook (fp16, PowerSGD, your own) runs as given and owners step from its result.
* Any ``torch.optim`` optimizer; gloo works (every collective is issued from
  the hook call, in bucket order, the same on every rank).
* With ``redundancy=2`` (each shard's state on its owner and on a carrier,
  so ``zerofn_torch.elastic.recover`` can go on without a lost rank) the
  hook runs ``hook`` on every bucket as given, so every rank holds every
  average, and takes the optimizer's whole step after the last bucket, its
  exchange included: the plain step's bytes and numbers, inside backward.
  A step that fails there fails DDP's future (backward raises), so DDP ends
  its iteration and a DDP rebuilt on the survivors' group takes a new hook.

The hook is the core's :func:`zerofn.overlap.hook.zero_step_hook`, run in a
:class:`~zerofn_torch.runtime.hook_cells.HookCell` like every other hook; its state decides
when the plan is fixed, who owns what and what to step after each bucket
(a :class:`~zerofn.overlap.hook.StepOrder`). This module only obeys: it
steps the optimizer and drives the programs the core gives it.
"""

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks

from zerofn.comm import split_like
from zerofn.errors import CollectiveError
from zerofn.hooks.hook import init_hook_state
from zerofn.overlap.hook import OverlapConfig, OverlapHookState, StepOrder, zero_step_hook
from zerofn.overlap.orders import Sent, StepChecks, obey_order, write_updates
from zerofn.zero.forward_gather import check_gather_with_hook
from zerofn.zero.mixed_precision.precision import clip_coefficient
from zerofn_torch.hooks.default import allreduce_hook
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.foreign_hooks import foreign_hook
from zerofn_torch.runtime.futures import failed, for_ddp
from zerofn_torch.runtime.heartbeat import interruptible, wait
from zerofn_torch.runtime.hook_cells import HookCell, bucket_info
from zerofn_torch.zero.loss_scaling import LossScaler
from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

DDPHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


def _check_covered(ddp: torch.nn.parallel.DistributedDataParallel, params: list[Any]) -> None:
    """Refuse a ZeRO optimizer that leaves some of DDP's trainable parameters out.

    Raises:
        ValueError: naming the first parameters left out.
    """
    mine = {id(p) for p in params}
    missing = [n for n, p in ddp.module.named_parameters() if p.requires_grad and id(p) not in mine]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"the ZeroRedundancyOptimizer holds {len(params)} parameters and leaves {len(missing)} "
            f"of the DDP model's trainable ones out ({shown}): the overlapped step steps every "
            "bucket DDP reduces. Build it over ddp.parameters() (one param group: add_param_group "
            "is refused with overlap_with_ddp=True), or freeze those parameters before wrapping "
            "the model in DDP"
        )


def _check_scaler(loss_scaler: object) -> None:
    """Refuse a loss scaler the hook cannot drive from inside backward.

    Raises:
        TypeError: anything but a :class:`zerofn_torch.LossScaler`.
    """
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise TypeError(
            f"loss_scaler must be a zerofn_torch.LossScaler, got {type(loss_scaler).__name__}: "
            "the overlapped step unscales and skips inside backward, which torch.amp.GradScaler "
            "cannot be told of. LossScaler keeps GradScaler's interface and state dict keys "
            "(either loads the other's) and works with fp32, bf16 and fp16 parameters"
        )


_Handed = tuple[tuple[int, ...], list[torch.Tensor], torch.futures.Future[torch.Tensor]]
"""A bucket handed over and not stepped yet: its parameters' global indices,
the parameters, and the future of their averaged flat gradient."""


class _OverlapRunner:
    """The stateful shell behind one overlapped hook registration: it runs
    the core's :func:`zerofn.overlap.hook.zero_step_hook` in a
    :class:`~zerofn_torch.runtime.hook_cells.HookCell`, like every other hook, and obeys
    the step orders its state carries."""

    def __init__(
        self,
        hook: DDPHook,
        ddp: torch.nn.parallel.DistributedDataParallel,
        zero: ZeroRedundancyOptimizer,
        shard_buckets: bool,
        interleaved: bool,
        max_grad_norm: float | None = None,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        if max_grad_norm is not None:
            clip_coefficient(0.0, max_grad_norm)  # refuse a bad one now, not mid-backward
        params = [p for group in zero.param_groups for p in group["params"]]
        _check_covered(ddp, params)
        _check_scaler(loss_scaler)
        whole = zero.zero_rank.steps_whole_in_hook
        # Plain averaging (ours or PyTorch's), which the overlap replaces by reduce-to-owner.
        averaging = hook in (allreduce_hook, torch_default_hooks.allreduce_hook)
        if whole:
            _check_whole_step(shard_buckets, interleaved, max_grad_norm, loss_scaler)
        check_gather_with_hook(zero.zero_rank.options.gather_during_forward, interleaved)
        self.binding = zero.bind_overlap_hook()
        self.config = OverlapConfig(
            sizes=tuple(p.numel() for p in params),
            world_size=zero.world_size,
            rank=zero.rank,
            shard_buckets=shard_buckets,
            interleaved=interleaved,
            reduce_to_owner=averaging and not whole,
            whole_step=whole,
        )
        self.hook = zero_step_hook(foreign_hook(hook), self.config)
        self.cell = HookCell(init_hook_state(self.hook))
        self.ddp = weakref.ref(ddp)
        self.zero = zero
        # The global questions before each step; a loss scaler's 1 / scale is read then.
        self.checks = StepChecks(max_norm=max_grad_norm, device=zero.join_device)
        self.loss_scaler = loss_scaler
        self.params = params
        self.index_of = {id(p): i for i, p in enumerate(params)}
        # Buckets handed over and not stepped yet (the core's state knows which
        # are waiting; only the driver holds their futures).
        self.handed: dict[int, _Handed] = {}
        self.sending: list[tuple[tuple[int, ...], torch.futures.Future[Sent], bool]] = []

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook DDP calls on each bucket (bound: what the functions below return)."""
        group = self.zero.process_group
        params = list(bucket.parameters())
        info = attrs.evolve(
            bucket_info(bucket, group),
            params=tuple(self.index_of[id(p)] for p in params),
            final=bool(getattr(self.ddp(), "_has_rebuilt_buckets", True)),
            handle=(state, bucket),
        )
        _, _, reduced = self.cell.start(self.hook, bucket, group, info)
        self.handed[info.index] = (info.params, params, reduced)
        state = self.cell.state.global_state
        if state.order is not None and state.order.whole:
            try:
                self._step_whole(state.order)
            except CollectiveError as error:
                # Raised from here, the error would leave DDP's reducer inside
                # this backward for good, and its hooks would refuse the next
                # backward of the DDP rebuilt after a recovery; failed through
                # the future, it ends the iteration and raises from backward.
                return for_ddp(failed(error))
        elif state.order is not None:
            self._obey(state, state.order)
        if info.is_last:
            self._receive()
        return for_ddp(interruptible(reduced))

    def _obey(self, state: OverlapHookState[Any], order: StepOrder) -> None:
        """Run the core's :func:`zerofn.overlap.orders.obey_order` for
        ``order``: its checks and step here (the rank's share kept once the
        plan is fixed), the owners' sends started without waiting.

        Raises:
            zerofn.errors.CollectiveError: a reduction, or a check before the
                step, failed.
        """
        self.cell.pipeline.drain()  # the buckets to step must be fully issued
        self.zero.wait()  # the last iteration's sends, if the forward left any
        handed: dict[int, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        for index in order.buckets:
            indices, params, reduced = self.handed.pop(index)
            handed[index] = (indices, split_like(reduced.wait(), params))
        scaler = self.loss_scaler
        inv_scale = None if scaler is None else 1.0 / scaler.get_scale()
        checks = attrs.evolve(self.checks, inv_scale=inv_scale)
        program = obey_order(self.binding, state, self.config, order, handed, self.params, checks)
        group = self.zero.process_group
        purpose = "the overlapped ZeRO step: the gradients' global checks before the step"
        done = drive(program, group, purpose).wait()
        if scaler is not None:
            scaler.record(self.zero, not done.stepped)
        for indices, send in done.sends:
            purpose = "the overlapped ZeRO step: sending updated parameters from their owners"
            self.sending.append((indices, drive(send, group, purpose), done.differences))

    def _step_whole(self, order: StepOrder) -> None:
        """Hand every bucket's averaged gradient to the optimizer's whole
        step (``redundancy=2``): its exchange runs here, before backward ends.

        Raises:
            zerofn.errors.CollectiveError: a reduction, or the step's
                exchange, failed (the optimizer's position says which).
        """
        self.cell.pipeline.drain()
        grads: dict[int, torch.Tensor] = {}
        for index in order.buckets:
            indices, params, reduced = self.handed.pop(index)
            purpose = "the overlapped ZeRO step: a bucket's averaged gradients"
            grads |= zip(indices, split_like(wait(reduced, purpose), params), strict=True)
        assert self.binding.step_whole is not None
        self.binding.step_whole(grads)

    def _receive(self) -> None:
        """Write the shards other ranks sent into this rank's parameters."""
        sending, self.sending = self.sending, []
        for indices, sent, differences in sending:
            write_updates(self.params, indices, sent.wait(), differences)


def _check_whole_step(
    shard_buckets: bool, interleaved: bool, max_grad_norm: float | None, loss_scaler: object
) -> None:
    """Refuse what divides the step by buckets, or asks inside backward what
    the whole step cannot, for an optimizer built with ``redundancy=2``
    (whose hook runs the whole step after the last bucket).

    Raises:
        ValueError: naming the option and ``redundancy=2``.
    """
    for name, asked in (
        ("shard_buckets=True", shard_buckets),
        ("hook_with_zero_step_interleaved", interleaved),
        ("max_grad_norm", max_grad_norm is not None),
        ("loss_scaler", loss_scaler is not None),
    ):
        if asked:
            raise ValueError(
                f"{name} is not available with a ZeroRedundancyOptimizer built with "
                "redundancy=2: its overlap hook averages every bucket on every rank (each "
                "carrier needs its owner's gradients) and runs the optimizer's whole step after "
                "the last one. Use hook_with_zero_step(hook, ddp, zero) alone, or redundancy=1"
            )


def hook_with_zero_step(
    hook: DDPHook,
    ddp: torch.nn.parallel.DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    max_grad_norm: float | None = None,
    loss_scaler: LossScaler | None = None,
) -> DDPHook:
    """Wrap ``hook`` so the ZeRO step runs when DDP hands over its last bucket.

    Args:
        hook: the communication hook to wrap (PyTorch-style ``(state, bucket)``).
        ddp: the DDP model the hook is registered on.
        zero: a ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True``.
        shard_buckets: split a bucket's parameters across ranks for balance.
        max_grad_norm: clip the gradients by their 2-norm over the whole
            model before the step, as ``torch.nn.utils.clip_grad_norm_`` would
            (the owners' shards give the norm with one all-reduce of one
            number). ``zero.clip_grad_norm_`` cannot do this: the step is
            over when backward returns.
        loss_scaler: with fp16 parameters and ``master_dtype``, unscale the
            gradients into the masters and skip the step on every rank when
            any owner's shard holds inf or nan (one all-reduce of one flag).
            Call ``loss_scaler.scale(loss).backward()`` and then
            ``loss_scaler.update()``; not ``loss_scaler.step``: backward stepped.

    Returns:
        The hook to pass to ``ddp.register_comm_hook``.

    Raises:
        ValueError: if ``zero`` was not built with ``overlap_with_ddp=True``;
            a negative or non-finite ``max_grad_norm``; ``shard_buckets``,
            ``max_grad_norm`` or ``loss_scaler`` with ``redundancy=2``.
        RuntimeError: if ``zero`` is already driven by another hook.
    """
    runner = _OverlapRunner(hook, ddp, zero, shard_buckets, False, max_grad_norm, loss_scaler)
    return runner.__call__


def hook_with_zero_step_interleaved(
    hook: DDPHook,
    ddp: torch.nn.parallel.DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> DDPHook:
    """Like :func:`hook_with_zero_step`, but each bucket is stepped as soon as
    the next bucket is handed over, interleaving the step with backward.

    Exact for per-parameter optimizers (every ``torch.optim`` one usable here):
    the buckets are stepped one after another, each with the others' parameters
    sitting out.

    Raises:
        ValueError: if ``zero`` was not built with ``overlap_with_ddp=True``,
            or was built with ``redundancy=2`` (whose step is taken whole).
        RuntimeError: if ``zero`` is already driven by another hook.
    """
    return _OverlapRunner(hook, ddp, zero, shard_buckets, interleaved=True).__call__
