"""Model averaging and local SGD as pure schedules over a step counter.

Local SGD lets every rank train on its own for a while and then averages the
*parameters* across ranks, instead of averaging gradients at every step.
Everything that decides *when* to average, and *with whom*, is a pure function
of an integer here:

* :class:`PeriodicSchedule`: average every ``period`` steps once
  ``warmup_steps`` have passed (PyTorch's ``PeriodicModelAverager``).
* :class:`HierarchicalSchedule`: several levels, each a period and a group
  size; a step averages at the highest level whose period divides it
  (PyTorch's ``HierarchicalModelAverager``).
* :class:`PostLocalSGDSchedule`: which group a DDP gradient bucket is
  all-reduced in (the whole world during warm-up, a subgroup or nobody after),
  as PyTorch's ``post_localSGD_hook`` decides it.

:class:`AveragerState` and :class:`LocalSGDState` are the counters; the
transitions :func:`take_averaging_step` and :func:`take_bucket` return new
records. :func:`average_program` is the averaging itself as a communication
program (see ``zerofn.comm``): one all-reduce of all tensors packed flat.

The records are validated when built and raise PyTorch's exception types
(``ValueError``) for bad periods, warm-ups and group sizes, before the adapter
creates any process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias, TypeVar

import attrs
import torch

from zerofn.comm import AllReduce, Program

__all__ = [
    "AveragerState",
    "GradientSync",
    "HierarchicalSchedule",
    "Level",
    "LocalSGDState",
    "PeriodicSchedule",
    "PostLocalSGDSchedule",
    "Schedule",
    "average_program",
    "averager_state_from_dict",
    "local_sgd_state_from_dict",
    "take_averaging_step",
    "take_bucket",
]


# ----- validation helpers -------------------------------------------------------


def _require_int(name: str, value: object) -> None:
    # bool is an int subclass, but True as a period is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Arg ``{name}`` must be an int, got {type(value).__name__}")


def _int_at_least(floor: int, name: str, what: str) -> Any:
    """A validator of an int ``name`` of at least ``floor``, refused in
    PyTorch's words (``what``: "a positive value", ...)."""

    def check(_: object, __: object, value: object) -> None:
        _require_int(name, value)
        assert isinstance(value, int)
        if value < floor:
            raise ValueError(f"Arg ``{name}`` must be {what}, got {value}.")

    return check


def _positive(name: str) -> Any:
    return _int_at_least(1, name, "a positive value")


def _non_negative(name: str) -> Any:
    return _int_at_least(0, name, "a non-negative number")


# ----- when to average ----------------------------------------------------------


@attrs.frozen
class PeriodicSchedule:
    """Average every ``period`` steps, counting from the end of the warm-up.

    Steps count from 0. Step ``s`` averages when ``s >= warmup_steps`` and
    ``(s - warmup_steps) % period == 0``: so the first step after the warm-up
    always averages, then every ``period``-th one.

    Attributes:
        period: steps between two averagings; at least 1.
        warmup_steps: steps at the start that never average; at least 0.

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
        TypeError: either is not an int.
    """

    period: int = attrs.field(validator=_positive("period"))
    warmup_steps: int = attrs.field(default=0, validator=_non_negative("warmup_steps"))

    @property
    def redundant_with_ddp(self) -> bool:
        """Whether it averages at every step, costing at least as much as DDP's
        gradient all-reduce (PyTorch warns about this)."""
        return self.period == 1

    def level_at(self, step: int) -> int | None:
        """``0`` if step ``step`` averages (over the whole group), else ``None``."""
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            return 0
        return None


@attrs.frozen
class Level:
    """One level of a hierarchy: groups of ``group_size`` ranks that average
    every ``period`` steps (unless a higher level averages at that step).

    Attributes:
        period: steps between this level's averagings; at least 1.
        group_size: ranks per group; at least 1.
    """

    period: int = attrs.field(validator=_positive("period"))
    group_size: int = attrs.field(validator=_positive("group_size"))


def _levels(value: Mapping[int, int] | Sequence[Level] | None) -> tuple[Level, ...]:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        return tuple(Level(period, size) for period, size in value.items())
    return tuple(value)


def _check_levels(levels: tuple[Level, ...], world_size: int) -> None:
    if not levels:
        raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
    periods = [level.period for level in levels]
    # PyTorch assumes ascending keys (it warns about the *last* one as the
    # maximum, and searches from the last one down); with any other order a
    # smaller period would shadow a larger one, so refuse it.
    if periods != sorted(set(periods)):
        raise ValueError(
            f"The periods in arg ``period_group_size_dict`` must be strictly increasing, "
            f"got {periods}."
        )
    for level in levels:
        if level.group_size > world_size or world_size % level.group_size:
            raise ValueError(
                f"The group size {level.group_size} (period {level.period}) in arg "
                f"``period_group_size_dict`` must divide the size of the process group "
                f"({world_size})."
            )
    if levels[-1].group_size != world_size:
        raise ValueError(
            f"The last value in arg ``period_group_size_dict`` {levels[-1].group_size} "
            f"must be equal to the size of arg ``process_group`` {world_size}."
        )


@attrs.frozen
class HierarchicalSchedule:
    """Average at several levels, each with its own period and group size.

    After the warm-up, step ``s`` averages at the highest level whose period
    divides ``s`` (the step itself, not the steps since the warm-up, as in
    PyTorch), and at no other: a higher level's groups contain the lower
    ones', so averaging those too would be redundant.

    Attributes:
        levels: the levels, by strictly increasing period; the last one's
            group is the whole process group. A ``{period: group_size}``
            mapping (PyTorch's ``period_group_size_dict``) converts.
        world_size: size of the whole process group.
        warmup_steps: steps at the start that never average; at least 0.

    Raises:
        ValueError: no levels; a period or group size below 1; periods not
            strictly increasing; a group size that does not divide
            ``world_size``; a last group size other than ``world_size``;
            ``warmup_steps < 0``.
        TypeError: a period, group size or ``warmup_steps`` is not an int.
    """

    levels: tuple[Level, ...] = attrs.field(converter=_levels)
    world_size: int = attrs.field(validator=_positive("world_size"))
    warmup_steps: int = attrs.field(default=0, validator=_non_negative("warmup_steps"))

    def __attrs_post_init__(self) -> None:
        # The levels are checked against world_size, so only once that has
        # passed its own validator (attrs runs validators before this).
        _check_levels(self.levels, self.world_size)

    @property
    def redundant_with_ddp(self) -> bool:
        """Whether even the largest period is 1 (PyTorch warns about this)."""
        return self.levels[-1].period == 1

    def level_at(self, step: int) -> int | None:
        """Index of the level that averages at step ``step``, or ``None``."""
        if step < self.warmup_steps:
            return None
        for index in reversed(range(len(self.levels))):
            if step % self.levels[index].period == 0:
                return index
        return None


Schedule: TypeAlias = PeriodicSchedule | HierarchicalSchedule
"""Any averaging schedule."""


@attrs.frozen
class AveragerState:
    """An averager's position: the number of steps taken so far.

    Attributes:
        step: steps taken; the next call averages according to this value.
    """

    step: int = attrs.field(default=0, validator=_non_negative("step"))

    def state_dict(self) -> dict[str, int]:
        """The state as a plain dict (safe for ``torch.load(weights_only=True)``)."""
        return attrs.asdict(self)


C = TypeVar("C", "AveragerState", "LocalSGDState")


def _counter_from_dict(record: type[C], whose: str, state_dict: Mapping[str, Any]) -> C:
    """``record`` (a one-counter record) from its ``state_dict()``.

    Raises:
        ValueError: ``state_dict`` lacks the counter, or it is negative.
        TypeError: the counter is not an int.
    """
    (key,) = attrs.fields_dict(record)
    if key not in state_dict:
        raise ValueError(f"{whose} state dict needs a {key!r} entry; got {sorted(state_dict)}")
    return record(state_dict[key])


def averager_state_from_dict(state_dict: Mapping[str, Any]) -> AveragerState:
    """The :class:`AveragerState` saved by :meth:`AveragerState.state_dict`
    (errors as :func:`_counter_from_dict`'s)."""
    return _counter_from_dict(AveragerState, "an averager", state_dict)


def take_averaging_step(
    schedule: Schedule, state: AveragerState
) -> tuple[AveragerState, int | None]:
    """One step of an averager: the next state, and the level to average at now.

    Returns:
        ``(state after the step, level index or None)``; ``None`` means no
        averaging at this step.
    """
    return AveragerState(state.step + 1), schedule.level_at(state.step)


# ----- post-local SGD: which group reduces gradients ----------------------------

GradientSync: TypeAlias = Literal["global", "subgroup", "none"]
"""Where a bucket's gradients are averaged: the whole process group, the
rank's subgroup, or nowhere (each rank keeps its own)."""


@attrs.frozen
class PostLocalSGDSchedule:
    """When DDP's gradient averaging switches from global to local.

    Attributes:
        start_localSGD_iter: iterations that average gradients globally, as
            plain DDP does; afterwards only within the subgroup (or not at all).
        post_local_gradient_allreduce: whether to average within the subgroup
            after the switch; if ``False``, each rank keeps its own gradients.

    Raises:
        ValueError: ``start_localSGD_iter < 0``.
        TypeError: ``start_localSGD_iter`` is not an int.
    """

    start_localSGD_iter: int = attrs.field(validator=_non_negative("start_localSGD_iter"))
    post_local_gradient_allreduce: bool = True

    def sync_at(self, iteration: int) -> GradientSync:
        """Where a bucket of iteration ``iteration`` is averaged."""
        if iteration < self.start_localSGD_iter:
            return "global"
        return "subgroup" if self.post_local_gradient_allreduce else "none"


@attrs.frozen
class LocalSGDState:
    """The post-local SGD hook's position: iterations completed, counted up to
    ``start_localSGD_iter`` only (like PyTorch's, it stops counting there).

    Attributes:
        iter: completed iterations, at most ``start_localSGD_iter``.
    """

    iter: int = attrs.field(default=0, validator=_non_negative("iter"))

    def state_dict(self) -> dict[str, int]:
        """As :meth:`AveragerState.state_dict`."""
        return attrs.asdict(self)


def local_sgd_state_from_dict(state_dict: Mapping[str, Any]) -> LocalSGDState:
    """The :class:`LocalSGDState` saved by :meth:`LocalSGDState.state_dict`
    (errors as :func:`_counter_from_dict`'s)."""
    return _counter_from_dict(LocalSGDState, "a post-local SGD", state_dict)


def take_bucket(
    schedule: PostLocalSGDSchedule, state: LocalSGDState, is_last: bool
) -> tuple[LocalSGDState, GradientSync]:
    """One DDP bucket through the post-local SGD hook.

    The bucket is averaged according to the iteration count *before* it; the
    count advances on an iteration's last bucket, during the global phase only.

    Args:
        schedule: the hook's configuration.
        state: the count before this bucket.
        is_last: whether this is the iteration's last bucket.

    Returns:
        ``(state after the bucket, where to average the bucket)``.
    """
    sync = schedule.sync_at(state.iter)
    if sync == "global" and is_last:
        return LocalSGDState(state.iter + 1), sync
    return state, sync


# ----- averaging itself ---------------------------------------------------------


def average_program(
    tensors: Sequence[torch.Tensor], world_size: int
) -> Program[tuple[torch.Tensor, ...]]:
    """Average ``tensors`` across ranks with one all-reduce.

    The tensors are packed into one flat tensor (mixed dtypes promote, as in
    ``torch.cat``), divided by ``world_size`` before the sum so that low
    precision does not overflow, and unpacked to their own shapes and dtypes.
    The same arithmetic as PyTorch's ``average_parameters``, so the results
    are bitwise equal. ``tensors`` are only read.

    Args:
        tensors: this rank's tensors; every rank passes the same shapes and
            dtypes in the same order.
        world_size: ranks taking part.

    Returns:
        A program whose result is the averaged tensors, in order; no request
        at all when ``tensors`` is empty.
    """
    if not tensors:
        return ()
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    (total,) = yield AllReduce((flat / world_size,), "sum", last=True)
    parts = torch.split(total, [t.numel() for t in tensors])
    return tuple(part.view_as(t).to(t.dtype) for part, t in zip(parts, tensors, strict=True))
