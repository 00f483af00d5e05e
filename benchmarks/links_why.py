"""The shaped-link benchmark's why lines: why a missed target missed it,
from parts of the same run (the link time of the bytes, the codec alone, the
update alone)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import bench_compressed
import bench_hooks
import bench_overlap
from links_setup import (
    FRAGMENTS,
    PYTORCH,
    QUIET,
    WORLD,
    ZERO_SETUPS,
    _mb,
    _ms,
    blocking_name,
    compressed_step_model,
    link_seconds,
    per_step,
    rate_label,
)
from report import floor_verdict, round_sums


def zero_why(
    label: str, times: Mapping[str, Sequence[float]], link_bytes: float, bits_per_second: float
) -> str:
    """Why a ZeRO set-up missed its target against PyTorch's step: its
    bytes' link time, its codec alone and the update alone (medians of the
    same rounds), in turn and with the update and the codec beside the wire."""
    codec, _ = ZERO_SETUPS[label]
    pt = statistics.median(times[PYTORCH])
    step = statistics.median(times[label])
    update = statistics.median(times[bench_compressed.UPDATE])
    link = link_seconds(link_bytes, bits_per_second)
    alone = statistics.median(times[bench_compressed.BYTES_ALONE[codec or "exact"]])
    bytes_clause = (
        f"its bytes take {_ms(link)} on the link alone ({_mb(link_bytes)} x 8 / "
        f"{rate_label(bits_per_second)}, both ranks' through the one half-duplex queue; "
        f"broadcast alone {_ms(alone)})"
    )
    if codec is None:
        floor = round_sums(
            times[bench_compressed.UPDATE], times[bench_compressed.BYTES_ALONE["exact"]]
        )
        verdict = floor_verdict((label, "PyTorch"), times[label], floor, times[PYTORCH])
        return (
            f"{bytes_clause}, the same bytes as PyTorch's, and the update alone {_ms(update)}: "
            f"{verdict}"
        )
    work = statistics.median(times[bench_compressed.CODEC_ALONE[codec]])
    serial = update + work + link
    beside = compressed_step_model(update, work, link_bytes, bits_per_second)
    return (
        f"{bytes_clause}, the {codec} codec alone {_ms(work)} and the update alone "
        f"{_ms(update)}, against PyTorch's {_ms(pt)} step: done in turn they allow "
        f"{serial / pt:.2f}, with the update and the codec beside the wire {beside / pt:.2f}; "
        f"the {codec} step takes {_ms(step)}, {step / serial:.2f}x the parts in turn"
    )


def link_factors(link: Mapping[str, float], payload: float) -> dict[str, float]:
    """Bytes on the link per payload byte of gloo's own collectives, from the
    loopback's counter around each part alone (``payload`` bytes each)."""
    kinds = {
        "reduce": bench_overlap.REDUCE,
        "all-reduce": bench_overlap.ALL_REDUCE,
        "broadcast": bench_overlap.BROADCAST,
    }
    return {kind: link[part] / payload for kind, part in kinds.items()}


def overlap_why(
    times: Mapping[str, list[float]],
    on_link: Mapping[str, float],
    factors: Mapping[str, float],
    bits_per_second: float,
) -> str:
    """Why the overlapped iteration missed its target against PyTorch's: the
    link time of each one's bytes (the loopback's counter over one
    iteration), then each part alone and the floors
    (``bench_overlap.missed_time_line``)."""
    mine, theirs = on_link["overlapped"], on_link["pytorch"]
    rate = rate_label(bits_per_second)
    head = (
        f"the overlapped iteration puts {_mb(mine)} on the link "
        f"({_ms(link_seconds(mine, bits_per_second))} at {rate}) against PyTorch's "
        f"{_mb(theirs)} ({_ms(link_seconds(theirs, bits_per_second))}), {mine / theirs:.2f} of "
        f"its bytes (gloo's own reduce puts {factors['reduce']:.2f}x its payload on the link, "
        f"its all-reduce {factors['all-reduce']:.2f}x, a broadcast {factors['broadcast']:.2f}x)"
    )
    body = bench_overlap.missed_time_line(dict(times), "pytorch", "the PyTorch iteration")
    return f"{head}; {body}"


def powersgd_why(
    times: Mapping[str, Sequence[float]],
    zerofn_link: float,
    ddp_link: float,
    bits_per_second: float,
) -> str:
    """Why zerofn's PowerSGD iteration missed its target against DDP's
    all-reduce: each one's bytes on the link, and what zerofn's iteration
    spends beside its bytes."""
    ours = statistics.median(times["zerofn"])
    ddp = statistics.median(times[bench_hooks.BUILTIN])
    mine = link_seconds(zerofn_link, bits_per_second)
    theirs = link_seconds(ddp_link, bits_per_second)
    return (
        f"DDP's all-reduce puts {_mb(ddp_link)} on the link ({_ms(theirs)} at "
        f"{rate_label(bits_per_second)}) and PowerSGD {_mb(zerofn_link)} ({_ms(mine)}); "
        f"zerofn's iteration takes {_ms(ours)}, of which {_ms(max(ours - mine, 0.0))} beside "
        f"its bytes (forward, backward, the compression), {(ours - mine) / ddp:.2f} of DDP's "
        f"{_ms(ddp)} iteration"
    )


def diloco_why(
    name: str,
    raw: Mapping[str, Any],
    bits_per_second: float,
) -> str:
    """Why a streaming run missed its target: the sync's link time against
    the inner steps it overlaps, and its arithmetic per inner step."""
    steps: Mapping[str, int] = raw["steps"]
    times: Mapping[str, Sequence[float]] = raw["times"]
    delay: int = raw["delays"][name]
    quiet = statistics.median(per_step(times[QUIET], steps[QUIET]))
    mine = statistics.median(per_step(times[name], steps[name]))
    link = link_seconds(raw["fragment_link_bytes"], bits_per_second)
    stride = raw["sync_every"] // FRAGMENTS
    codec = statistics.median(raw["codec"]) / WORLD
    exposed = max(0.0, link - delay * quiet)
    beyond = mine - quiet - (exposed + codec) / stride
    blocking = blocking_name(raw["sync_every"])
    same_h = ""
    if blocking in times:  # the same syncs, each waited for whole: what hiding them saves
        waited = statistics.median(per_step(times[blocking], steps[blocking])) - quiet
        same_h = (
            f"; blocking DiLoCo with the same H = {raw['sync_every']}, which hides nothing, "
            f"took {_ms(waited)} more"
        )
    return (
        f"a fragment's int8 sync puts {raw['fragment_link_bytes']:,} bytes on the link, "
        f"{_ms(link)} at {rate_label(bits_per_second)}, "
        f"{'more than' if exposed > 0 else 'within'} the {delay} inner step"
        f"{'s' if delay > 1 else ''} of {_ms(quiet)} it may take ({_ms(exposed)} left to wait, "
        f"{_ms(exposed / stride)} per inner step); its arithmetic alone (encode, decode, the "
        f"replica's update) takes {_ms(codec)} a sync on the rank's one core, "
        f"{_ms(codec / stride)} per inner step ({codec / stride / quiet:.2f} of a step); the "
        f"run took {_ms(mine - quiet)} per inner step more than without communication, "
        f"{_ms(beyond)} beyond the wait and the arithmetic{same_h}"
    )
