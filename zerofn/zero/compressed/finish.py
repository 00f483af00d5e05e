"""Finishing a compressed exchange that a lost rank cut short
(``redundancy=2`` with ``exchange_compression``).

A compressed exchange moves every replica by the decoded differences it
receives, piece by piece, so a loss inside it can leave the survivors'
replicas apart: one has added pieces another has not. Adding a piece twice
or never would leave them apart for good, and sending the masters' values
instead would leave them unlike a run without the loss. So the step is
finished in the old world's terms, with the bytes the lost rank would have
sent:

* every survivor knows how many pieces of each buffer it applied
  (:attr:`~zerofn.zero.compressed.exchange.CompressedExchange.applied`);
* the holder of each old segment (its owner, or the carrier of a lost one,
  whose carried masters are the owner's bit for bit) has that segment's
  payload: the pieces it applied arrived whole, and it encodes the rest from
  the masters and its replica, which those pieces have not moved; encoding
  is a function of those values, so these are the bytes the owner sent, or
  would have;
* the holders' payloads are all-gathered, and each survivor applies the
  pieces it has not.

Then every replica is what the uninterrupted step would have left, and the
world changes (:func:`zerofn.zero.elastic.regroup.regroup_program`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from zerofn.comm import AllGatherObjects, Program
from zerofn.zero.compressed.exchange import apply_piece, encode_unsent
from zerofn.zero.compressed.payloads import piece_count
from zerofn.zero.elastic.carried import carrier_of
from zerofn.zero.elastic.redundancy import Regrouping
from zerofn.zero.planning.chunks import ChunkSource
from zerofn.zero.rank import ZeroRank

__all__ = ["finish_compressed_program", "held_payloads", "holder_of"]

Payloads = dict[tuple[int, int], torch.Tensor]
"""Payload bytes by (buffer index, owner in the old world)."""


def holder_of(owner: int, world_size: int, survivors: Sequence[int]) -> int:
    """The old rank that provides ``owner``'s segment: the owner if it
    survived, else its carrier (which holds its masters)."""
    return owner if owner in survivors else carrier_of(owner, world_size)


def held_payloads(
    rank: ZeroRank, params: Sequence[torch.Tensor], survivors: Sequence[int]
) -> Payloads:
    """This rank's segments' and (for a lost owner it carried) the carried
    segment's whole payloads for the step in progress: what was applied as
    it arrived, the rest encoded now (:func:`~zerofn.zero.compressed.exchange.encode_unsent`).
    The payload buffers are written in place."""
    exchange, shards = rank.exchange, rank.shards
    assert exchange is not None and rank.masters is not None
    me, world = rank.options.rank, rank.options.world_size
    sources_of: dict[int, tuple[Sequence[torch.Tensor], Sequence[ChunkSource | None]]] = {
        me: (rank.masters.master, shards.local_sources(params))
    }
    carried = rank.carried
    if carried is not None and carried.owner not in survivors:
        assert carried.masters is not None
        flat_sources = [s for group in carried.sources for s in group]
        sources_of[carried.owner] = (carried.masters.master, flat_sources)
    held: Payloads = {}
    for index in range(len(shards.plan.layouts)):
        for owner, (masters, sources) in sources_of.items():
            if holder_of(owner, world, survivors) == me:
                encode_unsent(shards, index, owner, params, masters, sources, exchange)
                held[index, owner] = exchange.parts(index)[owner].clone()
    return held


def finish_compressed_program(
    rank: ZeroRank, params: Sequence[torch.Tensor], regrouping: Regrouping
) -> Program[None]:
    """Finish the interrupted step's compressed exchange on the survivors'
    group (rank ``rank`` of the old world; ``params``, its replica, written
    in place): every holder's payloads all-gathered (:func:`held_payloads`),
    then every piece this rank had not applied, applied."""
    exchange, shards = rank.exchange, rank.shards
    assert exchange is not None
    (every,) = yield AllGatherObjects(held_payloads(rank, params, regrouping.survivors))
    for payloads in cast(list[Payloads], every):
        for (index, owner), payload in payloads.items():
            exchange.parts(index)[owner].copy_(payload)
    for index, layout in enumerate(shards.plan.layouts):
        for k in range(exchange.applied[index], piece_count(exchange.piece, layout)):
            apply_piece(shards, index, params, exchange, k)
