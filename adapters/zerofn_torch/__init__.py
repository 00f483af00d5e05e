"""zerofn_torch: zerofn's pure core bound to torch.distributed, DDP and torch.optim.

Names and signatures follow PyTorch's, so switching is an import change::

    from zerofn_torch import ZeroRedundancyOptimizer
"""

from zerofn_torch.replicas import verify_replicas
from zerofn_torch.zero import LossScaler, ZeroRedundancyOptimizer

__all__ = ["LossScaler", "ZeroRedundancyOptimizer", "verify_replicas"]
