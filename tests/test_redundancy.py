"""Every ZeRO shard kept on two ranks (``redundancy=2``), on simulated ranks:
who carries what; the carried copies stay bitwise equal to their owners'
state and change no parameter; a world that loses ranks re-plans (each
survivor keeps its shard, a lost one goes to its carrier, the moves restore
redundancy) and goes on exactly: bitwise what the unsharded optimizer computes,
whether the loss came before a step or inside its exchange; a world that
grows gives the joiners whole parameters of the heaviest ranks and goes on
exactly too, a loss and a grow in one run included."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zerofn.footprint import plan_footprint
from zerofn.testing.elastic import grown_by, survivors_of
from zerofn.testing.zero import SimulatedRank, simulated_ranks, step_simulated
from zerofn.zero.elastic.piece_state import state_of, whole_pieces
from zerofn.zero.elastic.redundancy import (
    Regrouping,
    carried_owner,
    carrier_of,
    check_redundancy,
    plan_after_join,
    plan_after_loss,
)
from zerofn.zero.planning.partition import FlatPartition
from zerofn.zero.planning.plan import ShardPlan, plan_shards
from zerofn.zero.rank import answer_local_step
from zerofn.zero.step import LocalStep

SETTINGS = settings(max_examples=draws(60), deadline=None)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


@given(world=st.integers(2, 32))
@settings(max_examples=draws(40), deadline=None)
def test_every_rank_carries_exactly_one_other_ranks_shard(world: int) -> None:
    carriers = [carrier_of(r, world) for r in range(world)]
    assert sorted(carriers) == list(range(world))  # one extra share each
    assert all(c != r for r, c in enumerate(carriers))  # never its own
    assert all(carried_owner(c, world) == r for r, c in enumerate(carriers))


@st.composite
def worlds(draw: st.DrawFn) -> tuple[ShardPlan, list[torch.Tensor]]:
    world = draw(st.integers(2, 6))
    sizes = draw(st.lists(st.integers(1, 40), min_size=world, max_size=12))
    split = draw(st.integers(0, len(sizes)))
    groups = [g for g in (sizes[:split], sizes[split:]) if g]
    mode = draw(st.sampled_from(["greedy", "balanced", "flat"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))  # bf16: fp32 masters
    n = len(sizes)
    plan = plan_shards(groups, [f"cpu/{dtype}"] * n, [True] * n, world, mode)
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=generator).to(dtype) for size in sizes]
    return plan, params


def grads_for(params: list[torch.Tensor], steps: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]
        for _ in range(steps)
    ]


def master_dtype_for(params: list[torch.Tensor]) -> torch.dtype | None:
    """fp32 masters for bf16 parameters, as a mixed-precision job keeps them."""
    return torch.float32 if params[0].dtype == torch.bfloat16 else None


def unsharded(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], name: str
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The plain optimizer over every parameter (over fp32 masters of bf16
    parameters, cast down after each step): what ZeRO must equal."""
    cls, options = OPTIMIZERS[name]
    wide = master_dtype_for(params) or params[0].dtype
    mine = [p.detach().to(wide, copy=True) for p in params]
    optim = cls(mine, **options)
    for step in grads:
        for p, g in zip(mine, step, strict=True):
            p.grad = g.to(wide, copy=True)
        optim.step()
    return [m.to(params[0].dtype) for m in mine], optim


def world_of(plan: ShardPlan, params: list[torch.Tensor], name: str) -> list[SimulatedRank]:
    cls, options = OPTIMIZERS[name]
    return simulated_ranks(
        plan, params, cls, redundancy=2, master_dtype=master_dtype_for(params), **options
    )


def stepped(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optim`` steps, but for a flat shard's placeholder for a
    group it has no element of (a carried copy has none)."""
    return [t for g in optim.param_groups for t in g["params"] if t.numel()]


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    left = [a.state[t] for t in stepped(a)]
    right = [b.state[t] for t in stepped(b)]
    return len(left) == len(right) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(left, right, strict=True)
    )


def same_values(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    """The two optimizers step equal tensors (a carried copy's masters and its owner's)."""
    left, right = stepped(a), stepped(b)
    return len(left) == len(right) and all(map(torch.equal, left, right))


@given(worlds(), st.sampled_from(sorted(OPTIMIZERS)), st.integers(1, 4))
@SETTINGS
def test_carried_copies_equal_their_owners_bit_for_bit(
    world: tuple[ShardPlan, list[torch.Tensor]], name: str, steps: int
) -> None:
    plan, params = world
    ranks = world_of(plan, params, name)
    for grads in grads_for(params, steps, seed=steps):
        step_simulated(ranks, grads)
    size = plan.world_size
    for r, sim in enumerate(ranks):
        carried = sim.zero.carried
        assert carried is not None and carried.owner == carried_owner(r, size)
        assert same_state(carried.optim, ranks[carried.owner].optimizer)
        assert same_values(carried.optim, ranks[carried.owner].optimizer)
    expected, _ = unsharded(params, grads_for(params, steps, seed=steps), name)
    for sim in ranks:  # the carried steps moved no parameter
        assert all(torch.equal(p, e) for p, e in zip(sim.params, expected, strict=True))


Elements = set[tuple[int, int]]
"""Elements of parameters, as (parameter, element)."""


def elements(pieces: Any) -> Elements:
    return {(p.param, e) for p in pieces for e in range(p.start, p.stop)}


def owned_by(partition: Any, rank: int) -> Elements:
    return elements(partition.pieces_of(rank))


def check_moves(regrouping: Regrouping, old: Any, world: int) -> None:
    """After the moves every new owner holds the state of what it owns and
    every new carrier the state of what it carries; nothing is sent to a
    rank that held it; each move's source held it; values travel exactly
    to a new owner that did not hold them (after a loss)."""
    new = regrouping.plan.partition
    size = len(regrouping.old_ranks)

    def held(was: int | None) -> Elements:
        if was is None:
            return set()
        return owned_by(old, was) | owned_by(old, carried_owner(was, world))

    for rank, was in enumerate(regrouping.old_ranks):
        moves = [m for m in regrouping.moves if m.target == rank]
        moved = elements(p for m in moves for p in m.pieces)
        mine, carried = owned_by(new, rank), owned_by(new, carried_owner(rank, size))
        assert mine | carried <= held(was) | moved
        assert not moved & held(was)  # nothing sent that was there already
        for move in moves:
            source = regrouping.old_ranks[move.source]
            assert elements(move.pieces) <= held(source)
            lost_owner = any(
                old_rank not in regrouping.old_ranks
                for old_rank in range(world)
                if elements(move.pieces) & owned_by(old, old_rank)
            )
            assert move.values == (elements(move.pieces) <= mine and lost_owner)


@given(worlds(), st.data())
@SETTINGS
def test_the_plan_after_a_loss_keeps_every_shard_and_moves_only_what_is_missing(
    world: tuple[ShardPlan, list[torch.Tensor]], data: st.DataObject
) -> None:
    plan, _ = world
    size = plan.world_size
    assume(size >= 3)
    lost = data.draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size - 2))
    assume(all(carrier_of(r, size) not in lost for r in lost))
    regrouping = plan_after_loss(plan, lost)
    old, new = plan.partition, regrouping.plan.partition
    assert regrouping.survivors == tuple(r for r in range(size) if r not in lost)
    assert type(new) is type(old)
    for j, survivor in enumerate(regrouping.survivors):
        # Each survivor keeps what it owned and takes lost shards of its
        # neighbours: the one it carried, or under a flat partition the
        # last rank's, next to its own range.
        taken = {r for r in lost if carrier_of(r, size) == survivor}
        if isinstance(old, FlatPartition) and size - 1 in lost and survivor == size - 2:
            taken = (taken - {size - 1}) | {size - 1}
        if isinstance(old, FlatPartition) and size - 1 in lost and survivor == 0:
            taken.discard(size - 1)
        assert owned_by(new, j) == set().union(*(owned_by(old, r) for r in taken | {survivor}))
    check_moves(regrouping, old, size)


def test_a_loss_that_leaves_a_shard_nowhere_is_refused() -> None:
    plan = plan_shards([[4, 4, 4, 4]], ["k"] * 4, [True] * 4, 4)
    with pytest.raises(ValueError, match="both lost.*restart from a checkpoint"):
        plan_after_loss(plan, [1, 2])
    with pytest.raises(ValueError, match="needs 2 ranks"):
        plan_after_loss(plan_shards([[4, 4]], ["k"] * 2, [True] * 2, 2), [1])


def test_a_loss_of_nobody_keeps_the_world_as_it_is() -> None:
    """A transient failure (every rank answered): the same world, the same
    owners and carriers, nothing to move."""
    plan = plan_shards([[4, 3, 2, 1, 5]], ["k"] * 5, [True] * 5, 3)
    same = plan_after_loss(plan, [])
    assert same.survivors == (0, 1, 2) and not same.moves
    assert same.plan.partition.assignment == plan.partition.assignment


@pytest.mark.parametrize(
    ("options", "match"),
    [({"redundancy": 3}, "must be 1"), ({"world_size": 1}, "one rank")],
)
def test_redundancy_where_it_cannot_be_kept_is_refused(options: dict[str, Any], match: str) -> None:
    kwargs: dict[str, Any] = {"redundancy": 2, "world_size": 2, **options}
    with pytest.raises(ValueError, match=match):
        check_redundancy(kwargs["redundancy"], kwargs["world_size"])


def interrupt_in_exchange(ranks: list[SimulatedRank], grads: list[torch.Tensor]) -> None:
    """Every rank takes its local step of a step whose exchange then fails."""
    for r, sim in enumerate(ranks):
        for p, g in zip(sim.params, grads, strict=True):
            p.grad = g.clone()
        answer_local_step(sim.zero, sim.params, lambda optim: optim.step())(LocalStep(r))


@given(worlds(), st.sampled_from(sorted(OPTIMIZERS)), st.data())
@SETTINGS
def test_survivors_go_on_exactly_after_a_loss(
    world: tuple[ShardPlan, list[torch.Tensor]], name: str, data: st.DataObject
) -> None:
    plan, params = world
    size = plan.world_size
    assume(size >= 3)
    lost = data.draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size - 2))
    assume(all(carrier_of(r, size) not in lost for r in lost))
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
    interrupted = data.draw(st.booleans()) and before > 0
    grads = grads_for(params, before + after, seed=before)
    ranks = world_of(plan, params, name)
    for step in grads[: before - 1 if interrupted else before]:
        step_simulated(ranks, step)
    if interrupted:
        interrupt_in_exchange(ranks, grads[before - 1])
    ranks = survivors_of(ranks, sorted(lost), interrupted=interrupted)
    for step in grads[before:]:
        step_simulated(ranks, step)
    check_against_unsharded(ranks, params, grads, name)


def test_the_planner_counts_the_carried_copy() -> None:
    shapes = [[(64, 32), (32,), (32, 8)]]
    plain = plan_footprint(shapes, 4)
    carried = plan_footprint(shapes, 4, redundancy=2)
    numel = 64 * 32 + 32 + 32 * 8
    extra = sum(r.carried for r in carried.ranks)
    # every shard once more: its values, Adam's two states and a step count per tensor
    assert extra == numel * 4 + numel * 8 + 3 * 4
    assert [r.total - r.carried for r in carried.ranks] == [r.total for r in plain.ranks]


@pytest.mark.parametrize(
    ("partition", "compression"), [("greedy", None), ("flat", None), ("greedy", "int8")]
)
def test_the_optimizers_memory_matches_the_planner_with_redundancy(
    partition: str, compression: str | None
) -> None:
    shapes = [(8, 4), (4,), (4, 3), (3,), (5, 5)]
    params = [torch.randn(s) for s in shapes]
    n = len(shapes)
    sizes = [[p.numel() for p in params]]
    plan = plan_shards(sizes, ["cpu/torch.float32"] * n, [True] * n, 3, partition)
    ranks = simulated_ranks(
        plan, params, torch.optim.Adam, redundancy=2, exchange_compression=compression, lr=0.01
    )
    step_simulated(ranks, [torch.randn(s) for s in shapes])
    predicted = plan_footprint(
        [shapes], 3, redundancy=2, partition=partition, exchange_compression=compression
    )
    from zerofn.zero.rank import memory_bytes

    for r, sim in enumerate(ranks):
        counted = memory_bytes(sim.zero, sim.params)
        assert counted["carried"] == predicted.ranks[r].carried
        assert counted["optimizer_state"] == predicted.ranks[r].optimizer_state


def test_the_command_line_shows_the_carried_copy(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofn.footprint.cli import main

    main(["--model", "gpt2-small", "--world-size", "4", "--redundancy", "2", "--json"])
    (record,) = json.loads(capsys.readouterr().out)
    assert all(rank["carried"] > 0 for rank in record["ranks"])
    main(["--model", "gpt2-small", "--world-size", "4", "--redundancy", "2"])
    assert "carried GiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "gpt2-small", "--world-size", "4", "--redundancy", "3"])


def test_the_planner_counts_the_gradients_kept_behind_the_forward(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With the exchange behind the next forward and ``redundancy=2``, each
    rank keeps a copy of the gradients (its parameters' dtype) until the
    exchange lands; without either, nothing is kept."""
    shapes = [[(64, 32), (32,)]]
    numel = 64 * 32 + 32
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
        kept = plan_footprint(
            shapes, 3, param_dtype=dtype, redundancy=2, gather_during_forward=True
        )
        assert [r.kept_gradients for r in kept.ranks] == [numel * width] * 3
        carried = plan_footprint(shapes, 3, param_dtype=dtype, redundancy=2)
        assert [r.total + numel * width for r in carried.ranks] == [r.total for r in kept.ranks]
    alone = plan_footprint(shapes, 3, gather_during_forward=True)
    assert all(r.kept_gradients == 0 for r in alone.ranks)
    from zerofn.footprint.cli import main

    args = ["--model", "gpt2-small", "--world-size", "4", "--redundancy", "2"]
    main([*args, "--gather-during-forward"])
    assert "kept grads GiB" in capsys.readouterr().out
    main(args)
    assert "kept grads GiB" not in capsys.readouterr().out


def check_against_unsharded(
    ranks: list[SimulatedRank],
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    name: str,
) -> None:
    """Every rank's parameters are the unsharded optimizer's after ``grads``,
    and every state lives where :func:`check_holdings` says."""
    expected, reference = unsharded(params, grads, name)
    for sim in ranks:
        assert all(torch.equal(p, e) for p, e in zip(sim.params, expected, strict=True))
    check_holdings(ranks, reference)


def check_holdings(ranks: list[SimulatedRank], reference: torch.optim.Optimizer) -> None:
    """Every parameter's state lives on its owner and on its owner's carrier,
    equal to the unsharded optimizer's."""
    size = len(ranks)
    masters = reference.param_groups[0]["params"]
    by_index = {i: reference.state[p] for i, p in enumerate(masters)}
    for j, sim in enumerate(ranks):
        carried = sim.zero.carried
        assert carried is not None and carried.owner == carried_owner(j, size)
        assert same_state(carried.optim, ranks[carried.owner].optimizer)
        assert same_values(carried.optim, ranks[carried.owner].optimizer)
        pieces = sim.zero.shards.local_pieces(sim.params)
        local = [t for g in sim.optimizer.param_groups for t in g["params"]]
        for piece, tensor in zip(pieces, local, strict=True):
            if piece is None:
                continue
            mine = sim.optimizer.state[tensor]
            theirs = state_of(whole_pieces(by_index, sizes_of(masters)), piece, tensor.shape)
            assert mine.keys() == (theirs or {}).keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)  # type: ignore[index]
            if sim.zero.masters is not None:  # the master itself, as the reference's
                flat = masters[piece.param].reshape(-1)[piece.start : piece.stop]
                assert torch.equal(tensor, flat.view(tensor.shape))


def sizes_of(tensors: list[torch.Tensor]) -> list[int]:
    return [t.numel() for t in tensors]


@given(worlds(), st.integers(1, 3))
@SETTINGS
def test_the_plan_after_a_join_keeps_owners_and_sends_only_what_is_missing(
    world: tuple[ShardPlan, list[torch.Tensor]], joiners: int
) -> None:
    plan, _ = world
    size = plan.world_size
    regrouping = plan_after_join(plan, joiners)
    old, new = plan.partition, regrouping.plan.partition
    total = size + joiners
    assert regrouping.old_ranks == (*range(size), *([None] * joiners))
    if isinstance(old, FlatPartition):  # cut evenly again
        assert new.bounds == tuple(r * new.bounds[-1] // total for r in range(total + 1))
    else:
        for r in range(size):  # running ranks keep what they do not give away
            assert set(new.params_of(r)) <= set(old.params_of(r))  # type: ignore[union-attr]
        loads = new.loads()
        target = sum(old.loads()) // total
        assert all(loads[j] <= target for j in range(size, total))
    check_moves(regrouping, old, size)
    assert not any(move.values for move in regrouping.moves)  # every rank holds the values


@given(worlds(), st.sampled_from(sorted(OPTIMIZERS)), st.integers(1, 2), st.data())
@SETTINGS
def test_a_grown_world_goes_on_exactly(
    world: tuple[ShardPlan, list[torch.Tensor]], name: str, joiners: int, data: st.DataObject
) -> None:
    plan, params = world
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
    grads = grads_for(params, before + after, seed=after)
    ranks = world_of(plan, params, name)
    for step in grads[:before]:
        step_simulated(ranks, step)
    ranks = grown_by(ranks, joiners)
    assert len(ranks) == plan.world_size + joiners
    for step in grads[before:]:
        step_simulated(ranks, step)
    check_against_unsharded(ranks, params, grads, name)


def test_lose_a_rank_go_on_and_grow_back() -> None:
    """The whole lifecycle on 3 simulated ranks: rank 2 lost after step 2,
    2 ranks to step 4, a joiner, 3 ranks to the end: every parameter and
    state as the unsharded optimizer's."""
    sizes = [12, 7, 30, 5, 9, 16]
    params = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    n = len(sizes)
    plan = plan_shards([sizes], ["cpu/torch.float32"] * n, [True] * n, 3, "greedy")
    grads = grads_for(params, 6, seed=7)
    ranks = world_of(plan, params, "adam")
    for step in grads[:2]:
        step_simulated(ranks, step)
    ranks = survivors_of(ranks, [2])
    for step in grads[2:4]:
        step_simulated(ranks, step)
    ranks = grown_by(ranks, 1)
    for step in grads[4:]:
        step_simulated(ranks, step)
    assert len(ranks) == 3
    check_against_unsharded(ranks, params, grads, "adam")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_state_reaches_the_carried_copies_too(dtype: torch.dtype) -> None:
    """After ``load_global_state`` (what ``load_state_dict`` and
    ``load_sharded`` run) every carried copy holds its owner's state, and
    with master copies its owner's masters."""
    from zerofn.zero.mixed_precision.precision import MASTER_KEY
    from zerofn.zero.rank_state import load_global_state

    sizes = [12, 7, 30, 5]
    params = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) for n in sizes]
    plan = plan_shards([sizes], [f"cpu/{dtype}"] * 4, [True] * 4, 3, "greedy")
    grads = grads_for(params, 3, seed=3)
    _, reference = unsharded(params, grads, "adam")
    state = copy.deepcopy(reference.state_dict())  # its entries are the live states
    if dtype == torch.bfloat16:  # the masters travel in the state, as zerofn saves them
        for index, master in enumerate(reference.param_groups[0]["params"]):
            state["state"][index][MASTER_KEY] = master.detach().clone()
    ranks = world_of(plan, params, "adam")
    for sim in ranks:
        groups = [{"params": sim.params, **{k: v for k, v in reference.defaults.items()}}]
        load_global_state(sim.zero, groups, state)
    check_holdings(ranks, reference)


def test_the_planner_counts_carried_masters() -> None:
    """With fp32 masters of bf16 parameters the carried copy is the owner's
    masters and state: four bytes an element for each."""
    shapes = [[(64, 32), (32,), (32, 8)]]
    options: dict[str, Any] = {"param_dtype": torch.bfloat16, "master_dtype": torch.float32}
    carried = plan_footprint(shapes, 4, redundancy=2, **options)
    numel = 64 * 32 + 32 + 32 * 8
    assert sum(r.carried for r in carried.ranks) == numel * 4 + numel * 8 + 3 * 4
    sizes = [p for g in shapes for p in g]
    params = [torch.randn(s).to(torch.bfloat16) for s in sizes]
    n = len(params)
    plan = plan_shards([[p.numel() for p in params]], ["cpu/torch.bfloat16"] * n, [True] * n, 4)
    ranks = world_of(plan, params, "adam")
    step_simulated(ranks, grads_for(params, 1, seed=0)[0])
    from zerofn.zero.rank import memory_bytes

    for r, sim in enumerate(ranks):
        counted = memory_bytes(sim.zero, sim.params)
        assert counted["carried"] == carried.ranks[r].carried
        assert counted["master_weights"] == carried.ranks[r].master_weights


@given(worlds(), st.sampled_from(sorted(OPTIMIZERS)), st.integers(1, 3), st.data())
@SETTINGS
def test_a_group_added_under_redundancy_is_carried_too(
    world: tuple[ShardPlan, list[torch.Tensor]], name: str, added: int, data: st.DataObject
) -> None:
    """``add_param_group`` on every rank (greedy keeps owners and grows the
    carried copies; balanced moves the whole state, carried copies included),
    then more steps: every parameter and state as the unsharded optimizer's,
    which got the same group at the same step, and every carried copy its
    owner's."""
    from zerofn.zero.rank_state import joined_state, local_state_cpu
    from zerofn.zero.replan import with_added_group

    plan, params = world
    before, after = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    generator = torch.Generator().manual_seed(added)
    extra = [torch.randn(3 + i, generator=generator).to(params[0].dtype) for i in range(added)]
    every = [*params, *extra]
    grads = grads_for(every, before + after, seed=before)
    ranks = world_of(plan, params, name)
    for step in grads[:before]:
        step_simulated(ranks, [g for g in step[: len(params)]])
    cls, options = OPTIMIZERS[name]

    def groups_of(sim: SimulatedRank, params_now: list[torch.Tensor]) -> list[dict[str, Any]]:
        sizes = [len(g) for g in sim.zero.plan.partition.group_sizes]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        return [
            {**options, "params": params_now[a : a + n]} for a, n in zip(starts, sizes, strict=True)
        ]

    old = None
    if plan.mode != "greedy":
        states = [local_state_cpu(sim.zero, groups_of(sim, sim.params)) for sim in ranks]
        old = joined_state(ranks[0].zero, groups_of(ranks[0], ranks[0].params), states)
    grown = []
    for sim in ranks:
        # The grown plan gives an owner to what requires grad, as the optimizer's does.
        mine = [p.requires_grad_() for p in (*sim.params, *(e.detach().clone() for e in extra))]
        groups = [*groups_of(sim, mine), {"params": mine[len(params) :]}]
        zero = with_added_group(sim.zero, groups, copy.deepcopy(old))
        grown.append(SimulatedRank(mine, zero))
    for step in grads[before:]:
        step_simulated(grown, step)
    # The reference: the unsharded optimizer, the group added after ``before`` steps.
    wide = master_dtype_for(params) or params[0].dtype
    mine = [p.detach().to(wide, copy=True) for p in every]
    reference = cls(mine[: len(params)], **options)
    for s, step in enumerate(grads):
        if s == before:
            reference.add_param_group({"params": mine[len(params) :]})
        live = mine if s >= before else mine[: len(params)]
        for p, g in zip(live, step, strict=False):
            p.grad = g.to(wide, copy=True)
        reference.step()
    expected = [m.to(params[0].dtype) for m in mine]
    for sim in grown:
        assert all(torch.equal(p, e) for p, e in zip(sim.params, expected, strict=True))
        carried = sim.zero.carried
        assert carried is not None
        owner = grown[carried.owner]
        assert same_state(carried.optim, owner.optimizer)
        assert same_values(carried.optim, owner.optimizer)


# ----- the compressed exchange: a loss anywhere in it -------------------------------


@st.composite
def compressed_worlds(draw: st.DrawFn) -> tuple[ShardPlan, list[torch.Tensor]]:
    """A world of 3 to 5 ranks whose int8 exchange sends each segment in
    many small pieces, so that a loss can cut it anywhere."""
    world = draw(st.integers(3, 5))
    sizes = draw(st.lists(st.integers(1, 40), min_size=world, max_size=10))
    mode = draw(st.sampled_from(["greedy", "balanced", "flat"]))
    n = len(sizes)
    plan = plan_shards([sizes], ["cpu/torch.float32"] * n, [True] * n, world, mode)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return plan, [torch.randn(size, generator=generator) for size in sizes]


def compressed_world(plan: ShardPlan, params: list[torch.Tensor]) -> list[SimulatedRank]:
    cls, options = OPTIMIZERS["adam"]
    return simulated_ranks(
        plan, params, cls, exchange_compression="int8", piece_elements=8, redundancy=2,
        **options,
    )  # fmt: skip


def restarted(
    ranks: list[SimulatedRank], plan: ShardPlan, params: list[torch.Tensor]
) -> list[SimulatedRank]:
    """A fresh world of ``plan`` from ``ranks``' state (parameters, masters,
    optimizer state): what a restart from a consolidated checkpoint gives."""
    from zerofn.zero.rank_state import joined_state, load_global_state, local_state_cpu

    def groups(sim: SimulatedRank) -> list[dict[str, Any]]:
        return [{"params": sim.params, **OPTIMIZERS["adam"][1]}]

    state = joined_state(
        ranks[0].zero, groups(ranks[0]), [local_state_cpu(s.zero, groups(s)) for s in ranks]
    )
    fresh = compressed_world(plan, [p.detach().clone() for p in ranks[0].params])
    for sim in fresh:
        load_global_state(sim.zero, groups(sim), copy.deepcopy(state))
    return fresh


@given(compressed_worlds(), st.data())
@SETTINGS
def test_a_loss_anywhere_in_a_compressed_exchange_is_finished_as_the_whole_one(
    world: tuple[ShardPlan, list[torch.Tensor]], data: st.DataObject
) -> None:
    """A rank lost at the n-th request of a compressed exchange (every
    survivor has added some of its pieces), or between steps: the survivors
    finish the step with the bytes the whole exchange sends, re-plan and go
    on, bitwise as a world that took the step whole and restarted on the
    survivors' plan from its state."""
    from zerofn.errors import CollectiveError
    from zerofn.testing.world import Dropout, run_programs

    plan, params = world
    size = plan.world_size
    lost = data.draw(st.integers(0, size - 1))
    before, after = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    cut = data.draw(st.one_of(st.none(), st.integers(0, 12)))
    grads = grads_for(params, before + after, seed=before)
    ranks = compressed_world(plan, params)
    for step in grads[: before - 1]:
        step_simulated(ranks, step)
    programs = [sim.program(grads[before - 1], "broadcasts") for sim in ranks]
    if cut is None:  # a loss between steps
        run_programs(programs)
    else:
        try:
            run_programs(programs, drop=Dropout(lost, cut))
        except CollectiveError:
            pass
        else:
            assume(False)  # the exchange had fewer requests: nothing was cut
    survivors = survivors_of(ranks, [lost], interrupted=cut is not None)
    for step in grads[before:]:
        step_simulated(survivors, step)
    # The reference: the step taken whole, then the survivors' plan from its state.
    whole = compressed_world(plan, params)
    for step in grads[:before]:
        step_simulated(whole, step)
    reference = restarted(whole, survivors[0].zero.plan, params)
    for step in grads[before:]:
        step_simulated(reference, step)
    for mine, theirs in zip(survivors, reference, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(mine.params, theirs.params, strict=True))
        assert same_state(mine.optimizer, theirs.optimizer)
        assert same_values(mine.optimizer, theirs.optimizer)  # the masters
        carried = mine.zero.carried
        assert carried is not None
        assert same_state(carried.optim, survivors[carried.owner].optimizer)
        assert same_values(carried.optim, survivors[carried.owner].optimizer)
