"""PowerSGD DDP communication hooks: PyTorch's names, zerofn's programs.

Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``::

    from zerofn_torch.hooks.powersgd import PowerSGDState, powerSGD_hook

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1,
                          start_powerSGD_iter=10)
    ddp.register_comm_hook(state, powerSGD_hook)

:class:`PowerSGDState` is a shell: it holds the process group, the
configuration record and a :class:`zerofn_torch.runtime.hook_cells.HookCell` with the
hook's state records (see :mod:`zerofn.hooks.powersgd`). Each hook call reads
the state, asks the core for the bucket's program, runs it in the cell's
:class:`zerofn_torch.runtime.driver.ProgramPipeline` and assigns the new state, exactly
as :class:`zerofn_torch.hooks.HookRunner` does for any hook; PowerSGD adds
only its statistics log, and a claim before each bucket: the bucket's
parameter objects, by identity, for the core to find their keys and move
their memories to the bucket (see
:func:`zerofn.hooks.powersgd.claim_parameters`). The pipeline issues every
collective from the thread that calls the hook, in bucket-and-round order, so
all ranks issue them in one order however many buckets there are; and a
bucket's second all-reduce goes out in the next bucket's hook call, so
backward never waits for the first.

DDP checks a hook's annotations at registration, so this module keeps them as
real objects (no postponed evaluation).
"""

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from zerofn.hooks import powersgd
from zerofn.hooks.hook import init_hook_state
from zerofn.hooks.powersgd import (
    PowerSGDBucketState,
    PowerSGDConfig,
    PowerSGDHook,
    PowerSGDHookState,
)
from zerofn.hooks.powersgd.state import tracked
from zerofn_torch.runtime.hook_cells import HookCell

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)


class _ReadOnlyDict(dict[int, torch.Tensor]):
    """A dict that refuses changes, saying where the state lives."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "this is a read-only view of zerofn's PowerSGD state (kept per parameter); "
            "change the state with PowerSGDState.load_state_dict instead"
        )

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]


class _View:
    """A read-only attribute under one of PyTorch's names, computed from
    zerofn's state records when read."""

    def __init__(self, name: str, what: str, read: Callable[[Any], Any]) -> None:
        self.__doc__ = f"Read-only view: {what}."
        self._read = read
        self._name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else self._read(instance)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(
            f"PowerSGDState.{self._name} is a read-only view of zerofn's PowerSGD state "
            "(kept per parameter in hook_state); to change the state, load one with "
            "PowerSGDState.load_state_dict"
        )


def _by_bucket(
    state: PowerSGDHookState, part: Callable[[PowerSGDBucketState], torch.Tensor | None]
) -> _ReadOnlyDict:
    found = {i: part(b) for i, b in state.buckets if b is not None}
    return _ReadOnlyDict({i: t for i, t in found.items() if t is not None})


class PowerSGDState:
    """PowerSGD's configuration and state, shared by all buckets of one model.

    The constructor takes PyTorch's ``PowerSGDState`` arguments, with the same
    defaults and meanings (see :class:`zerofn.hooks.powersgd.PowerSGDConfig`).

    Args:
        process_group: the group to average over (``None``: the world).
        matrix_approximation_rank: rank of the low-rank factors.
        start_powerSGD_iter: plain-averaging iterations before compression.
        min_compression_rate: compress a matrix only if it shrinks this much.
        use_error_feedback: carry each step's compression error to the next.
        warm_start: start each step from the previous step's ``Q`` factors.
        orthogonalization_epsilon: guards orthogonalisation against zero columns.
        random_seed: seed of the per-step seeds (the same on every rank).
        compression_stats_logging_frequency: iterations between statistics logs.
        batch_tensors_with_same_shape: draw same-shape factors as one batch
            (PyTorch's random numbers for that setting).

    Raises:
        ValueError: for a rank below 1, a negative start iteration, a start
            iteration below 2 with error feedback or warm start, or a
            compression rate below 1.
        TypeError: for a value of the wrong type.
    """

    def __init__(
        self,
        process_group: Any,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        config = PowerSGDConfig(
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon,
            random_seed=random_seed,
            compression_stats_logging_frequency=compression_stats_logging_frequency,
            batch_tensors_with_same_shape=batch_tensors_with_same_shape,
        )
        logger.info("PowerSGD config: %s", config)
        self.process_group = process_group
        self.config = config
        # Not state to checkpoint: the cell's lock and pipeline belong to this
        # process; its state is replaced by load_state_dict.
        self._cell = HookCell(init_hook_state(powersgd.layerwise(config)))

    def track_parameters(self, parameters: Iterable[torch.Tensor]) -> None:
        """Key the state by these parameters' positions (e.g. ``model.parameters()``).

        Optional: without it, the keys are learned from DDP's first iteration
        (see :class:`zerofn.hooks.powersgd.state.KeyFinder`); give them when
        the state is attached to a DDP model that has already run, or whose
        parameters mix dtypes.

        Args:
            parameters: the model's parameters, in the model's order.
        """
        finder = tracked([id(p) for p in parameters])
        with self._cell.lock:
            self._cell.state = powersgd.with_parameter_keys(self._cell.state, finder)

    @property
    def hook_state(self) -> PowerSGDHookState:
        """The hook's state records after the calls so far."""
        return self._cell.state

    @property
    def iter(self) -> int:
        """Completed training iterations (PyTorch's ``state.iter``)."""
        return self.hook_state.global_state.iteration

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel_before, numel_after)`` over all compressing iterations.

        Returns:
            The rate (before / after; 0 before anything was compressed), the
            elements the compressed buckets held, and those sent instead.
        """
        return powersgd.compression_stats(self.hook_state.global_state)

    def state_dict(self) -> dict[str, Any]:
        """Configuration and state as tensors, numbers, strings and containers.

        Safe to save with ``torch.save`` and to load with ``torch.load(...,
        weights_only=True)``: no process group, no classes. Tensors are shared
        with the live state, which never modifies them in place.

        Returns:
            The state dict (see :func:`zerofn.hooks.powersgd.to_state_dict`).
        """
        with self._cell.lock:
            return powersgd.to_state_dict(self.config, self.hook_state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore configuration and state from :meth:`state_dict`'s result.

        Training continues exactly as if never stopped: same iteration, seed
        position, error feedback and warm-start factors, kept per parameter,
        so also in a freshly built DDP model, whose first iteration runs on
        provisional buckets (see ``docs/powersgd.md`` for the batched hook).
        The process group is kept, and so is what this state knows of which
        live parameter has which key (the state dict holds keys, not the
        parameter objects of the process that saved it).

        Args:
            state_dict: a dict :meth:`state_dict` made (tensors are copied).

        Raises:
            ValueError: if it is not a valid PowerSGD state dict; the state is
                then left as it was.
        """
        config, state = powersgd.from_state_dict(state_dict)
        with self._cell.lock:
            finder = self._cell.state.global_state.parameter_keys
            self.config = config
            self._cell.state = powersgd.with_parameter_keys(state, finder)

    def __getstate__(self) -> dict[str, Any]:
        # Pickling keeps working as with PyTorch's state: everything but the
        # process group (not picklable), restored as the default group.
        logger.warning("NOTE: the process group is not pickled with a PowerSGDState.")
        state = self.state_dict()
        # Plain pickle cannot restore uint32 tensors in PyTorch 2.13 (torch.save can).
        seeds = state["seeds"]
        state["seeds"] = {**seeds, "keys": seeds["keys"].to(torch.int64)}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = dist.distributed_c10d._get_default_group()
        logger.warning(
            "NOTE: an unpickled PowerSGDState uses the default process group; "
            "assign its process_group attribute for another one."
        )
        config, restored = powersgd.from_state_dict(state)
        self.config = config
        self._cell = HookCell(restored)

    def __repr__(self) -> str:
        return f"PowerSGDState(iter={self.iter}, config={self.config})"


def _config(name: str) -> tuple[str, Callable[[PowerSGDState], Any]]:
    return f"the configuration's {name} (a frozen record)", lambda self: getattr(self.config, name)


# PyTorch's PowerSGDState lists its attributes in __slots__, and code (PyTorch's
# own pickling test among it) reads that list. Assigned after the class is made,
# it creates no slots: every name on it is a property or a view below.
_PYTORCH_SLOTS = (
    "process_group",
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "orthogonalization_epsilon",
    "use_error_feedback",
    "warm_start",
    "batch_tensors_with_same_shape",
    "rng",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "compression_stats_logging_frequency",
    "next_stats_report",
)

# PyTorch's attribute names, each a read-only view of zerofn's records (code
# that reads them keeps working; writing one says what to do instead).
_PYTORCH_NAMES: dict[str, tuple[str, Callable[[PowerSGDState], Any]]] = {
    **{name: _config(name) for name in attrs.fields_dict(PowerSGDConfig) if name in _PYTORCH_SLOTS},
    "rng": (
        "a numpy RandomState positioned where the seed stream stands (a copy)",
        lambda self: self.hook_state.global_state.seeds.to_numpy(),
    ),
    "error_dict": (
        "bucket index -> the bucket's error feedback, flat over the whole bucket "
        "(zeros for parameters sent uncompressed; padding last for the batched hook)",
        lambda self: _by_bucket(self.hook_state, lambda b: b.error),
    ),
    "q_memory_dict": (
        "bucket index -> the bucket's Q factors laid out as PyTorch's (flat layer-wise, "
        "square for the batched hook)",
        lambda self: _by_bucket(self.hook_state, lambda b: b.q),
    ),
    "p_memory_dict": (
        "always empty: zerofn computes P from Q and the gradient each iteration and "
        "keeps none between iterations",
        lambda self: _ReadOnlyDict({}),
    ),
    "total_numel_before_compression": (
        "elements the compressing iterations would have sent uncompressed",
        lambda self: self.hook_state.global_state.numel_before_compression,
    ),
    "total_numel_after_compression": (
        "elements they sent instead",
        lambda self: self.hook_state.global_state.numel_after_compression,
    ),
    "next_stats_report": (
        "the iteration from which the next statistics log is due",
        lambda self: self.hook_state.global_state.next_stats_report,
    ),
}
for _name, (_what, _read) in _PYTORCH_NAMES.items():
    setattr(PowerSGDState, _name, _View(_name, _what, _read))
del _name, _what, _read
PowerSGDState.__slots__ = _PYTORCH_SLOTS  # type: ignore[attr-defined,misc]


def _run(
    state: PowerSGDState, make: Callable[[PowerSGDConfig], PowerSGDHook], bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    cell = state._cell
    if hasattr(bucket, "parameters"):  # a hand-made bucket: the core keys it by position
        identities = [id(p) for p in bucket.parameters()]
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        with cell.lock:
            cell.state = powersgd.claim_parameters(cell.state, bucket.index(), identities, shapes)
    before, _, result = cell.run(make(state.config), bucket, group)
    after = state.hook_state.global_state
    if after.next_stats_report != before.global_state.next_stats_report:
        rate, numel_before, numel_after = powersgd.compression_stats(after)
        logger.info(
            "PowerSGD compression stats: iter %s, %s elements before compression, "
            "%s after, rate %s",
            before.global_state.iteration,
            numel_before,
            numel_after,
            rate,
        )
    return result


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD, each gradient matrix compressed on its own (PyTorch's ``powerSGD_hook``).

    Plain averaging for the first ``state.start_powerSGD_iter`` iterations;
    then matrices worth compressing travel as rank-``r`` factors and the rest
    as they are, in two all-reduces per bucket (uncompressed gradients with
    the ``P`` factors, then the ``Q`` factors) instead of PyTorch's three.
    Works with any number of buckets on any backend. A bucket's second
    all-reduce is issued in the next bucket's call (in the last bucket's, all
    remaining ones), so, as under DDP, call the hook for every bucket of an
    iteration before waiting on the futures.

    Args:
        state: the model's :class:`PowerSGDState`.
        bucket: DDP's bucket.

    Returns:
        A future of the bucket's averaged (approximated) flat gradient.

    Raises:
        ValueError: if ``state`` holds state for this bucket index made for
            other gradient shapes (a state shared by two models).
    """
    return _run(state, powersgd.layerwise, bucket)


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD on the whole bucket as one square matrix (PyTorch's ``batched_powerSGD_hook``).

    Faster than :func:`powerSGD_hook`, usually less accurate beyond rank 1.
    The numbers PyTorch's hook was written to give (PyTorch 2.13's fails on
    every call; see :func:`zerofn.hooks.powersgd.batched`). Its arguments,
    result and errors are :func:`powerSGD_hook`'s; the state it refuses may
    also be one that :func:`powerSGD_hook` made.
    """
    return _run(state, powersgd.batched, bucket)
