"""How a rank holds and steps its shard: the ZeRO optimizer's three modes.

``ZeroRedundancyOptimizer.step`` is the same sequence in every mode: hand
the local optimizer this step's gradients, step it, exchange the updated
shards, write them into the parameters. What differs is what the local
optimizer steps, where its gradients come from and how updates reach the
parameters, and each mode is one class here:

* :class:`WholeTensorShards` (greedy, balanced, manual partitions): the
  local optimizer steps the owned parameters themselves, which hold their
  own ``.grad``; the owned values are packed into the exchange buffers
  before the exchange, the others' unpacked after it.
* :class:`FlatShards` (the flat partition): the local optimizer steps views
  of this rank's segment of the single buffer, one per piece of a parameter
  (cut into cache-sized chunks for ``torch.optim``'s per-tensor CPU loop,
  see :mod:`zerofn.zero.chunks`), whose gradients are views of the parameters'
  ``.grad``: nothing is gathered; the local step writes straight into
  what the exchange sends.
* :class:`HookDrivenShards` (``overlap_with_ddp=True``): whole tensors and
  no exchange buffers; the overlap hook steps them during backward and
  moves the updates itself.

Each is built from the plan, which says who owns what (the core decided
it); none of them works ownership out again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from zerofn.zero.chunks import ChunkSource, chunk_sources, merge_chunk_state, split_chunk_state
from zerofn.zero.exchange import ExchangeVia, exchange_program, group_slots, pack, unpack
from zerofn.zero.partition import FlatPartition
from zerofn.zero.plan import ShardPlan
from zerofn_torch.comm import drive

__all__ = ["FlatShards", "HookDrivenShards", "Shards", "WholeTensorShards", "build_buffers"]

StateDict = dict[str, Any]


def _hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def build_buffers(
    plan: ShardPlan, params: Sequence[torch.Tensor], bucket_view: bool, rebuilt: bool
) -> list[torch.Tensor]:
    """One exchange buffer per layout, holding the parameters' current values;
    with ``bucket_view``, every trainable parameter that fits in one span
    becomes a view of its place.

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
            {**_hyperparams(g), "params": [params[i] for i in indices]}
            for g, indices in zip(param_groups, owned, strict=True)
        ]

    def local_grads(
        self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """This step's gradient of each local tensor."""
        return [t.grad for t in local]

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Bring what the local optimizer steps up to date with the
        parameters (which the user may have written since the last step)."""

    def send(
        self, params: Sequence[torch.Tensor], group: Any, via: ExchangeVia
    ) -> torch.futures.Future[None]:
        """Start sending this rank's updated shard to every rank and
        receiving theirs: the core's exchange program, driven here."""
        if not self.bucket_view:
            for layout, buffer in zip(self.plan.layouts, self.buffers, strict=True):
                pack(buffer, layout.slots[self.rank], params)
        program = exchange_program(self.plan.layouts, self.buffers, self.rank, via)
        return drive(program, group, "the ZeRO step's exchange of updated shards")

    def receive(self, params: Sequence[torch.Tensor], sent: torch.futures.Future[None]) -> None:
        """Wait for the exchange and write what arrived into the parameters
        (with bucket views it already landed in them)."""
        sent.wait()
        if self.bucket_view:
            return
        for layout, buffer in zip(self.plan.layouts, self.buffers, strict=True):
            arrived = [s for r, rs in enumerate(layout.slots) for s in rs if r != self.rank]
            unpack(buffer, arrived, params)

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

    @classmethod
    def build(
        cls,
        plan: ShardPlan,
        rank: int,
        bucket_view: bool,
        buffers: list[torch.Tensor],
        itemsize: int,
        cache_sized: bool,
    ) -> FlatShards:
        """The flat mode's shards, its chunks cut for ``itemsize`` bytes per
        element (``cache_sized``: for the per-tensor CPU loop)."""
        if len(plan.layouts) > 1:
            raise AssertionError("a flat partition spans a single device/dtype buffer")
        if not plan.layouts:
            raise ValueError("partition='flat' needs at least one parameter that requires grad")
        assert isinstance(plan.partition, FlatPartition)
        slots = group_slots(plan.layouts[0], plan.partition, rank)
        sources = [chunk_sources(mine, itemsize, cache_sized) for mine in slots]
        return cls(plan, rank, bucket_view, buffers, sources)

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
            local.append({**_hyperparams(group), "params": list(torch.split(view, sizes))})
        return local

    def local_grads(
        self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Views of the parameters' gradients, one per local tensor. A group
        none of whose parameters has a gradient sits the step out; within a
        group, a parameter without one counts as zeros."""
        out: list[torch.Tensor | None] = []
        for sources in self.sources:
            if not sources or all(params[param].grad is None for param, _, _ in sources):
                out.extend([None] * max(1, len(sources)))
                continue
            for param, start, numel in sources:
                grad = params[param].grad
                if grad is None:
                    out.append(params[param].new_zeros(numel))
                else:
                    out.append(grad.detach().reshape(-1)[start : start + numel])
        return out

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        if not self.bucket_view:
            pack(self.buffers[0], self.plan.layouts[0].slots[self.rank], params)

    def send(
        self, params: Sequence[torch.Tensor], group: Any, via: ExchangeVia
    ) -> torch.futures.Future[None]:
        # The local step wrote this rank's segment in place: nothing to pack.
        program = exchange_program(self.plan.layouts, self.buffers, self.rank, via)
        return drive(program, group, "the ZeRO step's exchange of updated shards")

    def receive(self, params: Sequence[torch.Tensor], sent: torch.futures.Future[None]) -> None:
        sent.wait()
        if not self.bucket_view:
            unpack(self.buffers[0], [s for rs in self.plan.layouts[0].slots for s in rs], params)

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

    def send(
        self, params: Sequence[torch.Tensor], group: Any, via: ExchangeVia
    ) -> torch.futures.Future[None]:
        raise RuntimeError("the overlap hook moves the updated shards, not step()")


Shards = WholeTensorShards
"""Any of the three modes (the two others refine the whole-tensor one)."""
