"""What a simulated rank of the compressed exchange promises, measured: how
far its replica trails its masters, against the bound the last difference
sent allows (:mod:`zerofn.zero.compressed.exchange`)."""

from __future__ import annotations

import torch

from zerofn.testing.zero import SimulatedRank
from zerofn.zero.compressed.exchange import block_scales, local_spans

__all__ = ["master_replica_gap"]


def master_replica_gap(rank: SimulatedRank) -> tuple[torch.Tensor, torch.Tensor]:
    """How far a compressed rank's replica trails its masters, and the bound.

    Args:
        rank: a simulated rank built with ``exchange_compression``, after a step.

    Returns:
        Per element of the rank's own segments (``float64``): ``|master -
        replica|``, and the bound the difference just sent allows: half its
        block's quantization step, plus one rounding of the replica's dtype.

    Raises:
        ValueError: the rank keeps no compressed exchange.
    """
    if rank.masters is None or rank.compressed is None:
        raise ValueError("master_replica_gap needs a rank built with exchange_compression")
    exchange = rank.compressed.exchange
    quantizer = exchange.quantizer
    plan = rank.shards.plan
    me = rank.shards.rank
    eps = torch.finfo(rank.params[0].dtype).eps
    steps = []
    for index, layout in enumerate(plan.layouts):
        length = layout.segments[me].length
        scales = block_scales(exchange, index, me, length)
        steps.append(scales.repeat_interleave(quantizer.block)[:length].double())
    sources = rank.shards.local_sources(rank.params)
    gaps, bounds = [], []
    spans = local_spans(plan, me, sources)
    for master, source, span in zip(rank.masters.master, sources, spans, strict=True):
        if source is None or span is None:
            continue
        param, start, numel = source
        replica = rank.params[param].detach().reshape(-1)[start : start + numel].double()
        step = steps[span.layout][span.offset : span.offset + numel]
        gaps.append((master.detach().reshape(-1).double() - replica).abs())
        bounds.append(step / 2 * (1 + 1e-5) + replica.abs() * eps)
    if not gaps:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    return torch.cat(gaps), torch.cat(bounds)
