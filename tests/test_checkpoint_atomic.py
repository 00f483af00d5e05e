"""Sharded saves are all or nothing, and a run keeps its newest checkpoints.

First the pure decisions (:mod:`zerofn.zero.checkpoint.run`: temporaries,
pruning, the newest checkpoint) and the manifest's formats as hypothesis
properties and literal fixtures. Then real ranks: a rank killed (SIGKILL)
before, while and after writing a re-save, each rank in turn the victim;
the last good checkpoint must be the one a restart finds, holding exactly
the state it held. Last, on 2 live ranks: background saves (one with a
failure injected), ``keep_last`` and ``extra``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import signal
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _draws import draws
from _world import run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint_integrity import same
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import latest_checkpoint, load_sharded, save_sharded
from zerofn_torch.checkpoint import save as checkpoint_save
from zerofn_torch.checkpoint import sharded as checkpoint_module

from zerofn.errors import CheckpointError
from zerofn.zero.checkpoint.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    check_files,
)
from zerofn.zero.checkpoint.run import (
    is_temporary,
    newest,
    staging_name,
    temporaries,
    to_prune,
    trash_name,
)
from zerofn.zero.checkpoint.sharded import extra_entries, nested_extra

SETTINGS = settings(max_examples=draws(200), deadline=None)

# ----- the pure decisions ---------------------------------------------------------------

NAMES = st.text("abcxyz_0123.-", min_size=1, max_size=12).filter(lambda n: n not in (".", ".."))
TOKENS = st.binary(min_size=4, max_size=16).map(bytes.hex)


@SETTINGS
@given(NAMES, TOKENS)
def test_temporaries_are_hidden_never_plain_and_belong_to_their_target(
    name: str, token: str
) -> None:
    staging, trash = staging_name(name, token), trash_name(name, token)
    assert staging.startswith(".") and trash.startswith(".") and staging != trash
    assert is_temporary(staging) and is_temporary(trash)
    assert temporaries([staging, trash, name, "other"], name) == sorted([staging, trash])
    assert temporaries([staging_name("other", token)], name) == []


@SETTINGS
@given(NAMES.filter(lambda n: not n.startswith(".")))
def test_a_plain_name_is_never_a_temporary(name: str) -> None:
    assert not is_temporary(name)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b"])
def test_a_staging_name_needs_a_plain_target(bad: str) -> None:
    with pytest.raises(ValueError, match="plain directory name"):
        staging_name(bad, "ab" * 4)
    with pytest.raises(ValueError, match="hex"):
        staging_name("ckpt", "not-hex!")


SAVED = st.dictionaries(NAMES, st.floats(0, 1e9, allow_nan=False), max_size=8)


@SETTINGS
@given(SAVED, st.integers(1, 10), st.data())
def test_pruning_keeps_the_newest_and_always_the_current(
    saved: dict[str, float], keep: int, data: st.DataObject
) -> None:
    current = data.draw(st.sampled_from(sorted(saved))) if saved else "new"
    saved = {**saved, current: saved.get(current, 0.0)}
    dropped = to_prune(saved, keep, current)
    kept = set(saved) - set(dropped)
    assert current in kept
    assert len(kept) == min(keep, len(saved))
    others = [n for n in saved if n != current]
    # Every kept checkpoint besides the current is at least as new as every dropped one.
    for k in kept - {current}:
        assert all((saved[k], k) > (saved[d], d) for d in dropped)
    assert set(dropped) <= set(others)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_keep_last_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        to_prune({}, bad, "x")


@SETTINGS
@given(SAVED)
def test_the_newest_is_the_latest_saved(saved: dict[str, float]) -> None:
    found = newest(saved)
    if not saved:
        assert found is None
    else:
        assert found is not None and saved[found] == max(saved.values())


EXTRA_VALUES = st.recursive(
    st.one_of(st.integers(), st.text(max_size=4), st.builds(torch.zeros, st.integers(0, 3))),
    lambda inner: st.dictionaries(NAMES.filter(lambda n: "/" not in n), inner, min_size=1),
    max_leaves=8,
)


@SETTINGS
@given(st.dictionaries(NAMES.filter(lambda n: "/" not in n), EXTRA_VALUES, max_size=4))
def test_extra_state_round_trips_through_its_keys(extra: dict[str, Any]) -> None:
    entries = extra_entries(extra)
    assert all(k.startswith("zerofn_extra/") for k in entries)
    back = nested_extra({**entries, "zerofn_optim/group_sizes": [[1]]})
    assert same(back, extra)


@pytest.mark.parametrize("bad", [{"a/b": 1}, {"": 1}, {3: 1}, {"m": {"x/y": 1}}])
def test_extra_keys_must_be_plain_names(bad: dict[Any, Any]) -> None:
    with pytest.raises(ValueError, match="extra's keys"):
        extra_entries(bad)


# ----- the manifest's formats and file checks ----------------------------------------------

# A manifest exactly as format 1 wrote it (zerofn 0.1.0 before saved_at).
V1_MANIFEST = """{
 "format_version": 1,
 "zerofn_version": "0.1.0",
 "partition": "greedy",
 "world_size": 2,
 "shapes": [[4, 2], [4]],
 "group_sizes": [[8, 4]],
 "files": {
  ".metadata": {"size": 10, "sha256": "A"},
  "__0_0.distcp": {"size": 20, "sha256": "B"}
 }
}""".replace('"A"', f'"{"a" * 64}"').replace('"B"', f'"{"b" * 64}"')


def test_a_format_1_manifest_still_reads() -> None:
    manifest = Manifest.from_dict(json.loads(V1_MANIFEST))
    assert (manifest.format_version, manifest.saved_at, manifest.world_size) == (1, 0.0, 2)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert "saved_at" not in manifest.to_dict()


def test_a_format_2_manifest_records_when_it_was_saved() -> None:
    manifest = Manifest("0.1.0", "flat", 1, [[3]], [[3]], [], saved_at=12.5)
    assert manifest.format_version == 2
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest
    with pytest.raises(ValueError, match="no saved_at"):
        Manifest("0.1.0", "flat", 1, [[3]], [[3]], [], saved_at=1.0, format_version=1)


def _three_files() -> Manifest:
    files = [
        FileRecord(n, s, c * 64)
        for n, s, c in [
            (".metadata", 10, "a"),
            ("__0_0.distcp", 20, "b"),
            ("__1_0.distcp", 30, "c"),
        ]
    ]
    return Manifest("0.1.0", "greedy", 2, [[4]], [[4]], files, saved_at=1.0)


def test_swapped_data_files_are_named_as_swapped() -> None:
    m = _three_files()
    sizes = {".metadata": 10, "__0_0.distcp": 30, "__1_0.distcp": 20}
    hashes = {".metadata": "a" * 64, "__0_0.distcp": "c" * 64, "__1_0.distcp": "b" * 64}
    assert check_files(m, sizes, hashes) == [
        "__0_0.distcp holds what the manifest lists for __1_0.distcp: files swapped or renamed",
        "__1_0.distcp holds what the manifest lists for __0_0.distcp: files swapped or renamed",
    ]


def test_another_saves_manifest_is_named_as_such() -> None:
    m = _three_files()
    sizes = {".metadata": 11, "__0_0.distcp": 21, "__1_0.distcp": 31}
    hashes = {n: "d" * 64 for n in sizes}
    (problem,) = check_files(m, sizes, hashes)
    assert "manifest belongs to another save" in problem and "truncated" not in problem


# ----- a rank killed during a re-save -----------------------------------------------------

STEPS_BEFORE = 2  # steps in the first checkpoint; the re-save holds one more


def _model_and_optimizer() -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    return model, opt


def _train(model: torch.nn.Module, opt: ZeroRedundancyOptimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)  # every rank the same batch: a replica's run
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Make this process die (SIGKILL) at ``point`` of its next save."""
    if point == "entering":  # the snapshot taken, nothing written yet
        checkpoint_module.save = lambda *a, **k: _kill_self()  # type: ignore[assignment]
    elif point == "writing":  # its data files written, not yet hashed
        checkpoint_save.files.own_files = lambda *a, **k: _kill_self()  # type: ignore[assignment]
    elif point == "verifying":  # the manifest written, the staged copy whole
        checkpoint_save._verify_staged = lambda *a, **k: _kill_self()  # type: ignore[assignment]
    elif point == "committed":  # rank 0 swapped the new one in, then died
        commit = checkpoint_save.files.commit

        def commit_then_die(*args: Any) -> None:
            commit(*args)
            _kill_self()

        checkpoint_save.files.commit = commit_then_die  # type: ignore[assignment]


def resave_rank(rank: int, store: str, run: str, point: str, victim: int) -> None:
    """One rank of a 2-rank job: save after 2 steps, step once more, and
    re-save with ``victim`` killed at ``point``; the survivor records what
    it raised, rank 0 what each checkpoint must hold."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    model, opt = _model_and_optimizer()
    target = os.path.join(run, "ckpt")
    for steps in (range(STEPS_BEFORE), range(STEPS_BEFORE, STEPS_BEFORE + 1)):
        _train(model, opt, steps)
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            expected = {"optim": opt.state_dict(), "model": model.state_dict()}
            torch.save(expected, os.path.join(run, f"expected{steps.stop}.pt"))
        if steps.stop == STEPS_BEFORE:
            save_sharded(opt, target, extra={"model": model.state_dict(), "step": steps.stop})
    dist.barrier()
    if rank == victim:
        _arm(point)
    try:
        save_sharded(opt, target, extra={"model": model.state_dict(), "step": STEPS_BEFORE + 1})
        seen = {"error": None, "message": ""}
    except Exception as e:
        seen = {"error": type(e).__name__, "message": str(e)}
    torch.save(seen, os.path.join(run, f"seen{rank}.pt"))
    os._exit(0)  # the group is broken: skip its teardown


KILLS = [
    ("entering", 0, STEPS_BEFORE),
    ("entering", 1, STEPS_BEFORE),
    ("writing", 0, STEPS_BEFORE),
    ("writing", 1, STEPS_BEFORE),
    ("verifying", 0, STEPS_BEFORE),
    ("verifying", 1, STEPS_BEFORE),
    ("committed", 0, STEPS_BEFORE + 1),
]


@pytest.fixture(scope="module")
def killed_resaves(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], pathlib.Path]:
    """Every kill case run, each in a fresh 2-rank job (forked from a server
    with torch imported, so a case costs forks, not interpreter starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zerofn_torch.checkpoint"])
    runs = {}
    for point, victim, _ in KILLS:
        run = tmp_path_factory.mktemp(f"{point}-{victim}")
        store = str(run / "store")
        procs = [
            ctx.Process(target=resave_rank, args=(r, store, str(run), point, victim))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
            if p.is_alive():
                p.kill()
                raise AssertionError(f"case {point}/{victim}: a rank hung")
        os.remove(store) if os.path.exists(store) else None
        runs[(point, victim)] = run
    return runs


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(("point", "victim", "holds"), KILLS)
@pytest.mark.slow
def test_a_rank_killed_during_a_resave_leaves_a_whole_checkpoint(
    killed_resaves: dict[tuple[str, int], pathlib.Path], point: str, victim: int, holds: int
) -> None:
    run = killed_resaves[(point, victim)]
    survivor = 1 - victim
    seen = torch.load(run / f"seen{survivor}.pt", weights_only=False)
    assert seen["error"] == "CollectiveError", seen
    # What a restart finds: the one plain-named checkpoint, whole.
    assert latest_checkpoint(run) == str(run / "ckpt")
    plain = {p.name for p in run.iterdir() if p.is_dir() and not is_temporary(p.name)}
    assert plain == {"ckpt"}
    _, opt = _model_and_optimizer()
    extra = load_sharded(opt, run / "ckpt")
    expected = torch.load(run / f"expected{holds}.pt", weights_only=True)
    assert extra["step"] == holds
    assert same(extra["model"], expected["model"])
    opt.consolidate_state_dict(to=0)
    assert same(opt.state_dict(), expected["optim"])
    # The next save replaces it and clears what the cut-short one left.
    save_sharded(opt, run / "ckpt")
    assert temporaries(os.listdir(run)) == []
    load_sharded(opt, run / "ckpt")


# ----- background saves, keep_last and extra on 2 live ranks -------------------------------


def _failing_hash(*args: Any, **kwargs: Any) -> Any:
    raise OSError("injected: the disk is gone")


def background_world(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _model_and_optimizer()
    run = pathlib.Path(root) / "run"
    out: dict[str, Any] = {}
    _train(model, opt, range(2))
    first = save_sharded(opt, run / "step2", extra={"step": 2}, blocking=False)
    _train(model, opt, range(2, 4))  # training goes on while it writes
    first.wait()
    out["first done"] = first.done()
    opt.consolidate_state_dict(to=0)
    out["at step 2"] = load_sharded(_model_and_optimizer()[1], run / "step2")
    # A failure in one rank's background write reaches every rank's wait().
    real = checkpoint_save.files.own_files
    if rank == 1:
        checkpoint_save.files.own_files = _failing_hash  # type: ignore[assignment]
    failing = save_sharded(opt, run / "step4", blocking=False)
    try:
        failing.wait()
        out["failed wait"] = None
    except Exception as e:
        out["failed wait"] = (type(e).__name__, str(e))
    checkpoint_save.files.own_files = real  # type: ignore[assignment]
    out["after failure"] = sorted(os.listdir(run))
    # ... and, not waited for, at the next save.
    if rank == 1:
        checkpoint_save.files.own_files = _failing_hash  # type: ignore[assignment]
    save_sharded(opt, run / "step4", blocking=False)
    try:
        save_sharded(opt, run / "step4b")  # raises before it writes anything
        out["next save"] = None
    except Exception as e:
        out["next save"] = (type(e).__name__, str(e))
    checkpoint_save.files.own_files = real  # type: ignore[assignment]
    # keep_last: four more saves, two kept.
    for step in (5, 6, 7, 8):
        _train(model, opt, range(step - 1, step))
        save_sharded(
            opt, run / f"step{step}", extra={"step": step}, keep_last=2, blocking=step % 2 == 0
        )
    out["latest"] = latest_checkpoint(run)
    out["kept"] = sorted(os.listdir(run))
    out["latest extra"] = load_sharded(opt, run / "step8")
    try:
        save_sharded(opt, run, keep_last=0)
    except ValueError as e:
        out["keep_last=0"] = str(e)
    (run / "step8" / "notes.txt").write_text("mine") if rank == 0 else None
    dist.barrier()
    try:
        save_sharded(opt, run / "step8")
    except ValueError as e:
        out["foreign file"] = str(e)
    return out


@pytest.fixture(scope="module")
def background(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(background_world, 2, str(tmp_path_factory.mktemp("background")))


@pytest.mark.timeout(180)
def test_a_background_save_lets_training_go_on_and_commits(
    background: list[dict[str, Any]],
) -> None:
    for out in background:
        assert out["first done"]
        assert out["at step 2"] == {"step": 2}


@pytest.mark.timeout(180)
def test_a_failed_background_save_raises_on_every_rank_and_keeps_the_old(
    background: list[dict[str, Any]],
) -> None:
    for out in background:
        error, message = out["failed wait"]
        assert error == "RuntimeError" and "rank 1 could not hash its files" in message, message
        assert "injected" in message
        # No plain-named step4: the failed save left nothing a load would take.
        assert [n for n in out["after failure"] if not is_temporary(n)] == ["step2"]
        error, message = out["next save"]
        assert error == "RuntimeError" and "injected" in message


@pytest.mark.timeout(180)
def test_keep_last_keeps_the_newest_of_the_run(background: list[dict[str, Any]]) -> None:
    for out in background:
        assert out["latest"].endswith(os.path.join("run", "step8"))
        assert [n for n in out["kept"] if not n.startswith(".")] == ["step7", "step8"]
        assert temporaries(out["kept"]) == []
        assert out["latest extra"] == {"step": 8}
        assert "keep_last must be a positive int" in out["keep_last=0"]
        assert "notes.txt" in out["foreign file"] and "extra=" in out["foreign file"]


@pytest.mark.usefixtures("single_rank_group")
def test_a_staging_directory_is_refused_as_a_checkpoint(tmp_path: pathlib.Path) -> None:
    _, opt = _model_and_optimizer()
    _train(*_model_and_optimizer(), range(1))
    staging = tmp_path / staging_name("ckpt", "ab" * 4)
    staging.mkdir()
    (staging / MANIFEST_NAME).write_text("{}")
    with pytest.raises(CheckpointError, match="temporary directory"):
        load_sharded(opt, staging)
    assert latest_checkpoint(tmp_path) is None
