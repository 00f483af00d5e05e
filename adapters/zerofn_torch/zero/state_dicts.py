"""A ZeRO optimizer's state dicts: its part that answers ``state_dict`` and
``load_state_dict`` (:class:`StateDicts`), and moving the shards between
ranks to join them into the global state (on one rank or on all). What each
rank sends and how the shards are joined are :mod:`zerofn.zero.rank_state`'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerofn.zero import hook_driven
from zerofn.zero.params import StateDict, check_rank
from zerofn.zero.rank import ZeroRank
from zerofn.zero.rank_state import (
    full_state_dict,
    joined_state,
    load_global_state,
    local_state_cpu,
    local_state_dict,
    state_before_any_step,
)
from zerofn_torch.runtime.object_collectives import all_gather_objects, gather_objects
from zerofn_torch.zero.forward_gather import ForwardGathering

__all__ = ["StateDicts", "consolidate_on", "gather_global_state"]


class StateDicts(ForwardGathering):
    """The optimizer's part that reads and loads its state as
    ``torch.optim`` state dicts: consolidated on one rank, loaded from a
    full one, and this rank's own as checkpoints keep it (see
    :class:`~zerofn_torch.zero.shell_state.ShellState`)."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the full optimizer state on rank ``to`` for :meth:`state_dict`.

        Must be called on every rank. Only the local shards travel, to one rank.

        Args:
            to: the group rank that receives the state.

        Raises:
            TypeError: ``to`` is not an int.
            ValueError: ``to`` is not a rank of the group; checked before any
                collective, so the group stays usable.
            RuntimeError: with ``overlap_with_ddp=True``, before DDP fixed its
                buckets.
        """
        check_rank(to, self.world_size)
        hook_driven.check_overlap_initialized(self._zero)
        self.wait()
        self._consolidated = consolidate_on(self._zero, self.param_groups, self.process_group, to)

    def state_dict(self) -> StateDict:
        """The full state gathered by the last :meth:`consolidate_state_dict`,
        in ``torch.optim``'s format (loadable into the unsharded optimizer).

        Before the first step (and with no state loaded) every rank answers
        without consolidating: the state is empty everywhere, and only the
        groups' options are known, as for a fresh ``torch.optim`` optimizer.

        Returns:
            ``{"state": ..., "param_groups": [...]}`` with the live groups' options.

        Raises:
            RuntimeError: if the state was not consolidated on this rank.
        """
        if self._consolidated is None and self._untouched:
            return state_before_any_step(self.param_groups)
        return full_state_dict(self._consolidated, self.param_groups, self.rank)

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a full state dict (from :meth:`state_dict`, or from a plain
        ``torch.optim`` optimizer over the same parameters), keeping this
        rank's shard. ``state_dict`` is not modified.

        Args:
            state_dict: the full state, global parameter indices.

        With ``overlap_with_ddp=True`` it loads before the first iteration
        too: until DDP fixes its buckets every rank holds every parameter's
        state, and keeps its own share once they are fixed.

        Raises:
            ValueError: if ``state_dict`` belongs to another model; then
                nothing is changed.
        """
        self.wait()
        # Cut to this rank's shard first, so a foreign state dict changes nothing.
        load_global_state(self._zero, self.param_groups, state_dict)
        self._untouched = self._untouched and not state_dict["state"]

    def local_state_dict(self) -> StateDict:
        """This rank's local optimizer state as checkpoints keep it: one
        tensor per param group under a flat partition (chunks merged),
        masters as ``"master_param"``; tensors are the live ones."""
        return local_state_dict(self._zero)


def gather_global_state(rank: ZeroRank, groups: Sequence[dict[str, Any]], group: Any) -> StateDict:
    """Every rank's shard, joined into the global state on every rank
    (collective).

    Raises:
        zerofn.errors.CollectiveError: the all-gather failed.
    """
    purpose = "gathering every rank's optimizer shard"
    gathered = all_gather_objects(local_state_cpu(rank, groups), group, purpose)
    return joined_state(rank, groups, gathered)


def consolidate_on(
    rank: ZeroRank, groups: Sequence[dict[str, Any]], group: Any, to: int
) -> StateDict | None:
    """Every rank's shard, joined into the global state on rank ``to``
    (collective; only the local shards travel, to one rank).

    Returns:
        The global state on rank ``to``, ``None`` elsewhere.

    Raises:
        zerofn.errors.CollectiveError: the gather failed.
    """
    purpose = f"consolidating the optimizer state on rank {to}"
    gathered = gather_objects(local_state_cpu(rank, groups), to, group, purpose)
    return None if gathered is None else joined_state(rank, groups, gathered)
