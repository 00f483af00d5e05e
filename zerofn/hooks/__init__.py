"""DDP communication hooks as programs over explicit state.

- :mod:`~zerofn.hooks.hook`: the :class:`~zerofn.hooks.hook.CommHook`
  record, its state transitions, plain averaging and the ``cast`` combinator;
- :mod:`~zerofn.hooks.gather`, :mod:`~zerofn.hooks.quantization`,
  :mod:`~zerofn.hooks.sparsify`, :mod:`~zerofn.hooks.random_k`: lossy hooks
  whose ranks all-gather encoded gradients (random-k drawing its positions
  from the iteration's shared random stream);
- :mod:`~zerofn.hooks.error_feedback`: carrying what a lossy hook dropped
  into the next iteration;
- :mod:`~zerofn.hooks.powersgd`: PowerSGD, low-rank compression with error
  feedback and warm start.
"""
