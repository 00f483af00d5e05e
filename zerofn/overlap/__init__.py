"""Overlapping the ZeRO step with DDP's backward.

- :mod:`~zerofn.overlap.ddp_buckets`: which rank updates which part of
  each DDP gradient bucket;
- :mod:`~zerofn.overlap.state`: the overlap record (status, buckets, plan)
  and its transitions;
- :mod:`~zerofn.overlap.step`: the programs: reduce each shard's gradients
  to its owner, broadcast the owners' updates;
- :mod:`~zerofn.overlap.hook`: the overlapped step as a communication hook
  around any other (:func:`~zerofn.overlap.hook.zero_step_hook`);
- :mod:`~zerofn.overlap.orders`: what a rank does for the hook's step order,
  one program (checks, the local step, the owners' broadcasts).

The names of :mod:`~zerofn.overlap.state` are importable from here too
(``zerofn.overlap`` was that one module before the folder).
"""

from zerofn.overlap import state
from zerofn.overlap.state import *  # noqa: F403  (one list of names: state's own)

__all__ = state.__all__
