"""Integrity of sharded optimizer checkpoints.

The manifest's pure checks (:mod:`zerofn.zero.checkpoint.manifest`) as hypothesis
properties, then, on 2 real gloo ranks, every way a saved checkpoint can be
damaged: each must be refused by every rank with the same CheckpointError,
naming the file and its defect, with the optimizer unchanged. Spawning is
slow on 2 cores, so one world saves once and runs every case in turn.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _draws import draws
from _world import run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded

from zerofn.errors import CheckpointError
from zerofn.testing import strategies as zst
from zerofn.zero.checkpoint.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    check_files,
    check_model,
    refusal,
)

SETTINGS = settings(max_examples=draws(100), deadline=None)

# ----- the pure checks ----------------------------------------------------------------

DIGESTS = st.binary(max_size=8).map(lambda b: hashlib.sha256(b).hexdigest())
DATA_NAMES = st.builds("__{}_{}.distcp".format, st.integers(0, 7), st.integers(0, 3))
RECORDS = st.lists(
    st.builds(
        FileRecord, st.one_of(DATA_NAMES, st.just(".metadata")), st.integers(0, 10**9), DIGESTS
    ),
    unique_by=lambda r: r.name,
    max_size=6,
)
SHAPE_GROUPS = st.lists(st.lists(zst.shapes(max_dims=3, max_side=5), max_size=4), max_size=3)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    groups = draw(SHAPE_GROUPS)
    return Manifest(
        zerofn_version=draw(st.sampled_from(["0.1.0", "unknown"])),
        partition=draw(st.sampled_from(["greedy", "balanced", "flat", "manual"])),
        world_size=draw(st.integers(1, 64)),
        shapes=[s for g in groups for s in g],
        group_sizes=[[math.prod(s) for s in g] for g in groups],
        files=draw(RECORDS),
    )


def observed(manifest: Manifest) -> tuple[dict[str, int], dict[str, str]]:
    """The listing and hashes of a directory exactly as the manifest says."""
    return {f.name: f.size for f in manifest.files}, {f.name: f.sha256 for f in manifest.files}


@SETTINGS
@given(manifests())
def test_the_dict_round_trip_is_identity(manifest: Manifest) -> None:
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


@SETTINGS
@given(manifests(), st.sampled_from(["other.txt", "model.pt", "zerofn_manifest.json.tmp"]))
def test_an_unchanged_listing_has_no_problem(manifest: Manifest, unrelated: str) -> None:
    sizes, hashes = observed(manifest)
    assert check_files(manifest, sizes, hashes) == []
    assert check_files(manifest, sizes, {}) == []
    # Files that are not torch.distributed.checkpoint's are left alone.
    assert check_files(manifest, {**sizes, unrelated: 3}, hashes) == []


@SETTINGS
@given(manifests(), st.data())
def test_any_single_change_is_one_problem_naming_its_file(
    manifest: Manifest, data: st.DataObject
) -> None:
    sizes, hashes = observed(manifest)
    names = sorted(sizes)
    kinds = ["extra"] + (["removed", "resized", "rehashed"] if names else [])
    kind = data.draw(st.sampled_from(kinds))
    if kind == "extra":
        name = data.draw(DATA_NAMES.filter(lambda n: n not in sizes))
        sizes[name] = data.draw(st.integers(0, 100))
        defect = "extra file"
    else:
        name = data.draw(st.sampled_from(names))
        if kind == "removed":
            del sizes[name]
            defect = "missing"
        elif kind == "resized":
            sizes[name] = data.draw(st.integers(0, 10**9).filter(lambda n: n != sizes[name]))
            expected = next(f.size for f in manifest.files if f.name == name)
            defect = "truncated" if sizes[name] < expected else "wrong size"
        else:
            hashes[name] = data.draw(DIGESTS.filter(lambda h: h != hashes[name]))
            defect = "corrupt"
    problems = check_files(manifest, sizes, hashes)
    assert len(problems) == 1, problems
    assert problems[0].startswith(name) and defect in problems[0]


@SETTINGS
@given(manifests(), manifests())
def test_the_model_check_compares_shapes_and_grouping_only(a: Manifest, b: Manifest) -> None:
    assert check_model(a, a.shapes, a.group_sizes) == []
    same_model = a.shapes == b.shapes and [len(g) for g in a.group_sizes] == [
        len(g) for g in b.group_sizes
    ]
    problems = check_model(a, b.shapes, b.group_sizes)
    assert (problems == []) == same_model
    assert all("another model" in p for p in problems)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"world_size": "two"}, "world_size"),
        ({"world_size": 0}, "world_size"),
        ({"partition": "round-robin"}, "partition"),
        ({"format_version": 3}, "format version 3"),
        ({"saved_at": "yesterday"}, "saved_at"),
        ({"shapes": [[3, 3]]}, "do not match"),
        ({"files": {"a/b.distcp": {"size": 1, "sha256": "0" * 64}}}, "not a plain file name"),
        ({"files": {"x.distcp": {"size": -1, "sha256": "0" * 64}}}, "size"),
        ({"files": {"x.distcp": {"size": 1, "sha256": "XYZ"}}}, "sha256"),
        ({"files": ["x.distcp"]}, "'files'"),
        ({"extra": 1}, "unexpected: ['extra']"),
    ],
)
def test_a_malformed_manifest_is_refused_with_its_field(change: dict[str, Any], field: str) -> None:
    good = Manifest("0.1.0", "greedy", 2, [[2, 3]], [[6]], [FileRecord(".metadata", 1, "a" * 64)])
    assert Manifest.from_dict(good.to_dict()) == good
    with pytest.raises(ValueError, match=re.escape(field)):
        Manifest.from_dict({**good.to_dict(), **change})
    missing = good.to_dict()
    del missing["files"]
    with pytest.raises(ValueError, match="missing: \\['files'\\]"):
        Manifest.from_dict(missing)


def test_refusal_names_each_problem_once_with_the_ranks_that_found_it() -> None:
    assert refusal([[], []]) is None
    assert refusal([["a"], []]) == "a (found by rank 0)"
    assert refusal([["a"], ["b", "a"], []]) == "a (found by ranks 0, 1); b (found by rank 1)"


# ----- on 2 gloo ranks ----------------------------------------------------------------


def make_optimizer(mode: str, seed: int, out_features: int = 16) -> ZeroRedundancyOptimizer:
    """Adam over a small model, stepped twice on ``seed``'s data, so it has state.

    Its size puts the middle of rank 1's data file inside a tensor's bytes,
    where flipped bytes once loaded silently as garbage state."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, out_features)
    )
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition=mode, lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 64, generator=g)).square().mean().backward()
        opt.step()
    return opt


def same(a: Any, b: Any) -> bool:
    """Structural equality, tensors by torch.equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def flip(path: pathlib.Path, length: int = 4096) -> None:
    """Invert ``length`` bytes in the middle of the file."""
    data = bytearray(path.read_bytes())
    assert len(data) >= 2 * length, f"{path.name} is too small to corrupt in its middle"
    start = (len(data) - length) // 2
    data[start : start + length] = bytes(b ^ 0xFF for b in data[start : start + length])
    path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_manifest(path: pathlib.Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["world_size"] = "two"
    path.write_text(json.dumps(manifest))


def extra(d: pathlib.Path) -> None:
    shutil.copy(d / "__1_0.distcp", d / "__2_0.distcp")


# Each case: the directory it starts from ("clean", "other", or None for an
# empty one), what is done to it, and what the message must say.
CASES: dict[str, tuple[str | None, Callable[[pathlib.Path], None], tuple[str, ...]]] = {
    "flipped bytes": (
        "clean",
        lambda d: flip(d / "__1_0.distcp"),
        ("__1_0.distcp is corrupt", "sha256", "found by rank"),
    ),
    "flipped bytes, rank 0's file": (
        "clean",
        lambda d: flip(d / "__0_0.distcp"),
        ("__0_0.distcp is corrupt",),
    ),
    "truncated data file": (
        "clean",
        lambda d: truncate(d / "__0_0.distcp"),
        ("__0_0.distcp is truncated",),
    ),
    "corrupt metadata": ("clean", lambda d: flip(d / ".metadata", 512), (".metadata is corrupt",)),
    "corrupt manifest": (
        "clean",
        lambda d: truncate(d / MANIFEST_NAME),
        (f"manifest {MANIFEST_NAME} is corrupt",),
    ),
    "edited manifest": ("clean", lambda d: edit_manifest(d / MANIFEST_NAME), ("world_size",)),
    "missing data file": (
        "clean",
        lambda d: (d / "__1_0.distcp").unlink(),
        ("__1_0.distcp is missing",),
    ),
    "extra data file": ("clean", extra, ("__2_0.distcp is an extra file",)),
    "interrupted save": (
        "clean",
        lambda d: (d / MANIFEST_NAME).unlink(),
        ("not a zerofn checkpoint (no manifest",),
    ),
    "empty directory": (None, lambda d: None, ("not a zerofn checkpoint (no manifest",)),
    "foreign directory": (
        None,
        lambda d: (d / "notes.txt").write_text("not a checkpoint"),
        ("not a zerofn checkpoint (no manifest",),
    ),
    "no directory": (None, lambda d: d.rmdir(), ("directory does not exist",)),
    "another model": ("other", lambda d: None, ("another model", "parameter 2 has shape [8, 256]")),
}
MODES = ("greedy", "flat")


def attempt(opt: ZeroRedundancyOptimizer, directory: str) -> dict[str, Any]:
    """Load ``directory`` into ``opt``: what was raised, and whether ``opt`` kept its state."""
    before = copy.deepcopy(opt.optim.state_dict())
    try:
        load_sharded(opt, directory)
        error, message = None, ""
    # CheckpointException (torch.distributed.checkpoint's) is a BaseException.
    except (Exception, CheckpointException) as e:
        error, message = type(e).__name__, str(e)
    return {"error": error, "message": message, "unchanged": same(opt.optim.state_dict(), before)}


def integrity_world(rank: int, world: int, root: str) -> dict[str, Any]:
    base = pathlib.Path(root)
    clean, other = base / "clean", base / "other"
    if rank == 0:  # a larger world's leftovers, which the save must clear away
        clean.mkdir()
        (clean / "__7_0.distcp").write_bytes(b"stale")
        (clean / MANIFEST_NAME).write_text("stale")
    dist.barrier()
    saved = make_optimizer("greedy", seed=10)
    save_sharded(saved, clean)
    save_sharded(make_optimizer("greedy", seed=10, out_features=8), other)
    saved.consolidate_state_dict(to=0)
    out: dict[str, Any] = {"consolidated": saved.state_dict() if rank == 0 else None}
    out["sizes"] = {f.name: f.stat().st_size for f in clean.iterdir()}
    for mode in MODES:
        out[("clean", mode)] = attempt(make_optimizer(mode, seed=20 + rank), str(clean))
    out["same partition, same state"] = same(
        make_loaded(str(clean)).optim.state_dict(), saved.optim.state_dict()
    )
    for case, (source, damage, _) in CASES.items():
        directory = base / "".join(c if c.isalnum() else "_" for c in case)
        if rank == 0:
            if source is None:
                directory.mkdir()
            else:
                shutil.copytree(base / source, directory)
            damage(directory)
        dist.barrier()
        for mode in MODES:
            out[(case, mode)] = attempt(make_optimizer(mode, seed=20 + rank), str(directory))
    copies = [base / "flipped_bytes", clean]
    out["one damaged copy"] = attempt(make_optimizer("greedy", seed=20), str(copies[rank]))
    return out


def make_loaded(directory: str) -> ZeroRedundancyOptimizer:
    opt = make_optimizer("greedy", seed=30)
    load_sharded(opt, directory)
    return opt


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], pathlib.Path]:
    root = tmp_path_factory.mktemp("integrity")
    return run_world(integrity_world, 2, str(root)), root


@pytest.mark.timeout(120)
def test_a_save_writes_a_manifest_of_every_file_and_clears_leftovers(two_ranks: Any) -> None:
    results, root = two_ranks
    names = {".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST_NAME}
    assert set(results[0]["sizes"]) == names
    manifest = Manifest.from_dict(json.loads((root / "clean" / MANIFEST_NAME).read_text()))
    assert {f.name for f in manifest.files} == names - {MANIFEST_NAME}
    assert (manifest.partition, manifest.world_size) == ("greedy", 2)
    assert manifest.shapes == ((256, 64), (256,), (16, 256), (16,))
    for f in manifest.files:
        data = (root / "clean" / f.name).read_bytes()
        assert (f.size, f.sha256) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.timeout(120)
def test_a_clean_checkpoint_loads_under_every_partition(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank_results in results:
        for mode in MODES:
            assert rank_results[("clean", mode)]["error"] is None, rank_results[("clean", mode)]
        assert rank_results["same partition, same state"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_checkpoint_is_refused_by_every_rank(
    two_ranks: Any, case: str, mode: str
) -> None:
    results, _ = two_ranks
    outcomes = [rank_results[(case, mode)] for rank_results in results]
    assert [o["error"] for o in outcomes] == ["CheckpointError"] * 2, outcomes
    assert outcomes[0]["message"] == outcomes[1]["message"]
    for expected in CASES[case][2]:
        assert expected in outcomes[0]["message"], outcomes[0]["message"]
    assert all(o["unchanged"] for o in outcomes)


@pytest.mark.timeout(120)
def test_one_ranks_finding_is_every_ranks_refusal(two_ranks: Any) -> None:
    results, _ = two_ranks
    # Rank 0 loads a damaged copy, rank 1 a clean one (as on node-local disks):
    # only rank 0 finds the damage, and rank 1 refuses too, unchanged.
    outcomes = [rank_results["one damaged copy"] for rank_results in results]
    assert [o["error"] for o in outcomes] == ["CheckpointError"] * 2, outcomes
    for o in outcomes:
        assert "__1_0.distcp is corrupt" in o["message"] and o["message"].endswith(
            "(found by rank 0)"
        )
        assert o["unchanged"]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("mode", MODES)
def test_a_clean_checkpoint_from_two_ranks_loads_on_one_exactly(two_ranks: Any, mode: str) -> None:
    results, root = two_ranks
    opt = make_optimizer(mode, seed=40)
    load_sharded(opt, root / "clean")
    opt.consolidate_state_dict(to=0)
    assert same(opt.state_dict(), results[0]["consolidated"])


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_group")
def test_a_damaged_checkpoint_is_refused_on_one_rank(two_ranks: Any) -> None:
    _, root = two_ranks
    opt = make_optimizer("greedy", seed=40)
    before = copy.deepcopy(opt.optim.state_dict())
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is corrupt.*\(found by rank 0\)"):
        load_sharded(opt, root / "flipped_bytes")
    assert same(opt.optim.state_dict(), before)
