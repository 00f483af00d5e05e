"""Low-precision parameters: master dtypes and clipping
(:mod:`~zerofn.zero.mixed_precision.precision`), the master copies a rank
steps (:mod:`~zerofn.zero.mixed_precision.masters`), and fp16's loss-scale
schedule (:mod:`~zerofn.zero.mixed_precision.loss_scale`)."""
