"""The stateless DDP communication hooks and the runner for your own.

Every hook here is a :class:`zerofn.hooks.hook.CommHook` from the core, run by
:func:`zerofn_torch.runtime.driver.drive`. The PyTorch-named functions take the process
group as DDP's hook state, exactly like PyTorch's, so registering them is an
import change::

    from zerofn_torch.hooks import fp16_compress_hook
    ddp.register_comm_hook(process_group, fp16_compress_hook)

A hook of your own (a composition of core pieces) registers through a
:class:`HookRunner`, which keeps its state between iterations, one runner per
DDP model::

    runner = HookRunner(cast(my_hook, torch.bfloat16))
    runner.register(ddp)  # ddp.register_comm_hook(runner, run_hook), checked

DDP checks a hook's annotations at registration, so this module keeps them as
real objects (no postponed evaluation).
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from zerofn.hooks import hook as core
from zerofn.hooks import quantization
from zerofn.hooks.hook import CommHook, HookState
from zerofn_torch.runtime.futures import for_ddp, then
from zerofn_torch.runtime.heartbeat import interruptible
from zerofn_torch.runtime.hook_cells import HookCell, run_stateless

__all__ = [
    "HookRunner",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "run_hook",
]

G = TypeVar("G")
B = TypeVar("B")

DDPHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


class HookRunner(Generic[G, B]):
    """The stateful shell around a :class:`zerofn.hooks.hook.CommHook`.

    It holds the hook's :class:`zerofn.hooks.hook.HookState` (in a
    :class:`zerofn_torch.runtime.hook_cells.HookCell`) and the process group; each call
    reads the state, asks the core for the bucket's program, runs it and assigns
    the new state.

    A runner serves one DDP model: its state (error feedback, statistics)
    is kept per bucket of that model. :meth:`register` refuses a second
    model before registering anything on it; a runner registered by hand
    (``ddp.register_comm_hook(runner, run_hook)``) on a second model raises
    at that model's first bucket, before the runner's state changes.

    Args:
        hook: the hook to run.
        process_group: the group to communicate in (default: the world).
    """

    def __init__(self, hook: CommHook[G, B], process_group: Any | None = None) -> None:
        self.hook = hook
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self._cell: HookCell[G, B] = HookCell(core.init_hook_state(hook))
        # The parameters of the model served: set by register(), or learnt
        # from the buckets of the first iteration when registered by hand.
        # Their ids only, so the runner keeps no model alive.
        self._param_ids: set[int] = set()
        self._learning = True

    def register(self, ddp: Any) -> None:
        """Register this runner as ``ddp``'s communication hook, as
        ``ddp.register_comm_hook(runner, run_hook)`` does, after checking that
        it serves no other model.

        Args:
            ddp: a ``DistributedDataParallel`` model.

        Raises:
            RuntimeError: the runner already serves another DDP model (then
                nothing is registered on ``ddp``), or ``ddp`` already has a
                hook (DDP's own error).
        """
        ids = {id(p) for p in ddp.parameters()}
        if not self._param_ids <= ids:
            raise RuntimeError(
                "this HookRunner already serves another DDP model, and its state (per "
                "bucket of that model) cannot serve a second one; nothing was registered. "
                "Make one HookRunner per DDP model: HookRunner(hook).register(ddp)"
            )
        ddp.register_comm_hook(self, run_hook)
        self._param_ids = ids
        self._learning = False

    @property
    def state(self) -> HookState[G, B]:
        """The hook's state after the calls so far."""
        return self._cell.state

    def __call__(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._check_model(bucket)
        return self._cell.run(self.hook, bucket, self.process_group)[2]

    def _check_model(self, bucket: GradBucket) -> None:
        """Refuse a bucket of a model this runner does not serve (it was
        registered by hand on two models), before its state changes.

        Until the first iteration ends, the runner learns the parameters of
        the model it serves from the buckets (DDP's buckets hold all of its
        trainable parameters in every iteration).

        Raises:
            RuntimeError: the bucket holds a parameter of another model.
        """
        ids = [id(p) for p in bucket.parameters()]
        if self._learning:
            self._param_ids.update(ids)
            self._learning = not bucket.is_last()
            return
        if not self._param_ids.issuperset(ids):
            raise RuntimeError(
                f"DDP bucket {bucket.index()} belongs to a model this HookRunner does not "
                "serve: the runner is registered on two DDP models, and its state (per "
                "bucket of the first one) cannot serve a second. Make one HookRunner per "
                "DDP model; HookRunner(hook).register(ddp) checks this before registering"
            )


def run_hook(
    runner: HookRunner[Any, Any], bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP hook function for a :class:`HookRunner` state:
    ``ddp.register_comm_hook(runner, run_hook)``."""
    return runner(bucket)


def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks: the same numbers as DDP without a hook."""
    return run_stateless(core.allreduce_mean(), process_group, bucket)


def fp16_compress_hook(
    process_group: Any, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16 (half the bytes), returning the input dtype."""
    return run_stateless(core.cast(core.allreduce_mean(), torch.float16), process_group, bucket)


def _bf16_allreduce(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16 (half the bytes), returning the input dtype.

    Works on any backend, gloo included.
    """
    return run_stateless(core.cast(core.allreduce_mean(), torch.bfloat16), process_group, bucket)


# DDP refuses hooks *named* ``bf16_compress_hook`` unless NCCL is present; ours
# is correct on every backend, so its function carries another name.
bf16_compress_hook = _bf16_allreduce


def noop_hook(_: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the local gradient without communicating (to measure comm cost)."""
    return run_stateless(core.noop(), None, bucket)


def quantization_pertensor_hook(
    process_group: Any, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket quantized to 8 bits, one scale and zero point per
    rank: PyTorch's numbers, in one all-gather instead of two.

    PyTorch 2.13's own hook of this name fails on every call; this one gives
    the numbers it was written to give (see :mod:`zerofn.hooks.quantization`).
    """
    return run_stateless(quantization.quantize_per_tensor(), process_group, bucket)


def quantization_perchannel_hook(
    process_group: Any, bucket: GradBucket, bucket_size: int = 512
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket quantized to 8 bits, one scale and zero point per
    ``bucket_size`` consecutive elements: PyTorch's numbers, in one all-gather.

    To choose another ``bucket_size``, register a function of ``(state,
    bucket)`` that passes it on (DDP needs the parameter named ``bucket`` and
    a ``__name__``, which ``functools.partial`` lacks)::

        ddp.register_comm_hook(
            None, lambda state, bucket: quantization_perchannel_hook(state, bucket, 128)
        )
    """
    return run_stateless(quantization.quantize_per_channel(bucket_size), process_group, bucket)


def fp16_compress_wrapper(hook: DDPHook) -> DDPHook:
    """Wrap a PyTorch-style hook so that it communicates float16."""
    return _cast_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: DDPHook) -> DDPHook:
    """Wrap a PyTorch-style hook so that it communicates bfloat16 (any backend)."""
    return _cast_wrapper(torch.bfloat16, hook)


def _cast_wrapper(dtype: torch.dtype, hook: DDPHook) -> DDPHook:
    def compress_wrapper_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        original_dtype = bucket.buffer().dtype
        # The wrapped hook reads the bucket's buffer, so it sees the cast one.
        bucket.set_buffer(bucket.buffer().to(dtype))
        reduced = then(hook(state, bucket), lambda reduced: reduced.to(original_dtype))
        return for_ddp(interruptible(reduced))

    return compress_wrapper_hook
