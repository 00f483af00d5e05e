"""PowerSGD gradient compression as pure functions over explicit records.

PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) replaces the
all-reduce of a gradient matrix ``M`` (``n x m``) by the all-reduce of two thin
factors: ``P = M Q`` (``n x r``) and ``Q = M^T P`` (``m x r``), one power
iteration per training step, so each rank sends ``r (n + m)`` numbers instead
of ``n m``. The rounding error is kept locally and added to the next step's
gradient (*error feedback*), and ``Q`` is carried from step to step (*warm
start*), so the approximation tracks the gradients' dominant subspace.

The package is a composition of small modules, one idea each:

* :mod:`~zerofn.hooks.powersgd.config`: :class:`PowerSGDConfig`, validated once;
* :mod:`~zerofn.hooks.powersgd.codec`: which matrices are compressed, grouped by
  shape, and the low-rank arithmetic (orthogonalisation, ``P``/``Q``);
* :mod:`~zerofn.hooks.powersgd.state`: state keyed by parameter (which parameter
  is which, learned in the global state), :func:`claim`, :func:`claim_parameters`,
  and :class:`SeedStream`, PyTorch's seed sequence;
* :mod:`~zerofn.hooks.powersgd.common`: the hook shell both hooks share;
* :mod:`~zerofn.hooks.powersgd.layerwise` and :mod:`~zerofn.hooks.powersgd.batched`: the hooks,
  with :mod:`zerofn.hooks.error_feedback`'s per-parameter primitives;
* :mod:`~zerofn.hooks.powersgd.checkpoint`: versioned, weights-only state dicts.

A compressing bucket costs two collectives, not PyTorch's three: the
uncompressed gradients travel in the same all-reduce as the ``P`` factors.
"""

from zerofn.hooks.powersgd.batched import batched
from zerofn.hooks.powersgd.checkpoint import (
    STATE_DICT_FORMAT,
    from_state_dict,
    to_state_dict,
    upgrade_v1,
)
from zerofn.hooks.powersgd.codec import (
    BucketLayout,
    MatrixPlan,
    ShapeGroup,
    bucket_layout,
    matrix_view,
    orthogonalize,
    random_factors,
    should_compress,
    square_side,
)
from zerofn.hooks.powersgd.common import BucketResult, PowerSGDHook
from zerofn.hooks.powersgd.config import PowerSGDConfig
from zerofn.hooks.powersgd.layerwise import layerwise
from zerofn.hooks.powersgd.state import (
    UNCLAIMED,
    Key,
    ParamMemory,
    PowerSGDBucketState,
    PowerSGDGlobalState,
    PowerSGDHookState,
    SeedStream,
    SquareMemory,
    claim,
    claim_parameters,
    compression_stats,
    draw_seed,
    end_iteration,
    fits_bucket,
    init_global_state,
    memories,
    record_compression,
    with_parameter_keys,
)

__all__ = [
    "STATE_DICT_FORMAT",
    "UNCLAIMED",
    "BucketLayout",
    "BucketResult",
    "Key",
    "MatrixPlan",
    "ParamMemory",
    "PowerSGDBucketState",
    "PowerSGDConfig",
    "PowerSGDGlobalState",
    "PowerSGDHook",
    "PowerSGDHookState",
    "SeedStream",
    "ShapeGroup",
    "SquareMemory",
    "batched",
    "bucket_layout",
    "claim",
    "claim_parameters",
    "compression_stats",
    "draw_seed",
    "end_iteration",
    "fits_bucket",
    "from_state_dict",
    "init_global_state",
    "layerwise",
    "matrix_view",
    "memories",
    "orthogonalize",
    "random_factors",
    "record_compression",
    "should_compress",
    "square_side",
    "to_state_dict",
    "upgrade_v1",
    "with_parameter_keys",
]
