"""The compressed ZeRO exchange on real gloo ranks: the optimizer runs the
program the simulated world runs (bitwise equal to it), every rank's
parameters are bitwise identical, the bytes sent are the payloads', and a
checkpoint (consolidated or sharded) resumes exactly, also resharded to
another partition; and the overlapped step compresses its owners' sends, with its
memory counted as held (masters, no exchange buffer between iterations). One spawned
world runs every check (spawning is slow on 2 cores)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _world import run_world
from test_checkpoint_integrity import same
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.hooks.default import allreduce_hook
from zerofn_torch.hooks.overlap import hook_with_zero_step
from zerofn_torch.runtime.traffic import collective_traffic

from zerofn.testing.zero import simulated_ranks, step_simulated
from zerofn.zero.compressed.exchange import exchange_bytes

STEPS = 4


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(9, 16), torch.nn.ReLU(), torch.nn.Linear(16, 11), torch.nn.Linear(11, 3)
    )
    return model.to(dtype)


def grads_at(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    """The gradients DDP would hand every rank at ``step`` (the same on all)."""
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()


def gathered_equal(model: torch.nn.Module) -> bool:
    """Whether every rank holds bitwise the same parameters."""
    mine = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def compressed_world(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = [
        ("greedy", torch.float32, "int8", None),
        ("flat", torch.float32, "int4", None),
        ("balanced", torch.bfloat16, "int8", torch.float32),
        ("flat", torch.bfloat16, "int4", torch.float32),
    ]
    for mode, dtype, compression, master in cases:
        model = make_model(dtype)
        start = [p.detach().clone() for p in model.parameters()]
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            partition=mode,
            master_dtype=master,
            exchange_compression=compression,
            lr=0.01,
        )
        sim = simulated_ranks(
            opt.shard_plan,
            start,
            torch.optim.Adam,
            bucket_view=opt.parameters_as_bucket_view,
            master_dtype=master,
            exchange_compression=compression,
            lr=0.01,
        )
        identical = True
        for step in range(STEPS):
            grads = grads_at(model, step)
            set_grads(model, grads)
            opt.step()
            step_simulated(sim, grads)
            identical &= gathered_equal(model)
        out[("identical", mode, compression)] = identical
        out[("as_simulated", mode, compression)] = all(
            torch.equal(p.detach(), q)
            for p, q in zip(model.parameters(), sim[rank].params, strict=True)
        )
        out[("master_bytes", mode, compression)] = (
            opt.memory_bytes()["master_weights"],
            sum(t.numel() for t in sim[rank].masters.master) * 4,  # type: ignore[union-attr]
        )

    # Bytes on the wire: the payloads, against the exact exchange's.
    model = make_model()
    exact = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    squeezed_model = make_model()
    squeezed = ZeroRedundancyOptimizer(
        squeezed_model.parameters(), torch.optim.Adam, exchange_compression="int8", lr=0.01
    )
    for m, o, name in ((model, exact, "exact"), (squeezed_model, squeezed, "int8")):
        set_grads(m, grads_at(m, 0))
        with collective_traffic() as seen:
            o.step()
        out[("bytes", name)] = sum(seen.payload_bytes.values())
    out["planned_bytes"] = exchange_bytes(squeezed.zero_rank.options.quantizer, squeezed.shard_plan)  # type: ignore[arg-type]

    # Clipping, then a joined rank (its step sends only what it owes); inside
    # Join clipping is refused (a joined rank's shard would leave the norm).
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, exchange_compression="int8", lr=0.1, momentum=0.9
    )
    set_grads(model, grads_at(model, 0))
    opt.clip_grad_norm_(0.5)
    opt.step()
    with Join([opt]):
        for step in range(1, 3 + rank):
            set_grads(model, grads_at(model, step))
            if step == 1:
                try:
                    opt.clip_grad_norm_(0.5)
                except RuntimeError as e:
                    out["clip_inside_join"] = str(e)
            opt.step()
    out["identical_after_join"] = gathered_equal(model)

    # The overlapped step: owners send quantized differences during backward.
    finals = {}
    for compression in (None, "int8"):
        ddp = DDP(make_model(), bucket_cap_mb=0.001)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.Adam,
            overlap_with_ddp=True,
            exchange_compression=compression,
            lr=0.01,
        )
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        for step in range(6):
            g = torch.Generator().manual_seed(900 + 10 * step + rank)
            with collective_traffic() as seen:
                ddp(torch.randn(5, 9, generator=g)).square().mean().backward()
            zero.zero_grad()
        out[("identical_overlap", compression)] = gathered_equal(ddp.module)
        finals[compression] = [p.detach().clone() for p in ddp.module.parameters()]
        # What memory_bytes() counts, against what the optimizer really holds
        # between iterations: the tensors its local optimizer steps (the
        # masters, with compression) and no exchange buffer (the hook's
        # payloads live during backward only).
        stepped = [p for group in zero.optim.param_groups for p in group["params"]]
        out[("overlap_memory", compression)] = (
            zero.memory_bytes(),
            sum(p.numel() * p.element_size() for p in stepped),
            zero.zero_rank.exchange is None and not zero.zero_rank.shards.buffers,
        )
        out[("overlap_sent", compression)] = seen.payload_bytes["broadcast"]
    out["overlap_gap"] = max(
        (a - b).abs().max().item() for a, b in zip(finals[None], finals["int8"], strict=True)
    )

    # Resume: a consolidated checkpoint after 2 steps, loaded into fresh
    # optimizers (same and another partition), continued 2 steps, equals the
    # run that never stopped.
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, exchange_compression="int8", lr=0.01
    )
    for step in range(2):
        set_grads(model, grads_at(model, step))
        opt.step()
    opt.consolidate_state_dict(to=0)
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    saved_opt, saved_model = box[0], copy.deepcopy(model.state_dict())
    save_sharded(opt, ckpt)
    for step in range(2, 4):
        set_grads(model, grads_at(model, step))
        opt.step()
    for mode, source in (
        ("greedy", "consolidated"),
        ("flat", "consolidated"),
        ("greedy", "sharded"),
    ):
        resumed = make_model()
        resumed.load_state_dict(saved_model)
        again = ZeroRedundancyOptimizer(
            resumed.parameters(),
            torch.optim.Adam,
            partition=mode,
            exchange_compression="int8",
            lr=0.01,
        )
        if source == "sharded":
            load_sharded(again, ckpt)
        else:
            again.load_state_dict(copy.deepcopy(saved_opt))
        again.consolidate_state_dict(to=0)
        if rank == 0:
            out[("reloaded_state", mode, source)] = same(again.state_dict(), saved_opt)
        for step in range(2, 4):
            set_grads(resumed, grads_at(resumed, step))
            again.step()
        out[("resumed", mode, source)] = max(
            (p - q).abs().max().item()
            for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    outs = run_world(compressed_world, 2, str(tmp_path_factory.mktemp("sharded") / "ckpt"))
    assert outs[0]["identical_after_join"] == outs[1]["identical_after_join"]
    return outs[0]  # type: ignore[no-any-return]


def test_every_rank_holds_the_same_parameters(results: dict[str, Any]) -> None:
    flags = {k: v for k, v in results.items() if k[0] == "identical"}
    assert flags and all(flags.values()), flags
    assert results["identical_after_join"]
    assert "inside Join" in results["clip_inside_join"]


def test_the_overlapped_step_compresses_too(results: dict[str, Any]) -> None:
    assert results[("identical_overlap", None)]
    assert results[("identical_overlap", "int8")]
    # Six Adam steps of lr 0.01: int8 codes resolve a step to 1/254.
    assert 0 < results["overlap_gap"] < 1e-3


def test_the_overlapped_steps_memory_is_counted(results: dict[str, Any]) -> None:
    exact, _, exact_holds_none = results[("overlap_memory", None)]
    counted, masters, holds_none = results[("overlap_memory", "int8")]
    assert exact["master_weights"] == 0
    assert counted["master_weights"] == masters > 0
    # No exchange buffer is held between iterations, exact or compressed.
    assert exact_holds_none and holds_none
    assert exact["exchange_buffers"] == counted["exchange_buffers"] == 0
    # The compressed sends carry the payloads: about a quarter of fp32's bytes.
    assert results[("overlap_sent", "int8")] < 0.3 * results[("overlap_sent", None)]


def test_the_optimizer_runs_the_simulated_program(results: dict[str, Any]) -> None:
    flags = {k: v for k, v in results.items() if k[0] == "as_simulated"}
    assert flags and all(flags.values()), flags


def test_masters_are_counted(results: dict[str, Any]) -> None:
    counts = {k: v for k, v in results.items() if k[0] == "master_bytes"}
    assert counts
    for key, (counted, expected) in counts.items():
        assert counted == expected > 0, key


def test_bytes_sent_are_the_payloads(results: dict[str, Any]) -> None:
    exact, squeezed = results[("bytes", "exact")], results[("bytes", "int8")]
    # Every rank takes part in one broadcast per rank's payload: the plan's bytes.
    assert squeezed == results["planned_bytes"]
    assert squeezed < 0.27 * exact


def test_a_checkpoint_resumes_exactly_and_reshards(results: dict[str, Any]) -> None:
    # The state (masters included) travels exactly, whatever the partition.
    for key in [("greedy", "consolidated"), ("flat", "consolidated"), ("greedy", "sharded")]:
        assert results[("reloaded_state", *key)], key
    # Same partition: the resumed run is the run that never stopped.
    assert results[("resumed", "greedy", "consolidated")] == 0.0
    assert results[("resumed", "greedy", "sharded")] == 0.0
    # Another partition quantizes other blocks, so the replicas move by other
    # rounding: equal within the codes' resolution, not bitwise.
    assert results[("resumed", "flat", "consolidated")] < 1e-3
