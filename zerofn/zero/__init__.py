"""ZeRO: sharding optimizer state across ranks, as pure functions.

- :mod:`~zerofn.zero.planning`: who owns which parameters (greedy,
  balanced, flat, manual) and the pieces each rank holds, the flat buffers
  shards travel in, the plan tying them together, and a flat shard stepped
  in cache-sized views;
- :mod:`~zerofn.zero.exchange`: packing shards and the exchange program;
- :mod:`~zerofn.zero.shards`, :mod:`~zerofn.zero.step`: how each mode holds
  its shard, and the step as one program;
- :mod:`~zerofn.zero.rank`: one rank's whole state, built once for the
  optimizer and the simulated world, and its local step;
  :mod:`~zerofn.zero.rank_state`, :mod:`~zerofn.zero.replan`,
  :mod:`~zerofn.zero.hook_driven`: its state dicts, its re-planning, and
  what the overlap hook may do to it;
- :mod:`~zerofn.zero.mixed_precision`: master dtypes, clipping, the master
  copies a rank steps, fp16's loss-scale schedule;
- :mod:`~zerofn.zero.compressed`: sending the masters' quantized differences;
- :mod:`~zerofn.zero.shard_state`, :mod:`~zerofn.zero.checkpoint`:
  optimizer state across ranks and on disk;
- :mod:`~zerofn.zero.params`, :mod:`~zerofn.zero.optimizers`,
  :mod:`~zerofn.zero.options`: checks on what a user passes (and the plan
  a partition makes), resolved in one place;
- :mod:`~zerofn.zero.elastic`: going on without a lost rank, or with
  joiners (``redundancy=2``).

Modules that moved into the subpackages keep their old import paths
(:mod:`~zerofn.zero.old_paths`).
"""

from zerofn.zero.old_paths import install

install()
