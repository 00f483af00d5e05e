"""ZeRO stage 1 bound to a process group: the optimizer shell
(:mod:`~zerofn_torch.zero.optimizer`) and its other parts, one per concern
(:mod:`~zerofn_torch.zero.shell_state` names them), and the loss scaler
(:mod:`~zerofn_torch.zero.loss_scaling`). What a rank holds and how it is
built is the core's :mod:`zerofn.zero.rank`.

    from zerofn_torch.zero import ZeroRedundancyOptimizer
"""

from zerofn_torch.zero.optimizer import OverlapBinding, ZeroRedundancyOptimizer

from zerofn_torch.zero.loss_scaling import LossScaler  # isort: skip (it needs the optimizer)

__all__ = ["LossScaler", "OverlapBinding", "ZeroRedundancyOptimizer"]
