"""ZeRO stage 1 bound to a process group: the optimizer shell
(:mod:`~zerofn_torch.zero.optimizer`), the collectives its gradient checks
(:mod:`~zerofn_torch.zero.gradients`) and state dicts
(:mod:`~zerofn_torch.zero.state_dicts`) run, and the loss scaler
(:mod:`~zerofn_torch.zero.loss_scaling`). What a rank holds and how it is
built is the core's :mod:`zerofn.zero.rank`.

    from zerofn_torch.zero import ZeroRedundancyOptimizer
"""

from zerofn_torch.zero.optimizer import OverlapBinding, ZeroRedundancyOptimizer

from zerofn_torch.zero.loss_scaling import LossScaler  # isort: skip (it needs the optimizer)

__all__ = ["LossScaler", "OverlapBinding", "ZeroRedundancyOptimizer"]
