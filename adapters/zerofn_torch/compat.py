"""zerofn's ZeRO optimizer inside code written for PyTorch's: type checks, and
frameworks that call ``state_dict()`` on every rank.

zerofn's :class:`~zerofn_torch.ZeroRedundancyOptimizer` does not subclass
``torch.distributed.optim.ZeroRedundancyOptimizer``, so a test such as
``isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer)`` (how many
training scripts and checkpoint handlers decide to call
``consolidate_state_dict()`` first) is ``False`` for it. Two opt-ins, both
explicit:

* :class:`TorchTypedZeroRedundancyOptimizer`: zerofn's optimizer that such a
  test accepts. It runs none of PyTorch's ZeRO code: every name PyTorch's
  class defines resolves to zerofn's implementation or to ``torch.optim.
  Optimizer``'s, and PyTorch's private helpers are absent.
* :func:`consolidated`: for frameworks that call ``state_dict()`` on every
  rank and write only what rank 0 returned (Hugging Face Accelerate's
  ``save_state``), which no ZeRO optimizer, PyTorch's included, answers on
  the other ranks.

Without either, such code gets a ``RuntimeError`` from ``state_dict()`` (the
state was not consolidated on that rank), never one rank's shard passed off
as the whole state.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer
from torch.optim import Optimizer

from zerofn_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["TorchTypedZeroRedundancyOptimizer", "consolidated"]


def _acts(name: str) -> bool:
    """Whether a name in a class's namespace is behaviour rather than what
    Python records about the class (``__module__``, ``__doc__``, ABC's
    bookkeeping); ``__init__`` acts."""
    dunder = name.startswith("__") and name.endswith("__")
    return name != "_abc_impl" and (not dunder or name == "__init__")


def _absent(name: str) -> property:
    """A class attribute that reads as missing (``hasattr`` is ``False``),
    saying why."""

    def read(self: object) -> Any:
        raise AttributeError(
            f"{type(self).__name__!r} has no attribute {name!r}: it is zerofn's "
            "ZeroRedundancyOptimizer typed as PyTorch's, and PyTorch's private ZeRO internals "
            "do not exist in it (read ownership from opt.shard_plan instead; see the "
            "migration guide)"
        )

    return property(read)


class _WithoutTorchZeroCode(Optimizer):
    """Sits between zerofn's class and PyTorch's in the typed class's MRO and
    masks every attribute PyTorch's class defines: with ``torch.optim.
    Optimizer``'s where it has one (so zerofn's ``super()`` calls reach
    ``Optimizer``, as they do in zerofn's own class), as absent otherwise."""


for _name in [n for n in vars(TorchZeroRedundancyOptimizer) if _acts(n)]:
    _base = inspect.getattr_static(Optimizer, _name, None)
    setattr(_WithoutTorchZeroCode, _name, _absent(_name) if _base is None else _base)


class TorchTypedZeroRedundancyOptimizer(
    ZeroRedundancyOptimizer, _WithoutTorchZeroCode, TorchZeroRedundancyOptimizer
):
    """zerofn's :class:`~zerofn_torch.ZeroRedundancyOptimizer`, for which
    ``isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer)`` is
    ``True``.

    Same constructor, behaviour and results as zerofn's class (it adds no
    code). PyTorch's class is a base only so that type checks accept it: its
    ``__init__`` and methods never run, and its private attributes
    (``_partition_parameters``, ``_param_to_rank``, ...) raise
    ``AttributeError``.

    Use it where code decides by that type check to consolidate before saving
    (checkpoint handlers, training scripts), or to refuse what it does not
    support with a ZeRO optimizer (Lightning refuses post-local SGD model
    averaging).
    """


@contextmanager
def consolidated(
    optimizer: ZeroRedundancyOptimizer | TorchZeroRedundancyOptimizer, to: int = 0
) -> Iterator[None]:
    """Gather the full optimizer state on rank ``to`` and, until the block
    ends, let ``optimizer.state_dict()`` answer on every rank: the full state
    on rank ``to``, an empty dict on the others.

    For frameworks that call ``state_dict()`` on every rank and write only
    what one rank returned, such as Accelerate's ``save_state`` (it writes on
    the main process, global rank 0: keep ``to=0`` with the default group,
    and do not combine it with Accelerate's ``save_on_each_node=True``).
    Collective: enter it on every rank of the optimizer's group.

    Args:
        optimizer: zerofn's or PyTorch's ``ZeroRedundancyOptimizer`` (not a
            framework's wrapper of it: pass Accelerate's
            ``AcceleratedOptimizer.optimizer``).
        to: the group rank that receives the full state.

    Raises:
        TypeError: ``optimizer`` is not a ``ZeroRedundancyOptimizer``.
        ValueError: ``to`` is not a rank of the group (zerofn's optimizer
            checks it before any collective).
    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer | TorchZeroRedundancyOptimizer):
        inner = getattr(optimizer, "optimizer", None)
        hint = (
            f"; it wraps a {type(inner).__name__}: pass that (its .optimizer)"
            if inner is not None
            else ""
        )
        raise TypeError(
            "consolidated() takes a ZeroRedundancyOptimizer (zerofn's or PyTorch's), got an "
            f"object of type {type(optimizer).__name__}{hint}"
        )
    optimizer.consolidate_state_dict(to=to)
    if dist.get_rank(optimizer.process_group) == to:
        yield
        return
    # An instance attribute shadows the method for the block only: the empty
    # dict is what a framework writing on rank `to` alone discards.
    own = vars(optimizer).get("state_dict")
    setattr(optimizer, "state_dict", dict)  # noqa: B010
    try:
        yield
    finally:
        if own is None:
            delattr(optimizer, "state_dict")
        else:
            setattr(optimizer, "state_dict", own)  # noqa: B010
