"""The structural plan of a ZeRO optimizer: who owns what, and how shards travel.

A :class:`ShardPlan` bundles the partition with the exchange buffers derived
from it. It is rebuilt, never edited: a new param group or a change in which
parameters are trainable yields a new plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import attrs

from zerofn.zero.planning.layout import BufferLayout, buffer_layouts
from zerofn.zero.planning.partition import (
    FlatPartition,
    Partition,
    PartitionMode,
    balanced_partition,
    flat_partition,
    greedy_partition,
    manual_partition,
)

__all__ = ["PlanMode", "ShardPlan", "plan_shards", "with_trainable"]

PlanMode = Literal["greedy", "balanced", "flat", "manual"]
"""How a plan's partition was made: a :data:`~zerofn.zero.planning.partition.PartitionMode`,
or ``"manual"`` for a partition given rank by rank."""


def _strs(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _flags(values: Iterable[bool]) -> tuple[bool, ...]:
    return tuple(bool(v) for v in values)


@attrs.frozen
class ShardPlan:
    """Partition plus exchange layout for one optimizer.

    Attributes:
        mode: how the partition was made (``"manual"`` for a given one).
        partition: the ownership of parameters (or of element ranges).
        keys: device/dtype key of every global parameter.
        trainable: which global parameters are trained.
        layouts: one exchange buffer per key (see :func:`buffer_layouts`):
            derived from the others at construction, never passed.

    Raises:
        ValueError: at construction, when ``keys`` or ``trainable`` do not
            name every parameter of the partition.
    """

    mode: PlanMode = attrs.field(validator=attrs.validators.in_(get_args(PlanMode)))
    partition: Partition | FlatPartition
    keys: tuple[str, ...] = attrs.field(converter=_strs)
    trainable: tuple[bool, ...] = attrs.field(converter=_flags)
    layouts: tuple[BufferLayout, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        count = sum(len(group) for group in self.partition.group_sizes)
        if len(self.keys) != count or len(self.trainable) != count:
            raise ValueError(
                f"a plan needs a key and a trainable flag for each of its {count} parameters, "
                f"got {len(self.keys)} keys and {len(self.trainable)} flags"
            )
        # Frozen: the one assignment, at construction, of what the fields imply.
        pieces = [self.partition.pieces_of(r) for r in range(self.world_size)]
        object.__setattr__(self, "layouts", buffer_layouts(pieces, self.keys, self.trainable))

    @property
    def world_size(self) -> int:
        """Number of ranks the plan shards across."""
        return self.partition.world_size


def _check_trainable_owned(partition: Partition, trainable: Sequence[bool], changed: bool) -> None:
    """Refuse a manual partition that gives a trainable parameter to no rank.

    Leaving a parameter out is how a manual partition says "frozen" (as
    PyTorch's ``params_per_rank`` allows); a trainable one left out would be
    stepped by no rank, silently, so it is an error.

    Args:
        partition: the manual partition.
        trainable: whether each global parameter is trained.
        changed: the mask changed after the partition was made (the remedy
            is then a new optimizer).

    Raises:
        ValueError: naming the global indices of the parameters left out.
    """
    left_out = [
        index
        for index, (owner, trained) in enumerate(zip(partition.owners, trainable, strict=True))
        if trained and owner == -1
    ]
    if not left_out:
        return
    remedy = (
        "build a new optimizer whose partition lists them, or set requires_grad=False on them again"
        if changed
        else "list each in exactly one rank's entry, or set requires_grad=False on those "
        "meant to stay frozen"
    )
    raise ValueError(
        f"the manual partition gives no rank the parameter(s) at global index "
        f"{', '.join(map(str, left_out))} (their position among the parameters passed to "
        f"the optimizer), which {'now ' if changed else ''}require grad, so none would ever "
        f"be updated: {remedy}"
    )


def plan_shards(
    group_sizes: Sequence[Sequence[int]],
    keys: Sequence[str],
    trainable: Sequence[bool],
    world_size: int,
    mode: PartitionMode = "greedy",
    params_per_rank: Sequence[Sequence[int]] | None = None,
) -> ShardPlan:
    """Partition the parameters and lay out their exchange buffers.

    Args:
        group_sizes: element count of every parameter, per param group.
        keys: device/dtype key of every global parameter.
        trainable: whether each global parameter is trained.
        world_size: number of ranks.
        mode: ``"greedy"`` (PyTorch's), ``"balanced"`` or ``"flat"``; ignored
            when ``params_per_rank`` is given.
        params_per_rank: a manual partition (global indices per rank).

    Returns:
        The :class:`ShardPlan`. A flat plan splits only trainable parameters:
        frozen ones count as empty, as no rank updates them.

    Raises:
        ValueError: for an unknown mode or a bad manual partition (see
            :func:`manual_partition`; one that leaves a trainable parameter to
            no rank, too), or mismatched lengths.
    """
    if params_per_rank is not None:
        manual = manual_partition(group_sizes, world_size, params_per_rank)
        plan = ShardPlan("manual", manual, keys, trainable)  # refuses keys or flags amiss first
        _check_trainable_owned(manual, trainable, changed=False)
        return plan
    partition: Partition | FlatPartition
    if mode == "greedy":
        partition = greedy_partition(group_sizes, world_size)
    elif mode == "balanced":
        partition = balanced_partition(group_sizes, world_size)
    elif mode == "flat":
        flags = iter(trainable)  # a flag short: the plan refuses the lengths
        trained_sizes = [[n if next(flags, False) else 0 for n in group] for group in group_sizes]
        partition = flat_partition(trained_sizes, world_size)
    else:
        raise ValueError(
            f"unknown partition mode {mode!r}; choose 'greedy', 'balanced' or 'flat', "
            "or pass params_per_rank"
        )
    return ShardPlan(mode, partition, keys, trainable)


def with_trainable(plan: ShardPlan, trainable: Sequence[bool]) -> ShardPlan:
    """The same partition with exchange buffers for a new trainable mask.

    Raises:
        ValueError: for a flat plan, whose cut depends on the mask: build a
            new optimizer (or use a whole-tensor mode) to change trainability;
            for a manual plan that gives a parameter now trainable to no rank.
    """
    if isinstance(plan.partition, FlatPartition):
        raise ValueError(
            "partition='flat' cannot follow a change in which parameters require grad; "
            "create a new optimizer, or use partition='greedy' or 'balanced'"
        )
    if plan.mode == "manual":
        _check_trainable_owned(plan.partition, trainable, changed=True)
    return attrs.evolve(plan, trainable=trainable)
