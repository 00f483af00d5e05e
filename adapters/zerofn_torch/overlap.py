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

The decisions (when the plan is fixed, who owns what, which element range of
a bucket a shard is) come from :mod:`zerofn.overlap`.
"""

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks

from zerofn.comm import split_like
from zerofn.ddp_buckets import BucketPlan, BucketShard
from zerofn.overlap_step import broadcast_from_owners, owned_gradients, reduce_to_owners
from zerofn.precision import (
    clip_coefficient,
    global_norm_program,
    has_nonfinite,
    local_norm_power,
    nonfinite_program,
    norm_of_powers,
)
from zerofn_torch.comm import drive
from zerofn_torch.default_hooks import allreduce_hook
from zerofn_torch.loss_scaling import LossScaler
from zerofn_torch.zero import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

DDPHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


def _is_averaging_hook(hook: DDPHook) -> bool:
    """Whether ``hook`` is plain averaging, which the overlap replaces by
    reduce-to-owner."""
    return hook in (allreduce_hook, torch_default_hooks.allreduce_hook)


@attrs.define
class _Pending:
    """A bucket handed over this iteration, whose reduction may be in flight."""

    index: int
    params: list[torch.Tensor]
    buffer: torch.Tensor
    future: torch.futures.Future[torch.Tensor] | None  # the inner hook's result
    reduction: torch.futures.Future[torch.Tensor] | None  # pending reduce-to-owner


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


class _OverlappedStep:
    """The stateful shell behind one overlapped hook registration."""

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
        zero._attach_overlap(shard_buckets)
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler
        self.hook = hook
        self.ddp = weakref.ref(ddp)
        self.zero = zero
        self.interleaved = interleaved
        self.reduce_to_owner = _is_averaging_hook(hook)
        self.index_of = {id(p): i for i, p in enumerate(zero._all_params)}
        self.pending: list[_Pending] = []
        self.broadcasts: list[
            tuple[list[torch.Tensor], torch.futures.Future[list[tuple[BucketShard, torch.Tensor]]]]
        ] = []

    # ----- one bucket ----------------------------------------------------------

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        zero = self.zero
        overlapped = zero._overlap_state.status == "initialized"
        params = list(bucket.parameters())
        ddp = self.ddp()
        rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", True))
        zero._observe_bucket(bucket.index(), [self.index_of[id(p)] for p in params], rebuilt)
        if overlapped and self.reduce_to_owner:
            entry = _Pending(bucket.index(), params, bucket.buffer(), None, self._reduce(bucket))
            result = _completed(bucket.buffer())
        else:
            result = self.hook(state, bucket)
            entry = _Pending(bucket.index(), params, bucket.buffer(), result, None)
        self.pending.append(entry)
        if overlapped and self.interleaved and len(self.pending) >= 2:
            self._step_buckets([self.pending.pop(0)])
        if bucket.is_last():
            self._finish_iteration(overlapped)
        return result

    def _plan(self) -> BucketPlan:
        plan = self.zero._overlap_state.plan
        assert plan is not None
        return plan

    def _reduce(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average the bucket's gradients onto the owner of each of its shards."""
        program = reduce_to_owners(
            self._plan(), bucket.index(), bucket.buffer(), self.zero.world_size
        )
        purpose = (
            f"the overlapped ZeRO step: reducing DDP bucket {bucket.index()}'s gradients "
            "to their owners"
        )
        return drive(program, self.zero.process_group, purpose)

    # ----- stepping ----------------------------------------------------------------

    def _averaged(self, entry: _Pending) -> tuple[torch.Tensor, ...]:
        """The bucket's averaged gradients, once its reduction finished (on an
        owner; elsewhere the reduce-to-owner path leaves them unspecified).

        Raises:
            zerofn.errors.CollectiveError: the reduction failed.
        """
        if entry.reduction is not None:
            entry.reduction.wait()
        flat = entry.future.wait() if entry.future is not None else entry.buffer
        return split_like(flat, entry.params)

    def _indices(self, entry: _Pending) -> list[int]:
        return [self.index_of[id(p)] for p in entry.params]

    def _grad_factor(self, grads: dict[int, torch.Tensor], everywhere: bool) -> float | None:
        """What to multiply ``grads`` (this rank's share of the model's
        gradients, or all of them when ``everywhere``) by before the step:
        the loss scaler's ``1 / scale`` times the clipping factor; ``None``
        when some rank's share holds inf or nan (every rank then skips). One
        all-reduce of one number for each, unless every rank holds every
        gradient."""
        shares = list(grads.values())
        unscale = 1.0
        if self.loss_scaler is not None:
            unscale = 1.0 / self.loss_scaler.get_scale()
            if everywhere:
                found = has_nonfinite(shares)
            else:
                program = nonfinite_program(shares, self.zero.join_device)
                found = drive(program, self.zero.process_group, self._purpose("inf/nan")).wait()
            self.loss_scaler.record(self.zero, found)
            if found:
                return None
        if self.max_grad_norm is None:
            return unscale
        power = local_norm_power(shares, 2.0)
        if everywhere:
            norm = norm_of_powers(float(power.item()), 2.0)
        else:
            norm_program = global_norm_program(power, 2.0, self.zero.join_device)
            norm = drive(norm_program, self.zero.process_group, self._purpose("norm")).wait()
        return unscale * clip_coefficient(norm * unscale, self.max_grad_norm)

    @staticmethod
    def _purpose(what: str) -> str:
        return f"the overlapped ZeRO step: the gradients' global {what} check before the step"

    def _step_buckets(self, entries: list[_Pending]) -> None:
        """Step this rank's shards of ``entries`` in one local step (clipped
        by the whole model's norm when asked), then start sending every shard
        of them from its owner."""
        zero, plan = self.zero, self._plan()
        grads: dict[int, torch.Tensor] = {}
        for entry in entries:
            averaged = self._averaged(entry)
            grads |= owned_gradients(plan, zero.rank, entry.index, self._indices(entry), averaged)
        factor = self._grad_factor(grads, everywhere=False)
        if factor is None:  # every rank skips this step, and sends nothing
            return
        if grads:
            zero._step_with_grads(grads, factor)
        for entry in entries:
            program = broadcast_from_owners(plan, zero.rank, entry.index, entry.params)
            purpose = (
                f"the overlapped ZeRO step: sending DDP bucket {entry.index}'s updated "
                "parameters from their owners"
            )
            sent = drive(program, zero.process_group, purpose)
            self.broadcasts.append((entry.params, sent))

    def _receive_broadcasts(self) -> None:
        with torch.no_grad():
            for params, sent in self.broadcasts:
                for shard, flat in sent.wait():  # the shards other ranks own
                    owned = params[shard.offset : shard.offset + shard.count]
                    for p, value in zip(owned, split_like(flat, owned), strict=True):
                        p.copy_(value)
        self.broadcasts = []

    def _finish_iteration(self, overlapped: bool) -> None:
        zero = self.zero
        entries, self.pending = self.pending, []
        if overlapped:
            self._step_buckets(entries)
            self._receive_broadcasts()
            return
        # Buckets not final yet: every rank steps every parameter itself.
        grads: dict[int, torch.Tensor] = {}
        for entry in entries:
            for p, g in zip(entry.params, self._averaged(entry), strict=True):
                grads[self.index_of[id(p)]] = g
        factor = self._grad_factor(grads, everywhere=True)
        if factor is not None:
            zero._step_with_grads(grads, factor)
        zero._finish_overlap_iteration()


def _make_hook(step: _OverlappedStep) -> DDPHook:
    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        return step(state, bucket)

    return hook_with_zero_fn


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
            a negative or non-finite ``max_grad_norm``.
        RuntimeError: if ``zero`` is already driven by another hook.
    """
    step = _OverlappedStep(hook, ddp, zero, shard_buckets, False, max_grad_norm, loss_scaler)
    return _make_hook(step)


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
        ValueError: if ``zero`` was not built with ``overlap_with_ddp=True``.
        RuntimeError: if ``zero`` is already driven by another hook.
    """
    return _make_hook(_OverlappedStep(hook, ddp, zero, shard_buckets, interleaved=True))
