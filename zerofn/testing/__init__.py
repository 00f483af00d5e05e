"""Tools for testing sharding logic built on zerofn.

:mod:`zerofn.testing.strategies` holds `hypothesis <https://hypothesis.readthedocs.io>`_
strategies for world sizes, parameter sizes, param groups, tensor shapes, DDP
bucket layouts and optimizer state dicts::

    from hypothesis import given
    from zerofn.testing import strategies as zst

    @given(zst.group_sizes(), zst.world_sizes())
    def test_every_parameter_has_one_owner(groups, world_size): ...

hypothesis is a test extra (``pip install zerofn[test]``), not a dependency of
zerofn: this package imports it only when :mod:`zerofn.testing.strategies` is
imported.
"""

from __future__ import annotations
