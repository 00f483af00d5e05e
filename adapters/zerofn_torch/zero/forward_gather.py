"""The ``ZeroRedundancyOptimizer`` part that hides the exchange behind the
next forward (``gather_during_forward=True``; the order and the waits are
the core's, :mod:`zerofn.zero.forward_gather`).

``step()`` takes the local step, posts one broadcast per piece of the
exchange in the order the forward uses the parameters, and returns. A
forward pre-hook (one for the process, on every module) lets each module
run once the pieces holding its own parameters have arrived, and only
then; the rest arrive while it computes. The forward's order is watched
until the first step, and rank 0's is the one every rank follows (a
different order per rank would mismatch the broadcasts).

Whatever reads the parameters outside a module's forward must wait first:
:meth:`ForwardGathering.wait` (or :func:`wait_for_gathers`, for every
optimizer of the process). zerofn's own readers do: the next ``step()``,
the state dicts, ``save_sharded``, ``verify_replicas``, DiLoCo's syncs and
model averaging.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

from zerofn.comm import Program
from zerofn.zero.elastic.recovery_point import exchanged
from zerofn.zero.forward_gather import (
    Arrivals,
    compressed_arrivals,
    first_uses,
    plan_forward_gather,
)
from zerofn.zero.planning.plan import ShardPlan
from zerofn_torch.runtime.driver import PolledProgram, drive
from zerofn_torch.runtime.heartbeat import wait
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.zero.shell_state import ShellState

__all__ = ["Flight", "ForwardGathering", "Gathering", "wait_for_gathers"]

# Optimizers with a gather in flight, to finish before anything reads parameters.
_IN_FLIGHT: weakref.WeakSet[ForwardGathering] = weakref.WeakSet()


def wait_for_gathers() -> None:
    """Finish every gather of this process still behind a forward (a no-op
    without one), so that every parameter holds its updated value.

    Raises:
        zerofn.errors.CollectiveError: a gather failed.
    """
    for optimizer in list(_IN_FLIGHT):
        optimizer.wait()


@attrs.frozen(eq=False)
class Flight:
    """A gather in flight: the live program moving its pieces, their order
    and waits, and what its landing means to the optimizer.

    Attributes:
        program: the program, polled one piece at a time.
        gather: its pieces in the order they travel, and each parameter's wait.
        landed: called once every piece arrived.
    """

    program: PolledProgram[Any]
    gather: Arrivals
    landed: Callable[[], None]


class Gathering:
    """The live bookkeeping of ``gather_during_forward``: the parameters'
    indices, the forward's module calls (watched until the order is agreed),
    the order agreed from them, and the gather in flight.

    Attributes:
        calls: the parameters each module call used, until the order is
            first agreed (then ``None``).
        first_use: the first use of each parameter, once agreed.
        agreed: whether the ranks of this world agreed on ``first_use``.
        order: the pieces' order, for the shard plan it was made for.
        flight: the gather in flight, or ``None``.
        failed: the last gather failed behind the forward, after the step
            that started it had returned (until the world changes).
        grads: with ``redundancy=2``, the gradients the local step of the
            gather in flight took (or of one that failed), kept for a
            survivor that missed that step (the training loop may have
            zeroed or overwritten ``.grad`` since); ``None`` once it landed.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.index(params)
        self.calls: list[tuple[int, ...]] | None = []
        self.first_use: tuple[int | None, ...] | None = None
        self.agreed = False
        self.order: tuple[ShardPlan, Arrivals] | None = None
        self.flight: Flight | None = None
        self.failed = False
        self.grads: list[torch.Tensor | None] | None = None

    def index(self, params: list[torch.Tensor]) -> None:
        """Know ``params`` (the optimizer's, in order) from now on."""
        self._index = {id(p): i for i, p in enumerate(params)}

    def used_by(self, module: torch.nn.Module) -> tuple[int, ...]:
        """The indices of ``module``'s own parameters among the optimizer's."""
        index = self._index
        return tuple(index[id(p)] for p in module._parameters.values() if id(p) in index)


def _watch_forward(owner: ForwardGathering) -> None:
    """Register the process's forward pre-hook for ``owner``, held weakly
    and removed with it."""
    me = weakref.ref(owner)

    def before_forward(module: torch.nn.Module, _: Any) -> None:
        alive = me()
        if alive is not None:
            alive._before_forward(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    weakref.finalize(owner, handle.remove)


class ForwardGathering(ShellState):
    """The exchange of the optimizer's step, hidden behind the next forward
    when built with ``gather_during_forward=True``, else run inside it."""

    _gathering: Gathering | None

    def _start_gathering(self, enabled: bool) -> None:
        self._gathering = Gathering(self._all_params) if enabled else None
        if enabled:
            _watch_forward(self)

    def wait(self) -> None:
        """Finish the exchange of the last step, if it is still behind the
        forward (``gather_during_forward=True``; a no-op otherwise): call
        it before reading parameters outside a module's forward, for
        logging, an EMA or a checkpoint of the model.

        Raises:
            zerofn.errors.CollectiveError: the exchange failed (a peer died
                or hung): restart from a checkpoint, or, with
                ``redundancy=2``, go on without the lost rank
                (:func:`zerofn_torch.elastic.recover`).
        """
        flight = self._land_flight()
        if flight is None:
            return
        try:
            flight.program.wait()
        except BaseException:
            assert self._gathering is not None
            self._gathering.failed = True
            raise
        self._landed(flight)

    @property
    def exchange_behind_forward(self) -> bool:
        """Whether the last step's exchange is still behind the forward, or
        failed there: the ``step()`` that started it had returned, so
        whatever call failed since (a forward, DDP's collectives, a read of
        the parameters) was no step, and a recovery that finishes that step
        (:func:`zerofn_torch.elastic.recover`) leaves the call to be redone."""
        gathering = self._gathering
        return gathering is not None and (gathering.flight is not None or gathering.failed)

    @property
    def step_gradients(self) -> list[torch.Tensor | None]:
        """The gradients the last local step took, by parameter: kept beside
        an exchange behind the forward (``redundancy=2``), else the
        parameters' ``.grad``. What :func:`zerofn_torch.elastic.recover`
        hands a survivor that missed that step."""
        gathering = self._gathering
        if gathering is not None and gathering.grads is not None:
            return gathering.grads
        return [p.grad for p in self._all_params]

    @property
    def kept_gradient_bytes(self) -> int:
        """The bytes of the gradients kept for :attr:`step_gradients` (0
        unless an exchange is behind the forward with ``redundancy=2``)."""
        gathering = self._gathering
        kept = [] if gathering is None or gathering.grads is None else gathering.grads
        return sum(g.numel() * g.element_size() for g in kept if g is not None)

    def _landed(self, flight: Flight) -> None:
        """Every piece of ``flight`` arrived: nobody can have missed its step."""
        assert self._gathering is not None
        self._gathering.grads = None
        flight.landed()

    def _leave_world(self) -> None:
        """Leave the gather's old world behind, when the optimizer goes on
        in another: a gather still in flight there is abandoned (after a
        loss its group failed; a growth finished it first), and the
        forward's order is agreed again in the new world (a joiner
        learns rank 0's)."""
        flight = self._land_flight()
        if flight is not None:
            flight.program.abandon()
        gathering = self._gathering
        if gathering is not None:
            gathering.agreed, gathering.order, gathering.failed = False, None, False
            gathering.grads = None

    def _land_flight(self) -> Flight | None:
        """The gather in flight, taken off the books (``None``: none): whoever
        takes it finishes it or lets its error through."""
        gathering = self._gathering
        if gathering is None or gathering.flight is None:
            return None
        flight, gathering.flight = gathering.flight, None
        _IN_FLIGHT.discard(self)
        return flight

    def _gathers_now(self) -> bool:
        """Whether this step's exchange is to travel behind the forward.
        Not inside a ``Join``: the other joinables read the parameters when
        the last rank joins (DDP broadcasts its model), where no forward
        waits first."""
        join = getattr(self, "_join_config", None)
        return self._gathering is not None and not (join is not None and join.enable)

    def _agreed_first_use(self) -> tuple[int | None, ...]:
        """Each parameter's first use in the forward, rank 0's, agreed the
        first time a world asks for it (a collective then; rank 0 holds the
        order it watched or agreed before); parameters added since use none."""
        gathering = self._gathering
        assert gathering is not None
        params = self._all_params
        if not gathering.agreed:
            gathering.index(params)  # a param group may have been added
            mine = gathering.first_use or first_uses(gathering.calls or [], len(params))
            purpose = "gather_during_forward: agreeing on the forward's order"
            agreed = all_gather_objects(mine, self.process_group, purpose)[0]
            gathering.first_use, gathering.calls, gathering.agreed = tuple(agreed), None, True
        known = gathering.first_use
        assert known is not None
        return known + (None,) * (len(params) - len(known))

    def _forward_order(self, plan: ShardPlan) -> Arrivals | None:
        """How this step's exchange travels behind the forward (``None``:
        inside the step): the exact exchange's pieces in the forward's order
        (collective the first time one is needed), or the compressed
        exchange's own pieces, which keep their order."""
        gathering = self._gathering
        if gathering is None or not self._gathers_now():
            return None
        if gathering.order is None or gathering.order[0] is not plan:
            compressed = self._zero.compressed
            order: Arrivals
            if compressed is not None:
                gathering.calls = None  # no order to agree on: stop watching
                order = compressed_arrivals(plan, compressed.exchange.piece)
            else:
                gathering.index(self._all_params)
                order = plan_forward_gather(plan, self._agreed_first_use())
            gathering.order = (plan, order)
        return gathering.order[1]

    def _exchange(self, program: Program[Any], order: Arrivals | None, purpose: str) -> None:
        """Run the step's ``program``: to its end (then the position moves
        on), or, with an ``order`` (:meth:`_forward_order`), up to its first
        piece to collect (the local step taken, every piece posted)."""
        if order is None:
            wait(drive(program, self.process_group, purpose), purpose)
            self._exchanged()
            return
        if self._zero.options.redundancy == 2:  # a survivor may miss this step
            assert self._gathering is not None
            grads = [p.grad for p in self._all_params]
            self._gathering.grads = [None if g is None else g.detach().clone() for g in grads]
        self._behind_forward(order, program, purpose, self._exchanged)

    def _behind_forward(
        self,
        gather: Arrivals,
        program: Program[None],
        purpose: str,
        landed: Callable[[], None] = lambda: None,
    ) -> None:
        """Start ``program`` (its pieces ``gather``) and leave it in flight
        for the next forward, or a reader of parameters, to finish."""
        flight = PolledProgram(program, self.process_group, purpose)
        assert self._gathering is not None and self._gathering.flight is None
        self._gathering.flight = Flight(flight, gather, landed)
        _IN_FLIGHT.add(self)

    def _exchanged(self) -> None:
        """Every piece arrived: the step is over (a CollectiveError before
        this leaves the position "not exchanged")."""
        self._position = exchanged(self._position)
        self._versions = self._read_versions()

    def _before_forward(self, module: torch.nn.Module) -> None:
        gathering = self._gathering
        if gathering is None:
            return
        used = gathering.used_by(module)
        if not used:
            return
        if gathering.calls is not None:
            gathering.calls.append(used)
        flight = gathering.flight
        if flight is None:
            return
        try:
            flight.program.advance_until(flight.gather.waits(used))
        except BaseException:
            self._land_flight()
            gathering.failed = True
            raise
        if flight.program.ended:
            self._land_flight()
            self._landed(flight)
