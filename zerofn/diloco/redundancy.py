"""DiLoCo with ``redundancy=2``: every rank's outer state also lives on its
carrier, so the workers go on when one is lost.

Rank ``r`` owns a slice of every fragment (its anchor and outer optimizer
state, see :mod:`zerofn.diloco.fragments`); its *carrier*, rank
``(r + 1) % W``, keeps a copy of the same slices and steps it with the same
pseudo-gradient, bit for bit. So the outer state of any one lost rank is
still on a survivor.

A sync (:func:`redundant_sync_program`) therefore all-reduces the fragment
(not a reduce to each owner alone): owner and carrier must both hold the
slice's sum, and an all-reduce hands every rank the same bits. Each rank
then steps its own slice and the slice it carries, and the owners' new
slices are gathered as in the plain sync. Its bytes are one all-reduce and
one all-gather of the fragment: 1.5 times the plain sync's.

After a loss the survivors' outer states are whole again in one of two
ways, decided by :func:`sync_recovery` from where each stood
(:class:`SyncPosition`):

- some survivor holds the sum of the last sync any of them entered: that
  sync is finished with it (*forward*), the others stepping their slices
  from the same sum;
- none does: nobody stepped it (stepping needs the sum), and it is run again
  by the survivors (*back*), without the lost rank's parameters.

Then :func:`regrouped` cuts the outer state for the survivors' world from
each old rank's own state (or its carrier's copy, for a lost rank). With a
``delay`` the sync may be in flight across inner steps: a result finished
forward waits for its due step, and a sync run again starts from the values
it started from (which each rank keeps while it is in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.comm import (
    AllGatherObjects,
    AllReduce,
    Broadcast,
    GatherSegments,
    ObjectRequest,
    Request,
)
from zerofn.diloco.checkpoint import consolidate, shard
from zerofn.diloco.compressed_sync import replica_after_sync
from zerofn.diloco.config import Codec
from zerofn.diloco.fragments import Fragment, FragmentPlan, plan_fragments
from zerofn.diloco.outer import OuterStep, pseudo_gradient
from zerofn.diloco.sync import SyncProgram
from zerofn.validators import int_at_least

__all__ = [
    "InconsistentSyncs",
    "RegroupProgram",
    "Regrouped",
    "StateDicts",
    "SyncPosition",
    "SyncRecovery",
    "carried_rank",
    "carrier_of",
    "copies_disagreement",
    "outer_state_tensors",
    "outer_steps",
    "redundant_sync_program",
    "regroup_program",
    "regrouped",
    "sync_recovery",
]

_non_negative = int_at_least(0)


def carrier_of(rank: int, world_size: int) -> int:
    """The rank that keeps a copy of ``rank``'s outer state: the next one, around the ring."""
    return (rank + 1) % world_size


def carried_rank(rank: int, world_size: int) -> int:
    """The rank whose outer state ``rank`` keeps a copy of: the previous one."""
    return (rank - 1) % world_size


def redundant_sync_program(
    fragment: Fragment,
    rank: int,
    values: torch.Tensor,
    anchor: torch.Tensor,
    carried_anchor: torch.Tensor,
) -> SyncProgram:
    """Sync one fragment on rank ``rank``, stepping the slice it carries too.

    Args:
        fragment: the fragment, with its owners' slices.
        rank: this rank's index in the outer group (of at least 2 ranks).
        values: this rank's values of the fragment (``float32``), handed
            over: it holds the fragment's sum over ranks once the program
            asks for its first outer step, and keeps it to the end.
        anchor: this rank's anchor slice of the fragment.
        carried_anchor: its copy of the carried rank's anchor slice.

    The program asks for two outer steps: this rank's slice, then the
    carried one (``OuterStep.carried``), both with ``anchor - sum / W`` as
    their pseudo-gradient.

    Returns:
        A program whose result is a new tensor holding the fragment's new anchor.

    Raises:
        ValueError: a tensor that does not fit the fragment.
    """
    world_size = len(fragment.lengths)
    fragment.check_fits(rank, ("anchor", anchor), values=values)
    fragment.check_fits(carried_rank(rank, world_size), ("carried anchor", carried_anchor))
    (summed,) = yield AllReduce((values,))
    if summed is not values:  # a driver that packed it: the promise is about values
        values.copy_(summed)
    own = yield from outer_steps(fragment, rank, values, anchor, carried_anchor)
    out = torch.empty_like(values)
    slices = fragment.slices(out)
    slices[rank].copy_(own)
    yield GatherSegments(slices, rank, last=True)
    return out


def outer_steps(
    fragment: Fragment,
    rank: int,
    summed: torch.Tensor,
    anchor: torch.Tensor,
    carried_anchor: torch.Tensor,
) -> Generator[OuterStep, torch.Tensor, torch.Tensor]:
    """Ask for the two outer steps of rank ``rank`` from the fragment's sum
    over ranks (``summed``, only read): its own slice, then the carried one
    (``OuterStep.carried``), each with ``anchor - sum / W`` as its
    pseudo-gradient. Its result is the own slice, stepped. A sync runs it
    after its all-reduce, and a recovery finishing a sync forward runs it
    with a survivor's sum."""
    world_size = len(fragment.lengths)
    sums = fragment.slices(summed)
    carried = carried_rank(rank, world_size)
    own = yield OuterStep(fragment.index, pseudo_gradient(anchor, sums[rank] / world_size))
    yield OuterStep(
        fragment.index,
        pseudo_gradient(carried_anchor, sums[carried] / world_size),
        carried=True,
    )
    return own


@attrs.frozen
class SyncPosition:
    """Where one rank stood in the sequence of syncs when it met a loss.

    Attributes:
        steps: inner steps completed (``DiLoCoState.step``).
        sync: the inner step whose sync it entered last (0: none yet).
        due: the inner step that sync's result is merged at (``sync +
            delay``).
        summed: it holds that sync's sum (its all-reduce completed here, and
            it stepped its own and its carried slice).
        taken: the call that failed here (a ``step``) had taken its inner
            step: it failed starting a sync or merging one's result.
    """

    steps: int = attrs.field(validator=_non_negative)
    sync: int = attrs.field(validator=_non_negative)
    due: int = attrs.field(validator=_non_negative)
    summed: bool
    taken: bool = False

    @property
    def applied(self) -> bool:
        """The result of :attr:`sync` is in this rank's parameters."""
        return self.steps >= self.due

    @property
    def merges_now(self) -> bool:
        """The call that failed here is the one that merges :attr:`sync`'s result."""
        return self.taken and self.steps + 1 == self.due

    def to_text(self) -> str:
        """The position as the roll call's store keeps it."""
        flags = f"{int(self.summed)}{int(self.taken)}"
        return f"{self.steps}:{self.sync}:{self.due}:{flags}"

    @classmethod
    def from_text(cls, text: str) -> SyncPosition:
        """Read :meth:`to_text` back.

        Raises:
            ValueError: not a position.
        """
        parts = text.split(":")
        if (
            len(parts) != 4
            or not all(p.isdigit() for p in parts)
            or len(parts[3]) != 2
            or not set(parts[3]) <= {"0", "1"}
        ):
            raise ValueError(f"not a DiLoCo sync position: {text!r}")
        steps, sync, due, flags = parts
        return cls(int(steps), int(sync), int(due), flags[0] == "1", flags[1] == "1")


class InconsistentSyncs(ValueError):
    """The survivors' positions admit no common outer state to go on from."""


@attrs.frozen
class SyncRecovery:
    """How the survivors make their outer states whole, and what each does next.

    Attributes:
        sync: the last sync any survivor entered (0: none).
        forward: it is finished with a survivor's sum; otherwise nobody
            stepped it and the survivors that entered it run it again.
        source: with ``forward``, the survivor (its index among them) whose
            sum the survivors that lack it take; ``None`` when none lacks it,
            or not ``forward``.
    """

    sync: int
    forward: bool
    source: int | None

    def needs_sum(self, position: SyncPosition) -> bool:
        """Whether a survivor at ``position`` steps its slices from the source's sum."""
        return self.forward and not position.summed

    def applies_consolidated(self, position: SyncPosition) -> bool:
        """Whether a survivor at ``position`` takes the result of its last
        sync from the regrouped anchor (it stepped, or now steps, that
        sync, and its parameters lack the result): merged at once when the
        failed call was the one to merge it, else at its due step."""
        return not position.applied and (self.forward or position.sync < self.sync)

    def runs_again(self, position: SyncPosition) -> bool:
        """Whether a survivor at ``position`` runs :attr:`sync` again, on the
        survivors' group, before it goes on."""
        return not self.forward and position.sync == self.sync and not position.applied


def sync_recovery(positions: Sequence[SyncPosition]) -> SyncRecovery:
    """The survivors' way back to one outer state, from where each stood.

    The last sync anyone entered is finished forward when a survivor holds
    its sum; otherwise nobody can have stepped it (the sum comes before any
    outer step), and it runs again. Every earlier sync is complete in the
    outer state: a survivor could enter a sync only once the one before had
    gathered every owner's new slice.

    Raises:
        InconsistentSyncs: positions no run reaches (a sync finished
            forward that some survivor never entered; a survivor that holds
            the sum of an earlier sync and lacks its result while the others
            went past it).
    """
    if not positions:
        raise InconsistentSyncs("no survivors")
    last = max(p.sync for p in positions)
    holders = [i for i, p in enumerate(positions) if p.sync == last and p.summed]
    if not holders:
        return SyncRecovery(last, False, None)
    behind = [i for i, p in enumerate(positions) if p.sync != last]
    if behind:
        raise InconsistentSyncs(
            f"survivors {holders} hold the sum of the sync at inner step {last}, which "
            f"survivors {behind} never entered: the sum cannot be whole"
        )
    lacking = any(not p.summed for p in positions)
    return SyncRecovery(last, True, holders[0] if lacking else None)


StateDicts = tuple[dict[str, Any], dict[str, Any]]
"""A rank's own DiLoCo rank state dict and its copy of the carried rank's."""

RegroupProgram = Generator[Request | ObjectRequest | OuterStep, Any, "Regrouped"]
"""The survivors' regroup: collectives and outer steps; returns the regrouped state."""


def regroup_program(
    recovery: SyncRecovery,
    position: SyncPosition,
    plan: FragmentPlan,
    survivors: Sequence[int],
    new_rank: int,
    finish: Callable[[], tuple[Fragment, torch.Tensor | None, torch.Tensor, torch.Tensor]],
    held: Callable[[], StateDicts],
    compressed: tuple[Codec, int | None] | None = None,
) -> RegroupProgram:
    """Make the outer state whole on the survivors' group and cut it for
    their world, on survivor ``new_rank``.

    With ``recovery.forward``, the source broadcasts the sum of the sync to
    finish (when some survivor lacks it), and every survivor that lacks it
    asks for its two outer steps from it (:func:`outer_steps`). Then every
    survivor's state dicts are gathered, and :func:`regrouped` cuts this
    survivor's.

    Args:
        recovery: the survivors' way back (:func:`sync_recovery`).
        position: this survivor's position.
        plan: the old world's plan.
        survivors: the old ranks that go on, in order.
        new_rank: this survivor's rank among them.
        finish: the sync to finish's fragment, this survivor's sum of it
            (``None`` when it lacks it), anchor slice and carried anchor
            slice; called only when finishing forward.
        held: this survivor's own and carried state dicts, once whole
            (compressed syncs: its own with its replica and residual as
            :func:`regrouped` reads them).
        compressed: for compressed syncs, the codec and the fragment of the
            last sync any survivor entered (``None``: none yet).
    """
    old_rank = survivors[new_rank]
    if recovery.forward and recovery.source is not None:
        fragment, summed, anchor, carried_anchor = finish()
        if new_rank == recovery.source:
            assert summed is not None
            buffer = summed
        else:
            buffer = torch.empty(fragment.numel, dtype=torch.float32, device=anchor.device)
        (total,) = yield Broadcast(buffer, src=recovery.source)
        if recovery.needs_sum(position):
            yield from outer_steps(fragment, old_rank, total, anchor, carried_anchor)
    (every,) = yield AllGatherObjects((old_rank, held()), last=True)
    codec, synced = compressed if compressed is not None else (None, None)
    finished = synced if recovery.forward else None
    return regrouped(plan, dict(every), survivors, new_rank, codec, finished)


@attrs.frozen
class Regrouped:
    """One survivor's outer state in the survivors' world.

    Attributes:
        plan: the fragments cut for the survivors' world.
        own: its rank state dict (:mod:`zerofn.diloco.checkpoint`'s form).
        carried: the same for the rank it now carries.
        results: what a sync's result is, fragment by fragment: the whole
            anchor (fp32 syncs) or the replica (compressed syncs).
    """

    plan: FragmentPlan
    own: dict[str, Any]
    carried: dict[str, Any]
    results: tuple[torch.Tensor, ...]


def regrouped(
    plan: FragmentPlan,
    held: Mapping[int, tuple[Mapping[str, Any], Mapping[str, Any]]],
    survivors: Sequence[int],
    new_rank: int,
    codec: Codec | None = None,
    finished: int | None = None,
) -> Regrouped:
    """The outer state of ``survivors[new_rank]`` in the survivors' world.

    With compressed syncs, the survivors' own state dicts hold their replica
    (as before the last sync, where they entered it) and their residual (as
    the sync to run again starts from it, where one runs again). Every
    survivor goes on with the same replica, brought through the sync of
    fragment ``finished`` when one was finished forward
    (:func:`~zerofn.diloco.compressed_sync.replica_after_sync`), and with
    the mean of the survivors' residuals: a lost rank's error feedback is
    gone with its parameters.

    Args:
        plan: the old world's plan.
        held: by old rank, each survivor's own rank state dict and its copy
            of the carried rank's, labelled with that rank (both made whole
            by :func:`sync_recovery` first). Their schedule entries
            (``"state"``, ``"result"``) are not read: each survivor keeps
            its own.
        survivors: the old ranks that go on, in order (their new ranks).
        new_rank: this survivor's rank among them.
        codec: the compressed syncs' codec (``None``: fp32 syncs).
        finished: the fragment whose sync was finished forward, if any.

    Raises:
        ValueError: a lost rank whose carrier is lost too (its outer state
            is gone: restart from a checkpoint), or fewer than 2 survivors.
    """
    world = plan.world_size
    if len(survivors) < 2:
        raise ValueError(f"only {list(survivors)} survive: redundancy=2 needs 2 ranks to go on")
    per_rank: list[Mapping[str, Any]] = []
    for r in range(world):
        if r in held:
            per_rank.append({**held[r][0], "replica": None, "residual": None})
            continue
        carrier = carrier_of(r, world)
        if carrier not in held:
            raise ValueError(
                f"ranks {r} and {carrier} (its carrier) are both lost: rank {r}'s outer state is "
                "gone. Restart from a checkpoint"
            )
        per_rank.append(held[carrier][1])
    whole = consolidate(plan, per_rank)
    results = tuple(whole["anchor"])
    if codec is not None:
        whole["replica"] = _survivors_replica(plan, held, survivors, whole, codec, finished)
        whole["residual"] = torch.stack([held[r][0]["residual"] for r in survivors]).mean(dim=0)
        results = tuple(whole["replica"][f.start : f.start + f.numel] for f in plan.fragments)
    new_world = len(survivors)
    new_plan = plan_fragments(plan.sizes, len(plan.fragments), new_world)
    return Regrouped(
        new_plan,
        shard(new_plan, whole, new_rank),
        shard(new_plan, whole, carried_rank(new_rank, new_world)),
        results,
    )


def _survivors_replica(
    plan: FragmentPlan,
    held: Mapping[int, tuple[Mapping[str, Any], Mapping[str, Any]]],
    survivors: Sequence[int],
    whole: Mapping[str, Any],
    codec: Codec,
    finished: int | None,
) -> torch.Tensor:
    """The replica every survivor goes on with: the first survivor's (the
    same on all, as before the last sync), brought through the sync of
    fragment ``finished`` to its consolidated anchor."""
    replica: torch.Tensor = held[survivors[0]][0]["replica"].clone()
    if finished is not None:
        f = plan.fragments[finished]
        span = slice(f.start, f.start + f.numel)
        replica[span] = replica_after_sync(f, replica[span], whole["anchor"][finished], codec)
    return replica


def outer_state_tensors(saved: Mapping[str, Any]) -> list[torch.Tensor]:
    """A rank state dict's anchor slices and outer state tensors, in one
    fixed order (fragment, then state name): what a copy is compared by."""
    out = list(saved["anchor"])
    for index in sorted(saved["outer"]["state"]):
        entry = saved["outer"]["state"][index]
        out += [entry[k] for k in sorted(entry) if isinstance(entry[k], torch.Tensor)]
    return out


def copies_disagreement(
    own: Sequence[Sequence[int]], carried: Sequence[Sequence[int]]
) -> str | None:
    """What is wrong with the carried copies of the outer state, or ``None``.

    Args:
        own: by rank, digests of its own anchor slices and outer state.
        carried: by rank, digests of its copy of the carried rank's.
    """
    world = len(own)
    for rank in range(world):
        carrier = carrier_of(rank, world)
        if list(own[rank]) != list(carried[carrier]):
            return (
                f"rank {carrier}'s copy of rank {rank}'s DiLoCo outer state differs from rank "
                f"{rank}'s own"
            )
    return None
