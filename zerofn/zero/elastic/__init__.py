"""Going on without a lost rank, or with joiners (``redundancy=2``): who
carries whose shard and the carried copy (:mod:`~zerofn.zero.elastic.carried`),
the plan after ranks are lost or join (:mod:`~zerofn.zero.elastic.redundancy`),
optimizer state by piece of a parameter (:mod:`~zerofn.zero.elastic.piece_state`),
a rank rebuilt for the new world (:mod:`~zerofn.zero.elastic.regroup`), the
point survivors go on from (:mod:`~zerofn.zero.elastic.recovery_point`) and who
is silent (:mod:`~zerofn.zero.elastic.liveness`)."""
