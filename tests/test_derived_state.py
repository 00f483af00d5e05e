"""What a ZeRO rank derives survives every path that sets it from outside
the step, on simulated ranks, in every mode the plain step has:

* parameters written (DiLoCo's sync, averaging, a load, a user's
  ``param.copy_``): after :func:`~zerofn.zero.outside_writes.rederive_from_parameters`
  the next step starts from the written values. An exact mode then equals a
  plain optimizer over the same (master-precision) values bit for bit, a
  compressed one stays within its bound, replicas stay identical, carried
  copies stay their owners' state; the version check notices tracked writes
  and nothing else;
* a load of only what a rank holds (:func:`~zerofn.zero.rank_state.held_pieces`,
  what a sharded checkpoint reads) restores the same state as a load of the
  whole state dict: its shard, its masters and the copy it carries."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofn.testing.zero import SimulatedRank, simulated_ranks, step_simulated
from zerofn.zero.outside_writes import (
    owned_parameters,
    parameter_versions,
    rederive_from_parameters,
    written_since,
)
from zerofn.zero.planning.plan import plan_shards
from zerofn.zero.rank_state import (
    held_pieces,
    joined_state,
    load_global_state,
    local_state_cpu,
)

LR = 0.01


@st.composite
def configurations(draw: st.DrawFn) -> dict[str, Any]:
    """A world and every option of the plain step that keeps derived state."""
    world = draw(st.integers(2, 4))
    sizes = draw(st.lists(st.integers(1, 30), min_size=world, max_size=8))
    # redundancy=2 keeps whole tensors and the exact exchange without masters
    redundancy = draw(st.sampled_from([1, 2]))
    whole = ["greedy", "balanced"]
    mode = draw(st.sampled_from(whole if redundancy == 2 else [*whole, "flat"]))
    exchange = None if redundancy == 2 else draw(st.sampled_from([None, "masters", "int8"]))
    return {
        "world": world,
        "sizes": sizes,
        "mode": mode,
        "exchange": exchange,
        "redundancy": redundancy,
        "bucket_view": draw(st.booleans()),
        "steps": draw(st.integers(0, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(config: dict[str, Any], params: list[torch.Tensor]) -> list[SimulatedRank]:
    n = len(params)
    dtype = params[0].dtype
    plan = plan_shards(
        [config["sizes"]], [f"cpu/{dtype}"] * n, [True] * n, config["world"], config["mode"]
    )
    extra: dict[str, Any] = {}
    if config["exchange"] == "masters":
        extra["master_dtype"] = torch.float32
    elif config["exchange"] == "int8":
        extra["exchange_compression"] = "int8"
    return simulated_ranks(
        plan,
        params,
        torch.optim.Adam,
        bucket_view=config["bucket_view"],
        redundancy=config["redundancy"],
        lr=LR,
        **extra,
    )


def write_everywhere(ranks: list[SimulatedRank], values: list[torch.Tensor]) -> None:
    """What DiLoCo's sync or an averager does: the same values on every rank."""
    with torch.no_grad():
        for sim in ranks:
            for param, value in zip(sim.params, values, strict=True):
                param.copy_(value)


@given(configurations())
@settings(max_examples=draws(80), deadline=None)
def test_a_step_after_an_outside_write_starts_from_the_written_values(
    config: dict[str, Any],
) -> None:
    generator = torch.Generator().manual_seed(config["seed"])
    # Parameters in bf16 where masters are kept (the mode they exist for).
    dtype = torch.bfloat16 if config["exchange"] == "masters" else torch.float32
    params = [torch.randn(s, generator=generator).to(dtype) for s in config["sizes"]]
    grads = [
        [torch.randn(s, generator=generator).to(dtype) for s in config["sizes"]]
        for _ in range(config["steps"] + 1)
    ]
    written = [(torch.randn(s, generator=generator) + 3.0).to(dtype) for s in config["sizes"]]
    ranks = build(config, params)

    # The reference: a plain Adam over float32 copies (the masters, where kept).
    wide = [p.detach().to(torch.float32).clone() for p in params]
    reference = torch.optim.Adam(wide, lr=LR)
    for step in grads[:-1]:
        step_simulated(ranks, step)
        for w, g in zip(wide, step, strict=True):
            w.grad = g.to(torch.float32)
        reference.step()

    write_everywhere(ranks, written)
    for sim in ranks:
        rederive_from_parameters(sim.zero, sim.params)
    step_simulated(ranks, grads[-1])
    with torch.no_grad():
        for w, value in zip(wide, written, strict=True):
            w.copy_(value)
    for w, g in zip(wide, grads[-1], strict=True):
        w.grad = g.to(torch.float32)
    reference.step()
    expected = [w.to(dtype) for w in wide]

    first = ranks[0].params
    for sim in ranks[1:]:  # replicas identical
        assert all(torch.equal(a, b) for a, b in zip(sim.params, first, strict=True))
    if config["exchange"] == "int8":  # within the quantization of one step's update
        gap = max((a - e).abs().max().item() for a, e in zip(first, expected, strict=True))
        assert gap <= LR
    else:  # exact: bit for bit
        assert all(torch.equal(a, e) for a, e in zip(first, expected, strict=True))
    for sim in ranks:  # a carried copy is its owner's state, bit for bit
        carried = sim.zero.carried
        if carried is not None:
            owner = ranks[carried.owner].optimizer
            mine = [carried.optim.state[t] for t in carried.tensors()]
            theirs = [owner.state[t] for g in owner.param_groups for t in g["params"]]
            assert all(
                all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(mine, theirs, strict=True)
            )


@given(configurations())
@settings(max_examples=draws(40), deadline=None)
def test_versions_see_tracked_writes_to_held_parameters_and_nothing_else(
    config: dict[str, Any],
) -> None:
    generator = torch.Generator().manual_seed(config["seed"])
    params = [torch.randn(s, generator=generator) for s in config["sizes"]]
    grads = [torch.randn(s, generator=generator) for s in config["sizes"]]
    ranks = build(config, params)
    for sim in ranks:
        held = owned_parameters(sim.zero)
        versions = parameter_versions(sim.params, held)
        assert not written_since(versions, sim.params)
    step_simulated(ranks, grads)  # the step writes: read the versions after it
    for sim in ranks:
        held = owned_parameters(sim.zero)
        versions = parameter_versions(sim.params, held)
        for p in sim.params:
            p.grad = None  # gradients are no write
        assert not written_since(versions, sim.params)
        with torch.no_grad():
            sim.params[held[-1]].add_(1.0)
        assert written_since(versions, sim.params)


def test_a_master_that_rounds_to_its_parameter_is_kept_when_the_write_is_noticed() -> None:
    """Loading a model's state after the optimizer's keeps the loaded masters:
    only elements whose value the write changed are taken from the parameter."""
    params = [torch.tensor([1.0, 2.0, 3.0]).to(torch.bfloat16)]
    plan = plan_shards([[3]], ["cpu/torch.bfloat16"], [True], 2)
    ranks = simulated_ranks(plan, params, torch.optim.Adam, master_dtype=torch.float32, lr=LR)
    owner = next(sim for sim in ranks if sim.zero.masters is not None and sim.zero.masters.master)
    assert owner.zero.masters is not None
    master = owner.zero.masters.master[0]
    with torch.no_grad():
        master.copy_(torch.tensor([1.001, 2.001, 3.001]))  # each rounds to the bf16 value
        owner.params[0][2] = 5.0  # a write changes the third value only
    rederive_from_parameters(owner.zero, owner.params, keep_consistent=True)
    assert master.tolist() == pytest.approx([1.001, 2.001, 5.0], abs=1e-6)
    rederive_from_parameters(owner.zero, owner.params)
    assert master.tolist() == [1.0, 2.0, 5.0]


def only_held(state: dict[str, Any], sim: SimulatedRank) -> dict[str, Any]:
    """``state`` cut to what ``sim`` holds, as a sharded checkpoint's load
    gives it: elements outside the rank's pieces zero, parameters it holds
    no piece of absent."""
    kept: dict[int, dict[str, Any]] = {}
    for piece in held_pieces(sim.zero):
        saved = state["state"].get(piece.param)
        if saved is None:
            continue
        entry = kept.setdefault(piece.param, {})
        for name, value in saved.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                entry[name] = value
                continue
            full = entry.setdefault(name, torch.zeros_like(value))
            full.view(-1)[piece.start : piece.stop] = value.reshape(-1)[piece.start : piece.stop]
    return {"state": kept, "param_groups": state["param_groups"]}


def rank_state(sim: SimulatedRank) -> list[torch.Tensor]:
    """Every tensor of the rank's optimizer state, masters and carried copy, in order."""
    out = [
        v
        for t in sim.zero.local_tensors()
        for v in sim.zero.optim.state[t].values()
        if torch.is_tensor(v)
    ]
    if sim.zero.masters is not None:
        out += list(sim.zero.masters.master)
    if sim.zero.carried is not None:
        carried = sim.zero.carried
        out += [v for t in carried.tensors() for v in carried.optim.state[t].values()]
    return out


@given(configurations())
@settings(max_examples=draws(60), deadline=None)
def test_a_load_of_only_what_a_rank_holds_restores_all_of_its_state(
    config: dict[str, Any],
) -> None:
    generator = torch.Generator().manual_seed(config["seed"])
    dtype = torch.bfloat16 if config["exchange"] == "masters" else torch.float32
    params = [torch.randn(s, generator=generator).to(dtype) for s in config["sizes"]]
    ranks = build(config, params)
    for _ in range(config["steps"] + 1):
        step_simulated(
            ranks, [torch.randn(s, generator=generator).to(dtype) for s in config["sizes"]]
        )
    locals_ = [local_state_cpu(sim.zero, _groups_of(sim)) for sim in ranks]
    full = joined_state(ranks[0].zero, _groups_of(ranks[0]), locals_)
    for sim in ranks:
        whole, cut = build(config, sim.params), build(config, sim.params)
        mine = sim.zero.options.rank
        load_global_state(whole[mine].zero, _groups_of(whole[mine]), full)
        load_global_state(cut[mine].zero, _groups_of(cut[mine]), only_held(full, cut[mine]))
        expected, got = rank_state(whole[mine]), rank_state(cut[mine])
        assert len(expected) == len(got) and all(
            torch.equal(a, b) for a, b in zip(expected, got, strict=True)
        )
        assert all(torch.equal(a, b) for a, b in zip(rank_state(sim), expected, strict=True)), (
            "a load of the whole state restores the rank as it was"
        )


def _groups_of(sim: SimulatedRank) -> list[dict[str, Any]]:
    """The simulated rank's param groups (one group: the plan's)."""
    return [{"params": sim.params}]
