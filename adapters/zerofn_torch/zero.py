"""``ZeroRedundancyOptimizer``: ZeRO stage 1 as a real ``torch.optim.Optimizer``.

The shell holds three things: the live parameters (in ``param_groups``), the
local optimizer over this rank's shard (``optim``), and a
:class:`zerofn.zero.plan.ShardPlan` saying who owns what and how shards travel.
Every decision is made by the pure core; this class reads live state, calls
the core, runs the collectives it asks for and writes the result back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable
from torch.optim import Optimizer

from zerofn.blockquant import BlockQuantizer
from zerofn.overlap.obey import SendCompressed
from zerofn.zero.compressed_exchange import (
    CompressedExchange,
    compressed_exchange,
    compression_master_dtype,
    resolve_compression,
)
from zerofn.zero.exchange import ExchangeVia
from zerofn.zero.masters import Masters, make_masters, with_masters, without_masters
from zerofn.zero.optimizers import check_elementwise
from zerofn.zero.params import (
    StateDict,
    check_same_dense_type,
    global_groups,
    hyperparameters,
    normalize_params,
)
from zerofn.zero.plan import ShardPlan, plan_shards, with_trainable
from zerofn.zero.precision import (
    clip_coefficient,
    global_norm_program,
    local_norm_power,
    nonfinite_program,
    resolve_master_dtype,
)
from zerofn.zero.shard_state import consolidate, shard, validate_global
from zerofn.zero.shards import Shards, shards_for
from zerofn.zero.step import (
    Compressed,
    LocalStep,
    load_step_grads,
    run_zero_step,
    settle_masters,
)
from zerofn_torch.driver import drive
from zerofn_torch.join import Join, JoinHook
from zerofn_torch.object_collectives import all_gather_objects, gather_objects

__all__ = ["OverlapBinding", "ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


def _copyhyperparameters(src: Sequence[dict[str, Any]], dst: Sequence[dict[str, Any]]) -> None:
    for s, d in zip(src, dst, strict=True):
        d.update(hyperparameters(s))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> str:
    return f"{t.device}/{t.dtype}"


def _cpu_copy(value: Any) -> Any:
    """A snapshot of ``value`` with every tensor copied to the CPU, so that
    later steps cannot change it through shared storage."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(v) for v in value)
    return value


def _check_arguments(
    groups: Sequence[dict[str, Any]],
    optimizer_class: type[Optimizer],
    overlap_with_ddp: bool,
    partition: str | Sequence[Sequence[torch.Tensor]],
    elementwise: bool,
) -> None:
    """Refuse what the constructor cannot build, before anything is built."""
    check_same_dense_type([p for g in groups for p in g["params"]])
    if overlap_with_ddp and len(groups) != 1:
        raise RuntimeError(
            "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single param "
            f"group, got {len(groups)}"
        )
    if overlap_with_ddp and partition != "greedy":
        raise ValueError(
            "with overlap_with_ddp=True ownership follows DDP's buckets; leave partition "
            "at its default"
        )
    if partition == "flat":
        check_elementwise(optimizer_class, elementwise)


def _check_local_optimizer(
    groups: Sequence[dict[str, Any]],
    optimizer_class: type[Optimizer],
    defaults: dict[str, Any],
    probe: torch.Tensor,
) -> None:
    """Let ``optimizer_class`` check its hyperparameters before anything is built.

    The local optimizer is made last, after the exchange buffers, and with
    ``parameters_as_bucket_view`` the parameters' storage has moved into
    them by then; so its own checks (a negative ``lr``, an unknown option)
    run first here, on one throwaway tensor per param group, each group
    with its own options as the local optimizer will see them.

    Args:
        groups: the param groups (their tensors are not touched).
        optimizer_class: the local optimizer's class.
        defaults: the keyword arguments it will get.
        probe: a one-element tensor of the local optimizer's dtype and
            device (each group gets a copy).

    Raises:
        ValueError: ``optimizer_class`` refuses a value (``torch.optim``'s
            checks: a negative ``lr``, ``betas`` out of range, ...).
        TypeError: ``optimizer_class`` takes no option of that name.
    """
    probes = [{**hyperparameters(g), "params": [probe.clone()]} for g in groups]
    optimizer_class(probes, **defaults)


@attrs.frozen
class OverlapBinding:
    """What the overlap hook may do to the optimizer it drives
    (:meth:`ZeroRedundancyOptimizer.bind_overlap_hook`).

    Attributes:
        step: step the local optimizer with ``{global index: gradient}``,
            multiplied by a factor; the parameters not named sit out.
        adopt_owners: keep only this rank's parameters (global indices per
            rank) and their state from now on.
    """

    step: Callable[[dict[int, torch.Tensor], float, bool], None]
    adopt_owners: Callable[[Sequence[Sequence[int]]], None]
    compressed: Callable[[], SendCompressed | None]


class _ZeroJoinHook(JoinHook):
    """Shadows a joined rank's share of the step's collectives."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


# PyTorch's Joinable base makes this both a PyTorch and a zerofn Joinable (the
# latter registers the former), so either Join accepts it.
class ZeroRedundancyOptimizer(Optimizer, Joinable):
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
            parameters.
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
        **defaults: Any,
    ) -> None:
        groups = normalize_params(params)
        _check_arguments(groups, optimizer_class, overlap_with_ddp, partition, elementwise)
        first = groups[0]["params"][0]
        self._quantizer = resolve_compression(exchange_compression, first.dtype)
        self._master_dtype = (
            resolve_master_dtype(first.dtype, master_dtype)
            if self._quantizer is None
            else compression_master_dtype(first.dtype, master_dtype)
        )
        probe = torch.zeros(1, dtype=self._master_dtype or first.dtype, device=first.device)
        _check_local_optimizer(groups, optimizer_class, defaults, probe)
        self._masters: Masters | None = None
        self._initialized = False
        Optimizer.__init__(self, groups, defaults)
        Joinable.__init__(self)

        self.process_group: Any = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        # gloo's all-gather measured 2-3.5x slower than broadcasts of the same
        # bytes on CPU; NCCL's all-gather is its best path.
        gloo = dist.get_backend(self.process_group) == "gloo"
        self._via: ExchangeVia = "broadcasts" if gloo else "all_gather"
        if parameters_as_bucket_view is None:
            parameters_as_bucket_view = partition == "flat"
        self.parameters_as_bucket_view = parameters_as_bucket_view and not overlap_with_ddp
        self._optimizer_class = optimizer_class
        self._optim_defaults = defaults
        self._default_device = self._all_params[0].device
        self._overlap_with_ddp = overlap_with_ddp
        self._overlap_attached = False  # a hook drives the step
        self._overlap_sharded = False  # the hook fixed the bucket plan
        if overlap_with_ddp:
            # Until DDP's buckets are final this rank steps every parameter.
            everything = list(range(len(self._all_params)))
            partition = [[] for _ in range(self.world_size)]
            partition[self.rank] = [self._all_params[i] for i in everything]
        self._plan = self._new_plan(partition)
        self._set_shards(rebuilt=False)
        self.optim: Optimizer = self._new_local_optimizer()
        _copyhyperparameters(self.optim.param_groups, self.param_groups)
        self._consolidated: StateDict | None = None
        self._initialized = True

    # ----- reading live state -------------------------------------------------

    @property
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _trainable(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self._all_params)

    def _new_plan(
        self,
        partition: str | Sequence[Sequence[torch.Tensor]],
        trainable: tuple[bool, ...] | None = None,
    ) -> ShardPlan:
        """The plan for ``partition`` (a mode, or the tensors per rank).

        Args:
            partition: a partition mode, or each rank's parameter tensors.
            trainable: which parameters the plan must give an owner
                (default: those requiring grad now).

        Raises:
            TypeError: a manual partition lists something other than tensors.
            ValueError: a bad manual partition (wrong length, a stranger, a
                parameter twice, a trainable parameter left to no rank).
        """
        params = self._all_params
        group_sizes = [[p.numel() for p in g["params"]] for g in self.param_groups]
        keys = [_key(p) for p in params]
        trainable = self._trainable() if trainable is None else trainable
        if isinstance(partition, str):
            return plan_shards(group_sizes, keys, trainable, self.world_size, partition)  # type: ignore[arg-type]
        index_of = {id(p): i for i, p in enumerate(params)}
        if len(partition) != self.world_size:
            raise ValueError(
                f"params_per_rank has {len(partition)} entries; it needs one per rank "
                f"(world_size={self.world_size})"
            )
        manual = []
        for rank, rank_params in enumerate(partition):
            indices = []
            for p in rank_params:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(
                        f"partition[{rank}] holds a {type(p).__name__} ({p!r}); a manual "
                        "partition lists, for each rank, the parameter tensors it owns "
                        "(e.g. [[model.weight], [model.bias]]), not their indices"
                    )
                if id(p) not in index_of:
                    raise ValueError(
                        f"params_per_rank[{rank}] holds a tensor of shape {tuple(p.shape)} "
                        "that was not passed to the optimizer"
                    )
                indices.append(index_of[id(p)])
            manual.append(indices)
        return plan_shards(group_sizes, keys, trainable, self.world_size, "greedy", manual)

    def _set_shards(self, rebuilt: bool) -> None:
        """How this rank holds its shard under the current plan (see
        :mod:`zerofn.zero.shards`): the mode, its exchange buffers and, with
        compression, the payload buffers."""
        params = self._all_params
        # The overlap hook sends its own payloads, bucket by bucket.
        self._exchange: CompressedExchange | None = (
            None
            if self._quantizer is None or self._overlap_with_ddp
            else compressed_exchange(self._quantizer, self._plan, self._default_device)
        )
        self._shards: Shards = shards_for(
            self._plan,
            self.rank,
            params,
            bucket_view=self.parameters_as_bucket_view,
            stepped_by_hook=self._overlap_with_ddp,
            step_dtype=self._master_dtype or params[0].dtype,
            options=self._optim_defaults,
            rebuilt=rebuilt,
        )

    def _new_local_optimizer(self) -> Optimizer:
        local = self._shards.local_groups(self.param_groups, self._all_params)
        if self._master_dtype is not None:
            local, self._masters = make_masters(local, self._master_dtype)
        return self._optimizer_class(local, **self._optim_defaults)

    # ----- the step -----------------------------------------------------------

    def _refresh_trainable(self) -> None:
        trainable = self._trainable()
        if trainable == self._plan.trainable:
            return
        plan = with_trainable(self._plan, trainable)  # may refuse: then nothing changed
        logger.warning(
            "ZeroRedundancyOptimizer: the set of parameters requiring grad changed; "
            "rebuilding the exchange buffers"
        )
        self._plan = plan
        self._set_shards(rebuilt=True)

    def _load_step_grads(self, unscale: float = 1.0) -> None:
        """Hand the local optimizer this step's gradients: the masters get
        them upcast (times ``unscale``), a flat shard's chunks get views of
        the parameters' gradients; owned whole parameters hold their own."""
        local = [t for g in self.optim.param_groups for t in g["params"]]
        load_step_grads(self._shards, self._all_params, local, self._masters, unscale)

    def _prepare_step(self) -> None:
        Join.notify_join_context(self)
        self._refresh_trainable()
        _copyhyperparameters(self.param_groups, self.optim.param_groups)
        self._shards.refresh(self._all_params)

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
            zerofn.errors.CollectiveError: the exchange failed (a peer died or
                timed out). This rank's shard is stepped; other ranks' shards
                may be partly received: restart from a checkpoint.
        """
        if self._shards.stepped_by_hook:
            self._check_overlap_attached()
            logger.warning(
                "step() does nothing with overlap_with_ddp=True: the DDP hook steps the "
                "optimizer during backward"
            )
            return None
        if closure is not None and self._masters is not None:
            raise ValueError(
                "step(closure) with master copies (master_dtype or exchange_compression): the "
                "closure's gradients would land on the parameters after the masters read them; "
                "run forward and backward before step() instead"
            )
        self._prepare_step()

        def local_step(_: LocalStep) -> Any:
            self._load_step_grads()
            loss = (
                self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
            )
            settle_masters(self._masters, compressed=self._exchange is not None)
            return loss

        compressed = None
        if self._exchange is not None:
            assert self._masters is not None
            compressed = Compressed(self._exchange, self._masters.master)
        program = run_zero_step(self._shards, self._all_params, self._via, local_step, compressed)
        done = drive(program, self.process_group, "the ZeRO step's exchange of updated shards")
        _copyhyperparameters(self.optim.param_groups, self.param_groups)
        return done.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients, and any the masters hold."""
        super().zero_grad(set_to_none)
        if self._masters is not None:
            self._masters.drop_grads()

    # ----- gradients: clipping and loss scaling ---------------------------------

    def _check_stepped_here(self, what: str) -> None:
        if self._shards.stepped_by_hook:
            raise RuntimeError(
                f"{what} is not available with overlap_with_ddp=True: the DDP hook steps each "
                "bucket during backward, before the gradients of the whole model are known. "
                "Pass max_grad_norm= and loss_scaler= to hook_with_zero_step instead."
            )

    def _step_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's step reads, for the elements it owns: the
        masters' (upcast now if not yet), or views into the parameters' ``.grad``."""
        if self._masters is not None:
            self._load_step_grads()
            return self._masters.grads()
        params = self._all_params
        views = []
        for piece in self._plan.partition.pieces_of(self.rank):
            grad = params[piece.param].grad
            if grad is not None and piece.numel:
                views.append(grad.reshape(-1)[piece.start : piece.stop])
        return views

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients by their norm over the whole model, as
        ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model (the
        same norm and factor up to the order of additions and where they
        are rounded: last bits in float32, up to 2 bf16 ulps on bf16
        gradients without masters; see ``docs/mixed_precision.md``).

        Collective: call on every rank, after backward and before :meth:`step`.
        Each rank reduces only the elements it owns; one all-reduce of one
        number gives the global norm. Without ``master_dtype`` every
        gradient on this rank is scaled in place; with it, the float32
        gradients of this rank's masters are (the parameters' own ``.grad``
        stay as they are).

        Args:
            max_norm: the largest norm allowed.
            norm_type: the norm's order (``float("inf")`` for the largest element).
            error_if_nonfinite: raise if the norm is inf or nan.

        Returns:
            The norm before clipping: a float32 scalar, equal on every rank.

        Raises:
            ValueError: ``max_norm`` negative, ``norm_type`` not positive.
            RuntimeError: with ``overlap_with_ddp=True``; a non-finite norm
                with ``error_if_nonfinite``.
            zerofn.errors.CollectiveError: the all-reduce failed.
        """
        self._check_stepped_here("clip_grad_norm_")
        clip_coefficient(0.0, max_norm)  # reject a bad max_norm before any collective
        share = local_norm_power(self._step_grads(), float(norm_type))
        program = global_norm_program(share, float(norm_type), self._default_device)
        total = drive(program, self.process_group, "clip_grad_norm_'s global norm").wait()
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {total}; "
                "pass error_if_nonfinite=False to clip anyway"
            )
        coefficient = clip_coefficient(total, max_norm)
        if coefficient != 1.0:
            grads = (
                self._masters.grads()
                if self._masters is not None
                else [p.grad for p in self._all_params if p.grad is not None]
            )
            for grad in grads:
                grad.mul_(coefficient)
        return torch.tensor(total, dtype=torch.float32)

    def unscale_gradients_(self, factor: float) -> bool:
        """Multiply the gradients the step reads by ``factor`` (a loss
        scaler's ``1 / scale``), and tell whether any rank's hold inf or nan.

        With ``master_dtype`` the product lands in the float32 masters (fp16
        gradients would underflow); without, gradients are scaled in place.
        Collective: one all-reduce of one flag; call before
        :meth:`clip_grad_norm_`, once per step.

        Returns:
            ``True`` on every rank if any rank found inf or nan: then skip
            the step everywhere with :meth:`discard_step`.

        Raises:
            RuntimeError: with ``overlap_with_ddp=True``, or if the gradients
                were already read for this step (clipped or unscaled).
            zerofn.errors.CollectiveError: the all-reduce failed.
        """
        self._check_stepped_here("loss scaling")
        if self._masters is not None:
            if self._masters.grads():
                raise RuntimeError(
                    "the gradients were already unscaled or clipped for this step: unscale "
                    "once per step, before clip_grad_norm_"
                )
            self._load_step_grads(unscale=factor)
            grads = self._masters.grads()
        else:
            for p in self._all_params:
                if p.grad is not None:
                    p.grad.mul_(factor)
            grads = self._step_grads()
        program = nonfinite_program(grads, self._default_device)
        return drive(program, self.process_group, "loss scaling's inf/nan check").wait()

    def discard_step(self) -> None:
        """Skip this step: forget the gradients loaded for it (into the
        masters). Every rank must skip alike; :meth:`unscale_gradients_`
        tells them all the same."""
        if self._masters is not None:
            self._masters.drop_grads()

    # ----- param groups -------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (call it on all ranks alike).

        The greedy partition places the new parameters after the old ones,
        which keep their owners; other modes re-partition and move the
        optimizer state to its new owners (a collective).
        """
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        if self._shards.stepped_by_hook:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single param group"
            )
        if self._plan.mode == "manual":
            raise RuntimeError(
                "a manual partition (params_per_rank) supports a single param group; "
                "build a new optimizer with every group, using an automatic partition"
            )
        check_same_dense_type([*self._all_params, *normalize_params([param_group])[0]["params"]])
        moved = self._plan.mode != "greedy"
        old_state = self._gather_global_state() if moved else None
        super().add_param_group(param_group)
        for name, default in self.optim.defaults.items():
            self.param_groups[-1].setdefault(name, default)
        self._plan = self._new_plan(self._plan.mode)
        self._set_shards(rebuilt=True)
        if moved:
            assert old_state is not None
            old_state["param_groups"].append(hyperparameters(self.param_groups[-1]))
            old_state["param_groups"][-1]["params"] = []
            self.optim = self._new_local_optimizer()
            self._load_global_state(self._regroup(old_state))
        else:
            new_local = self._shards.local_groups(self.param_groups, self._all_params)[-1]
            if self._masters is not None:
                (new_local,), added = make_masters([new_local], self._masters.dtype)
                self._masters = self._masters.extended(added)
            self.optim.add_param_group(new_local)
        _copyhyperparameters(self.optim.param_groups, self.param_groups)

    def _regroup(self, state: StateDict) -> StateDict:
        """Give ``state``'s groups the current global indices (groups only grew)."""
        counts = [len(live["params"]) for live in self.param_groups]
        return {**state, "param_groups": global_groups(counts, state["param_groups"])}

    # ----- state dicts --------------------------------------------------------

    def _shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self._all_params]

    def _local_state_dict(self) -> StateDict:
        """The local optimizer's state dict, one tensor per group under a flat
        partition (chunks merged)."""
        sd: StateDict = self.optim.state_dict()
        if self._masters is not None:
            sd = with_masters(sd, self._masters)
        return self._shards.saved_state(sd)

    def _local_state_cpu(self) -> StateDict:
        _copyhyperparameters(self.param_groups, self.optim.param_groups)
        sd: StateDict = _cpu_copy(self._local_state_dict())
        return sd

    def _gather_global_state(self) -> StateDict:
        """Every rank's shard, joined into the global state on every rank."""
        purpose = "gathering every rank's optimizer shard"
        gathered = all_gather_objects(self._local_state_cpu(), self.process_group, purpose)
        return consolidate(self._plan.partition, gathered, self._shapes())

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the full optimizer state on rank ``to`` for :meth:`state_dict`.

        Must be called on every rank. Only the local shards travel, to one rank.

        Args:
            to: the group rank that receives the state.

        Raises:
            TypeError: ``to`` is not an int.
            ValueError: ``to`` is not a rank of the group; checked before any
                collective, so the group stays usable.
            RuntimeError: with ``overlap_with_ddp=True``, before DDP fixed its
                buckets.
        """
        self._check_rank(to)
        self._check_overlap_initialized()
        purpose = f"consolidating the optimizer state on rank {to}"
        gathered = gather_objects(self._local_state_cpu(), to, self.process_group, purpose)
        if gathered is None:
            self._consolidated = None
        else:
            self._consolidated = consolidate(self._plan.partition, gathered, self._shapes())

    def _check_rank(self, to: Any) -> None:
        """Refuse a ``to`` that names no rank of the group, before any
        collective: a gather to a rank that does not exist would fail inside
        the collective and look like a broken group.

        Raises:
            TypeError: ``to`` is not an int (a bool is not a rank either).
            ValueError: ``to`` is outside ``0 .. world_size - 1``.
        """
        if not isinstance(to, int) or isinstance(to, bool):
            raise TypeError(
                f"consolidate_state_dict(to=...) takes a group rank, an int in "
                f"0..{self.world_size - 1}; got {type(to).__name__} {to!r}"
            )
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"consolidate_state_dict(to={to}): the group has {self.world_size} rank(s), "
                f"so to must be in 0..{self.world_size - 1}"
            )

    def state_dict(self) -> StateDict:
        """The full state gathered by the last :meth:`consolidate_state_dict`,
        in ``torch.optim``'s format (loadable into the unsharded optimizer).

        Raises:
            RuntimeError: if the state was not consolidated on this rank.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Call "
                f"consolidate_state_dict(to={self.rank}) on all ranks first."
            )
        return {
            "state": dict(self._consolidated["state"]),
            "param_groups": [
                {**hyperparameters(live), "params": list(saved["params"])}
                for live, saved in zip(
                    self.param_groups, self._consolidated["param_groups"], strict=True
                )
            ],
        }

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a full state dict (from :meth:`state_dict`, or from a plain
        ``torch.optim`` optimizer over the same parameters), keeping this
        rank's shard. ``state_dict`` is not modified.

        Raises:
            ValueError: if ``state_dict`` belongs to another model; then
                nothing is changed.
        """
        self._check_overlap_initialized()
        validate_global(self._plan.partition, state_dict)
        self._load_global_state(state_dict)

    def _load_global_state(self, state_dict: StateDict) -> None:
        # Copy, so that stepping never writes into the caller's tensors.
        local = _cpu_copy(shard(self._plan.partition, state_dict, self.rank))
        local = self._shards.loaded_state(local, self.optim.param_groups)
        local, masters = without_masters(local)
        self.optim.load_state_dict(local)
        self._load_masters(masters)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(hyperparameters(saved))
        _copyhyperparameters(self.param_groups, self.optim.param_groups)

    def _load_masters(self, saved: dict[int, torch.Tensor]) -> None:
        """Set the masters from ``saved`` (local index -> master); a master
        not saved (a state dict from PyTorch, or without masters) is copied
        up from its parameter."""
        if self._masters is None:
            return
        self._shards.refresh(self._all_params)
        missing = [i for i in range(len(self._masters.master)) if i not in saved]
        self._masters.reseed(missing)
        with torch.no_grad():
            for index, master in saved.items():
                self._masters.master[index].copy_(master)

    # ----- overlap with DDP (driven by zerofn_torch.overlap) --------------------
    # The overlap hook owns the overlap record (zerofn.overlap.hook); the
    # optimizer is told three things: a hook drives it, step these gradients,
    # and, once the bucket plan is fixed, which parameters each rank owns.

    def bind_overlap_hook(self) -> OverlapBinding:
        """Let one overlap hook (``zerofn_torch.overlap``) drive this optimizer:
        what it may do to it, and nothing else. Not for training loops.

        Returns:
            The hook's handles: step given gradients, adopt the owners.

        Raises:
            ValueError: the optimizer was not built with ``overlap_with_ddp=True``.
            RuntimeError: another hook drives it already.
        """
        if not self._shards.stepped_by_hook:
            raise ValueError(
                "the ZeroRedundancyOptimizer must be built with overlap_with_ddp=True to be "
                "stepped by this hook"
            )
        if self._overlap_attached:
            raise RuntimeError("this ZeroRedundancyOptimizer is already driven by a DDP hook")
        self._overlap_attached = True
        return OverlapBinding(
            self._step_with_grads, self._adopt_overlap_plan, self._send_compressed
        )

    def _check_overlap_attached(self) -> None:
        """Refuse to train with ``overlap_with_ddp=True`` and no hook: the hook
        is what steps the optimizer, so without one nothing would change.

        Raises:
            RuntimeError: no overlap hook was made for this optimizer.
        """
        if not self._overlap_attached:
            raise RuntimeError(
                "this ZeroRedundancyOptimizer was built with overlap_with_ddp=True, so DDP's "
                "backward steps it through a communication hook, and no such hook was made "
                "for it: nothing would ever be updated. Register one before training, "
                "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero)) "
                "(or hook_with_zero_step_interleaved; both in zerofn_torch.hooks), and drop "
                "zero.step() from the loop; or build the optimizer with overlap_with_ddp=False"
            )

    def _check_overlap_initialized(self) -> None:
        if self._shards.stepped_by_hook and not self._overlap_sharded:
            raise RuntimeError(
                "this ZeroRedundancyOptimizer (overlap_with_ddp=True) is not initialized yet: "
                "DDP fixes its buckets during the first iterations"
            )

    def _send_compressed(self) -> SendCompressed | None:
        """What the overlap hook's compressed sends read: the quantizer and
        this rank's masters by global parameter index (``None``: no
        compression)."""
        if self._quantizer is None:
            return None
        assert self._masters is not None
        params = self._all_params
        index_of = {id(p): i for i, p in enumerate(params)}
        masters: list[torch.Tensor | None] = [None] * len(params)
        for low, master in zip(self._masters.low, self._masters.master, strict=True):
            masters[index_of[id(low)]] = master
        return SendCompressed(self._quantizer, masters)

    def _step_with_grads(
        self, grads: dict[int, torch.Tensor], scale: float = 1.0, write_back: bool = True
    ) -> None:
        """Step the local optimizer with ``grads`` (global index -> gradient),
        multiplied by ``scale`` (in the masters' dtype when kept), for some of
        its parameters; the others sit this step out. Their own ``.grad`` is
        left as it was. Masters are cast into the parameters afterwards
        unless ``write_back`` is ``False`` (a compressed send moves them)."""
        if scale != 1.0:
            if self._masters is None:
                grads = {i: g * scale for i, g in grads.items()}
            else:
                wide = self._masters.dtype
                grads = {i: g.to(wide).mul_(scale) for i, g in grads.items()}
        params = self._all_params
        local = [p for g in self.optim.param_groups for p in g["params"]]
        index_of = {id(p): i for i, p in enumerate(params)}
        if self._masters is not None:
            low = self._masters.low
            self._masters.load_grads_from([grads.get(index_of[id(p)]) for p in low])
            try:
                _copyhyperparameters(self.param_groups, self.optim.param_groups)
                self.optim.step()
                _copyhyperparameters(self.optim.param_groups, self.param_groups)
            finally:
                if write_back:
                    self._masters.write_back(only_stepped=True)
                else:
                    self._masters.drop_grads()
            return
        saved = [p.grad for p in local]
        try:
            for p in local:
                p.grad = grads.get(index_of[id(p)])
            _copyhyperparameters(self.param_groups, self.optim.param_groups)
            self.optim.step()
            _copyhyperparameters(self.optim.param_groups, self.param_groups)
        finally:
            for p, g in zip(local, saved, strict=True):
                p.grad = g

    def _adopt_overlap_plan(self, owned: Sequence[Sequence[int]]) -> None:
        """Keep only this rank's parameters and their state from now on
        (every rank held all of it until the bucket plan was fixed).

        Args:
            owned: global parameter indices each rank owns.
        """
        full_state = self._local_state_dict()  # global indices: it held every parameter
        params = self._all_params
        # DDP's buckets hold what required grad when DDP was built; only those
        # are stepped in this mode, so only those need an owner.
        synced = {i for ranks in owned for i in ranks}
        trainable = tuple(i in synced for i in range(len(params)))
        self._plan = self._new_plan([[params[i] for i in ranks] for ranks in owned], trainable)
        self._set_shards(rebuilt=False)
        self.optim = self._new_local_optimizer()
        self._load_global_state(full_state)
        self._overlap_sharded = True

    # ----- what checkpoints read ------------------------------------------------

    @property
    def shard_plan(self) -> ShardPlan:
        """Who owns what and how shards travel (the core's record; read only)."""
        return self._plan

    def local_state_dict(self) -> StateDict:
        """This rank's local optimizer state as checkpoints keep it: one
        tensor per param group under a flat partition (chunks merged),
        masters as ``"master_param"``; tensors are the live ones."""
        return self._local_state_dict()

    # ----- memory ---------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes by kind, from the live tensors: what
        :func:`zerofn.footprint.plan_footprint` predicts.

        Returns:
            ``parameters`` (all of them), ``gradients`` (their ``.grad``),
            ``master_weights`` (this rank's master copies; zero without
            ``master_dtype``), ``optimizer_state`` (tensors in the local
            optimizer's state) and ``exchange_buffers`` (buffer bytes no
            parameter lives in: zero with ``parameters_as_bucket_view``; with
            ``exchange_compression``, plus the payload buffers).
        """
        params = self._all_params
        aliased = 0
        for buffer in self._shards.buffers:
            lo = buffer.data_ptr()
            hi = lo + buffer.numel() * buffer.element_size()
            aliased += sum(_nbytes(p) for p in params if lo <= p.data_ptr() < hi)
        return {
            "parameters": sum(_nbytes(p) for p in params),
            "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "master_weights": self._masters.nbytes() if self._masters is not None else 0,
            "optimizer_state": sum(
                _nbytes(v)
                for state in self.optim.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ),
            "exchange_buffers": sum(_nbytes(b) for b in self._shards.buffers)
            - aliased
            + (self._exchange.nbytes() if self._exchange is not None else 0),
        }

    # ----- Join ---------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A hook that runs :meth:`step` on a rank that ran out of inputs, so
        its collectives match the ranks still training."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the parameters, where Join's collectives run."""
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        """The process group the optimizer shards across."""
        return self.process_group
