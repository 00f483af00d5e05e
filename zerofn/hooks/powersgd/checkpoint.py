"""PowerSGD state dicts: versioned, ``torch.load(weights_only=True)``-loadable.

Format 2 (tag ``"zerofn.powersgd/2"``) keeps each parameter's memory under
its key (``"parameters"``), the batched hook's bucket-shaped memories with
their parameters' keys (``"squares"``, by bucket index), and the layouts the
random draws follow. Format 1 (tag ``"zerofn.powersgd/1"``, bucket-keyed)
cannot be assigned to parameters: :func:`from_state_dict` refuses it, and
:func:`upgrade_v1` converts it by dropping the bucket memories.

Tags are constants of the format, never derived from where the code lives:
a saved state dict outlives any module layout. Every tag a version of zerofn
wrote is read (:data:`READABLE_FORMATS`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from zerofn.hooks.hook import HookState
from zerofn.hooks.powersgd.codec import matrix_view
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.state import (
    UNCLAIMED,
    BucketKeys,
    ParamMemory,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    PowerSGDHookState,
    SeedStream,
    SquareMemory,
    claim,
    memories,
)

__all__ = [
    "READABLE_FORMATS",
    "STATE_DICT_FORMAT",
    "from_state_dict",
    "to_state_dict",
    "upgrade_v1",
]

STATE_DICT_FORMAT = "zerofn.powersgd/2"
"""The ``"format"`` entry of a PowerSGD state dict (bumped on incompatible changes)."""

READABLE_FORMATS = (STATE_DICT_FORMAT, "zerofn.hooks.powersgd/2")
"""Every tag of format 2 that zerofn has written; all load the same way."""

_V1 = "zerofn.powersgd/1"
_CONFIG_FIELDS = tuple(f.name for f in attrs.fields(PowerSGDConfig))


def _layout(layout: tuple[BucketKeys, ...]) -> list[dict[str, Any]]:
    return [{"keys": list(keys), "shapes": [list(s) for s in shapes]} for keys, shapes in layout]


def _tensors(**named: torch.Tensor | None) -> dict[str, Any]:
    return {name: value for name, value in named.items() if value is not None}


def to_state_dict(config: PowerSGDConfig, state: PowerSGDHookState) -> dict[str, Any]:
    """Config and state as tensors, numbers, strings, lists and dicts only
    (loadable with ``torch.load(..., weights_only=True)``).

    Tensors are shared with ``state``, which never changes them in place. The
    seed generator's words are a ``torch.uint32`` tensor, which ``torch.save``
    handles but plain ``pickle`` cannot in PyTorch 2.13; a pickler converts
    them to ``torch.int64`` first (:func:`from_state_dict` takes both).
    """
    g, seeds = state.global_state, state.global_state.seeds
    return {
        "format": STATE_DICT_FORMAT,
        "config": {name: getattr(config, name) for name in _CONFIG_FIELDS},
        "iteration": g.iteration,
        "seeds": {
            "keys": seeds.keys,
            "pos": seeds.pos,
            "has_gauss": seeds.has_gauss,
            "cached_gaussian": seeds.cached_gaussian,
        },
        "numel_before_compression": g.numel_before_compression,
        "numel_after_compression": g.numel_after_compression,
        "next_stats_report": g.next_stats_report,
        "reference_layout": _layout(g.reference),
        "previous_layout": _layout(g.previous),
        **_memory_entries(state),
    }


def _memory_entries(state: PowerSGDHookState) -> dict[str, Any]:
    """Each parameter's memory by key, and the batched squares by bucket index."""
    params = {
        key: {"shape": list(m.shape), **_tensors(error=m.error, q=m.q)}
        for key, m in memories(state).items()
    }
    squares = {
        index: {"keys": list(b.square.keys), **_tensors(padding=b.square.padding, q=b.square.q)}
        for index, b in state.buckets
        if b is not None and b.square is not None
    }
    return {"parameters": params, "squares": squares}


def _entry(mapping: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in mapping:
        raise ValueError(f"PowerSGD state dict: {where}lacks {key!r}")
    value = mapping[key]
    if not isinstance(value, kind):
        raise ValueError(f"PowerSGD state dict: {where}{key!r} is a {type(value).__name__}")
    return value


def _optional_tensor(entry: Mapping[str, Any], key: str, where: str) -> torch.Tensor | None:
    if key not in entry:
        return None
    value = _entry(entry, key, torch.Tensor, where)
    assert isinstance(value, torch.Tensor)
    return value.detach().clone()


def _seed_stream(entry: Mapping[str, Any]) -> SeedStream:
    keys = _entry(entry, "keys", torch.Tensor, "seeds ")
    if keys.shape != (624,) or keys.dtype not in (torch.uint32, torch.int64):
        raise ValueError(
            "PowerSGD state dict: seeds 'keys' must be 624 uint32 (or int64) words, "
            f"got {keys.dtype} of shape {tuple(keys.shape)}"
        )
    if keys.dtype == torch.int64 and not bool(((keys >= 0) & (keys < 2**32)).all()):
        raise ValueError("PowerSGD state dict: seeds 'keys' hold values outside 32 bits")
    return SeedStream(
        # int64 words come from pickles (see to_state_dict), stored as uint32 again.
        keys=keys.detach().to(torch.uint32, copy=True),
        pos=int(_entry(entry, "pos", int, "seeds ")),
        has_gauss=int(_entry(entry, "has_gauss", int, "seeds ")),
        cached_gaussian=float(_entry(entry, "cached_gaussian", (int, float), "seeds ")),
    )


def _read_layout(entries: Any, name: str) -> tuple[BucketKeys, ...]:
    if not isinstance(entries, list):
        raise ValueError(f"PowerSGD state dict: {name!r} is a {type(entries).__name__}")
    layout = []
    for index, entry in enumerate(entries):
        where = f"{name} bucket {index} "
        if not isinstance(entry, Mapping):
            raise ValueError(f"PowerSGD state dict: {where}is a {type(entry).__name__}")
        keys = tuple(_entry(entry, "keys", (list, tuple), where))
        shapes = tuple(_shape(s, where) for s in _entry(entry, "shapes", (list, tuple), where))
        if len(keys) != len(shapes):
            raise ValueError(
                f"PowerSGD state dict: {where}has {len(keys)} keys, {len(shapes)} shapes"
            )
        layout.append((keys, shapes))
    return tuple(layout)


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) for d in value):
        raise ValueError(f"PowerSGD state dict: {where}holds a shape that is not a list of ints")
    return tuple(int(d) for d in value)


def _read_memory(key: Any, entry: Any) -> ParamMemory:
    """One parameter's memory, checked against its shape."""
    where = f"parameter {key!r} "
    if not isinstance(entry, Mapping):
        raise ValueError(f"PowerSGD state dict: {where}is a {type(entry).__name__}")
    shape = _shape(_entry(entry, "shape", (list, tuple), where), where)
    error, q = _optional_tensor(entry, "error", where), _optional_tensor(entry, "q", where)
    if error is not None and error.numel() != math.prod(shape):
        raise ValueError(
            f"PowerSGD state dict: {where}'error' has {error.numel()} elements, "
            f"its shape {list(shape)} {math.prod(shape)}"
        )
    if q is not None and (q.dim() != 2 or q.shape[0] != matrix_view(shape)[1]):
        raise ValueError(
            f"PowerSGD state dict: {where}'q' has shape {list(q.shape)}, expected "
            f"[{matrix_view(shape)[1]}, rank] for a parameter of shape {list(shape)}"
        )
    return ParamMemory(shape, error, q)


def _read_params(entries: Mapping[Any, Any]) -> PowerSGDBucketState | None:
    if not entries:
        return None
    keys = tuple(entries)
    params = tuple(_read_memory(k, e) for k, e in entries.items())
    return PowerSGDBucketState(keys, tuple(p.shape for p in params), params)


def _read_squares(entries: Mapping[Any, Any]) -> dict[int, SquareMemory]:
    squares = {}
    for index, entry in entries.items():
        where = f"square {index!r} "
        keys = tuple(_entry(entry, "keys", (list, tuple), where))
        padding, q = _optional_tensor(entry, "padding", where), _optional_tensor(entry, "q", where)
        squares[int(index)] = SquareMemory(keys, padding, q)
    return squares


def _with_square(
    state: PowerSGDHookState, index: int, square: SquareMemory | None
) -> PowerSGDHookState:
    """Give bucket ``index`` its batched square memory back, if it was made
    for exactly the parameters the bucket holds, in any order (else it is of
    no use)."""
    bucket = state.bucket(index)
    if square is None or bucket is None or set(bucket.keys) != set(square.keys):
        return state
    restored = attrs.evolve(bucket, square=square)
    return attrs.evolve(
        state, buckets=tuple((i, restored if i == index else b) for i, b in state.buckets)
    )


def _check_format(state_dict: Mapping[str, Any]) -> None:
    found = state_dict.get("format") if isinstance(state_dict, Mapping) else None
    if found == _V1:
        raise ValueError(
            f"this PowerSGD state dict has format {_V1!r}, which keeps error "
            "feedback and warm-start factors per DDP bucket; they cannot be assigned to "
            "parameters. Convert it with zerofn.hooks.powersgd.upgrade_v1(state_dict) (keeps "
            "iteration, seeds, statistics and config; error and factors restart from zero "
            "and random), or resume from a state dict saved by this version"
        )
    if found not in READABLE_FORMATS:
        raise ValueError(
            f"not a PowerSGD state dict: format {found!r}, expected {STATE_DICT_FORMAT!r}"
        )


def _read_config(state_dict: Mapping[str, Any]) -> PowerSGDConfig:
    config_entry = _entry(state_dict, "config", Mapping, "")
    unknown = set(config_entry) - set(_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"PowerSGD state dict: unknown config entries {sorted(unknown)}")
    try:
        return PowerSGDConfig(**config_entry)
    except TypeError as error:
        raise ValueError(f"PowerSGD state dict: invalid config: {error}") from error


def from_state_dict(state_dict: Mapping[str, Any]) -> tuple[PowerSGDConfig, PowerSGDHookState]:
    """Config and state from a :func:`to_state_dict` result (tensors are copied).

    The parameters' memories wait, unclaimed, for the buckets that hold them.

    Raises:
        ValueError: if the dict is not a PowerSGD state dict of this format
            (for format 1, saying how to convert it), lacks an entry, or
            holds an invalid configuration.
    """
    _check_format(state_dict)
    config = _read_config(state_dict)
    global_state = PowerSGDGlobalState(
        iteration=int(_entry(state_dict, "iteration", int, "")),
        seeds=_seed_stream(_entry(state_dict, "seeds", Mapping, "")),
        numel_before_compression=int(_entry(state_dict, "numel_before_compression", int, "")),
        numel_after_compression=int(_entry(state_dict, "numel_after_compression", int, "")),
        next_stats_report=int(_entry(state_dict, "next_stats_report", int, "")),
        reference=_read_layout(state_dict.get("reference_layout", []), "reference_layout"),
        previous=_read_layout(state_dict.get("previous_layout", []), "previous_layout"),
    )
    squares = _read_squares(_entry(state_dict, "squares", Mapping, ""))
    unclaimed = _read_params(_entry(state_dict, "parameters", Mapping, ""))
    state: PowerSGDHookState = HookState(
        global_state, () if unclaimed is None else ((UNCLAIMED, unclaimed),)
    )
    # Laid out as in the last iteration (the batched squares with their
    # buckets); a driver's claims move the memories on from there.
    for index, (keys, shapes) in enumerate(global_state.previous):
        state = claim(state, index, keys, shapes)
        state = _with_square(state, index, squares.get(index))
    return config, state


def upgrade_v1(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A format-1 (bucket-keyed) state dict as format 2, without its bucket memories.

    Iteration, seed stream, statistics and config carry over; each
    parameter's error starts from zero and its factors from random ones.

    Raises:
        ValueError: if ``state_dict`` is not of format 1.
    """
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != _V1:
        raise ValueError(f"upgrade_v1 takes a PowerSGD state dict of format {_V1!r}")
    kept = {k: v for k, v in state_dict.items() if k not in ("format", "buckets")}
    return {**kept, "format": STATE_DICT_FORMAT, "parameters": {}, "squares": {}}
