"""Capacity planning: what each rank holds and sends, before anything runs.

:func:`~zerofn.footprint.plan.plan_footprint` answers "does this model fit on
N ranks with this partition?" from parameter shapes alone (or any
``nn.Module``, including one built on the ``meta`` device, which allocates
nothing). Every number is exact and comes from the same core functions the
adapter uses (partition, buffer layouts, PowerSGD's compression decisions),
so it equals what ``zerofn_torch`` allocates and sends; the tests check that
on live ranks.

- :mod:`~zerofn.footprint.plan`: the planner, pure functions over frozen
  records (re-exported here);
- :mod:`~zerofn.footprint.cli`: its command line, which reads models by name
  or from a factory and prints Markdown tables.

Run it as a program::

    python -m zerofn.footprint --model gpt2-small --world-size 8 --world-size 64 \\
        --partition flat --param-dtype bf16
"""

from zerofn.footprint import plan
from zerofn.footprint.plan import *  # noqa: F403  (one list of names: plan's own)

__all__ = plan.__all__
