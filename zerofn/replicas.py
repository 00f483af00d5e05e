"""Whether every rank holds the same parameters: a digest per tensor, one
all-gather of the digests, and the first tensor that differs with the ranks
that disagree. A data-parallel job assumes its replicas are identical; after
the world changes (``zerofn_torch.elastic``) or now and then, this checks it
for the price of 8 bytes per tensor on the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from zerofn.comm import AllGather, Program
from zerofn.zero.planning.partition import Piece

__all__ = [
    "Disagreement",
    "ReplicaMismatch",
    "copies_disagreement",
    "digests",
    "first_disagreement",
    "replicas_program",
    "state_digest",
]


class ReplicaMismatch(RuntimeError):
    """The ranks' replicas of a parameter differ; raised on every rank."""


@attrs.frozen
class Disagreement:
    """The first tensor whose digests differ, and who holds which.

    Attributes:
        index: the tensor's position.
        groups: the ranks holding each distinct digest, the largest group first.
    """

    index: int
    groups: tuple[tuple[int, ...], ...]


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An int64 digest of each tensor's bytes (BLAKE2b, 8 bytes): equal
    tensors of equal dtype and shape give equal digests on every rank."""
    out = []
    for t in tensors:
        data = t.detach().cpu().contiguous()
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{data.dtype}{tuple(data.shape)}".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        out.append(int.from_bytes(h.digest(), "little", signed=True))
    return torch.tensor(out, dtype=torch.int64)


def first_disagreement(per_rank: Sequence[torch.Tensor]) -> Disagreement | None:
    """The first tensor whose digest is not the same on every rank (``None``:
    all agree), with the ranks grouped by the digest they hold."""
    table = torch.stack(list(per_rank))
    differs = (table != table[0]).any(dim=0).nonzero()
    if differs.numel() == 0:
        return None
    index = int(differs[0])
    by_digest: dict[int, list[int]] = {}
    for rank, value in enumerate(table[:, index].tolist()):
        by_digest.setdefault(value, []).append(rank)
    groups = sorted((tuple(r) for r in by_digest.values()), key=lambda g: (-len(g), g))
    return Disagreement(index, tuple(groups))


def replicas_program(
    tensors: Sequence[torch.Tensor], names: Sequence[str], device: torch.device
) -> Program[None]:
    """Check that every rank holds the same ``tensors``: one all-gather of
    their digests.

    Raises:
        ReplicaMismatch: (on every rank) naming the first tensor that
            differs and the ranks that hold each version.
    """
    mine = digests(tensors).to(device)
    per_rank = yield AllGather(mine, last=True)
    found = first_disagreement([t.cpu() for t in per_rank])
    if found is not None:
        versions = "; ".join(f"ranks {list(g)} hold one" for g in found.groups)
        raise ReplicaMismatch(
            f"the replicas of {names[found.index]} differ across ranks ({versions}): the ranks "
            "no longer train the same model; restart from a checkpoint"
        )


def state_digest(state: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """One parameter's optimizer state as ``(name, digest)`` pairs, by name:
    equal states give equal digests on every rank."""
    names = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
    values = digests([state[k] for k in names]).tolist() if names else []
    return tuple(zip(names, values, strict=True))


def copies_disagreement(
    per_rank: Sequence[tuple[Mapping[Piece, Any], Mapping[Piece, Any]]],
) -> str | None:
    """What is wrong with the ranks' copies of optimizer state, or ``None``.

    Args:
        per_rank: per rank, the :func:`state_digest` of each piece of a
            parameter it owns and of each it carries (``redundancy=2``; a
            carrier's pieces are cut as its owner's).

    Returns:
        A sentence naming the first carried copy that differs from its
        owner's state, or the ranks whose step counts of one parameter
        differ; ``None`` when every copy equals its owner's and each
        parameter has one step count everywhere.
    """
    owned = {i: (r, d) for r, (mine, _) in enumerate(per_rank) for i, d in mine.items()}
    for rank, (_, carried) in enumerate(per_rank):
        for piece, digest in carried.items():
            owner, expected = owned.get(piece, (None, ()))
            if digest != expected:
                return (
                    f"rank {rank}'s copy of the optimizer state of parameter {piece.param} "
                    f"(elements {piece.start}..{piece.stop}) differs from its owner's "
                    f"(rank {owner})"
                )
    # Every piece of one parameter steps together, wherever it lives (a flat
    # partition cuts a parameter over ranks; a group added later, or a
    # parameter without gradients, may count fewer steps than another).
    steps: dict[int, dict[Any, set[int]]] = {}
    for rank, (mine, carried) in enumerate(per_rank):
        for piece, digest in (*mine.items(), *carried.items()):
            for name, value in digest:
                if name == "step":
                    steps.setdefault(piece.param, {}).setdefault(value, set()).add(rank)
    for param, counts in sorted(steps.items()):
        if len(counts) > 1:
            ranks = sorted(set().union(*counts.values()))
            return (
                f"the pieces of parameter {param} (on ranks {ranks}) count "
                f"{len(counts)} different steps"
            )
    return None
