"""DiLoCo and Streaming DiLoCo on the pure core.

Workers take ``sync_every`` local (inner) steps, then an outer optimizer
steps a shared *anchor* with the pseudo-gradient ``anchor - mean of the
workers' parameters``, and the workers continue from the new anchor. The
pieces, one idea per module:

- :mod:`~zerofn.diloco.config`: the hyperparameters (:class:`DiLoCoConfig`);
- :mod:`~zerofn.diloco.schedule`: which fragment syncs after which inner
  step, and when its result is applied;
- :mod:`~zerofn.diloco.state`: the evolving position and its transition;
- :mod:`~zerofn.diloco.fragments`: fragments of the flat parameter vector
  and each one's owners' slices;
- :mod:`~zerofn.diloco.start`: all workers start from rank 0's parameters;
- :mod:`~zerofn.diloco.outer`: the pseudo-gradient and the owner's outer step;
- :mod:`~zerofn.diloco.sync`, :mod:`~zerofn.diloco.compressed_sync`: a
  fragment's sync as a communication program, in fp32 or quantized;
- :mod:`~zerofn.diloco.merge`: merging local and global values;
- :mod:`~zerofn.diloco.checkpoint`: per-rank and consolidated state dicts;
- :mod:`~zerofn.diloco.footprint`: the outer state's bytes per rank and
  the bytes of a sync, per codec.
"""

from zerofn.diloco.config import DiLoCoConfig
from zerofn.diloco.footprint import (
    outer_state_bytes,
    outer_state_bytes_per_rank,
    sync_bytes_per_rank,
)
from zerofn.diloco.fragments import Fragment, FragmentPlan, plan_fragments
from zerofn.diloco.state import DiLoCoState, InFlight, StepActions, take_inner_step

__all__ = [
    "DiLoCoConfig",
    "DiLoCoState",
    "Fragment",
    "FragmentPlan",
    "InFlight",
    "StepActions",
    "outer_state_bytes",
    "outer_state_bytes_per_rank",
    "plan_fragments",
    "sync_bytes_per_rank",
    "take_inner_step",
]
