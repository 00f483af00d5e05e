"""Model averaging and post-local SGD: PyTorch's names over zerofn's schedules.

Drop-ins for ``torch.distributed.algorithms.model_averaging`` and
``torch.distributed.optim.PostLocalSGDOptimizer``::

    from zerofn_torch.averaging import PeriodicModelAverager, PostLocalSGDOptimizer

    opt = PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        PeriodicModelAverager(period=4, warmup_steps=100),
    )

Each averager holds a pure schedule (:mod:`zerofn.averaging`), the
:class:`zerofn.averaging.AveragerState` counter and its process groups. A call
asks the schedule whether, and at which level, this step averages, runs the
core's averaging program on that level's group and copies the result into the
parameters. The averagers subclass PyTorch's ``ModelAverager``, so PyTorch's
own ``PostLocalSGDOptimizer`` accepts them too, and their ``state_dict()``
holds plain integers only (loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from zerofn.averaging import (
    AveragerState,
    HierarchicalSchedule,
    PeriodicSchedule,
    average_program,
    averager_state_from_dict,
    take_averaging_step,
)
from zerofn_torch.diloco import DiLoCoOptimizer
from zerofn_torch.runtime.driver import drive
from zerofn_torch.runtime.wrapped_optimizer import WrappedOptimizer, carries_copies
from zerofn_torch.zero.forward_gather import wait_for_gathers

__all__ = [
    "DiLoCoOptimizer",
    "HierarchicalModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "get_params_to_average",
]

ParamsOrGroups = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
S = TypeVar("S", PeriodicSchedule, HierarchicalSchedule)


# ----- averaging parameters -----------------------------------------------------


def _is_member(group: Any) -> bool:
    # get_rank answers -1 on a rank outside ``group`` (PyTorch skips those ranks).
    return bool(dist.get_rank(group) >= 0)


def average_parameters(params: Iterable[torch.Tensor], process_group: Any) -> None:
    """Average ``params`` across ``process_group`` with one all-reduce.

    The parameters are packed into one flat tensor, averaged and copied back
    in place, so each keeps its own storage (PyTorch instead points them into
    the flat buffer, which breaks views other code holds, such as a ZeRO
    optimizer's bucket views). A rank outside the group returns at once; an
    empty ``params`` communicates nothing.

    Args:
        params: the tensors to average; every rank passes the same shapes and
            dtypes in the same order.
        process_group: the group to average over (``None``: the world).

    Raises:
        zerofn.errors.CollectiveError: the all-reduce failed (a peer died or
            timed out); the parameters are unchanged.
    """
    wait_for_gathers()  # a ZeRO exchange still behind the forward writes them
    group = process_group if process_group is not None else dist.group.WORLD
    if not _is_member(group):
        return
    params = list(params)
    program = average_program(params, dist.get_world_size(group))
    # The parameters were just written by kernels that may still be running on
    # an accelerator; the collective must read their final values.
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    purpose = f"averaging {len(params)} parameters"
    averaged = drive(program, group, purpose).wait()  # raises CollectiveError: params untouched
    with torch.no_grad():
        for param, value in zip(params, averaged, strict=True):
            param.copy_(value)


def get_params_to_average(params: ParamsOrGroups) -> list[torch.Tensor]:
    """The parameters that have a gradient, from a model's parameters or an
    optimizer's param groups (parameters without one did not train).

    Args:
        params: tensors, or param-group dicts with a ``"params"`` list.

    Returns:
        The tensors with a ``.grad``, in order.

    Raises:
        NotImplementedError: an entry is neither a tensor nor a dict.
    """
    selected = []
    for entry in params:
        if isinstance(entry, torch.Tensor):
            candidates = [entry]
        elif isinstance(entry, dict):
            candidates = list(entry["params"])
        else:
            raise NotImplementedError(f"Parameter input of type {type(entry)} is not supported")
        selected += [p for p in candidates if p.grad is not None]
    return selected


def average_parameters_or_parameter_groups(params: ParamsOrGroups, process_group: Any) -> None:
    """Average a model's parameters, or an optimizer's param groups, across
    ``process_group``; only parameters with a gradient take part.

    Args:
        params: tensors, or param-group dicts with a ``"params"`` list.
        process_group: the group to average over (``None``: the world).

    Raises:
        NotImplementedError: an entry is neither a tensor nor a dict.
    """
    average_parameters(get_params_to_average(params), process_group)


# ----- averagers ----------------------------------------------------------------


class _ScheduledAverager(ModelAverager, Generic[S]):
    """An averager driven by a pure schedule: the shared shell of both kinds.

    Subclasses give the schedule (one that averages at every step is warned
    about, as PyTorch does) and set one process group per level.
    """

    _groups: tuple[Any, ...]

    def __init__(self, process_group: Any | None, schedule: S) -> None:
        if schedule.redundant_with_ddp:
            warnings.warn(
                "Averaging parameters at every step costs at least as much as DDP's gradient "
                "all-reduce; use DistributedDataParallel alone instead.",
                UserWarning,
                stacklevel=3,
            )
        self._schedule: S = schedule
        self._state = AveragerState()
        super().__init__(process_group)

    @property  # type: ignore[override]
    def step(self) -> int:
        """Steps taken; PyTorch's ``PostLocalSGDOptimizer`` reads and sets it."""
        return self._state.step

    @step.setter
    def step(self, value: int) -> None:
        self._state = AveragerState(value)

    def average_parameters(self, params: ParamsOrGroups) -> None:
        """Average ``params`` if the schedule says so at this step; then count
        the step.

        Args:
            params: a model's parameters or an optimizer's param groups; only
                those with a gradient take part.

        Raises:
            NotImplementedError: an entry is neither a tensor nor a dict.
        """
        after, level = take_averaging_step(self._schedule, self._state)
        if level is not None:
            average_parameters_or_parameter_groups(params, self._groups[level])
        self._state = after

    def state_dict(self) -> dict[str, int]:
        """The averager's position, ``{"step": int}`` (safe for
        ``torch.load(weights_only=True)``)."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the step saved by :meth:`state_dict`.

        Raises:
            ValueError: ``state_dict`` has no ``"step"`` or a negative one;
                then nothing changes.
            TypeError: the step is not an int.
        """
        self._state = averager_state_from_dict(state_dict)


class PeriodicModelAverager(_ScheduledAverager[PeriodicSchedule]):
    """Average parameters every ``period`` steps after a warm-up.

    Call :meth:`average_parameters` after each optimizer step. With DDP over
    subgroups (or :func:`zerofn_torch.hooks.post_local_sgd.post_localSGD_hook`), this
    is post-local SGD. A drop-in for PyTorch's ``PeriodicModelAverager``.

    Args:
        period: steps between two averagings (1 is allowed, with a warning: DDP
            alone is cheaper).
        warmup_steps: steps at the start that never average.
        process_group: the group to average over (default: the world).

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
        TypeError: either is not an int.
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: Any | None = None):
        super().__init__(process_group, PeriodicSchedule(period, warmup_steps))
        self._groups = (self.process_group,)

    @property
    def period(self) -> int:
        """Steps between two averagings."""
        return self._schedule.period

    @property
    def warmup_steps(self) -> int:
        """Steps at the start that never average."""
        return self._schedule.warmup_steps


class HierarchicalModelAverager(_ScheduledAverager[HierarchicalSchedule]):
    """Average parameters in groups of several sizes, each with its own period.

    At a step after the warm-up, only the level with the largest period that
    divides the step averages (its groups contain the smaller levels' groups).
    Subgroups are made with ``dist.new_subgroups``, so every rank of
    ``process_group`` must construct the averager. A drop-in for PyTorch's
    ``HierarchicalModelAverager``.

    Args:
        period_group_size_dict: ``{period: group_size}`` by increasing period;
            the last group size must be the size of ``process_group``.
        warmup_steps: steps at the start that never average.
        process_group: the group that holds every level (default: the world).

    Raises:
        ValueError: the dict is empty or not by increasing period, a period or
            group size is below 1, a group size does not divide the group's
            size, the last group size is not the group's size, or
            ``warmup_steps < 0``. Nothing is created then.
        TypeError: a period, group size or ``warmup_steps`` is not an int.
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int] | None = None,
        warmup_steps: int = 0,
        process_group: Any | None = None,
    ) -> None:
        schedule = HierarchicalSchedule(
            period_group_size_dict,
            world_size=dist.get_world_size(process_group),
            warmup_steps=warmup_steps,
        )
        super().__init__(process_group, schedule)
        self._groups = tuple(
            self._level_group(level.group_size, schedule.world_size) for level in schedule.levels
        )
        self.period_process_group_dict: OrderedDict[int, Any] = OrderedDict(
            (level.period, group)
            for level, group in zip(schedule.levels, self._groups, strict=True)
        )

    def _level_group(self, group_size: int, world_size: int) -> Any:
        """This rank's group at a level; a collective (every rank makes every
        subgroup, in the same order)."""
        if group_size == world_size:
            return self.process_group
        subgroup, _ = dist.new_subgroups(  # type: ignore[no-untyped-call]
            group_size=group_size, group=self.process_group
        )
        return subgroup

    @property
    def warmup_steps(self) -> int:
        """Steps at the start that never average."""
        return self._schedule.warmup_steps


# ----- the optimizer ------------------------------------------------------------


class PostLocalSGDOptimizer(WrappedOptimizer):
    """Run any optimizer locally, then let an averager average the parameters.

    Each :meth:`step` steps ``optim`` and calls
    ``averager.average_parameters(self.param_groups)``. The state dict is the
    local optimizer's plus the averager's ``"step"``, so a resumed run neither
    repeats the warm-up nor shifts the averaging steps. A drop-in for
    PyTorch's ``PostLocalSGDOptimizer``; any ``ModelAverager`` works, PyTorch's
    included.

    Over a ``ZeroRedundancyOptimizer`` with master copies, the averaged
    values reach the masters at its next step (it notices the averaging's
    writes to the parameters it owns).

    Args:
        optim: the local optimizer.
        averager: decides when and where to average.

    Raises:
        ValueError: ``optim`` is a ``ZeroRedundancyOptimizer`` with
            ``redundancy=2``: in the local phase each rank steps from its own
            gradients, so a carrier could not step its copy as the owner does.
    """

    join_refusal = (
        "PostLocalSGDOptimizer does not run under Join: a rank that runs out of inputs early "
        "would never reach the averagings the others wait in. Give every rank the same number "
        "of steps (drop or repeat batches), or train without post-local SGD under Join"
    )

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        if carries_copies(optim):
            raise ValueError(
                "PostLocalSGDOptimizer over a ZeroRedundancyOptimizer with redundancy=2: in "
                "the local phase each rank's gradients are its own, so a carrier cannot step "
                "its copy of another rank's shard as that rank does. Build the "
                "ZeroRedundancyOptimizer with redundancy=1, or average with DDP's all-reduce"
            )
        # Deliberately no Optimizer.__init__: the wrapped optimizer owns the
        # parameters and state; this class shares its param groups.
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict with the averager's ``"step"`` added."""
        return {**self.optim.state_dict(), **self.wrapper_state_dict()}

    def wrapper_state_dict(self) -> dict[str, Any]:
        """The averager's ``"step"`` alone (the local optimizer's state aside)."""
        return {"step": self.averager.step}

    def load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the averager's step from :meth:`wrapper_state_dict`.

        Raises:
            ValueError, TypeError: a negative or non-int step.
        """
        self.averager.step = AveragerState(state["step"]).step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and the averager's step.

        A dict without ``"step"`` (a plain optimizer's) loads with a warning,
        and the averager restarts at step 0, as in PyTorch.

        Raises:
            ValueError: the step is negative (checked before anything loads).
            TypeError: the step is not an int.
        """
        if "step" not in state_dict:
            warnings.warn(
                "The state dict has no averager 'step' (it may come from a plain optimizer); "
                "the averager restarts at step 0.",
                UserWarning,
                stacklevel=2,
            )
        step = AveragerState(state_dict.get("step", 0)).step
        self.optim.load_state_dict(state_dict)
        self.averager.step = step

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Step the local optimizer, then let the averager average.

        Args:
            closure: re-evaluates the model and returns the loss (optional;
                PyTorch's version takes none).

        Returns:
            The local optimizer's return value.
        """
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(params=self.param_groups)  # type: ignore[no-untyped-call]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the local optimizer's gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the local optimizer (shared with this one)."""
        self.optim.add_param_group(param_group)
