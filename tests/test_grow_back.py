"""The whole lifecycle on real gloo ranks (``examples/train_grow_back.py``):
3 ranks, rank 2 dies at step 2, ranks 0 and 1 go on, a replacement process
joins at step 4, 3 ranks finish. The three final ranks' parameters and the
optimizer state equal, bit for bit, a reference that runs 3 ranks to the
loss, 2 fresh ranks from the consolidated state to the join, then 3 fresh
ranks from the consolidated state again, with the same batches. A joiner
with another optimizer is refused with the reason, and the job goes on."""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

import pytest
import torch
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.runtime.futures import settle
from zerofn_torch.runtime.launch import run_local_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import train_grow_back as example
from train_elastic import (
    CONFIGS,
    make_ddp,
    make_model,
    owners_after_join,
    owners_after_loss,
    train_step,
)
from train_elastic import fresh_phase as phase


@pytest.mark.slow  # make test-slow: a real rank killed, 4 processes, three reference worlds
@pytest.mark.parametrize("config", ["plain", "masters", "flat", "int8", "overlap", "gather"])
def test_lose_a_rank_go_on_and_grow_back_on_real_ranks(tmp_path: Any, config: str) -> None:
    chosen = CONFIGS[config]
    ours = example.lifecycle(str(tmp_path), chosen)
    # Each reference world shards as the job's does then (the compressed
    # exchange's numbers depend on who owns what).
    shrunk = owners_after_loss(chosen, 3, 2)
    grown = owners_after_join(chosen, 2, 1, shrunk)
    first = run_local_world(phase, 3, None, range(example.LOST_AT), chosen)[0]
    second = run_local_world(
        phase, 2, first, range(example.LOST_AT, example.JOIN_AT), chosen, shrunk
    )[0]
    reference = run_local_world(
        phase, 3, second, range(example.JOIN_AT, example.STEPS), chosen, grown
    )
    assert [r["rank"] for r in ours] == [0, 1, 2] and all(r["world_size"] == 3 for r in ours)
    assert ours[0]["log"] == ["step 2: lost [2], 2 ranks", "step 4: 1 joined, 3 ranks"]
    assert ours[2]["log"] == ["joined at step 4 as rank 2"]
    for mine, theirs in zip(ours, reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"], strict=True))
    a, b = ours[0]["state"], reference[0]["state"]
    assert a["state"].keys() == b["state"].keys()
    assert all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )


def _refused_joiner(job_store: str, out: str) -> None:
    from zerofn_torch.elastic import join

    store = torch.distributed.FileStore(job_store, -1)
    try:
        join(store, make_model(), torch.optim.SGD, redundancy=2, lr=0.1, timeout_s=60.0)
    except ValueError as e:
        torch.save(str(e), out)


def _admitting(rank: int, world_size: int, job_store: str) -> Any:
    from zerofn_torch.elastic import JOINERS, admit

    store = torch.distributed.FileStore(job_store, -1)
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = make_ddp(model)
    train_step(ddp, zero, 0)
    store.wait([f"{JOINERS}/1/fingerprint"])
    grown = admit(zero, store)
    train_step(ddp, zero, 1)  # the job goes on, untouched
    return grown is None and zero.world_size == 2


def test_a_joiner_with_another_optimizer_is_refused_and_the_job_goes_on(tmp_path: Any) -> None:
    job_store, out = str(tmp_path / "job"), str(tmp_path / "refusal.pt")
    joiner = multiprocessing.get_context("spawn").Process(
        target=_refused_joiner, args=(job_store, out)
    )
    joiner.start()
    try:
        assert run_local_world(_admitting, 2, job_store) == [True, True]
    finally:
        joiner.join(timeout=60)
    refusal = torch.load(out)
    assert "refused" in refusal and "optimizer" in refusal and "torch.optim.adam.Adam" in refusal


def _two_joiners_running(rank: int, world_size: int, job_store: str, ckpt: str) -> Any:
    """2 running ranks; at step 2 a background save is in flight when 2
    joiners are let in at once."""
    from zerofn_torch.checkpoint import latest_checkpoint, save_sharded
    from zerofn_torch.elastic import JOINERS, admit

    store = torch.distributed.FileStore(job_store, -1)
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = make_ddp(model)
    for step in range(4):
        if step == 2:
            save_sharded(zero, os.path.join(ckpt, "step-2"), blocking=False)
            store.wait([f"{JOINERS}/1/fingerprint", f"{JOINERS}/2/fingerprint"])
            grown = admit(zero, store, extra={"step": step})
            assert grown is not None and grown.joined == 2 and grown.world_size == 4
            ddp = make_ddp(model)
        train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if zero.rank == 0 else None,
        "checkpoint": latest_checkpoint(ckpt),
    }


def _two_joiners_joiner(job_store: str, out: str) -> None:
    from zerofn_torch.elastic import join

    torch.set_num_threads(1)
    store = torch.distributed.FileStore(job_store, -1)
    model = make_model()
    joined = join(store, model, torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = make_ddp(model)
    for step in range(joined.extra["step"], 4):
        train_step(ddp, joined.optimizer, step)
    joined.optimizer.consolidate_state_dict(to=0)
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"rank": joined.rank, "params": params}, out)
    settle()  # and ended at once, as examples/train_grow_back.py's replacement is
    os._exit(0)


@pytest.mark.slow  # make test-slow: 4 processes and two reference worlds
def test_two_joiners_at_once_while_a_background_save_is_in_flight(tmp_path: Any) -> None:
    job_store, ckpt = str(tmp_path / "job"), str(tmp_path / "run")
    outs = [str(tmp_path / f"joiner{i}.pt") for i in range(2)]
    context = multiprocessing.get_context("spawn")
    joiners = [context.Process(target=_two_joiners_joiner, args=(job_store, out)) for out in outs]
    for joiner in joiners:
        joiner.start()
    try:
        running = run_local_world(_two_joiners_running, 2, job_store, ckpt)
    finally:
        for joiner in joiners:
            joiner.join(timeout=120)
    assert all(j.exitcode == 0 for j in joiners)
    assert running[0]["checkpoint"] == os.path.join(ckpt, "step-2")  # the save was whole
    joined = sorted((torch.load(out) for out in outs), key=lambda r: r["rank"])
    assert [r["rank"] for r in joined] == [2, 3]
    first = run_local_world(phase, 2, None, range(2))[0]
    reference = run_local_world(phase, 4, first, range(2, 4))
    for mine, theirs in zip([*running, *joined], reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"], strict=True))
    a, b = running[0]["state"], reference[0]["state"]
    assert all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )
