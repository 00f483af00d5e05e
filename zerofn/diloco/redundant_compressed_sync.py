"""One fragment's compressed sync with ``redundancy=2``.

The compressed sync (:mod:`zerofn.diloco.compressed_sync`) sends each
owner the codes of its slice alone, and the owner adds its own slice exact.
A carrier (:mod:`zerofn.diloco.redundancy`) must step its copy of the
owner's slice from the same sum, bit for bit, and a recovery that finishes
a sync forward hands a survivor's sum to the others, so here every rank
forms the *whole* fragment's sum, the same bits everywhere:

1. ``g = replica - values + residual``, as in the compressed sync; every
   owner's slice of ``g``, this rank's own included, is encoded, and the
   residual keeps what the codes leave out of every slice.
2. One :class:`~zerofn.comm.GatherSegments` brings every rank's codes of
   the whole fragment to every rank. Each rank decodes them and adds them
   up in rank order: the sum of the fragment, the same on every rank (it
   plays the part the fp32 redundant sync's all-reduce plays, so
   :func:`~zerofn.diloco.redundancy.outer_steps`,
   :func:`~zerofn.diloco.redundancy.sync_recovery` and
   :func:`~zerofn.diloco.redundancy.regroup_program` serve both).
3. The two outer steps, own slice and carried slice, from ``anchor - sum / W``.
4. The owners' encoded anchor updates are exchanged and added to the
   replica, as in the compressed sync. A carrier can encode its owner's
   update too (same master, same replica), so a recovery gives every
   survivor the replica the exchange would have left
   (:func:`~zerofn.diloco.compressed_sync.replica_after_sync`).

Bytes (:func:`redundant_compressed_sync_bytes`): the codes of the whole
fragment from every rank (``W`` payloads of the fragment), then one
exchange of the owners' update codes. Where the compressed sync sends each
code to one owner, this one sends it to every rank, so its first half grows
with ``W``: with ``"int8"`` (blocks of 128), ``(W + 1) / 7.8`` of the fp32
redundant sync's bytes (an all-reduce and a gather of fp32 values), fewer
up to 6 workers; with ``"int4"`` and ``"int2"``, up to 14 and about 29.
"""

from __future__ import annotations

import itertools

import torch

from zerofn.comm import GatherSegments
from zerofn.diloco.compressed_sync import exchange_anchor_update, payload_sizes
from zerofn.diloco.config import Codec
from zerofn.diloco.fragments import Fragment
from zerofn.diloco.redundancy import SyncRecovery, carried_rank, outer_steps
from zerofn.diloco.sync import SyncProgram
from zerofn.zero.exchange import ExchangeCollective

__all__ = [
    "as_found",
    "redundant_compressed_sync_bytes",
    "redundant_compressed_sync_program",
]


def _payloads_in(codes: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Each owner's payload in one rank's codes of the whole fragment (views)."""
    starts = itertools.accumulate(sizes[:-1], initial=0)
    return [codes[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def redundant_compressed_sync_program(
    fragment: Fragment,
    rank: int,
    values: torch.Tensor,
    replica: torch.Tensor,
    residual: torch.Tensor,
    anchor: torch.Tensor,
    carried_anchor: torch.Tensor,
    quantizer: Codec,
    collective: ExchangeCollective = "broadcasts",
) -> SyncProgram:
    """Sync one fragment on rank ``rank`` with quantized codes, stepping the
    slice it carries too.

    Args:
        fragment: the fragment, with its owners' slices.
        rank: this rank's index in the outer group (of at least 2 ranks).
        values: this rank's values of the fragment (``float32``), handed
            over: it holds the fragment's sum over ranks (of the decoded
            codes) once the program asks for its first outer step, and keeps
            it to the end.
        replica: this rank's copy of the fragment's anchor, handed over:
            every owner's decoded update is added to it.
        residual: this rank's error feedback for the fragment, handed over:
            replaced by what this sync's codes leave out, before the first
            collective.
        anchor: this rank's anchor slice of the fragment.
        carried_anchor: its copy of the carried rank's anchor slice.
        quantizer: how payloads are coded.
        collective: how the codes move.

    Returns:
        A program whose result is ``replica``, holding the fragment's new
        anchor as the codes carry it (the same on every rank).

    Raises:
        ValueError: a tensor that does not fit the fragment.
    """
    world_size = len(fragment.lengths)
    fragment.check_fits(rank, ("anchor", anchor), values=values, replica=replica, residual=residual)
    fragment.check_fits(carried_rank(rank, world_size), ("carried anchor", carried_anchor))
    device = values.device
    gradient = torch.sub(replica, values).add_(residual)
    scratch = torch.empty(max(fragment.lengths), dtype=torch.float32, device=device)
    sizes = payload_sizes(quantizer, fragment.lengths)
    segments = [torch.empty(sum(sizes), dtype=torch.uint8, device=device) for _ in fragment.lengths]
    mine = _payloads_in(segments[rank], sizes)
    for part, payload, left_out in zip(
        fragment.slices(gradient), mine, fragment.slices(residual), strict=True
    ):
        quantizer.encode(part, payload)
        decoded = quantizer.decode(payload, part.numel(), scratch[: part.numel()])
        torch.sub(part, decoded, out=left_out)
    every = yield GatherSegments(tuple(segments), rank, collective)
    summed = values.zero_()
    # Every rank adds the same decoded codes in the same order: the same bits.
    for codes in every:
        for part, payload in zip(fragment.slices(summed), _payloads_in(codes, sizes), strict=True):
            part.add_(quantizer.decode(payload, part.numel(), scratch[: part.numel()]))
    stepped = yield from outer_steps(fragment, rank, summed, anchor, carried_anchor)
    yield from exchange_anchor_update(
        fragment, rank, stepped, replica, quantizer, collective, scratch
    )
    return replica


def redundant_compressed_sync_bytes(fragment: Fragment, quantizer: Codec) -> int:
    """The bytes a rank hands to the collectives of a redundant compressed
    sync of ``fragment`` (:func:`zerofn.comm.request_bytes` summed): every
    rank's codes of the whole fragment, and every owner's update codes."""
    sizes = payload_sizes(quantizer, fragment.lengths)
    return len(sizes) * sum(sizes) + sum(sizes)


def as_found(
    recovery: SyncRecovery,
    entered: int,
    fragment: Fragment | None,
    now: tuple[torch.Tensor, torch.Tensor],
    before: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A survivor's replica and residual as the regroup reads them
    (:func:`~zerofn.diloco.redundancy.regrouped`): the replica as the
    recovered sync found it, and the residual too where that sync runs again.

    Args:
        recovery: the survivors' way back.
        entered: the inner step of the last sync this survivor entered (0: none).
        fragment: that sync's fragment (``None``: none).
        now: its replica and residual now (the whole model's; only read).
        before: that sync's span of both, as the sync found them.

    Returns:
        New tensors: copies of ``now``, with that span as found where this
        survivor entered the recovered sync (where it did not, every sync
        it entered is whole).
    """
    replica, residual = (t.clone() for t in now)
    if entered != recovery.sync or fragment is None or before is None:
        return replica, residual
    span = slice(fragment.start, fragment.start + fragment.numel)
    replica[span] = before[0]
    if not recovery.forward:  # it runs again: from the residual it started from
        residual[span] = before[1]
    return replica, residual
