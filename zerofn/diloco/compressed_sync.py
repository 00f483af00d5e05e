"""One fragment's sync with compressed payloads and error feedback.

The fp32 sync (:mod:`zerofn.diloco.sync`) sums the parameters on the owners,
which needs no anchor anywhere else. Quantized codes cannot be summed in
flight, so here every rank forms its *own* pseudo-gradient, and for that it
keeps a full copy of the anchor, the *replica*, identical on every rank:

1. ``g = replica - values + residual``: this rank's pseudo-gradient of the
   fragment plus what earlier syncs failed to carry (error feedback).
2. Each owner's slice of ``g`` is encoded (a :class:`~zerofn.diloco.config.Codec`:
   :mod:`zerofn.blockquant`'s int8/int4, :mod:`zerofn.twobit`'s 2 bits, or
   :mod:`zerofn.topk`'s top entries of each chunk); the new
   residual is ``g`` minus what those codes decode to (zero on the rank's
   own slice, which never leaves it).
3. One :class:`~zerofn.comm.AllToAll`: each rank sends each owner its codes
   for that owner's slice, and nobody else's; every owner sums what it
   received, decoded, with its own exact slice.
4. The owner's outer step (:class:`~zerofn.diloco.outer.OuterStep`) on its
   exact anchor slice, the *master*, with the mean as gradient.
5. The owner encodes ``master - replica`` of its slice; one more
   :class:`~zerofn.comm.GatherSegments` brings every owner's codes to every
   rank, and every rank adds them, decoded, to its replica. Decoding depends
   on the bytes alone, so the replicas stay bitwise identical; what the
   codes leave out stays in ``master - replica`` and travels with the next
   sync (the compressed ZeRO exchange does the same,
   :mod:`zerofn.zero.compressed.exchange`).

Memory: the replica and the residual cost 8 bytes per parameter on every
rank, on top of the owners' 4-byte master slices and the optimizer state.
Bytes (:func:`compressed_sync_bytes`): a rank sends the others' share of
its codes once (step 3) and takes part in one exchange of every owner's
codes (step 5), where the fp32 sync moves the same shares of fp32 values
(a reduce and an exchange). With int8 codes (one byte per element and a
4-byte scale per block of ``b`` elements) the bytes on the wire are
``(1 + 4 / b) / 4`` of the fp32 sync's: about a quarter, at any ``W``;
with 2-bit codes in blocks of 256, 1/15; with top-k at density 0.02 and
2 bits, 1/116. Every codec's payload size is a function of the slice's
length alone, which the plan fixes: sparse payloads need no size agreement.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from zerofn.comm import AllToAll, GatherSegments
from zerofn.diloco.config import Codec
from zerofn.diloco.fragments import Fragment
from zerofn.diloco.outer import OuterStep
from zerofn.diloco.sync import SyncProgram
from zerofn.zero.exchange import ExchangeCollective

__all__ = [
    "add_anchor_updates",
    "compressed_sync_bytes",
    "compressed_sync_program",
    "encode_anchor_update",
    "exchange_anchor_update",
    "payload_sizes",
    "replica_after_sync",
]


def payload_sizes(quantizer: Codec, lengths: tuple[int, ...]) -> list[int]:
    """The bytes of the codes of slices of ``lengths`` elements, slice by slice."""
    return [quantizer.payload_nbytes(n) for n in lengths]


def _payloads(
    quantizer: Codec, lengths: tuple[int, ...], device: torch.device
) -> list[torch.Tensor]:
    sizes = payload_sizes(quantizer, lengths)
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]


def _encoded(
    fragment: Fragment,
    rank: int,
    gradient: torch.Tensor,
    residual: torch.Tensor,
    quantizer: Codec,
    decoded: torch.Tensor,
) -> list[torch.Tensor]:
    """Each owner's slice of ``gradient`` as a payload for it (the own slice's
    payload is left unwritten), and into ``residual`` what the codes leave out
    (``decoded``: scratch for the codes read back, at least a slice long)."""
    sends = _payloads(quantizer, fragment.lengths, gradient.device)
    left_out = fragment.slices(residual)
    for owner, (part, payload) in enumerate(zip(fragment.slices(gradient), sends, strict=True)):
        carried = part
        if owner != rank:
            quantizer.encode(part, payload)
            carried = quantizer.decode(payload, part.numel(), decoded[: part.numel()])
        torch.sub(part, carried, out=left_out[owner])
    return sends


def compressed_sync_program(
    fragment: Fragment,
    rank: int,
    values: torch.Tensor,
    replica: torch.Tensor,
    residual: torch.Tensor,
    master: torch.Tensor,
    quantizer: Codec,
    collective: ExchangeCollective = "broadcasts",
) -> SyncProgram:
    """Sync one fragment on rank ``rank``, sending quantized codes.

    Args:
        fragment: the fragment, with its owners' slices.
        rank: this rank's index in the outer group.
        values: this rank's values of the fragment (``float32``; only read).
        replica: this rank's copy of the fragment's anchor (``float32``),
            handed over: every owner's decoded update is added to it.
        residual: this rank's error feedback for the fragment (``float32``),
            handed over: replaced by what this sync's codes leave out.
        master: this rank's exact anchor slice (the outer optimizer's
            tensor); stepped by the answer to the outer step.
        quantizer: how payloads are coded (any :class:`~zerofn.diloco.config.Codec`).
        collective: how the payloads move.

    Returns:
        A program whose result is ``replica``, holding the fragment's new
        anchor (the same on every rank).

    Raises:
        ValueError: a tensor that does not fit the fragment.
    """
    fragment.check_fits(rank, ("master", master), values=values, replica=replica, residual=residual)
    lengths = fragment.lengths
    world_size = len(lengths)
    device = values.device
    gradient = torch.sub(replica, values).add_(residual)
    # One scratch buffer for every decode: a sync allocates per fragment, not per payload.
    decoded = torch.empty(max(lengths), dtype=torch.float32, device=device)
    sends = _encoded(fragment, rank, gradient, residual, quantizer, decoded)
    # The own slice never leaves this rank: it is summed exact, not encoded.
    nothing = torch.empty(0, dtype=torch.uint8, device=device)
    sends[rank] = nothing

    total = fragment.slices(gradient)[rank].clone()
    receives = _payloads(quantizer, (lengths[rank],) * world_size, device)
    receives[rank] = nothing
    received = yield AllToAll(tuple(sends), tuple(receives), rank)
    for k in range(1, world_size):
        total += quantizer.decode(
            received[(rank - k) % world_size], lengths[rank], decoded[: lengths[rank]]
        )

    stepped = yield OuterStep(fragment.index, total.div_(world_size))
    yield from exchange_anchor_update(
        fragment, rank, stepped, replica, quantizer, collective, decoded
    )
    return replica


def encode_anchor_update(
    quantizer: Codec,
    stepped: torch.Tensor,
    replica: torch.Tensor,
    scratch: torch.Tensor,
    payload: torch.Tensor,
) -> None:
    """Encode into ``payload`` an owner's update of its slice's anchor:
    ``stepped - replica`` (both the owner's slice; ``scratch``: at least a
    slice long)."""
    quantizer.encode(torch.sub(stepped, replica, out=scratch[: stepped.numel()]), payload)


def add_anchor_updates(
    fragment: Fragment,
    replica: torch.Tensor,
    updates: Sequence[torch.Tensor],
    quantizer: Codec,
    scratch: torch.Tensor,
) -> None:
    """Add every owner's decoded update payload to its slice of ``replica``:
    a pure function of the bytes, so every rank's replica moves alike."""
    with torch.no_grad():
        for part, payload in zip(fragment.slices(replica), updates, strict=True):
            part.add_(quantizer.decode(payload, part.numel(), scratch[: part.numel()]))


def exchange_anchor_update(
    fragment: Fragment,
    rank: int,
    stepped: torch.Tensor,
    replica: torch.Tensor,
    quantizer: Codec,
    collective: ExchangeCollective,
    scratch: torch.Tensor,
) -> Generator[GatherSegments, Any, None]:
    """Send this owner's encoded update (``stepped``: its new anchor slice),
    receive every other owner's, and add them all to ``replica``."""
    updates = _payloads(quantizer, fragment.lengths, replica.device)
    own = fragment.slices(replica)[rank]
    encode_anchor_update(quantizer, stepped, own, scratch, updates[rank])
    yield GatherSegments(tuple(updates), rank, collective, last=True)
    add_anchor_updates(fragment, replica, updates, quantizer, scratch)


def replica_after_sync(
    fragment: Fragment, replica: torch.Tensor, anchor: torch.Tensor, quantizer: Codec
) -> torch.Tensor:
    """The fragment's replica after a compressed sync whose new anchor is
    ``anchor`` (the whole fragment), from ``replica`` as it was before it:
    every owner's update encoded as the owner encodes it, and added as every
    rank adds it, so the result is bitwise what the sync's exchange leaves.
    What a recovery that finishes a sync forward gives every survivor.

    Returns:
        A new tensor.
    """
    fragment.check_fits(0, ("anchor", fragment.slices(anchor)[0]), replica=replica, anchor=anchor)
    scratch = torch.empty(max(fragment.lengths), dtype=torch.float32, device=replica.device)
    updates = _payloads(quantizer, fragment.lengths, replica.device)
    for new, old, payload in zip(
        fragment.slices(anchor), fragment.slices(replica), updates, strict=True
    ):
        encode_anchor_update(quantizer, new, old, scratch, payload)
    out = replica.clone()
    add_anchor_updates(fragment, out, updates, quantizer, scratch)
    return out


def compressed_sync_bytes(fragment: Fragment, quantizer: Codec, rank: int) -> int:
    """The bytes rank ``rank`` hands to the collectives of a compressed sync
    of ``fragment`` (:func:`zerofn.comm.request_bytes` summed): its codes for
    the other owners' slices (the all-to-all), and every owner's codes of
    the anchor update (the exchange's whole buffer)."""
    payloads = payload_sizes(quantizer, fragment.lengths)
    return sum(payloads) - payloads[rank] + sum(payloads)
