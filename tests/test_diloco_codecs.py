"""DiLoCo's sparse and 2-bit codecs, property-tested: bit packing round
trips, the 2-bit codes' and top-k's error bounds, top-k's exact k per chunk
with ties to the lowest offset, the error-feedback identity, payload sizes
known from the element count, the bytes against fp32, and compressed syncs
on the simulated world (replicas bitwise identical, fragments included)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from test_diloco_core import OUTER, World, drift, replicated, sizes_lists

from zerofn.bitpack import pack_bits, packed_nbytes, unpack_bits
from zerofn.blockquant import BlockQuantizer
from zerofn.comm import request_bytes
from zerofn.diloco.compressed_sync import compressed_sync_bytes
from zerofn.diloco.config import Codec, DiLoCoConfig, codec_for
from zerofn.diloco.footprint import sync_bytes_per_rank
from zerofn.diloco.fragments import plan_fragments
from zerofn.diloco.sync import sync_bytes
from zerofn.topk import TopK
from zerofn.twobit import TwoBitQuantizer

SETTINGS = settings(max_examples=draws(60), deadline=None)

CODECS: dict[str, Codec] = {
    "int2": TwoBitQuantizer(8),
    "top-k 2 bits": TopK(0.25, 2, 8),
    "top-k int8": TopK(0.3, 8, 5),
    "top-k everything": TopK(1.0, 2, 4),
    "int8": BlockQuantizer(8, 16),
}


@st.composite
def vectors(draw: st.DrawFn, max_size: int = 300) -> torch.Tensor:
    """Vectors with ties, zeros and spread magnitudes: a few distinct values
    scaled per draw, so equal magnitudes are common."""
    n = draw(st.integers(0, max_size))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "ties", "zeros", "wide"]))
    if kind == "ties":
        return torch.randint(-3, 4, (n,), generator=g).to(torch.float32)
    if kind == "zeros":
        return torch.zeros(n)
    x = torch.randn(n, generator=g)
    return x * torch.exp(4 * torch.randn(n, generator=g)) if kind == "wide" else x


def round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    payload = torch.empty(codec.payload_nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, payload)
    return codec.decode(payload, x.numel())


# ----- bit packing ------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 24), st.integers(0, 200), st.integers(0, 2**16))
def test_packed_bits_unpack_to_the_same_values(bits: int, count: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (count,), generator=g)
    packed = torch.empty(packed_nbytes(count, bits), dtype=torch.uint8)
    pack_bits(values, bits, packed)
    assert torch.equal(unpack_bits(packed, count, bits), values)
    assert packed.numel() * 8 < count * bits + 8  # no byte more than the bits need


def test_bad_packing_is_refused() -> None:
    with pytest.raises(ValueError, match="bits must be an int in"):
        packed_nbytes(3, 0)
    with pytest.raises(ValueError, match="3 bytes"):
        pack_bits(torch.zeros(3, dtype=torch.int64), 8, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2 bytes"):
        unpack_bits(torch.empty(3, dtype=torch.uint8), 5, 3)


# ----- error bounds -----------------------------------------------------------------


@SETTINGS
@given(vectors(), st.sampled_from([4, 8, 12, 256]))
def test_two_bit_codes_come_back_within_a_third_of_their_blocks_largest(
    x: torch.Tensor, block: int
) -> None:
    codec = TwoBitQuantizer(block)
    back = round_trip(codec, x)
    for start in range(0, x.numel(), block):
        part, got = x[start : start + block], back[start : start + block]
        bound = float(part.abs().max()) / 3
        assert float((part - got).abs().max()) <= bound * (1 + 1e-6)
        if bound == 0:  # an all-zero block decodes to zeros
            assert torch.all(got == 0)
        else:  # four levels, a scale apart from the middle
            assert set(torch.unique((got / bound).round()).tolist()) <= {-3, -1, 1, 3}


@SETTINGS
@given(
    vectors(),
    st.one_of(st.floats(0.01, 1.0), st.just(1e-12)),
    st.sampled_from([2, 8]),
    st.integers(2, 40),
)
def test_top_k_keeps_exactly_k_per_chunk_largest_first_ties_to_the_lowest_offset(
    x: torch.Tensor, density: float, bits: int, chunk: int
) -> None:
    codec = TopK(density, bits, chunk)  # type: ignore[arg-type]
    chosen = codec.select(x).tolist()
    back = round_trip(codec, x)
    at = 0
    for start in range(0, x.numel(), chunk):
        part = x[start : start + chunk]
        k = codec.k_of(part.numel())
        assert 1 <= k <= part.numel()
        # The reference: by magnitude, largest first, then by offset.
        order = sorted(range(part.numel()), key=lambda i: (-abs(float(part[i])), i))
        assert chosen[at : at + k] == sorted(order[:k])
        at += k
        kept = torch.zeros(part.numel(), dtype=torch.bool)
        kept[order[:k]] = True
        got = back[start : start + chunk]
        assert torch.all(got[~kept] == 0)
        if (~kept).any():  # nothing left out is larger than what was kept
            assert float(part[~kept].abs().max()) <= float(part[kept].abs().min())
        magnitudes = part[kept].abs()
        if bits == 2:  # two levels over the kept magnitudes' range, and the sign
            step = float(magnitudes.max() - magnitudes.min()) / 4
        else:
            step = float(magnitudes.max()) / 254
        error = (part[kept] - got[kept]).abs().max()
        assert float(error) <= step * (1 + 1e-6) + 1e-6 * float(magnitudes.max())
    assert at == len(chosen) == codec.kept(x.numel())


@SETTINGS
@given(vectors(), vectors(), st.sampled_from(sorted(CODECS)))
def test_what_was_sent_plus_the_new_residual_is_the_residual_plus_the_gradient(
    gradient: torch.Tensor, residual: torch.Tensor, name: str
) -> None:
    n = min(gradient.numel(), residual.numel())
    g, r = gradient[:n], residual[:n]
    owed = g + r
    sent = round_trip(CODECS[name], owed)
    new_residual = owed - sent
    # Exact but for float32 rounding of the subtraction and the sum (a unit
    # roundoff, 2**-24, of each).
    bound = 2.0**-23 * (owed.abs() + new_residual.abs())
    assert torch.all((sent + new_residual - owed).abs() <= bound)


@SETTINGS
@given(vectors(), st.sampled_from(sorted(CODECS)))
def test_decoding_depends_on_the_bytes_alone(x: torch.Tensor, name: str) -> None:
    codec = CODECS[name]
    payload = torch.empty(codec.payload_nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, payload)
    again = copy.deepcopy(codec)
    assert torch.equal(codec.decode(payload.clone(), x.numel()), again.decode(payload, x.numel()))


# ----- bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize(
    ("compression", "most"), [("int2", 1 / 14), (TopK(density=0.02, bits=2), 1 / 100)]
)
def test_syncs_hand_over_at_most_their_share_of_the_fp32_bytes(
    world_size: int, compression: Any, most: float
) -> None:
    codec = codec_for(compression)
    assert codec is not None
    f = plan_fragments([1_000_000], 1, world_size).fragments[0]
    for rank in range(world_size):
        assert compressed_sync_bytes(f, codec, rank) <= most * sync_bytes(f)


@SETTINGS
@given(st.integers(1, 10**7), st.integers(1, 16), st.integers(1, 8))
def test_the_planner_counts_every_codecs_bytes_per_sync(
    numel: int, world_size: int, fragments: int
) -> None:
    fragments = min(fragments, numel)
    plan = plan_fragments([numel], fragments, world_size)
    for compression in (None, "int8", "int4", "int2", TopK()):
        codec = codec_for(compression)
        planned = [
            sync_bytes(f) if codec is None else compressed_sync_bytes(f, codec, r)
            for f in plan.fragments
            for r in range(world_size)
        ]
        assert sync_bytes_per_rank(numel, world_size, fragments, compression) == max(planned)


# ----- the configuration ------------------------------------------------------------


def test_names_and_records_become_codecs() -> None:
    assert DiLoCoConfig(4, compression="int2").compression == TwoBitQuantizer(256)
    topk = TopK(density=0.02, bits=2)
    assert DiLoCoConfig(4, compression=topk).compression == topk
    assert isinstance(DiLoCoConfig(4, compression=TwoBitQuantizer(64)).compression, Codec)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: DiLoCoConfig(4, compression="int3"), ValueError, "int8, int4, int2"),
        (lambda: DiLoCoConfig(4, compression="topk"), ValueError, r"TopK\(density=0.02"),
        (lambda: DiLoCoConfig(4, compression=2), TypeError, "a zerofn.topk.TopK"),
        (lambda: TopK(density=0), ValueError, r"\(0, 1\]"),
        (lambda: TopK(density=1.5), ValueError, r"\(0, 1\]"),
        (lambda: TopK(density="2%"), TypeError, "density is the fraction"),
        (lambda: TopK(bits=4), ValueError, "2 or 8"),
        (lambda: TopK(chunk=1), ValueError, "chunk must be an int >= 2"),
        (lambda: TwoBitQuantizer(6), ValueError, "multiple of 4"),
    ],
)
def test_bad_codecs_are_refused_with_the_fix(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_bad_payloads_are_refused() -> None:
    for codec in (TwoBitQuantizer(), TopK()):
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(torch.empty(3, dtype=torch.uint8), 100)
        with pytest.raises(ValueError, match="1-D float"):
            codec.encode(torch.zeros(2, 2), torch.empty(8, dtype=torch.uint8))


# ----- syncs on the simulated world -------------------------------------------------


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(sorted(CODECS)),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_compressed_syncs_keep_replicas_identical_and_hand_over_the_bytes_planned(
    sizes: list[int], fragments: int, world_size: int, name: str, rounds: int, seed: int
) -> None:
    fragments = min(fragments, sum(sizes))
    codec = CODECS[name]
    params = replicated(sizes, world_size, seed)
    world = World(plan_fragments(sizes, fragments, world_size), params, OUTER["nesterov"], codec)  # type: ignore[arg-type]
    for r in range(rounds):
        drift(params, seed + r)
        for fragment, f in enumerate(world.plan.fragments):
            world.requests = [[] for _ in range(world_size)]
            results = world.sync(fragment)
            assert all(torch.equal(result, results[0]) for result in results)
            for rank, requests in enumerate(world.requests):
                handed = sum(request_bytes(q) for q in requests)
                assert handed == compressed_sync_bytes(f, codec, rank)
    assert all(torch.equal(replica, world.replicas[0]) for replica in world.replicas)


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 5), st.sampled_from(sorted(CODECS)))
def test_each_owner_receives_the_true_mean_less_what_is_still_owed(
    n: int, world_size: int, name: str
) -> None:
    params = replicated([n], world_size, n)
    world = World(plan_fragments([n], 1, world_size), params, OUTER["sgd lr 1"], CODECS[name])  # type: ignore[arg-type]
    drift(params, n + 1)
    truth = [world.replicas[r] - params[r][0] for r in range(world_size)]
    world.sync(0)
    f = world.plan.fragments[0]
    for owner, received in enumerate(world.gradients):
        owed = torch.stack([res[f.owned(owner)] for res in world.residuals]).mean(0)
        true = torch.stack([t[f.owned(owner)] for t in truth]).mean(0)
        torch.testing.assert_close(received + owed, true, rtol=1e-5, atol=1e-5)


def test_the_planner_prints_bytes_per_sync_for_a_codec(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofn.footprint.cli import main

    args = ["--model", "gpt2-small", "--world-size", "8", "--diloco-fragments", "4"]
    main([*args, "--diloco-compression", "topk"])
    header, _, row = capsys.readouterr().out.strip().splitlines()[1:]
    cells = dict(
        zip(
            [c.strip() for c in header.split("|")[1:-1]],
            [c.strip() for c in row.split("|")[1:-1]],
            strict=True,
        )
    )
    numel = 124_439_808
    fp32 = sync_bytes_per_rank(numel, 8, 4) / 2**20
    topk = sync_bytes_per_rank(numel, 8, 4, TopK(density=0.02, bits=2)) / 2**20
    assert cells["DiLoCo MiB/sync (fp32)"] == f"{fp32:.2f}"
    assert cells["DiLoCo MiB/sync (topk)"] == f"{topk:.2f}"
    assert topk <= fp32 / 100
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "gpt2-small", "--world-size", "8", "--diloco-compression", "int2"])
    assert exit_info.value.code == 2
    assert "needs --diloco-fragments" in capsys.readouterr().err
