"""``ZeroRedundancyOptimizer``: ZeRO stage 1 as a real ``torch.optim.Optimizer``.

A thin shell: it holds the live parameters (in ``param_groups``), the local
optimizer and everything else of this rank's ZeRO state in one record
(:class:`zerofn.zero.rank.ZeroRank`: plan, shards, masters, local optimizer,
overlap mode), built by the core's :func:`~zerofn.zero.rank.build_rank` (as
each simulated rank is) and replaced whole when it changes. Every decision is
the pure core's; this module runs the collectives the core asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable
from torch.optim import Optimizer

from zerofn.blockquant import BlockQuantizer
from zerofn.overlap.orders import OverlapBinding
from zerofn.zero import hook_driven
from zerofn.zero.elastic.recovery_point import Position
from zerofn.zero.options import collective_for_backend, resolve_options
from zerofn.zero.outside_writes import (
    rederive_from_parameters,
    written_since,
)
from zerofn.zero.params import StateDict, check_added_group, normalize_params, plan_for
from zerofn.zero.planning.plan import ShardPlan
from zerofn.zero.rank import (
    ZeroRank,
    answer_local_step,
    build_rank,
    copy_hyperparameters,
    drop_master_grads,
    memory_bytes,
    synced_hyperparameters,
    with_current_trainable,
)
from zerofn.zero.replan import with_added_group
from zerofn.zero.step import run_zero_step
from zerofn_torch.join import Join
from zerofn_torch.runtime.heartbeat import next_generation, start_heartbeat
from zerofn_torch.zero.forward_gather import ForwardGathering
from zerofn_torch.zero.gradients import GradientChecks
from zerofn_torch.zero.joining import Joining
from zerofn_torch.zero.overlap_binding import HookDriven
from zerofn_torch.zero.state_dicts import StateDicts, gather_global_state
from zerofn_torch.zero.world_changes import WorldChanges

__all__ = ["OverlapBinding", "ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


# One class of parts, one per concern, each in its module (zerofn_torch.zero.shell_state
# says which). PyTorch's Joinable base makes this both a PyTorch and a zerofn
# Joinable (the latter registers the former), so either Join accepts it.
class ZeroRedundancyOptimizer(
    GradientChecks, StateDicts, WorldChanges, HookDriven, ForwardGathering, Joining, Optimizer,
    Joinable,
):  # fmt: skip
    """Shard any ``torch.optim`` optimizer's state across the ranks of a group.

    Each rank keeps optimizer state only for the parameters it owns, steps
    them, then every rank receives the updated shards in one contiguous
    message per rank and device/dtype. A drop-in for
    ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    Whatever the constructor refuses, it refuses before changing anything:
    the parameters keep their storage and values (``optimizer_class``'s own
    checks of ``**defaults`` run before any exchange buffer is built).

    Args:
        params: tensors, or param-group dicts, to optimize.
        optimizer_class: the ``torch.optim.Optimizer`` class run on the shard.
        process_group: the group to shard across (default: the world).
        parameters_as_bucket_view: make parameters views into the exchange
            buffers, so updated shards land in place without copies (their
            ``.data`` is replaced, as PyTorch's own option does). ``None``
            (the default): on with ``partition="flat"``, where the local step
            then writes straight into what the exchange sends and nothing is
            packed or unpacked; off in every other mode, PyTorch's default.
            ``True`` or ``False`` is honoured in every mode.
        overlap_with_ddp: step inside DDP's backward, through a hook from
            :func:`zerofn_torch.hooks.hook_with_zero_step` (or its interleaved
            twin); ownership then follows DDP's buckets, ``partition`` and
            ``parameters_as_bucket_view`` do not apply, and :meth:`step` does
            nothing. Until DDP fixes its buckets every rank steps all
            parameters itself, so no iteration goes without an update.
        partition: ``"greedy"`` (PyTorch's sorted-greedy, the default),
            ``"balanced"`` (whole tensors, heaviest rank never heavier than
            greedy's), ``"flat"`` (tensors split so each rank holds within one
            element of ``total / world_size``; element-wise optimizers only), or
            a list per rank of the parameters it owns (one param group only).
        elementwise: with ``partition="flat"``, vouch that an optimizer class
            outside the known element-wise ones is element-wise.
        master_dtype: with low-precision parameters (bf16, fp16), keep a copy
            of this rank's shard in this dtype (``torch.float32``) and step
            that: gradients are upcast into it, the local optimizer and its
            state live in it, and the result is cast back into the
            parameters before the exchange. ``None`` (the default), or the
            parameters' own dtype, keeps no copy.
        exchange_compression: ``None`` (the default: the exact exchange),
            ``"int8"``, ``"int4"`` or a :class:`zerofn.blockquant.BlockQuantizer`:
            send each shard's difference from the replica every rank holds,
            block-quantized, instead of its values. The owner keeps the exact
            values (a master copy, in ``master_dtype`` or float32) and every
            rank applies the same decoded differences, so the parameters stay
            bitwise identical on every rank and within half a quantization
            step of the masters (see ``docs/compressed_exchange.md``). With
            ``overlap_with_ddp=True`` the owners' sends are compressed alike.
        redundancy: ``1`` (the default): each shard's optimizer state lives
            on its owner alone. ``2``: also on the next rank (round), which
            steps its copy from the averaged gradients it already holds, with
            the owner's arithmetic: the copies stay bitwise equal and no byte
            more is sent; so :func:`zerofn_torch.elastic.recover` can go on
            without a lost rank (see ``docs/resilience.md``). Every
            partition, master copies and the compressed exchange (their
            masters are carried too), and ``overlap_with_ddp=True`` (its
            hook then takes the whole plain step after the last bucket).
        gather_during_forward: ``step()`` takes the local step, starts the
            exchange piece by piece in the order the forward uses the
            parameters, and returns; each module waits only for the pieces
            holding its parameters as the next forward reaches it. Read
            parameters outside a forward only after :meth:`wait`. Every
            partition, bucket views and master copies; not with
            ``overlap_with_ddp``, ``exchange_compression`` or ``redundancy=2``
            (see ``docs/zero.md``).
        **defaults: forwarded to ``optimizer_class``.

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or holds a non-tensor;
            a manual partition lists something other than tensors (indices, say);
            ``optimizer_class`` takes no option of a name in ``**defaults``.
        ValueError: ``params`` is empty, sparse or of mixed dtype/device; a bad
            manual partition (one that leaves a trainable parameter to no rank
            included); ``partition="flat"`` with a non-element-wise optimizer;
            ``master_dtype`` narrower than the parameters; a value in
            ``**defaults`` that ``optimizer_class`` refuses (``lr=-1``); an
            unknown ``exchange_compression`` or compression of non-float
            parameters; ``redundancy`` other than 1 or 2, or 2 where it is
            not available.
        RuntimeError: a manual partition, or ``overlap_with_ddp=True``, with
            more than one param group.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool | None = None,
        overlap_with_ddp: bool = False,
        *,
        partition: str | Sequence[Sequence[torch.Tensor]] = "greedy",
        elementwise: bool = False,
        master_dtype: torch.dtype | None = None,
        exchange_compression: str | BlockQuantizer | None = None,
        redundancy: int = 1,
        gather_during_forward: bool = False,
        **defaults: Any,
    ) -> None:
        groups = normalize_params(params)
        group = process_group if process_group is not None else dist.group.WORLD
        options = resolve_options(
            groups, optimizer_class, defaults,
            rank=dist.get_rank(group), world_size=dist.get_world_size(group),
            collective=collective_for_backend(dist.get_backend(group)),
            bucket_view=parameters_as_bucket_view, overlap_with_ddp=overlap_with_ddp,
            partition=partition, master_dtype=master_dtype,
            exchange_compression=exchange_compression, elementwise=elementwise,
            redundancy=redundancy, gather_during_forward=gather_during_forward,
        )  # fmt: skip
        Optimizer.__init__(self, groups, defaults)
        Joinable.__init__(self)
        self.process_group: Any = group
        self.world_size: int = options.world_size
        self.rank: int = options.rank
        self.parameters_as_bucket_view = options.bucket_view
        if overlap_with_ddp and parameters_as_bucket_view:
            logger.warning(
                "parameters_as_bucket_view=True does nothing with overlap_with_ddp=True: the "
                "overlap hook holds no exchange buffers for the parameters to be views of"
            )
        if overlap_with_ddp:
            self._zero = hook_driven.build_hook_driven_rank(self.param_groups, options)
        else:
            plan = plan_for(self.param_groups, self.world_size, partition)
            self._zero = build_rank(self.param_groups, options, plan)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._consolidated: StateDict | None = None
        # Until a step or a load gives it state, every rank knows the whole
        # (empty) state: state_dict() answers without consolidating, as
        # frameworks that read it at set-up (Accelerate's prepare) expect.
        self._untouched = True
        self._position = Position(0)
        self._regroups = 0
        self._versions = self._read_versions()
        self._start_gathering(gather_during_forward)
        # With every shard on two ranks the job can go on without a lost rank:
        # the others tell this one is alive by its heartbeat (zerofn_torch.elastic),
        # in a world of its own (no earlier optimizer's alarm or roll call).
        self._generation = next_generation() if redundancy == 2 else 0
        self._heartbeat = None
        if redundancy == 2:
            self._heartbeat = start_heartbeat(self._generation, self.rank, self.world_size, group)

    # ----- what the shell holds -----------------------------------------------

    @property
    def zero_rank(self) -> ZeroRank:
        """This rank's ZeRO state: plan, shards, masters, local optimizer,
        overlap mode (the core's record; read only)."""
        return self._zero

    @property
    def optim(self) -> Optimizer:
        """The local optimizer over this rank's shard (as PyTorch's ``optim``)."""
        return self._zero.optim

    @property
    def shard_plan(self) -> ShardPlan:
        """Who owns what and how shards travel (the core's record; read only)."""
        return self._zero.plan

    # ----- the step -----------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step this rank's shard, then bring every rank's updated shard here.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            **kwargs: passed to the local optimizer's ``step``.

        Returns:
            The local optimizer's return value (the loss, with a closure).

        Raises:
            RuntimeError: with ``overlap_with_ddp=True`` and no overlap hook
                made for this optimizer: nothing would ever step it.
            ValueError: a closure with master copies.
            zerofn.errors.CollectiveError: the exchange failed (a peer died or
                timed out). This rank's shard is stepped; other ranks' shards
                may be partly received: restart from a checkpoint.
        """
        if self._zero.stepped_by_hook:
            hook_driven.check_overlap_attached(self._zero.overlap)
            logger.warning(
                "step() does nothing with overlap_with_ddp=True: the DDP hook steps the "
                "optimizer during backward"
            )
            return None
        if closure is not None and self._zero.masters is not None:
            raise ValueError(
                "step(closure) with master copies (master_dtype or exchange_compression): the "
                "closure's gradients would land on the parameters after the masters read them; "
                "run forward and backward before step() instead"
            )
        Join.notify_join_context(self)
        return self._step_and_exchange(closure, **kwargs)

    def _step_and_exchange(self, closure: Callable[[], float] | None, **kwargs: Any) -> Any:
        """:meth:`step` past its checks and its announcement to a join context."""
        self.wait()
        if written_since(self._versions, self._all_params):
            rederive_from_parameters(self._zero, self._all_params, keep_consistent=True)
        zero = with_current_trainable(self._zero, self.param_groups)
        if zero is not self._zero:
            logger.warning(
                "ZeroRedundancyOptimizer: the set of parameters requiring grad changed; "
                "rebuilding the exchange buffers"
            )
        self._zero = zero
        params = self._all_params

        losses: list[Any] = []

        def run(optim: Optimizer) -> Any:
            losses.append(
                optim.step(**kwargs) if closure is None else optim.step(closure, **kwargs)
            )
            return losses[-1]

        answer = self._counted(answer_local_step(zero, params, run))
        with synced_hyperparameters(self.param_groups, zero):
            order = self._forward_order(zero.plan)
            collective, compressed = zero.options.collective, zero.compressed
            program = run_zero_step(zero.shards, params, collective, answer, compressed, order)
            self._exchange(program, order, "the ZeRO step's exchange of updated shards")
        return losses[-1] if losses else None

    def refresh_from_parameters(self) -> None:
        """Take the parameters' current values as the truth: re-derive the
        master copies, the compressed exchange's exact values, a flat
        shard's segment and the carried copy (``redundancy=2``) from them.

        Whatever sets parameter values from outside the step calls this on
        every rank afterwards (:class:`~zerofn_torch.averaging.DiLoCoOptimizer`
        does after each sync), or lets :meth:`step` notice the write (below).
        Optimizer state (moments, step counts) is kept. Local: no collective.

        :meth:`step` also notices tracked in-place writes to the parameters
        this rank owns or carries (``param.copy_`` under ``torch.no_grad()``,
        ``average_parameters`` and so post-local SGD's averaging,
        ``model.load_state_dict``) and re-derives from them itself, keeping
        each master element that already rounds to its parameter (so a model
        state loaded after the optimizer's keeps the loaded masters). A write
        through ``.data`` is not tracked: call this after it.
        """
        self.wait()
        rederive_from_parameters(self._zero, self._all_params)
        self._versions = self._read_versions()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients, and any the masters hold."""
        super().zero_grad(set_to_none)
        drop_master_grads(self._zero)

    # ----- param groups -------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (call it on all ranks alike).

        The greedy partition places the new parameters after the old ones,
        which keep their owners; other modes re-partition and move the
        optimizer state to its new owners (a collective). With
        ``redundancy=2`` the carried copies follow: each carrier holds its
        owner's new shard too.

        Raises:
            RuntimeError: with ``overlap_with_ddp=True`` or a manual partition.
            TypeError, ValueError: a malformed group, or tensors of another
                layout, dtype or device.
        """
        zero: ZeroRank | None = getattr(self, "_zero", None)
        if zero is None:  # Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            return
        self.wait()
        (param_group,) = normalize_params([param_group])  # a generator is read once
        check_added_group(zero.plan.mode, zero.stepped_by_hook, self._all_params, param_group)
        old = None
        if zero.plan.mode != "greedy":  # the state moves to new owners
            old = gather_global_state(zero, self.param_groups, self.process_group)
        super().add_param_group(param_group)
        self._zero = with_added_group(zero, self.param_groups, old)

    # ----- memory ---------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes by kind, from the live tensors: what
        :func:`zerofn.footprint.plan_footprint` predicts.

        Returns:
            ``parameters`` (all of them), ``gradients`` (their ``.grad``),
            ``master_weights`` (this rank's master copies; zero without
            ``master_dtype``), ``optimizer_state`` (tensors in the local
            optimizer's state), ``exchange_buffers`` (buffer bytes no
            parameter lives in: zero with ``parameters_as_bucket_view``; with
            ``exchange_compression``, plus the payload buffers), ``carried``
            (``redundancy=2``: the copy of another rank's shard) and
            ``kept_gradients`` (``redundancy=2`` with ``gather_during_forward``:
            the gradients kept while the exchange is behind the forward).
        """
        measured = memory_bytes(self._zero, self._all_params)
        return measured | {"kept_gradients": self.kept_gradient_bytes}
