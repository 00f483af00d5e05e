"""How a rank holds and steps its shard: the ZeRO optimizer's three modes.

The ZeRO step (:func:`zerofn.zero.step.zero_step`) is the same program in
every mode: bring the local tensors up to date, have the local optimizer
step them, exchange the updated shards, write them into the parameters. What
differs is what the local optimizer steps, where its gradients come from and
how updates reach the parameters, and each mode is one record here:

* :class:`WholeTensorShards` (greedy, balanced, manual partitions): the
  local optimizer steps the owned parameters themselves, which hold their
  own ``.grad``; the owned values are packed into the exchange buffers
  before the exchange, the others' unpacked after it.
* :class:`FlatShards` (the flat partition): the local optimizer steps views
  of this rank's segment of the single buffer, one per piece of a parameter
  (cut into cache-sized chunks for ``torch.optim``'s per-tensor CPU loop,
  see :mod:`zerofn.zero.planning.chunks`), whose gradients are views of the parameters'
  ``.grad``: nothing is gathered; the local step writes straight into
  what the exchange sends.
* :class:`HookDrivenShards` (``overlap_with_ddp=True``): whole tensors and
  no exchange buffers; the overlap hook steps them during backward and
  moves the updates itself.

Each is built from the plan, which says who owns what; none of them works
ownership out again. They write only into the parameters and buffers handed
to them, as each method says: ``ZeroRedundancyOptimizer`` and the simulated
world (:mod:`zerofn.testing.zero`) hold the same records and step the same
local tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from zerofn.zero.exchange import group_slots, pack, unpack
from zerofn.zero.params import StateDict, hyperparameters
from zerofn.zero.planning.chunks import (
    ChunkSource,
    chunk_sources,
    merge_chunk_state,
    piece_of,
    split_chunk_state,
)
from zerofn.zero.planning.partition import FlatPartition, Piece
from zerofn.zero.planning.plan import ShardPlan

__all__ = [
    "FlatShards",
    "HookDrivenShards",
    "Shards",
    "WholeTensorShards",
    "build_buffers",
    "chunking",
    "flat_grads",
    "flat_sources",
    "shards_for",
]


def build_buffers(
    plan: ShardPlan, params: Sequence[torch.Tensor], bucket_view: bool, rebuilt: bool
) -> list[torch.Tensor]:
    """One exchange buffer per layout, holding the parameters' current values;
    with ``bucket_view``, every trainable parameter that fits in one span
    becomes a view of its place (its ``.data`` is replaced: the parameters
    are handed over).

    Args:
        plan: the shard plan.
        params: every parameter, in the optimizer's order.
        bucket_view: make parameters views of the buffers.
        rebuilt: buffers existed before (a parameter that left them must
            stop aliasing the old ones).
    """
    buffers = [
        torch.empty(layout.numel, dtype=params[0].dtype, device=params[0].device)
        for layout in plan.layouts
    ]
    for layout, buffer in zip(plan.layouts, buffers, strict=True):
        for rank_slots in layout.slots:
            pack(buffer, rank_slots, params)
    if not bucket_view:
        return buffers
    with torch.no_grad():
        if rebuilt:
            for p, trained in zip(params, plan.trainable, strict=True):
                if not trained:
                    p.data = p.data.detach().clone()
        for layout, buffer in zip(plan.layouts, buffers, strict=True):
            for index in {s.piece.param for rs in layout.slots for s in rs}:
                span = layout.span_of(index)
                if span is not None:
                    offset, numel = span
                    params[index].data = buffer[offset : offset + numel].view_as(params[index])
    return buffers


@attrs.define(eq=False)
class WholeTensorShards:
    """Whole parameters owned by this rank (greedy, balanced, manual).

    Attributes:
        plan: who owns what, and how shards travel.
        rank: this rank.
        bucket_view: the parameters are views of the buffers.
        buffers: one exchange buffer per layout.
    """

    plan: ShardPlan
    rank: int
    bucket_view: bool
    buffers: list[torch.Tensor]

    stepped_by_hook: ClassVar[bool] = False
    """The DDP hook steps the shard; ``step()`` does nothing."""
    grads_in_place: ClassVar[bool] = True
    """The local tensors are the parameters, holding their own gradients."""

    def local_groups(
        self, param_groups: Sequence[dict[str, Any]], params: Sequence[torch.Tensor]
    ) -> list[dict[str, Any]]:
        """Param groups for the local optimizer, one per global group."""
        owned = self.plan.partition.assignment[self.rank]  # type: ignore[union-attr]
        return [
            {**hyperparameters(g), "params": [params[i] for i in indices]}
            for g, indices in zip(param_groups, owned, strict=True)
        ]

    def local_grads(
        self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """This step's gradient of each local tensor."""
        return [t.grad for t in local]

    def local_sources(self, params: Sequence[torch.Tensor]) -> list[ChunkSource | None]:
        """Where each local tensor comes from, in the local optimizer's order:
        ``(parameter, first element, element count)``, or ``None`` for a
        placeholder standing for an empty group."""
        owned = self.plan.partition.assignment[self.rank]  # type: ignore[union-attr]
        return [(i, 0, params[i].numel()) for indices in owned for i in indices]

    def local_pieces(self, params: Sequence[torch.Tensor]) -> list[Piece | None]:
        """:meth:`local_sources` as pieces of the parameters (``None``: a
        placeholder), what optimizer state is moved and compared by."""
        return [None if s is None else piece_of(s) for s in self.local_sources(params)]

    def write_grads(self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> None:
        """Give each local tensor (what the local optimizer steps) this
        step's gradient, read from the parameters' ``.grad`` (``local``'s
        ``.grad`` are assigned). Owned whole parameters hold theirs already."""
        if self.grads_in_place:
            return
        for tensor, grad in zip(local, self.local_grads(params, local), strict=True):
            tensor.grad = grad

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Bring what the local optimizer steps up to date with the
        parameters (which the user may have written since the last step);
        the owned parameters are stepped themselves here: nothing to do."""

    def pack_own(self, params: Sequence[torch.Tensor]) -> None:
        """After the local step: copy this rank's updated pieces into its
        segments of the buffers (written in place), unless the parameters
        are views of them already."""
        if not self.bucket_view:
            for layout, buffer in zip(self.plan.layouts, self.buffers, strict=True):
                pack(buffer, layout.slots[self.rank], params)

    def unpack_arrived(self, params: Sequence[torch.Tensor]) -> None:
        """After the exchange: write what the other ranks sent into the
        parameters (written in place; with bucket views it landed there)."""
        for index, layout in enumerate(self.plan.layouts):
            self.unpack_range(params, index, 0, layout.numel)

    def unpack_range(
        self, params: Sequence[torch.Tensor], buffer: int, start: int, stop: int
    ) -> None:
        """Write what arrived in elements ``[start, stop)`` of buffer
        ``buffer`` into the parameters: the other ranks' pieces (this rank's
        own are its parameters already), nothing with bucket views."""
        if not self.bucket_view:
            self._unpack(params, buffer, start, stop)

    def _unpack(self, params: Sequence[torch.Tensor], buffer: int, start: int, stop: int) -> None:
        # Own pieces are in the parameters already when they are the local tensors.
        layout = self.plan.layouts[buffer]
        ranks = [
            r for r in range(len(layout.slots)) if not (self.grads_in_place and r == self.rank)
        ]
        inside = [s for r in ranks for s in layout.slots[r] if s.offset < stop and start < s.stop]
        unpack(self.buffers[buffer], inside, params, start, stop)

    def saved_state(self, state: StateDict) -> StateDict:
        """The local optimizer's state dict as checkpoints keep it."""
        return state

    def loaded_state(self, state: StateDict, local_groups: Sequence[dict[str, Any]]) -> StateDict:
        """A checkpoint's local state dict as the local optimizer takes it."""
        return state


@attrs.define(eq=False)
class FlatShards(WholeTensorShards):
    """This rank's segment of one flat buffer, stepped as views per piece.

    Attributes:
        sources: per param group, where each local tensor comes from
            (parameter, first element, element count).
    """

    sources: list[tuple[ChunkSource, ...]] = attrs.field(factory=list)

    grads_in_place: ClassVar[bool] = False

    def local_groups(
        self, param_groups: Sequence[dict[str, Any]], params: Sequence[torch.Tensor]
    ) -> list[dict[str, Any]]:
        """Each group's part of this rank's segment, cut into its chunks
        (views), so the local step writes straight into what is sent."""
        buffer = self.buffers[0]
        assert isinstance(self.plan.partition, FlatPartition)
        slots = group_slots(self.plan.layouts[0], self.plan.partition, self.rank)
        local = []
        for group, mine, sources in zip(param_groups, slots, self.sources, strict=True):
            view = buffer[mine[0].offset : mine[-1].stop] if mine else buffer.new_empty(0)
            sizes = [n for _, _, n in sources] or [0]
            local.append({**hyperparameters(group), "params": list(torch.split(view, sizes))})
        return local

    def local_grads(
        self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Views of the parameters' gradients, one per local tensor (see
        :func:`flat_grads`; an empty group's placeholder gets none)."""
        out: list[torch.Tensor | None] = []
        for sources in self.sources:
            out.extend(flat_grads(sources, params) if sources else [None])
        return out

    def local_sources(self, params: Sequence[torch.Tensor]) -> list[ChunkSource | None]:
        # An empty group steps one empty view (see local_groups).
        return [source for sources in self.sources for source in (sources or (None,))]

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Copy the owned pieces into this rank's segment (written in place),
        unless the parameters are views of it."""
        if not self.bucket_view:
            pack(self.buffers[0], self.plan.layouts[0].slots[self.rank], params)

    def pack_own(self, params: Sequence[torch.Tensor]) -> None:
        # The local step wrote this rank's segment in place: nothing to pack.
        pass

    def saved_state(self, state: StateDict) -> StateDict:
        """One tensor per group (the chunks merged), whatever the chunking."""
        return merge_chunk_state(state)

    def loaded_state(self, state: StateDict, local_groups: Sequence[dict[str, Any]]) -> StateDict:
        chunks = [[p.numel() for p in g["params"]] for g in local_groups]
        return split_chunk_state(state, chunks)


@attrs.define(eq=False)
class HookDrivenShards(WholeTensorShards):
    """Whole parameters stepped by the overlap hook during backward: until
    DDP fixes its buckets this rank owns every parameter, then its buckets'."""

    stepped_by_hook: ClassVar[bool] = True


Shards = WholeTensorShards
"""Any of the three modes (the two others refine the whole-tensor one)."""


def flat_sources(
    plan: ShardPlan, rank: int, itemsize: int, cache_sized: bool
) -> list[tuple[ChunkSource, ...]]:
    """Per param group, what each tensor ``rank``'s local optimizer steps
    under a flat ``plan`` holds (see :func:`~zerofn.zero.planning.chunks.chunk_sources`):
    the owner's, and its carrier's copy's, cut alike."""
    if len(plan.layouts) > 1:
        raise AssertionError("a flat partition spans a single device/dtype buffer")
    if not plan.layouts:
        raise ValueError("partition='flat' needs at least one parameter that requires grad")
    assert isinstance(plan.partition, FlatPartition)
    slots = group_slots(plan.layouts[0], plan.partition, rank)
    return [chunk_sources(mine, itemsize, cache_sized) for mine in slots]


def flat_grads(
    sources: Sequence[ChunkSource], params: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """One param group's gradients for the tensors ``sources`` name: views
    of the parameters' gradients. A group none of whose parameters has a
    gradient sits the step out (all ``None``); within a group, a parameter
    without one counts as zeros (the group's tensors step together)."""
    if all(params[param].grad is None for param, _, _ in sources):
        return [None] * len(sources)
    out: list[torch.Tensor | None] = []
    for param, start, numel in sources:
        grad = params[param].grad
        if grad is None:
            out.append(params[param].new_zeros(numel))
        else:
            out.append(grad.detach().reshape(-1)[start : start + numel])
    return out


def chunking(
    params: Sequence[torch.Tensor], step_dtype: torch.dtype, options: Mapping[str, Any]
) -> tuple[int, bool]:
    """How a flat shard is cut: the bytes per element the local optimizer
    steps (``step_dtype``'s), and whether into cache-sized chunks."""
    # torch.optim's per-tensor loop (the CPU default) steps a flat shard
    # twice as fast cut into cache-sized chunks; foreach and fused kernels
    # do not gain from that (see zerofn.zero.planning.chunks).
    cache_sized = (
        params[0].device.type == "cpu" and not options.get("foreach") and not options.get("fused")
    )
    return torch.empty((), dtype=step_dtype).element_size(), cache_sized


def shards_for(
    plan: ShardPlan,
    rank: int,
    params: Sequence[torch.Tensor],
    *,
    bucket_view: bool,
    stepped_by_hook: bool,
    step_dtype: torch.dtype,
    options: Mapping[str, Any],
    rebuilt: bool = False,
) -> Shards:
    """How rank ``rank`` holds its shard under ``plan``: the mode's record and
    its exchange buffers (built here, from the parameters' values).

    Args:
        plan: who owns what.
        rank: this rank.
        params: every parameter, in the optimizer's order; handed over: with
            ``bucket_view`` they become views of the buffers.
        bucket_view: make the parameters views of the exchange buffers.
        stepped_by_hook: the overlap hook steps the shard (no buffers).
        step_dtype: the dtype the local optimizer steps (the masters', when
            kept): it sets how a flat shard is cut into chunks.
        options: the local optimizer's keyword arguments (``foreach`` and
            ``fused`` kernels step a flat shard uncut).
        rebuilt: buffers existed before (see :func:`build_buffers`).
    """
    if stepped_by_hook:
        return HookDrivenShards(plan, rank, False, [])
    buffers = build_buffers(plan, params, bucket_view, rebuilt)
    if not isinstance(plan.partition, FlatPartition):
        return WholeTensorShards(plan, rank, bucket_view, buffers)
    sources = flat_sources(plan, rank, *chunking(params, step_dtype, options))
    return FlatShards(plan, rank, bucket_view, buffers, sources)
