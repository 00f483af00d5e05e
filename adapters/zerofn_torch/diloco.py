"""DiLoCo: local inner steps, an outer optimizer on pseudo-gradients, sharded outer state.

``DiLoCoOptimizer`` wraps any optimizer the way ``PostLocalSGDOptimizer``
does: ``DiLoCoOptimizer(torch.optim.AdamW(model.parameters()), sync_every=50)``.
Inner steps communicate nothing. After every ``sync_every``-th one, each
fragment of the parameters is synced (the core's program,
:mod:`zerofn.diloco.sync` or :mod:`zerofn.diloco.compressed_sync`): the
owners of its slices step the outer optimizer on the pseudo-gradient
``anchor - mean over ranks of the parameters``, and every rank merges the
new anchor into its parameters (:mod:`zerofn.diloco.merge`), at once or
``delay`` inner steps later. When a sync starts and when its result is
applied is the core's :func:`zerofn.diloco.state.take_inner_step`.

This shell holds the live tensors (anchor slices, the outer optimizer, the
compressed mode's replica and residual) and the one sync in flight, which it
moves on, request by request, whenever it gets the chance without waiting:
at each ``step`` and ``zero_grad`` and as gradients accumulate during
backward; it waits only when the result is due. A failed collective raises
:class:`zerofn.errors.CollectiveError` there, on every live rank; with
``redundancy=2`` the others go on (:mod:`zerofn_torch.diloco_carried`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofn.diloco.checkpoint import (
    check_layout,
    check_tensors,
    consolidate,
    rank_state_dict,
    shard,
)
from zerofn.diloco.compressed_sync import compressed_sync_program
from zerofn.diloco.config import Compression, DiLoCoConfig
from zerofn.diloco.fragments import plan_fragments, read_fragment, write_fragment
from zerofn.diloco.merge import merge
from zerofn.diloco.outer import (
    OuterOptimizerFactory,
    OuterStep,
    check_outer_optimizer,
    default_outer_optimizer,
    outer_step,
)
from zerofn.diloco.redundancy import carried_rank, redundant_sync_program
from zerofn.diloco.redundant_compressed_sync import redundant_compressed_sync_program
from zerofn.diloco.schedule import applied_at
from zerofn.diloco.start import agree_program
from zerofn.diloco.state import DiLoCoState, InFlight, state_from_dict, take_inner_step
from zerofn.diloco.sync import SyncProgram, run_sync, sync_program
from zerofn_torch.diloco_carried import (
    CarriedOuter,
    CarryingWorker,
    check_redundancy,
    state_tensors,
    workers_of,
)
from zerofn_torch.diloco_refusals import (
    NO_JOIN,
    refuse_all_reducing_ddp,
    refuse_carried_inner,
    stepped_in_backward,
)
from zerofn_torch.runtime.driver import PolledProgram, drive
from zerofn_torch.runtime.object_collectives import all_gather_objects
from zerofn_torch.runtime.wrapped_optimizer import WrappedOptimizer, innermost, parameters_written
from zerofn_torch.zero.forward_gather import wait_for_gathers

__all__ = ["DiLoCoOptimizer"]


class DiLoCoOptimizer(CarryingWorker, WrappedOptimizer):
    """DiLoCo and Streaming DiLoCo around any inner optimizer.

    Each :meth:`step` steps ``optim`` alone; the fragments' syncs start and
    are applied as :class:`zerofn.diloco.config.DiLoCoConfig` describes.
    All ranks of ``process_group`` start from its rank 0's parameters (one
    broadcast, at construction) and step in lockstep. The anchor and the
    outer optimizer's state are sharded: each rank keeps the slices it owns.

    Args:
        optim: the inner optimizer (its parameters are what DiLoCo syncs).
        sync_every: inner steps between two syncs of a fragment (H).
        outer_optimizer: ``tensors -> torch.optim.Optimizer`` over exactly
            the tensors given (this rank's anchor slices); an element-wise
            optimizer. Default: SGD, lr 0.7, Nesterov momentum 0.9.
        fragments: fragments synced in turn (P); must divide ``sync_every``.
        delay: inner steps a sync overlaps before its result is applied
            (tau); below ``sync_every // fragments``.
        compression: ``None``, ``"int8"``, ``"int4"``, ``"int2"``, a
            :class:`zerofn.topk.TopK` (e.g. ``TopK(density=0.02, bits=2)``:
            the top 2% of each chunk, 2-bit values), or a
            :class:`zerofn.blockquant.BlockQuantizer` or
            :class:`zerofn.twobit.TwoBitQuantizer`: pseudo-gradients and
            anchor updates travel compressed, with error feedback (8 more
            bytes per parameter on every rank: the anchor's replica and the
            residual).
        process_group: the group across DiLoCo workers (default: the
            world). A model under DDP over groups inside each worker is fine.
        mixing: the weight of the local values when a result is applied
            (0: take the global values, as DiLoCo; 0.5: Streaming DiLoCo's).
        redundancy: 2 keeps a copy of each rank's outer state on the next
            rank, so the others go on when one is lost (``recover`` of
            :mod:`zerofn_torch.elastic`): every rank gets each sync's sum
            (fp32: 1.5 times the bytes; compressed: every rank's codes),
            kept until the next (with a delay, its starting values too).
            Needs an inner optimizer that is not sharded across ranks. With
            workers of several ranks (DDP over a group inside each, one
            outer group per local index), every rank of the job builds its
            ``DiLoCoOptimizer`` at the same time (they learn the layout from
            each other), and a lost rank takes its whole worker with it.

    Raises:
        ValueError, TypeError: a bad configuration (see
            :class:`~zerofn.diloco.config.DiLoCoConfig`), more fragments than
            parameter elements, a rank outside ``process_group``, an outer
            optimizer that is not element-wise or not over the given
            tensors, parameters under a DDP model that averages gradients
            across workers, a ZeRO inner optimizer with ``redundancy=2``,
            or a ``redundancy`` this configuration cannot keep.
        zerofn.errors.CollectiveError: the starting broadcast failed.
    """

    join_refusal = NO_JOIN

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        sync_every: int,
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int = 1,
        delay: int = 0,
        compression: Compression = None,
        process_group: Any | None = None,
        *,
        mixing: float = 0.0,
        redundancy: int = 1,
    ) -> None:
        # Deliberately no Optimizer.__init__: the inner optimizer owns the
        # parameters and their state; this class shares its param groups.
        self.config = DiLoCoConfig(sync_every, fragments, delay, mixing, compression)
        group: Any = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                "this rank is not in process_group: build DiLoCoOptimizer on the ranks of "
                "the group it syncs over"
            )
        params = [p for g in optim.param_groups for p in g["params"]]
        world_size = dist.get_world_size(group)
        workers = workers_of(group, gather=redundancy == 2)
        check_redundancy(redundancy, self.config, workers, optim)
        plan = plan_fragments([p.numel() for p in params], fragments, world_size)
        refuse_all_reducing_ddp(params, group)
        refuse_carried_inner(optim)
        self.optim = optim
        self.param_groups = optim.param_groups
        self.process_group = group
        self._params = params
        self._plan = plan
        self._rank = rank
        # The outer optimizer is built (and checked) before anything changes;
        # its tensors are filled once the ranks agree on the parameters.
        self._anchors = [
            torch.empty(f.lengths[rank], dtype=torch.float32, device=params[0].device)
            for f in plan.fragments
        ]
        factory = outer_optimizer if outer_optimizer is not None else default_outer_optimizer
        self._factory = factory
        self.outer = check_outer_optimizer(factory(self._anchors), self._anchors)
        self._carried = (
            CarriedOuter(plan, rank, factory, params[0].device) if redundancy == 2 else None
        )
        drive(agree_program(params), group, "DiLoCo: starting from rank 0's parameters").wait()
        parameters_written(optim)
        start = [read_fragment(f, params) for f in plan.fragments]
        for anchor, f, values in zip(self._anchors, plan.fragments, start, strict=True):
            anchor.copy_(values[f.owned(rank)])
        if self._carried is not None:
            self._carried.fill(plan, rank, start)
        self._start_beating(group, workers, redundancy)
        self._replica: torch.Tensor | None = None
        self._residual: torch.Tensor | None = None
        if self.config.compression is not None:
            self._replica = torch.cat(start)
            self._residual = torch.zeros_like(self._replica)
        self._state = DiLoCoState()
        self._flight: PolledProgram[torch.Tensor] | None = None
        self._result: torch.Tensor | None = None
        self._taken = False
        self._hooks = self._poll_during_backward()

    # ----- the optimizer's face ------------------------------------------------------

    @property
    def inner_steps(self) -> int:
        """Inner steps taken so far."""
        return self._state.step

    def __repr__(self) -> str:
        return f"DiLoCoOptimizer({self.config}, inner={self.optim!r}, outer={self.outer!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused (``ValueError``, always): the fragments and the outer state
        are cut for the parameters given at construction."""
        raise ValueError(
            "DiLoCoOptimizer cuts its fragments and outer state for the parameters it was "
            "built over; add every param group to the inner optimizer before wrapping it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner optimizer's gradients (and move a sync in flight on)."""
        self._poll()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """One inner step; then start a fragment's sync and apply a due
        result, as the schedule says.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns the inner optimizer's return value.

        Raises:
            zerofn.errors.CollectiveError: a sync whose result is due now
                failed (a peer died or hung), on every live rank.
        """
        self._check_inner()
        self._poll()
        if stepped_in_backward(self.optim):
            loss = None  # DDP's backward took the inner step, through the overlap hook
        else:
            loss = self.optim.step() if closure is None else self.optim.step(closure)
        self._taken = True  # a loss from here on finds this step taken
        after, actions = take_inner_step(self.config, self._state)
        if actions.start is not None or actions.apply is not None:
            wait_for_gathers()  # the parameters must hold the inner step's update
        if actions.start is not None:
            self._start(actions.start, after.step)
        if actions.apply is not None:
            self._apply(actions.apply)
        self._state, self._taken = after, False
        return loss

    def _check_inner(self) -> None:
        """Refuse to step an inner optimizer DiLoCo cannot sync as it is now.

        Raises:
            ValueError: a param group was added to the inner optimizer after
                it was wrapped, or the inner optimizer is in a ``Join``.
        """
        count = sum(len(g["params"]) for g in self.optim.param_groups)
        if count != len(self._params):
            raise ValueError(
                f"the inner optimizer holds {count} parameters, DiLoCoOptimizer was built over "
                f"{len(self._params)}: a param group added to the inner optimizer after wrapping "
                "it would never be synced. Add every group before building DiLoCoOptimizer"
            )
        config = getattr(innermost(self.optim), "_join_config", None)
        if config is not None and config.enable:
            raise ValueError(NO_JOIN)

    # ----- the sync in flight ------------------------------------------------------------

    def _poll(self) -> None:
        self._check_alarm()
        if self._flight is not None:
            self._flight.poll()

    def _poll_during_backward(self) -> list[Any]:
        # Gradients accumulate all through backward: each is a chance to move
        # a sync on without waiting. The hook holds this optimizer weakly.
        me = weakref.ref(self)

        def poll(_: torch.Tensor) -> None:
            alive = me()
            if alive is not None:
                alive._poll()

        hooks = [
            p.register_post_accumulate_grad_hook(poll) for p in self._params if p.requires_grad
        ]
        weakref.finalize(self, lambda hs: [h.remove() for h in hs], hooks)
        return hooks

    def _start(self, fragment: int, t: int, values: torch.Tensor | None = None) -> None:
        f = self._plan.fragments[fragment]
        values = read_fragment(f, self._params) if values is None else values
        anchor, codec = self._anchors[fragment], self.config.compression
        span = slice(f.start, f.start + f.numel)
        replica = None if self._replica is None else self._replica[span]
        residual = None if self._residual is None else self._residual[span]
        program: SyncProgram
        if self._carried is not None:
            self._carried.entered(t, applied_at(self.config, t), values, replica, residual)
            carried = self._carried.anchors[fragment]
            if codec is None:
                program = redundant_sync_program(f, self._rank, values, anchor, carried)
            else:
                assert replica is not None and residual is not None
                program = redundant_compressed_sync_program(
                    f, self._rank, values, replica, residual, anchor, carried, codec
                )
        elif codec is None:
            program = sync_program(f, self._rank, values, anchor)
        else:
            assert replica is not None and residual is not None
            program = compressed_sync_program(
                f, self._rank, values, replica, residual, anchor, codec
            )
        purpose = f"DiLoCo sync of fragment {fragment} (after inner step {t})"
        self._flight = PolledProgram(
            run_sync(program, self.answer_outer_step), self.process_group, purpose
        )
        self._result = None

    def answer_outer_step(self, request: OuterStep) -> torch.Tensor:
        """Step the outer optimizer a sync (or a recovery) asks for: this
        rank's slice, or (``request.carried``) its copy of the carried rank's."""
        if not request.carried:
            return outer_step(self.outer, self._anchors, request)
        assert self._carried is not None
        stepped = outer_step(self._carried.outer, self._carried.anchors, request)
        self._carried.summed = True  # both slices stepped from the sum
        return stepped

    def drain(self) -> None:
        """Finish the communication of the sync in flight, if any; its result
        is still applied at its due step.

        Raises:
            zerofn.errors.CollectiveError: the sync failed.
        """
        if self._flight is not None:
            flight, self._flight = self._flight, None
            self._result = flight.wait()

    def _apply(self, flight: InFlight) -> None:
        self.drain()
        assert self._result is not None
        self._merge(flight.fragment, self._result)
        self._result = None

    def _merge(self, index: int, result: torch.Tensor) -> None:
        """Merge a sync's ``result`` into the parameters of fragment ``index``."""
        fragment = self._plan.fragments[index]
        local = read_fragment(fragment, self._params)
        write_fragment(fragment, self._params, merge(local, result, self.config.mixing))
        parameters_written(self.optim)

    # ----- memory and checkpoints --------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes of outer state on this rank: anchor slices, the outer
        optimizer's state tensors, (compressed) the replica and residual, and
        (``redundancy=2``) the carried copy and the last sync's sum. A sync
        in flight holds one fragment's values on top, until applied."""
        tensors = [*self._anchors, *state_tensors(self.outer)]
        tensors += [t for t in (self._replica, self._residual) if t is not None]
        tensors += [] if self._carried is None else self._carried.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    def _own(self) -> dict[str, Any]:
        """This rank's DiLoCo state dict (see :mod:`zerofn.diloco.checkpoint`)."""
        self.drain()
        return rank_state_dict(
            self._plan,
            self._rank,
            self._state,
            self._result,
            self._anchors,
            self.outer.state_dict(),
            self._replica,
            self._residual,
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict with this rank's DiLoCo state
        under ``"diloco"`` (plain tensors, ints and lists: safe for
        ``torch.load(weights_only=True)``). A sync in flight is finished
        first and its result saved, so a resumed run applies it at the same
        step. Loads on this rank of an outer group of the same size.

        Raises:
            zerofn.errors.CollectiveError: the sync in flight failed.
        """
        saved = self.optim.state_dict()
        saved["diloco"] = self._own()
        return saved

    def consolidated_state_dict(self) -> dict[str, Any]:
        """Like :meth:`state_dict`, with the DiLoCo state joined over the
        outer group (:meth:`outer_state_dict`), so it loads on an outer group
        of any size; the inner optimizer's state is this rank's. Collective:
        call on every rank.

        Raises:
            zerofn.errors.CollectiveError: the sync in flight, or the
                gathering, failed.
        """
        saved = self.optim.state_dict()
        saved["diloco"] = self.outer_state_dict()
        return saved

    def outer_state_dict(self) -> dict[str, Any]:
        """DiLoCo's own state alone (schedule, anchor, outer optimizer, the
        compressed sync's replica and residual), joined over the outer group:
        the same on every rank of it, and loadable on an outer group of any
        size with :meth:`load_outer_state_dict`. Collective: call on every
        rank. ``save_sharded`` keeps it beside a ZeRO inner optimizer's shards.

        Raises:
            zerofn.errors.CollectiveError: the sync in flight, or the
                gathering, failed.
        """
        every = all_gather_objects(self._own(), self.process_group, "DiLoCo: consolidating")
        return consolidate(self._plan, every)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (same rank and world size) or
        :meth:`consolidated_state_dict` (any world size).

        A sync in flight here is finished first (every rank must). Nothing
        changes when the state dict is refused.

        Raises:
            ValueError: no ``"diloco"`` entry, or one that does not fit this
                optimizer (other parameters, fragments, compression or
                schedule; another rank's or world size's per-rank state).
            zerofn.errors.CollectiveError: the sync in flight failed.
        """
        if "diloco" not in state_dict:
            raise ValueError(
                "the state dict has no 'diloco' entry: load one saved by "
                "DiLoCoOptimizer.state_dict() or consolidated_state_dict()"
            )
        inner = {k: v for k, v in state_dict.items() if k != "diloco"}
        self._load(state_dict["diloco"], lambda: self.optim.load_state_dict(inner))

    def wrapper_state_dict(self) -> dict[str, Any]:
        """:meth:`outer_state_dict` (collective: call on every rank)."""
        return self.outer_state_dict()

    def load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`load_outer_state_dict`."""
        self.load_outer_state_dict(state)

    def load_outer_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Resume DiLoCo's own state from :meth:`outer_state_dict` (or the
        ``"diloco"`` entry of :meth:`state_dict`, same rank and world size);
        the inner optimizer is left as it is. Nothing changes when refused.

        Raises:
            ValueError: a state that does not fit this optimizer.
            zerofn.errors.CollectiveError: the sync in flight failed.
        """
        self._load(saved, lambda: None)

    def _load(self, saved: Mapping[str, Any], load_inner: Callable[[], None]) -> None:
        """Check ``saved`` (DiLoCo's part), then ``load_inner()``, then set
        DiLoCo's tensors; the outer optimizer is restored if the inner load
        raises."""
        self.drain()
        compressed = self.config.compression is not None
        if saved.get("world_size", 0) is None:
            saved = shard(self._plan, saved, self._rank)
        check_layout(self._plan, saved, self._rank, compressed)
        state = state_from_dict(self.config, saved["state"])
        check_tensors(self._plan, self._rank, saved, state)
        before = copy.deepcopy(self.outer.state_dict())
        self.outer.load_state_dict(saved["outer"])
        try:
            load_inner()
        except Exception:
            self.outer.load_state_dict(before)
            raise
        with torch.no_grad():
            for anchor, value in zip(self._anchors, saved["anchor"], strict=True):
                anchor.copy_(value)
            for mine, value in (
                (self._replica, saved["replica"]),
                (self._residual, saved["residual"]),
            ):
                if mine is not None:
                    mine.copy_(value)
        self._result = None if saved["result"] is None else saved["result"].clone()
        self._state = state
        if self._carried is not None:  # every rank loads: hand each carrier its copy
            every = all_gather_objects(self._own(), self.process_group, "DiLoCo: carried copies")
            self._carried.load(every[carried_rank(self._rank, self.world_size)])
