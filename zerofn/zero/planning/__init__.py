"""Who owns what, and how shards travel: the partition modes
(:mod:`~zerofn.zero.planning.partition`: greedy, balanced, flat, manual, and
the pieces each rank holds), the flat exchange buffers
(:mod:`~zerofn.zero.planning.layout`), the plan tying them together
(:mod:`~zerofn.zero.planning.plan`), and a flat shard stepped in cache-sized
views (:mod:`~zerofn.zero.planning.chunks`)."""
