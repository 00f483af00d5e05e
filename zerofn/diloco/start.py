"""Starting from one set of parameters: the program every DiLoCo run begins with.

DiLoCo's first pseudo-gradient measures how far each worker moved from the
anchor, so all workers must start from the same parameters, and the anchor
must be those parameters. :func:`agree_program` makes them the outer
group's rank 0's (as DDP does when it wraps a model): one broadcast per
dtype, each dtype's parameters packed flat, values unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofn.comm import Broadcast, Program, split_like

__all__ = ["agree_program"]


def agree_program(params: Sequence[torch.Tensor]) -> Program[None]:
    """Give every rank rank 0's ``params``.

    Args:
        params: this rank's parameters (the same shapes and dtypes on every
            rank), handed over: rank 0's values are written into them.

    Returns:
        A program of one :class:`~zerofn.comm.Broadcast` per dtype (none for
        no parameters).
    """
    dtypes = list(dict.fromkeys(p.dtype for p in params))
    for index, dtype in enumerate(dtypes):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([p.detach().reshape(-1) for p in group])
        (received,) = yield Broadcast(flat, src=0, last=index == len(dtypes) - 1)
        with torch.no_grad():
            for param, value in zip(group, split_like(received, group), strict=True):
                param.copy_(value)
