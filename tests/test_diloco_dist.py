"""DiLoCoOptimizer on real gloo ranks: against DiLoCo written out plainly in
this file (one sync every H steps, and streaming fragments with a delay and
mixing), the bytes the syncs send (int8 and int2 against fp32), replicas
bitwise identical across 3 ranks with the 2-bit and top-k codecs, the outer state's
bytes, checkpoints resumed exactly in a fresh process group and resharded
from 2 ranks to 1, a peer that dies or hangs, and 4 ranks as 2 DDP groups of
2 with DiLoCo across them. Spawning is slow on 2 cores, so each world runs
several checks."""

from __future__ import annotations

import copy
import io
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _faults import FAULT_STEP, STEPS, Case, Outcome, Tick, run_family
from _world import run_world
from test_checkpoint_integrity import same
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.averaging import DiLoCoOptimizer
from zerofn_torch.hooks import noop_hook
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.diloco.compressed_sync import compressed_sync_bytes
from zerofn.diloco.config import Compression, DiLoCoConfig
from zerofn.diloco.footprint import outer_state_bytes
from zerofn.diloco.fragments import plan_fragments
from zerofn.diloco.sync import sync_bytes
from zerofn.topk import TopK

pytestmark = pytest.mark.timeout(240)  # a spawned world must never hang the suite

TIMEOUT_S = 2.0
MARGIN_S = 5.0  # slack for a loaded 2-core machine


def make_model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3)
    )


def backward(model: torch.nn.Module, step: int, rank: int) -> None:
    """Each rank draws its own batch, so the workers drift apart."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(8, 6, generator=g)).square().mean().backward()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def weights_only(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class PlainDiLoCo:
    """DiLoCo from first principles: every rank keeps the whole anchor, the
    mean comes from an all-reduce when a fragment's sync starts, the outer
    step is Nesterov SGD written out, and the result is merged ``delay``
    steps later."""

    def __init__(self, model: torch.nn.Module, config: DiLoCoConfig, group: Any = None) -> None:
        self.model, self.config, self.group = model, config, group
        self.anchor = flat(model)
        numel, parts = self.anchor.numel(), config.fragments
        self.bounds = [p * numel // parts for p in range(parts + 1)]
        self.momentum: dict[int, torch.Tensor] = {}
        self.pending: tuple[int, int, torch.Tensor] | None = None  # (fragment, due, result)

    def _write(self, lo: int, hi: int, values: torch.Tensor) -> None:
        start = 0
        with torch.no_grad():
            for p in self.model.parameters():
                a, b = max(lo, start), min(hi, start + p.numel())
                if a < b:
                    p.view(-1)[a - start : b - start].copy_(values[a - lo : b - lo])
                start += p.numel()

    def after_inner_step(self, t: int) -> None:
        c = self.config
        if self.pending is not None and self.pending[1] == t:
            self._apply()
        if t % c.stride == 0:
            fragment = (t % c.sync_every // c.stride - 1) % c.fragments
            lo, hi = self.bounds[fragment], self.bounds[fragment + 1]
            total = flat(self.model)[lo:hi]
            dist.all_reduce(total, group=self.group)
            gradient = self.anchor[lo:hi] - total / dist.get_world_size(self.group)
            buf = self.momentum.get(fragment)
            buf = gradient.clone() if buf is None else 0.9 * buf + gradient
            self.momentum[fragment] = buf
            self.anchor[lo:hi] -= 0.7 * (gradient + 0.9 * buf)
            self.pending = (fragment, t + c.delay, self.anchor[lo:hi].clone())
            if c.delay == 0:
                self._apply()

    def _apply(self) -> None:
        assert self.pending is not None
        fragment, _, result = self.pending
        lo, hi = self.bounds[fragment], self.bounds[fragment + 1]
        local = flat(self.model)[lo:hi]
        self._write(lo, hi, self.config.mixing * local + (1 - self.config.mixing) * result)
        self.pending = None


def against_plain(rank: int, inner: Callable[[Any], torch.optim.Optimizer], **kw: Any) -> float:
    """Train DiLoCoOptimizer and PlainDiLoCo side by side; their largest difference."""
    ours, theirs = make_model(), make_model()
    opt = DiLoCoOptimizer(inner(ours.parameters()), **kw)
    plain = PlainDiLoCo(theirs, opt.config)
    plain_inner = inner(theirs.parameters())
    for step in range(13):
        for model, o in ((ours, opt), (theirs, plain_inner)):
            o.zero_grad()
            backward(model, step, rank)
            o.step()
        plain.after_inner_step(step + 1)
    return float((flat(ours) - flat(theirs)).abs().max())


def sgd(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


STREAMING = {"sync_every": 4, "fragments": 2, "delay": 1, "mixing": 0.5}


def train(model: torch.nn.Module, opt: DiLoCoOptimizer, steps: range, rank: int) -> None:
    for step in steps:
        opt.zero_grad()
        backward(model, step, rank)
        opt.step()


def sync_traffic(rank: int, compression: Compression) -> tuple[int, int, float, torch.Tensor]:
    """One fp32 or quantized sync of a wider model: the bytes handed to
    collectives, the bytes the core planned, the bytes sent (ring estimate)
    and the parameters after it."""
    world_size = dist.get_world_size()
    model = make_model(width=256)
    opt = DiLoCoOptimizer(sgd(model.parameters()), sync_every=1, compression=compression)
    backward(model, 0, rank)
    with collective_traffic() as traffic:
        opt.step()
    sizes = [p.numel() for p in model.parameters()]
    fragment = plan_fragments(sizes, 1, world_size).fragments[0]
    quantizer = opt.config.compression
    planned = (
        sync_bytes(fragment)
        if quantizer is None
        else compressed_sync_bytes(fragment, quantizer, rank)
    )
    handed = sum(traffic.payload_bytes.values())
    return handed, planned, traffic.sent_bytes(world_size), flat(model)


def two_ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["plain/every H"] = against_plain(rank, sgd, sync_every=3)
    out["plain/streaming"] = against_plain(rank, adamw, **STREAMING)
    for compression in (None, "int8"):
        out[f"bytes/{compression}"] = sync_traffic(rank, compression)

    # The outer state is what the core says a rank keeps.
    model = make_model()
    opt = DiLoCoOptimizer(sgd(model.parameters()), sync_every=2, fragments=2)
    train(model, opt, range(4), rank)
    plan = plan_fragments([p.numel() for p in model.parameters()], 2, world_size)
    out["memory"] = (opt.memory_bytes(), outer_state_bytes(plan, rank, compressed=False))

    # redundancy=2: the carried copy and the kept sum are counted as
    # planned; a checkpoint hands each carrier its copy again on loading,
    # and the resumed run goes on as the saved one does.
    model = make_model()
    opt = DiLoCoOptimizer(adamw(model.parameters()), sync_every=2, redundancy=2)
    train(model, opt, range(4), rank)
    plan = plan_fragments([p.numel() for p in model.parameters()], 1, world_size)
    planned = outer_state_bytes(plan, rank, compressed=False, redundancy=2)
    out["memory/redundancy"] = (opt.memory_bytes(), planned)
    streamed = make_model()
    streaming = DiLoCoOptimizer(adamw(streamed.parameters()), sync_every=2, delay=1, redundancy=2)
    train(streamed, streaming, range(3), rank)
    delayed = outer_state_bytes(plan, rank, compressed=False, redundancy=2, delayed=True)
    out["memory/redundancy delayed"] = (streaming.memory_bytes(), delayed)
    squeezed = make_model()
    compressed = DiLoCoOptimizer(
        adamw(squeezed.parameters()), sync_every=2, compression="int8", redundancy=2
    )
    train(squeezed, compressed, range(3), rank)
    planned = outer_state_bytes(plan, rank, compressed=True, redundancy=2)
    out["memory/redundancy compressed"] = (compressed.memory_bytes(), planned)
    compressed.verify_copies()
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, range(4, 8), rank)
    resumed_model = make_model()
    resumed = DiLoCoOptimizer(adamw(resumed_model.parameters()), sync_every=2, redundancy=2)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    resumed.verify_copies()
    train(resumed_model, resumed, range(4, 8), rank)
    out["redundancy/resumed"] = (flat(model), flat(resumed_model))

    # An inner ZeRO optimizer sharded across the workers would lose a shard with a rank.
    try:
        DiLoCoOptimizer(
            ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.Adam),
            sync_every=2,
            redundancy=2,
        )
    except ValueError as e:
        out["sharded inner refused"] = str(e)

    # DDP over the DiLoCo workers would all-reduce every inner step.
    ddp = DDP(make_model())
    try:
        DiLoCoOptimizer(sgd(ddp.parameters()), sync_every=2)
    except ValueError as e:
        out["ddp refused"] = str(e)
    ddp.register_comm_hook(None, noop_hook)
    DiLoCoOptimizer(sgd(ddp.parameters()), sync_every=2)  # accepted with the no-op hook

    # Checkpoints at step 6, a sync of fragment 0 in flight (due at 7).
    for compression in (None, "int8"):
        model = make_model()
        outer = None if compression is None else lambda ts: torch.optim.Adam(ts, lr=0.1)
        opt = DiLoCoOptimizer(adamw(model.parameters()), outer_optimizer=outer,
                              compression=compression, **STREAMING)  # fmt: skip
        train(model, opt, range(6), rank)
        saved = {"model": model.state_dict(), "opt": opt.state_dict()}
        torch.save(saved, os.path.join(folder, f"{compression}-rank{rank}.pt"))
        whole = {"model": model.state_dict(), "opt": opt.consolidated_state_dict()}
        if rank == 0:
            torch.save(whole, os.path.join(folder, f"{compression}-whole.pt"))
        train(model, opt, range(6, 11), rank)
        out[f"final/{compression}"] = flat(model)
    return out


def resume(rank: int, folder: str, name: str, compression: str | None, group: Any) -> Any:
    """A model and optimizer built afresh, then loaded from ``name``."""
    torch.manual_seed(5)  # another start: everything comes from the checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    outer = None if compression is None else lambda ts: torch.optim.Adam(ts, lr=0.1)
    opt = DiLoCoOptimizer(adamw(model.parameters()), outer_optimizer=outer,
                          compression=compression, process_group=group, **STREAMING)  # fmt: skip
    saved = torch.load(os.path.join(folder, name), weights_only=True)
    # The model after the optimizer: its constructor gives every rank rank 0's.
    model.load_state_dict(saved["model"])
    return model, opt, saved


def resumed(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    for compression in (None, "int8"):
        model, opt, saved = resume(rank, folder, f"{compression}-rank{rank}.pt", compression, None)
        other = torch.load(os.path.join(folder, f"{compression}-rank{1 - rank}.pt"))
        before = weights_only(opt.state_dict())
        try:
            opt.load_state_dict(other["opt"])
        except ValueError as e:
            out[f"refused/{compression}"] = str(e)
        out[f"unchanged/{compression}"] = same(weights_only(opt.state_dict()), before)
        opt.load_state_dict(saved["opt"])
        train(model, opt, range(6, 11), rank)
        out[f"final/{compression}"] = flat(model)

        # Resharded: the consolidated checkpoint on an outer group of one rank.
        model, opt, saved = resume(rank, folder, f"{compression}-whole.pt", compression, alone)
        opt.load_state_dict(saved["opt"])
        whole = saved["opt"]["diloco"]
        out[f"reconsolidated/{compression}"] = same(opt.consolidated_state_dict()["diloco"], whole)
        if compression is None:  # beside DiLoCo written out, from the same state
            theirs = copy.deepcopy(model)
            plain_inner = adamw(theirs.parameters())
            inner = {k: v for k, v in saved["opt"].items() if k != "diloco"}
            plain_inner.load_state_dict(copy.deepcopy(inner))  # torch keeps the tensors given
            plain = PlainDiLoCo(theirs, opt.config, group=alone)
            plain.anchor = torch.cat(whole["anchor"])
            outer = copy.deepcopy(whole["outer"]["state"])
            plain.momentum = {i: s["momentum_buffer"] for i, s in outer.items()}
            flight = whole["state"]["in_flight"]
            plain.pending = (flight["fragment"], flight["due"], whole["result"])
            for step in range(6, 11):
                plain_inner.zero_grad()
                backward(theirs, step, rank)
                plain_inner.step()
                plain.after_inner_step(step + 1)
        train(model, opt, range(6, 11), rank)
        if compression is None:
            out["alone/plain"] = float((flat(model) - flat(theirs)).abs().max())
        out[f"alone/{compression}"] = flat(model)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("diloco"))


@pytest.fixture(scope="module")
def two(checkpoints: str) -> list[dict[str, Any]]:
    return run_world(two_ranks, 2, checkpoints)


def test_matches_diloco_written_out_plainly(two: list[dict[str, Any]]) -> None:
    for out in two:
        assert out["plain/every H"] < 1e-5
        assert out["plain/streaming"] < 1e-5


def test_int8_syncs_send_under_a_third_of_the_fp32_bytes(two: list[dict[str, Any]]) -> None:
    for out in two:
        (fp32, fp32_planned, _, _), (int8, int8_planned, _, _) = (
            out["bytes/None"],
            out["bytes/int8"],
        )
        assert (fp32, int8) == (fp32_planned, int8_planned)
        assert int8 <= 0.3 * fp32


SPARSER: dict[str, Compression] = {"int2": "int2", "topk": TopK(density=0.02, bits=2, chunk=64)}
"""The 2-bit and top-k codecs (top-k in chunks of 64, so that this small
model's slices hold whole chunks)."""


def three_ranks(rank: int, world_size: int) -> dict[str | None, Any]:
    out: dict[str | None, Any] = {
        compression: sync_traffic(rank, compression) for compression in (None, "int8")
    }
    for name, compression in SPARSER.items():
        out[f"bytes/{name}"] = sync_traffic(rank, compression)
        # Streaming: two fragments, a delay and mixing; the replicas stay identical.
        model = make_model(width=64)
        opt = DiLoCoOptimizer(adamw(model.parameters()), compression=compression, **STREAMING)
        train(model, opt, range(9), rank)
        opt.drain()
        assert opt._replica is not None
        out[f"replica/{name}"] = opt._replica.clone()
        # Blocking, mixing 0: after a sync every rank holds the same parameters.
        model = make_model(width=64)
        opt = DiLoCoOptimizer(adamw(model.parameters()), sync_every=2, compression=compression)
        train(model, opt, range(6), rank)
        out[f"params/{name}"] = flat(model)
        out[f"moved/{name}"] = float((flat(model) - flat(make_model(width=64))).abs().max())
    return out


@pytest.fixture(scope="module")
def three() -> list[dict[str | None, Any]]:
    return run_world(three_ranks, 3)


def test_int8_syncs_send_a_quarter_of_the_fp32_bytes_on_three_ranks_too(
    three: list[dict[str | None, Any]],
) -> None:
    """Each rank's codes go to their owner alone (an all-to-all), so the
    ratio does not grow with the number of workers."""
    out = [{k: v for k, v in syncs.items() if k in (None, "int8")} for syncs in three]
    for syncs in out:
        for handed, planned, _, _ in syncs.values():
            assert handed == planned
        assert syncs["int8"][2] <= 0.27 * syncs[None][2]  # bytes on the wire
    assert all(torch.equal(syncs["int8"][3], out[0]["int8"][3]) for syncs in out)


@pytest.mark.parametrize("name", sorted(SPARSER))
def test_two_bit_and_top_k_syncs_keep_replicas_bitwise_identical_across_ranks(
    three: list[dict[str | None, Any]], name: str
) -> None:
    first = three[0]
    for out in three:
        handed, planned, _, params = out[f"bytes/{name}"]
        assert handed == planned
        assert torch.equal(params, first[f"bytes/{name}"][3])
        assert torch.equal(out[f"replica/{name}"], first[f"replica/{name}"])
        assert torch.equal(out[f"params/{name}"], first[f"params/{name}"])
        assert out[f"moved/{name}"] > 0  # the syncs carried training, not nothing
    if name == "int2":  # bytes on the wire
        assert all(out["bytes/int2"][2] <= out[None][2] / 14 for out in three)


def test_each_rank_keeps_the_outer_state_the_core_plans(two: list[dict[str, Any]]) -> None:
    for out in two:
        measured, planned = out["memory"]
        assert measured == planned


def test_redundancy_counts_its_copy_and_a_checkpoint_restores_the_copies(
    two: list[dict[str, Any]],
) -> None:
    for out in two:
        for key in (
            "memory/redundancy",
            "memory/redundancy delayed",
            "memory/redundancy compressed",
        ):
            measured, planned = out[key]
            assert measured == planned, key
        continued, resumed = out["redundancy/resumed"]
        assert torch.equal(continued, resumed)


def test_redundancy_over_an_inner_optimizer_sharded_across_workers_is_refused(
    two: list[dict[str, Any]],
) -> None:
    for out in two:
        assert "shards over 2 ranks" in out["sharded inner refused"]


def test_ddp_that_all_reduces_across_workers_is_refused(two: list[dict[str, Any]]) -> None:
    for out in two:
        assert "noop_hook" in out["ddp refused"]


def test_a_checkpoint_resumes_exactly_in_a_fresh_process_group_and_on_one_rank(
    two: list[dict[str, Any]], checkpoints: str
) -> None:
    again = run_world(resumed, 2, checkpoints)
    for rank in range(2):
        for compression in (None, "int8"):
            final = f"final/{compression}"
            assert torch.equal(again[rank][final], two[rank][final])
            assert "load it there" in again[rank][f"refused/{compression}"]
            assert again[rank][f"unchanged/{compression}"]
            assert again[rank][f"reconsolidated/{compression}"]
            assert torch.isfinite(again[rank][f"alone/{compression}"]).all()
        assert again[rank]["alone/plain"] < 1e-5


# ----- 4 ranks: DDP inside groups of 2, DiLoCo across them -----------------------


def hierarchy(rank: int, world_size: int) -> dict[str, Any]:
    inner_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    inner, outer = inner_groups[rank // 2], outer_groups[rank % 2]
    model = DDP(make_model(), process_group=inner)
    opt = DiLoCoOptimizer(sgd(model.parameters()), sync_every=2, process_group=outer)
    theirs = make_model()
    plain = PlainDiLoCo(theirs, opt.config, group=outer)
    plain_inner = sgd(theirs.parameters())
    for step in range(7):
        opt.zero_grad()
        backward(model, step, rank)
        opt.step()
        plain_inner.zero_grad()
        backward(theirs, step, rank)
        for p in theirs.parameters():
            assert p.grad is not None
            p.grad.div_(2)
            dist.all_reduce(p.grad, group=inner)
        plain_inner.step()
        plain.after_inner_step(step + 1)
    return {"ours": flat(model), "plain": flat(theirs)}


def test_ddp_inside_groups_and_diloco_across_them() -> None:
    out = run_world(hierarchy, 4)
    for rank in range(4):
        torch.testing.assert_close(out[rank]["ours"], out[rank]["plain"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0]["ours"], out[1]["ours"])
    assert torch.equal(out[2]["ours"], out[3]["ours"])


def undrained(rank: int, world_size: int) -> int:
    """Returns with a delayed sync in flight, moved on further on rank 0 than
    on rank 1, and never drained: the launcher must finish it before its
    barrier, or the two ranks' next collectives do not match."""
    model = make_model()
    opt = DiLoCoOptimizer(sgd(model.parameters()), sync_every=2, delay=1)
    train(model, opt, range(4), rank)  # the sync started after step 4 is due at 5
    if rank == 0:
        time.sleep(0.3)
        backward(model, 4, rank)  # each gradient polls the sync on
    return rank


def test_a_sync_left_in_flight_is_finished_before_the_group_goes() -> None:
    # Without the launcher finishing it, rank 0's next request meets rank 1's
    # barrier and the world fails (after the group's timeout).
    assert run_world(undrained, 2) == [0, 1]


# ----- a peer that dies or hangs -------------------------------------------------


def streaming_case(rank: int, tick: Tick) -> None:
    """Syncs start after steps 2, 4 and 6 and apply a step later: the victim
    fails at step FAULT_STEP with a sync in flight."""
    model = make_model()
    opt = DiLoCoOptimizer(sgd(model.parameters()), sync_every=2, delay=1)
    for step in range(STEPS):
        tick(step)
        opt.zero_grad()
        backward(model, step, rank)
        opt.step()
    opt.drain()


CASES: dict[str, Case] = {"DiLoCoOptimizer.step (delay 1)": streaming_case}


@pytest.mark.slow
def test_a_dead_or_hung_peer_raises_a_collective_error_when_the_result_is_due() -> None:
    outcomes = run_family(CASES, timeout_s=TIMEOUT_S)
    control: Outcome = outcomes[next(iter(CASES)), "none"]
    assert control.finished, control.trace
    for fault in ("exit", "hang"):
        outcome = outcomes[next(iter(CASES)), fault]
        assert not outcome.finished, "the survivor trained on alone"
        assert outcome.error_type == "CollectiveError", outcome.trace
        assert "DiLoCo sync of fragment 0" in outcome.message
        assert "No result was produced" in outcome.message
        assert outcome.step <= FAULT_STEP + 1
        limit = (TIMEOUT_S if fault == "hang" else 0.0) + MARGIN_S
        assert outcome.seconds < limit, f"raised after {outcome.seconds:.1f} s"


# ----- one rank, in this process: bad inputs change nothing ----------------------


def lbfgs(ts: Any) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(ts)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync_every": 0}, ValueError, "sync_every must be at least 1"),
        ({"sync_every": 4, "fragments": 3}, ValueError, r"use one of \[1, 2, 4\]"),
        ({"sync_every": 4, "fragments": 2, "delay": 2}, ValueError, "use delay <= 1"),
        ({"sync_every": 84, "fragments": 84}, ValueError, "use fragments <= 83"),
        ({"sync_every": 4, "outer_optimizer": lbfgs}, ValueError, "element-wise"),
        ({"sync_every": 4, "outer_optimizer": lambda ts: None}, TypeError, "torch.optim"),
        ({"sync_every": 4, "compression": "int3"}, ValueError, "unknown compression"),
        ({"sync_every": 4, "compression": "topk"}, ValueError, r"TopK\(density=0.02"),
        ({"sync_every": 4, "compression": 0.02}, TypeError, "a zerofn.topk.TopK"),
        ({"sync_every": 4, "redundancy": 3}, ValueError, "redundancy must be 1"),
        ({"sync_every": 4, "redundancy": 2}, ValueError, "one worker has nobody"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = make_model()
    before = flat(model)
    with pytest.raises(error, match=match):
        DiLoCoOptimizer(sgd(model.parameters()), **kwargs)
    assert torch.equal(flat(model), before)


@pytest.mark.usefixtures("single_rank_group")
def test_state_dicts_that_do_not_fit_are_refused_and_change_nothing() -> None:
    model = make_model()
    opt = DiLoCoOptimizer(adamw(model.parameters()), **STREAMING)
    train(model, opt, range(6), 0)
    saved = weights_only(opt.state_dict())
    other = DiLoCoOptimizer(adamw(make_model().parameters()), sync_every=4)
    for bad, match in (
        ({k: v for k, v in saved.items() if k != "diloco"}, "no 'diloco' entry"),
        (other.state_dict(), "same fragments"),
    ):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert same(weights_only(opt.state_dict()), saved)
    with pytest.raises(ValueError, match="add every param group"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


@pytest.mark.usefixtures("single_rank_group")
def test_one_worker_with_outer_sgd_at_lr_1_trains_as_its_inner_optimizer() -> None:
    ours, theirs = make_model(), make_model()
    opt = DiLoCoOptimizer(
        adamw(ours.parameters()), sync_every=1, outer_optimizer=lambda ts: torch.optim.SGD(ts, lr=1)
    )
    plain = adamw(theirs.parameters())
    for step in range(5):
        for model, o in ((ours, opt), (theirs, plain)):
            o.zero_grad()
            backward(model, step, 0)
            o.step()
    torch.testing.assert_close(flat(ours), flat(theirs))
    assert opt.inner_steps == 5
