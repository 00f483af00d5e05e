"""The errors zerofn raises when the world fails it.

Two kinds of failure are part of the contract (see ``docs/failures.md``):

* :class:`CollectiveError`: a collective did not complete on this rank (a
  peer died, hung past the group's timeout, or the transport broke). It is
  raised instead of a result: a failed collective never yields a tensor. The
  underlying error is kept as ``__cause__``.
* :class:`CheckpointError`: a checkpoint was refused before anything was
  changed (corrupt, truncated, incomplete, foreign, or for another model).

Both carry what failed in their message, so a log line alone says which
collective, for what, in which group.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CollectiveError", "PeerLost"]


class CollectiveError(RuntimeError):
    """A collective failed; no result was produced.

    After it, the process group is unusable (its peers have failed or are out
    of step): end the job and restart from the last checkpoint.

    Attributes:
        collective: what was asked for, e.g. ``"all_reduce of 1 tensor (4.0 KiB)"``.
        purpose: what it was for, e.g. ``"DDP bucket 2, hook 'allreduce', request 1"``.
        group: the group it ran in, e.g. ``"gloo group of 2 ranks (this is rank 0)"``.
    """

    def __init__(self, collective: str, purpose: str, group: str, reason: str) -> None:
        self.collective = collective
        self.purpose = purpose
        self.group = group
        self.reason = reason
        super().__init__(
            f"{collective} for {purpose} in {group} failed: {reason}. No result was produced; "
            "the group is unusable now: end the job and restart it from its last checkpoint"
        )

    def __reduce__(self) -> tuple[type[CollectiveError], tuple[str, str, str, str]]:
        # Keeps the error picklable (spawned workers send it to their parent).
        return (type(self), (self.collective, self.purpose, self.group, self.reason))


class PeerLost(RuntimeError):
    """The cause of a :class:`CollectiveError` in the simulated world: a rank
    was dropped before it joined the collective."""


class CheckpointError(ValueError):
    """A checkpoint was refused: nothing was changed.

    Raised on every rank with the same message, naming the file (or the
    checkpoint) and what is wrong with it.
    """
