"""ZeRO: sharding optimizer state across ranks, as pure functions.

- :mod:`~zerofn.zero.partition`: who owns which parameters (greedy,
  balanced, flat, manual), and the pieces each rank holds;
- :mod:`~zerofn.zero.layout`, :mod:`~zerofn.zero.plan`: the flat buffers
  shards travel in, and the plan tying partition and layouts together;
- :mod:`~zerofn.zero.exchange`: packing shards and the exchange program;
- :mod:`~zerofn.zero.shards`, :mod:`~zerofn.zero.step`: how each mode holds
  its shard, and the step as one program;
- :mod:`~zerofn.zero.rank`: one rank's whole state, built once for the
  optimizer and the simulated world, and its local step;
  :mod:`~zerofn.zero.rank_state`, :mod:`~zerofn.zero.replan`,
  :mod:`~zerofn.zero.hook_driven`: its state dicts, its re-planning, and
  what the overlap hook may do to it;
- :mod:`~zerofn.zero.masters`, :mod:`~zerofn.zero.compressed`: the
  exact copies a rank steps, and sending their quantized differences;
- :mod:`~zerofn.zero.chunks`: stepping a flat shard in cache-sized views;
- :mod:`~zerofn.zero.precision`: master weights, clipping;
- :mod:`~zerofn.zero.loss_scale`: fp16's loss-scale schedule;
- :mod:`~zerofn.zero.shard_state`, :mod:`~zerofn.zero.checkpoint`:
  optimizer state across ranks and on disk;
- :mod:`~zerofn.zero.params`, :mod:`~zerofn.zero.arguments`,
  :mod:`~zerofn.zero.optimizers`: checks on what a user passes;
- :mod:`~zerofn.zero.elastic`: going on without a lost rank, or with
  joiners (``redundancy=2``).

Modules that moved into the subpackages keep their old import paths
(:mod:`~zerofn.zero.old_paths`).
"""

from zerofn.zero.old_paths import install

install()
