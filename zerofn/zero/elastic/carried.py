"""The copy of another rank's shard that each rank steps beside its own
(``redundancy=2``): who carries whose, and the carried copy itself.

Rank ``r``'s shard (its optimizer state) lives on ``r`` and on its *carrier*
``(r + 1) % world_size``; so every rank carries exactly one extra share, and
never its own. The plain step already hands every rank the whole averaged
gradient (DDP's all-reduce), so the carrier steps its copy from gradients it
holds, with the owner's arithmetic on tensors cut as the owner's are (whole
parameters, or a flat shard's chunks): the two copies stay bitwise equal
and nothing extra is sent. With master copies (``master_dtype``) the carried
tensors are masters too, kept from step to step as the owner keeps its own (a
parameter's low precision cannot restore them), and handed the same upcast,
unscaled and clipped gradients.

Which copies move when the world changes is :mod:`zerofn.zero.elastic.redundancy`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.zero.mixed_precision.masters import Masters
from zerofn.zero.params import hyperparameters
from zerofn.zero.planning.chunks import ChunkSource, piece_of
from zerofn.zero.planning.partition import FlatPartition, Piece
from zerofn.zero.planning.plan import ShardPlan
from zerofn.zero.shards import chunking, flat_grads, flat_sources

__all__ = [
    "CarriedShard",
    "carried_owner",
    "carried_shard",
    "carrier_of",
    "owner_sources",
    "reseed_carried",
    "step_carried",
    "write_carried_grads",
    "write_pieces",
]


def carrier_of(rank: int, world_size: int) -> int:
    """The rank that carries a copy of ``rank``'s shard: the next one, round.

    Raises:
        ValueError: a world of one rank (no other rank can carry anything).
    """
    if world_size < 2:
        raise ValueError(
            "redundancy=2 needs at least 2 ranks: a shard needs another rank to carry it"
        )
    return (rank + 1) % world_size


def carried_owner(rank: int, world_size: int) -> int:
    """The rank whose shard ``rank`` carries: the previous one, round."""
    if world_size < 2:
        raise ValueError(
            "redundancy=2 needs at least 2 ranks: a shard needs another rank to carry it"
        )
    return (rank - 1) % world_size


@attrs.frozen(eq=False)
class CarriedShard:
    """A copy of another rank's shard, stepped beside the owner's.

    Without master copies its tensors are the parameters' values, refreshed
    from the live parameters before each step (they are equal on every rank
    then). With them, its tensors are the owner's masters, kept here from
    step to step; ``masters`` pairs them with the parameters, for gradients
    going up and (when the owner is lost) values coming down.

    Attributes:
        owner: the rank whose shard this is.
        sources: per param group, what each carried tensor holds (the
            owner's local tensors', cut alike: a whole parameter, shaped as
            it is, or a flat shard's chunk, flat).
        optim: the carried optimizer, over one tensor per source; its state
            is the owner's, bit for bit.
        masters: the carried masters over the parameters (``None``: no masters).
        flat: the owner's shard is flat (its tensors are chunks, and a group
            steps as one).
    """

    owner: int
    sources: tuple[tuple[ChunkSource, ...], ...]
    optim: torch.optim.Optimizer
    masters: Masters | None = None
    flat: bool = False

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """What each carried tensor holds, in the carried optimizer's order."""
        return tuple(piece_of(source) for group in self.sources for source in group)

    @property
    def indices(self) -> tuple[int, ...]:
        """The parameters the carried tensors belong to, in the carried
        optimizer's order (one per tensor)."""
        return tuple(i for group in self.sources for i, _, _ in group)

    def tensors(self) -> list[torch.Tensor]:
        """The carried tensors, in the owner's local order."""
        return [t for g in self.optim.param_groups for t in g["params"]]


def owner_sources(
    plan: ShardPlan,
    owner: int,
    params: Sequence[torch.Tensor],
    step_dtype: torch.dtype,
    options: Mapping[str, Any],
) -> tuple[tuple[ChunkSource, ...], ...]:
    """Per param group, what each tensor ``owner``'s local optimizer steps
    holds: its whole parameters, or its flat shard's chunks (cut for
    ``step_dtype`` and the optimizer's ``options``, as the owner cuts them)."""
    partition = plan.partition
    if isinstance(partition, FlatPartition):
        itemsize, cache_sized = chunking(params, step_dtype, options)
        return tuple(flat_sources(plan, owner, itemsize, cache_sized))
    return tuple(
        tuple((i, 0, params[i].numel()) for i in group) for group in partition.assignment[owner]
    )


def _piece_value(param: torch.Tensor, source: ChunkSource, flat: bool) -> torch.Tensor:
    """The elements of ``param`` that ``source`` names (a view where it can):
    the parameter itself for a whole-tensor shard, flat elements for a chunk."""
    if not flat:
        return param.detach()
    _, start, numel = source
    return param.detach().reshape(-1)[start : start + numel]


def write_pieces(
    params: Sequence[torch.Tensor], pieces: Sequence[Piece], values: Sequence[torch.Tensor]
) -> None:
    """Write ``values`` (one per piece, any shape of its element count, cast
    to the parameter's dtype) into the parameters' elements ``pieces`` name."""
    with torch.no_grad():
        for piece, value in zip(pieces, values, strict=True):
            param = params[piece.param]
            if piece.start == 0 and piece.numel == param.numel():
                param.copy_(value.reshape(param.shape))
            elif param.is_contiguous():
                param.view(-1)[piece.start : piece.stop].copy_(value.reshape(-1))
            else:  # a strided parameter has no flat view: write it whole
                whole = param.reshape(-1).clone()
                whole[piece.start : piece.stop] = value.reshape(-1)
                param.copy_(whole.view_as(param))


def carried_shard(
    plan: ShardPlan,
    rank: int,
    groups: Sequence[dict[str, Any]],
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    master_dtype: torch.dtype | None = None,
) -> CarriedShard:
    """The copy ``rank`` carries under ``plan``: the shard of
    :func:`carried_owner`, over fresh copies of its tensors (in
    ``master_dtype``, if given: the owner's masters as it makes them),
    cut and grouped as the owner's local optimizer's (same options, same
    order)."""
    owner = carried_owner(rank, plan.world_size)
    params = [p for g in groups for p in g["params"]]
    flat = isinstance(plan.partition, FlatPartition)
    step_dtype = master_dtype or params[0].dtype
    sources = owner_sources(plan, owner, params, step_dtype, defaults)
    views = [[_piece_value(params[s[0]], s, flat) for s in group] for group in sources]
    local_groups = [
        {**hyperparameters(g), "params": [v.to(step_dtype, copy=True) for v in group_views]}
        for g, group_views in zip(groups, views, strict=True)
    ]
    optim = optimizer_class(local_groups, **defaults)
    masters = None
    if master_dtype is not None:
        copies = tuple(t for g in local_groups for t in g["params"])
        masters = Masters(tuple(v for group in views for v in group), copies, master_dtype)
    return CarriedShard(owner, sources, optim, masters, flat)


def _carried_grads(
    carried: CarriedShard, params: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """This step's gradient of each carried tensor, as the owner's tensor
    gets it: a whole parameter's own, or a chunk's by the flat rule
    (:func:`~zerofn.zero.shards.flat_grads`)."""
    if carried.flat:
        return [g for group in carried.sources for g in flat_grads(group, params)]
    return [params[i].grad for i in carried.indices]


def write_carried_grads(
    carried: CarriedShard, params: Sequence[torch.Tensor], unscale: float = 1.0
) -> None:
    """Give the carried masters their gradients as the owner's masters get
    them (upcast, times ``unscale``; one that has a gradient keeps it).
    Without masters nothing is handed before the step."""
    if carried.masters is not None:
        carried.masters.write_grads(_carried_grads(carried, params), unscale)


def step_carried(carried: CarriedShard, params: Sequence[torch.Tensor]) -> None:
    """Step the carried copy as its owner steps its shard, with the same
    gradients: the parameters' (DDP's average, on every rank), or with
    masters the ones written for them (:func:`write_carried_grads`, clipped as
    the owner's were). Without masters its values are first set to the
    parameters' (equal on every rank before the step). A tensor without a
    gradient sits out, as it does on the owner."""
    if carried.masters is not None:
        write_carried_grads(carried, params)
        carried.optim.step()
        carried.masters.drop_grads()
        return
    _take_values(carried, params)
    for tensor, grad in zip(carried.tensors(), _carried_grads(carried, params), strict=True):
        tensor.grad = None if grad is None else grad.clone().view_as(tensor)
    carried.optim.step()
    for tensor in carried.tensors():
        tensor.grad = None


def reseed_carried(
    carried: CarriedShard, params: Sequence[torch.Tensor], *, keep_consistent: bool = False
) -> None:
    """Take the carried values from the parameters after a write from
    outside the step, as the owner re-derives its own (``keep_consistent``:
    see :meth:`~zerofn.zero.mixed_precision.masters.Masters.reseed`)."""
    if carried.masters is not None:
        carried.masters.reseed(keep_consistent=keep_consistent)
        return
    _take_values(carried, params)


def _take_values(carried: CarriedShard, params: Sequence[torch.Tensor]) -> None:
    """Set the carried tensors (no masters) to their parameters' values."""
    sources = [s for group in carried.sources for s in group]
    with torch.no_grad():
        for tensor, source in zip(carried.tensors(), sources, strict=True):
            tensor.copy_(_piece_value(params[source[0]], source, carried.flat).view_as(tensor))
