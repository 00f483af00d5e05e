"""DDP communication hooks: PyTorch's names, zerofn's programs.

Where PyTorch's users look for them (``torch.distributed.algorithms.
ddp_comm_hooks.*``), gathered in one module; each lives in a module of its
own:

* :mod:`zerofn_torch.hooks.default`: averaging, fp16/bf16 and their wrappers,
  quantization, the no-op hook, and :class:`HookRunner` for your own
  compositions;
* :mod:`zerofn_torch.hooks.powersgd`: ``PowerSGDState``, ``powerSGD_hook``,
  ``batched_powerSGD_hook``;
* :mod:`zerofn_torch.hooks.post_local_sgd`: ``PostLocalSGDState``,
  ``post_localSGD_hook``;
* :mod:`zerofn_torch.hooks.overlap`: ``hook_with_zero_step`` and its interleaved
  twin.

Registering one is an import change::

    from zerofn_torch.hooks import fp16_compress_hook
    ddp.register_comm_hook(process_group, fp16_compress_hook)
"""

from zerofn_torch.hooks.default import (
    HookRunner,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
    quantization_perchannel_hook,
    quantization_pertensor_hook,
    run_hook,
)
from zerofn_torch.hooks.overlap import hook_with_zero_step, hook_with_zero_step_interleaved
from zerofn_torch.hooks.post_local_sgd import PostLocalSGDState, post_localSGD_hook
from zerofn_torch.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = [
    "HookRunner",
    "PostLocalSGDState",
    "PowerSGDState",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "noop_hook",
    "post_localSGD_hook",
    "powerSGD_hook",
    "quantization_perchannel_hook",
    "quantization_pertensor_hook",
    "run_hook",
]
