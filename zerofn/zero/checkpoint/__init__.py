"""A ZeRO optimizer's state on disk, as pure parts: :mod:`~zerofn.zero.checkpoint.sharded`
(each rank's keys and records of a sharded checkpoint),
:mod:`~zerofn.zero.checkpoint.manifest` (the manifest that says what a
checkpoint holds, and checks it) and :mod:`~zerofn.zero.checkpoint.run`
(which directories of a run are checkpoints, or saves in progress)."""
