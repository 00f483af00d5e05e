"""DDP hooks the core cannot see into (PyTorch's own, or yours), as core hooks.

:func:`foreign_hook` wraps such a hook as a :class:`zerofn.hooks.hook.CommHook`
whose program awaits the running hook's future with an :class:`Await`, a
request only the adapter's driver (:func:`zerofn_torch.runtime.issue.issue`) answers;
so combinators (the overlapped ZeRO step) can wrap any DDP hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from zerofn.comm import Program
from zerofn.hooks.hook import BucketInfo, CommHook

__all__ = ["Await", "foreign_hook"]


@attrs.frozen(eq=False)
class Await:
    """A request the core does not know: the result of a DDP hook the core
    cannot see into (PyTorch's own, or yours), already started. The driver
    answers with the future's value; a failure fails the request with a
    :class:`~zerofn.errors.CollectiveError` naming the hook (one the hook
    raised itself passes through as it is).

    Attributes:
        future: the running hook's future of the reduced flat gradient.
        hook: the hook's name, for the error.
        last: always the program's final request.
    """

    future: torch.futures.Future[torch.Tensor]
    hook: str = "a DDP hook"
    last: bool = True


def foreign_hook(
    fn: Callable[[Any, Any], torch.futures.Future[torch.Tensor]],
) -> CommHook[None, None]:
    """A DDP hook the core cannot see into, ``fn(state, bucket)``, as a core
    hook, so combinators (the overlapped ZeRO step) can wrap it.

    The bucket's :attr:`~zerofn.hooks.hook.BucketInfo.handle` must be the pair
    ``(state, bucket)`` DDP passed; ``fn`` starts when the hook starts (in
    bucket order) and its program awaits ``fn``'s future (:class:`Await`).
    Only the adapter's driver (:mod:`zerofn_torch.runtime.driver`) runs such a program.
    """

    name = getattr(fn, "__name__", "hook")

    def start(
        grad: torch.Tensor, bucket: BucketInfo, g: None, b: None
    ) -> tuple[None, Program[tuple[torch.Tensor, None]]]:
        running = fn(*bucket.handle)

        def program() -> Program[tuple[torch.Tensor, None]]:
            (reduced,) = yield Await(running, name)  # type: ignore[misc]
            return reduced, None

        return None, program()

    return CommHook(init=lambda: None, start=start, name=name)
