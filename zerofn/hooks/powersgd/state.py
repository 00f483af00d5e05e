"""PowerSGD's state records, keyed by parameter, and their transitions.

Error feedback and warm-start factors belong to *parameters*, not to DDP
buckets: a :class:`ParamMemory` per parameter key (the parameter's index in
the model, or a name), so the state means the same thing whatever DDP's
bucket layout is this iteration (its provisional first iteration, a rebuild,
another ``bucket_cap_mb``).

The memories are stored in a :class:`zerofn.hooks.hook.HookState` as usual, each
in the state of the bucket that last used it (:class:`PowerSGDBucketState`);
before a bucket runs, a driver that knows the bucket's parameter keys calls
:func:`claim`, which moves the memories of those keys (wherever they are) to
that bucket. A driver that knows only which parameter objects the bucket holds
calls :func:`claim_parameters` instead, which finds their keys first (see
:class:`KeyFinder`). Memories nobody has claimed yet (after
loading a checkpoint, or left behind by a layout change) wait under the
pseudo-index :data:`UNCLAIMED`.

The global record (:class:`PowerSGDGlobalState`) holds the iteration count,
the seed stream (:class:`SeedStream`: PyTorch's seeds, drawn from a numpy
generator kept as plain values, so a resumed run draws what the uninterrupted
one would have), the statistics, the bucket layouts the random draws follow
(see :func:`end_iteration`) and what is known of the parameters' keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import attrs
import torch

from zerofn.hooks.hook import BucketInfo, HookState
from zerofn.hooks.powersgd.codec import matrix_view
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.keys import KeyFinder, bucket_keys, finish_key_iteration, tracked
from zerofn.hooks.powersgd.seeds import SeedStream, draw_seed

__all__ = [
    "UNCLAIMED",
    "BucketKeys",
    "Key",
    "KeyFinder",
    "ParamMemory",
    "PowerSGDBucketState",
    "PowerSGDGlobalState",
    "PowerSGDHookState",
    "SeedStream",
    "SquareMemory",
    "bucket_keys",
    "claim",
    "claim_parameters",
    "compression_stats",
    "default_keys",
    "draw_seed",
    "end_iteration",
    "finish_key_iteration",
    "fits_bucket",
    "init_global_state",
    "memories",
    "record_bucket",
    "record_compression",
    "tracked",
    "with_parameter_keys",
]

Key: TypeAlias = int | str
"""A parameter's key: its index in the model, or its name."""

Shape: TypeAlias = tuple[int, ...]

# ----- the memories and the records that hold them -------------------------------

UNCLAIMED = -1
"""The pseudo bucket index under which unclaimed memories wait."""


@attrs.frozen(eq=False)
class ParamMemory:
    """What one parameter carries from one iteration to the next.

    Attributes:
        shape: the parameter's shape (checked when the memory is claimed).
        error: its local compression error (flat), or ``None``.
        q: its last averaged ``Q`` factor (``cols x rank``, the layer-wise
            hook's warm start), or ``None``.
    """

    shape: Shape
    error: torch.Tensor | None = None
    q: torch.Tensor | None = None


@attrs.frozen(eq=False)
class SquareMemory:
    """The bucket-shaped part of the batched hook's state.

    Attributes:
        keys: the parameters of the bucket it was made for, in bucket order;
            it is used only by a bucket holding exactly these.
        padding: the error of the padding that squares the bucket, or ``None``.
        q: the last averaged ``Q`` (``side x rank``), or ``None``.
    """

    keys: tuple[Key, ...]
    padding: torch.Tensor | None = None
    q: torch.Tensor | None = None


@attrs.frozen(eq=False)
class PowerSGDBucketState:
    """The memories one bucket holds.

    Attributes:
        keys: its parameters' keys, in bucket order.
        shapes: their shapes.
        params: one memory per key (``None`` where a parameter has none yet).
        square: the batched hook's bucket-shaped memory, or ``None``.
    """

    keys: tuple[Key, ...]
    shapes: tuple[Shape, ...]
    params: tuple[ParamMemory | None, ...] = ()
    square: SquareMemory | None = None

    @property
    def error(self) -> torch.Tensor | None:
        """The bucket's error as PyTorch keeps it (its ``error_dict`` entry):
        flat over the whole bucket, zeros for parameters without one,
        padding last for the batched hook; ``None`` when no parameter
        remembers one."""
        errors = [
            m.error if m is not None else None for m in map(self.memory, range(len(self.shapes)))
        ]
        held = next((e for e in errors if e is not None), None)
        if held is None:
            return None
        parts = [
            e.reshape(-1) if e is not None else held.new_zeros(math.prod(shape))
            for e, shape in zip(errors, self.shapes, strict=True)
        ]
        padding = self.square.padding if self.square is not None else None
        return torch.cat(parts + ([padding] if padding is not None else []))

    @property
    def q(self) -> torch.Tensor | None:
        """The bucket's ``Q`` as PyTorch lays it out: the batched hook's
        square one, or the layer-wise factors flat, grouped by 2-D shape."""
        if self.square is not None:
            return self.square.q
        held = [(j, m) for j, m in enumerate(self.params) if m is not None and m.q is not None]
        if not held:
            return None
        first: dict[tuple[int, ...], int] = {}
        for j, _ in held:
            first.setdefault(matrix_view(self.shapes[j]), j)
        held.sort(key=lambda item: (first[matrix_view(self.shapes[item[0]])], item[0]))
        return torch.cat([m.q.reshape(-1) for _, m in held if m.q is not None])

    def memory(self, position: int) -> ParamMemory | None:
        """The memory of the parameter at ``position`` in the bucket, if any."""
        return self.params[position] if position < len(self.params) else None


BucketKeys: TypeAlias = tuple[tuple[Key, ...], tuple[Shape, ...]]
"""One bucket of a layout: its parameters' keys and shapes."""


@attrs.frozen(eq=False)
class PowerSGDGlobalState:
    """What all buckets share.

    Attributes:
        iteration: completed training iterations (PyTorch's ``state.iter``).
        seeds: where the seed generator stands.
        numel_before_compression: elements the compressing iterations would
            have sent uncompressed, summed over buckets and iterations.
        numel_after_compression: elements they actually sent.
        next_stats_report: the iteration from which the next statistics
            report is due (moved forward when one is made).
        reference: the bucket layout random factors are drawn by (see
            :func:`end_iteration`); empty until a layout has held for two
            iterations.
        previous: the last completed iteration's layout.
        current: this iteration's buckets so far.
        ahead: random ``Q`` factors drawn ahead, by ``reference``, in an
            iteration whose buckets differ from it: key -> ``cols x rank``.
            ``None`` when not drawing ahead.
        parameter_keys: which of the driver's parameter identities has which
            key (see :func:`claim_parameters`). The identities belong to the
            driver's process, so state dicts keep the keys (with each memory
            and in the layouts), never this.
    """

    iteration: int
    seeds: SeedStream
    numel_before_compression: int = 0
    numel_after_compression: int = 0
    next_stats_report: int = 0
    reference: tuple[BucketKeys, ...] = ()
    previous: tuple[BucketKeys, ...] = ()
    current: tuple[BucketKeys, ...] = ()
    ahead: tuple[tuple[Key, torch.Tensor], ...] | None = None
    parameter_keys: KeyFinder = attrs.field(factory=KeyFinder)


PowerSGDHookState: TypeAlias = HookState[PowerSGDGlobalState, PowerSGDBucketState | None]
"""The state a PowerSGD hook carries from bucket to bucket."""


def init_global_state(config: PowerSGDConfig) -> PowerSGDGlobalState:
    """The global state before the first iteration."""
    return PowerSGDGlobalState(iteration=0, seeds=SeedStream.from_seed(config.random_seed))


def default_keys(bucket: BucketInfo) -> tuple[Key, ...]:
    """Keys for a bucket whose driver names no parameters: ``"<bucket>.<position>"``."""
    return tuple(f"{bucket.index}.{j}" for j in range(len(bucket.shapes)))


def fits_bucket(state: PowerSGDBucketState | None, bucket: BucketInfo) -> bool:
    """Whether a bucket state was made for a bucket of these gradient shapes."""
    return state is None or state.shapes == bucket.shapes


def memories(
    state: PowerSGDHookState,
) -> dict[Key, ParamMemory]:
    """Every parameter memory in ``state``, by key."""
    return _by_key(state.buckets)


def _by_key(
    buckets: Iterable[tuple[int, PowerSGDBucketState | None]],
) -> dict[Key, ParamMemory]:
    """Every parameter memory of ``buckets``, by key."""
    out: dict[Key, ParamMemory] = {}
    for _, bucket in buckets:
        if bucket is not None:
            for key, memory in zip(bucket.keys, bucket.params, strict=False):
                if memory is not None:
                    out[key] = memory
    return out


def _check_shape(key: Key, memory: ParamMemory, shape: Shape) -> None:
    if memory.shape != shape:
        raise ValueError(
            f"PowerSGD state for parameter {key!r} was made for shape {list(memory.shape)}, "
            f"but that parameter now has shape {list(shape)}: is one PowerSGDState shared by "
            "models with different parameters? Give each model its own"
        )


def claim(
    state: PowerSGDHookState,
    index: int,
    keys: Sequence[Key],
    shapes: Sequence[Shape],
) -> PowerSGDHookState:
    """Move the memories of ``keys`` to bucket ``index``, wherever they are.

    Other buckets keep their other memories; bucket ``index``'s former
    memories of other keys wait under :data:`UNCLAIMED`. A batched square
    memory goes with them only to a bucket that holds exactly its parameters
    (in any order: the batched hook compresses them in the square's order).

    Raises:
        ValueError: if a memory was made for another shape than its key's now.
    """
    keys, shapes = tuple(keys), tuple(tuple(int(d) for d in s) for s in shapes)
    pool = memories(state)
    for key, shape in zip(keys, shapes, strict=True):
        if key in pool:
            _check_shape(key, pool[key], shape)
    square = _square_for(state, index, keys)
    claimed = PowerSGDBucketState(keys, shapes, tuple(pool.pop(k, None) for k in keys), square)
    # Other buckets keep their entries (a bucket with no state too), less these keys.
    others: list[tuple[int, PowerSGDBucketState | None]] = [
        (i, _without(b, set(keys)) if b is not None else None)
        for i, b in state.buckets
        if i not in (index, UNCLAIMED)
    ]
    held = _by_key(others)
    leftover = {k: m for k, m in pool.items() if k not in held}
    if leftover:
        others.append((UNCLAIMED, _unclaimed(leftover)))
    return attrs.evolve(state, buckets=(*others, (index, claimed)))


def with_parameter_keys(state: PowerSGDHookState, finder: KeyFinder) -> PowerSGDHookState:
    """``state`` with ``finder`` as what is known of the parameters' keys
    (a driver's :func:`tracked` parameters, or the
    finder of the state it replaces)."""
    return attrs.evolve(state, global_state=attrs.evolve(state.global_state, parameter_keys=finder))


def claim_parameters(
    state: PowerSGDHookState,
    index: int,
    identities: Sequence[int],
    shapes: Sequence[Shape],
) -> PowerSGDHookState:
    """Before bucket ``index`` runs: find its parameters' keys, and once they
    are known, :func:`claim` their memories for it.

    Args:
        state: the hook's state.
        index: the bucket's index.
        identities: the driver's identities of the bucket's parameters, in
            bucket order (one integer per parameter object).
        shapes: their shapes.

    Returns:
        The state with the key finder advanced past this bucket and, when
        every key is known, the bucket's memories claimed; while some key is
        unknown (DDP's first iteration of an untracked model) the bucket keeps
        its own state and is keyed by position.

    Raises:
        ValueError: if a memory was made for another shape than its key's now.
    """
    finder, keys = bucket_keys(
        state.global_state.parameter_keys, identities, _parameter_count(state.global_state)
    )
    state = with_parameter_keys(state, finder)
    return state if keys is None else claim(state, index, keys, shapes)


def _parameter_count(state: PowerSGDGlobalState) -> int | None:
    """The model's parameter count, as the restored (or last) layout says,
    when its keys are indices."""
    layout = state.reference or state.previous
    keys = [k for layout_keys, _ in layout for k in layout_keys]
    if keys and all(isinstance(k, int) for k in keys):
        return len(keys)
    return None


def _square_for(
    state: PowerSGDHookState,
    index: int,
    keys: tuple[Key, ...],
) -> SquareMemory | None:
    """The batched square memory made for exactly these parameters (in any
    order), bucket ``index``'s own first; ``None`` if there is none."""
    wanted = set(keys)
    own = state.bucket(index)
    for bucket in (own, *(b for i, b in state.buckets if i != index)):
        square = bucket.square if bucket is not None else None
        if square is not None and len(square.keys) == len(keys) and set(square.keys) == wanted:
            return square
    return None


def _without(bucket: PowerSGDBucketState, taken: set[Key]) -> PowerSGDBucketState:
    if not taken.intersection(bucket.keys):
        return bucket
    kept = [j for j, k in enumerate(bucket.keys) if k not in taken]
    return PowerSGDBucketState(
        tuple(bucket.keys[j] for j in kept),
        tuple(bucket.shapes[j] for j in kept),
        tuple(bucket.memory(j) for j in kept),
    )


def _unclaimed(pool: dict[Key, ParamMemory]) -> PowerSGDBucketState:
    keys = tuple(pool)
    return PowerSGDBucketState(
        keys, tuple(pool[k].shape for k in keys), tuple(pool[k] for k in keys)
    )


def record_bucket(
    state: PowerSGDGlobalState, keys: tuple[Key, ...], shapes: tuple[Shape, ...]
) -> PowerSGDGlobalState:
    """Note one bucket of this iteration's layout (called in bucket order)."""
    return attrs.evolve(state, current=(*state.current, (keys, shapes)))


def end_iteration(state: PowerSGDGlobalState) -> PowerSGDGlobalState:
    """Advance the iteration; the layout random draws follow moves on only
    once a layout has held for two iterations in a row.

    So DDP's one-off provisional iteration (in a fresh model, or after a
    rebuild) draws its random factors by the layout before it, as the run
    that was never interrupted did, while an ordinary run, whose layout
    changes only before compression starts, draws by its current buckets,
    exactly as PyTorch's hook does.
    """
    settled = state.current == state.previous
    return attrs.evolve(
        state,
        iteration=state.iteration + 1,
        reference=state.current if settled else state.reference,
        previous=state.current,
        current=(),
        ahead=None,
        parameter_keys=finish_key_iteration(state.parameter_keys),
    )


def record_compression(
    state: PowerSGDGlobalState,
    numel_before: int,
    numel_after: int,
    is_last_bucket: bool,
    config: PowerSGDConfig,
) -> PowerSGDGlobalState:
    """Add one compressed bucket to the statistics.

    After the iteration's last bucket, once a report is due, the next report
    is scheduled ``compression_stats_logging_frequency`` iterations later; a
    driver reports whenever ``next_stats_report`` moves.
    """
    next_report = state.next_stats_report
    if is_last_bucket and state.iteration >= next_report:
        next_report = state.iteration + config.compression_stats_logging_frequency
    return attrs.evolve(
        state,
        numel_before_compression=state.numel_before_compression + numel_before,
        numel_after_compression=state.numel_after_compression + numel_after,
        next_stats_report=next_report,
    )


def compression_stats(state: PowerSGDGlobalState) -> tuple[float, int, int]:
    """``(rate, numel_before, numel_after)`` as PyTorch's ``compression_stats()``:
    the rate is before / after, or 0 before anything was compressed."""
    before, after = state.numel_before_compression, state.numel_after_compression
    rate = before / after if after > 0 else 0.0
    return rate, before, after
