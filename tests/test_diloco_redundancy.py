"""DiLoCo with ``redundancy=2`` in a simulated world
(:mod:`zerofn.diloco.redundancy`): carried copies that equal their owners
bit for bit, and a loss at any point of a sync, seen by any subset of the
survivors, regrouped into the outer state of a world that lost the rank
before the sync (nobody stepped it) or just after it (somebody holds its
sum)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from test_diloco_core import OUTER, Factory, World, drift, replicated, sizes_lists

from zerofn.blockquant import BlockQuantizer
from zerofn.comm import Request, answered_locally, recording_requests, request_bytes
from zerofn.diloco.checkpoint import consolidate, rank_state_dict, shard
from zerofn.diloco.config import Codec, DiLoCoConfig
from zerofn.diloco.footprint import outer_state_bytes
from zerofn.diloco.fragments import FragmentPlan, plan_fragments, read_fragment, write_fragment
from zerofn.diloco.outer import OuterStep, outer_step
from zerofn.diloco.redundancy import (
    InconsistentSyncs,
    Regrouped,
    SyncPosition,
    SyncRecovery,
    carried_rank,
    copies_disagreement,
    outer_state_tensors,
    redundant_sync_program,
    regroup_program,
    regrouped,
    sync_recovery,
)
from zerofn.diloco.redundant_compressed_sync import (
    as_found,
    redundant_compressed_sync_bytes,
    redundant_compressed_sync_program,
)
from zerofn.diloco.state import DiLoCoState
from zerofn.diloco.sync import run_sync, sync_bytes
from zerofn.replicas import digests
from zerofn.testing.world import fulfil, run_programs

SETTINGS = settings(max_examples=draws(60), deadline=None)


class CarriedWorld:
    """W simulated DiLoCo workers with ``redundancy=2``: each keeps its
    anchor slices and outer optimizer, and a copy of the previous rank's;
    with a ``codec``, its replica and residual too, and both as the last
    sync found them."""

    def __init__(
        self,
        plan: FragmentPlan,
        params: list[list[torch.Tensor]],
        factory: Factory,
        codec: Codec | None = None,
    ):
        self.plan, self.params, self.codec = plan, params, codec
        flat = torch.cat([p.reshape(-1) for p in params[0]])
        world = plan.world_size

        def slices(rank: int) -> list[torch.Tensor]:
            return [
                flat[f.start : f.start + f.numel][f.owned(rank)].clone() for f in plan.fragments
            ]

        self.anchors = [slices(r) for r in range(world)]
        self.carried = [slices(carried_rank(r, world)) for r in range(world)]
        self.outers = [factory(a) for a in self.anchors]
        self.carried_outers = [factory(a) for a in self.carried]
        self.sums: list[torch.Tensor | None] = [None] * world
        self.replicas = [flat.clone() for _ in range(world)]
        self.residuals = [torch.zeros_like(flat) for _ in range(world)]
        self.before: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * world

    def answer(self, rank: int) -> Callable[[OuterStep], torch.Tensor]:
        def step(request: OuterStep) -> torch.Tensor:
            if request.carried:
                return outer_step(self.carried_outers[rank], self.carried[rank], request)
            return outer_step(self.outers[rank], self.anchors[rank], request)

        return step

    def program(self, rank: int, fragment: int) -> Any:
        f = self.plan.fragments[fragment]
        values = read_fragment(f, self.params[rank])
        self.sums[rank] = values
        anchor, carried = self.anchors[rank][fragment], self.carried[rank][fragment]
        if self.codec is None:
            program = redundant_sync_program(f, rank, values, anchor, carried)
            return run_sync(program, self.answer(rank))
        span = slice(f.start, f.start + f.numel)
        replica, residual = self.replicas[rank][span], self.residuals[rank][span]
        self.before[rank] = (replica.clone(), residual.clone())
        program = redundant_compressed_sync_program(
            f, rank, values, replica, residual, anchor, carried, self.codec
        )
        return run_sync(program, self.answer(rank))

    def sync(self, fragment: int) -> None:
        f = self.plan.fragments[fragment]
        results = run_programs([self.program(r, fragment) for r in range(self.plan.world_size)])
        for ps, result in zip(self.params, results, strict=True):
            write_fragment(f, ps, result)

    def held(
        self, rank: int, recovery: SyncRecovery | None = None, fragment: int = 0
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank ``rank``'s own and carried state dicts; for ``recovery`` of
        the sync of ``fragment`` (which every rank entered, at step 1), with
        its replica and residual as the regroup reads them."""
        carried = carried_rank(rank, self.plan.world_size)
        replica = residual = None
        if recovery is not None and self.codec is not None:
            replica, residual = as_found(
                recovery,
                1,
                self.plan.fragments[fragment],
                (self.replicas[rank], self.residuals[rank]),
                self.before[rank],
            )
        return (
            rank_state_dict(
                self.plan,
                rank,
                DiLoCoState(),
                None,
                self.anchors[rank],
                self.outers[rank].state_dict(),
                replica,
                residual,
            ),
            rank_state_dict(
                self.plan,
                carried,
                DiLoCoState(),
                None,
                self.carried[rank],
                self.carried_outers[rank].state_dict(),
            ),
        )

    def consolidated(self) -> dict[str, Any]:
        return consolidate(self.plan, [self.held(r)[0] for r in range(self.plan.world_size)])


CODECS: dict[str, Codec | None] = {
    "fp32": None,
    "int8": BlockQuantizer(8, 16),
    "int4": BlockQuantizer(4, 8),
}


def same_tensors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 3),
    st.integers(2, 5),
    st.sampled_from(sorted(OUTER)),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_carried_copies_equal_their_owners_and_the_outer_state_is_the_plain_syncs(
    sizes: list[int], fragments: int, world_size: int, outer: str, rounds: int, seed: int
) -> None:
    fragments = min(fragments, sum(sizes))
    plan = plan_fragments(sizes, fragments, world_size)
    params = replicated(sizes, world_size, seed)
    plain_params = copy.deepcopy(params)
    carried = CarriedWorld(plan, params, OUTER[outer])
    plain = World(plan, plain_params, OUTER[outer])
    for r in range(rounds):
        drift(params, seed + r)
        drift(plain_params, seed + r)
        for fragment in range(fragments):
            carried.sync(fragment)
            f = plan.fragments[fragment]
            for ps, result in zip(plain_params, plain.sync(fragment), strict=True):
                write_fragment(f, ps, result)
    # The sum comes from an all-reduce of the fragment, not a reduce of each
    # slice: the same numbers, up to the order of the additions.
    for a, b in zip(params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for r in range(world_size):
        plain_own = rank_state_dict(
            plan, r, DiLoCoState(), None, plain.anchors[r], plain.outers[r].state_dict()
        )
        got, want = outer_state_tensors(carried.held(r)[0]), outer_state_tensors(plain_own)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    own = [digests(outer_state_tensors(carried.held(r)[0])).tolist() for r in range(world_size)]
    copies = [digests(outer_state_tensors(carried.held(r)[1])).tolist() for r in range(world_size)]
    assert copies_disagreement(own, copies) is None
    # A copy that drifts is named.
    carrier = next(r for r in range(world_size) if carried.carried[r][0].numel())
    owner = carried_rank(carrier, world_size)
    carried.carried[carrier][0].add_(1.0)
    copies = [digests(outer_state_tensors(carried.held(r)[1])).tolist() for r in range(world_size)]
    assert copies_disagreement(own, copies) == (
        f"rank {carrier}'s copy of rank {owner}'s DiLoCo outer state differs from rank {owner}'s own"
    )


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 3),
    st.integers(2, 5),
    st.sampled_from(sorted(set(CODECS) - {"fp32"})),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_compressed_syncs_keep_copies_and_replicas_equal_and_carry_what_codes_drop(
    sizes: list[int], fragments: int, world_size: int, codec: str, rounds: int, seed: int
) -> None:
    """Owner and carrier step from the same sum of decoded codes, so the
    copies stay bitwise equal; every rank's replica moves alike; the sum
    and what the residuals still owe add up to the true sum; and a sync
    hands over the bytes :func:`redundant_compressed_sync_bytes` plans."""
    fragments = min(fragments, sum(sizes))
    plan = plan_fragments(sizes, fragments, world_size)
    params = replicated(sizes, world_size, seed)
    world = CarriedWorld(plan, params, OUTER["nesterov"], CODECS[codec])
    for r in range(rounds):
        drift(params, seed + r)
        for fragment, f in enumerate(plan.fragments):
            span = slice(f.start, f.start + f.numel)
            owed = [
                world.replicas[k][span] - read_fragment(f, params[k]) for k in range(world_size)
            ]
            true = torch.stack([o + world.residuals[k][span] for k, o in enumerate(owed)]).sum(0)
            requests: list[list[Request]] = [[] for _ in range(world_size)]
            programs = [
                recording_requests(world.program(k, fragment), requests[k].append)
                for k in range(world_size)
            ]
            results = run_programs(programs)
            for ps, result in zip(params, results, strict=True):
                write_fragment(f, ps, result)
            summed = world.sums[0]
            assert summed is not None
            assert all(torch.equal(world.sums[k], summed) for k in range(world_size))
            still = torch.stack([world.residuals[k][span] for k in range(world_size)]).sum(0)
            torch.testing.assert_close(summed + still, true, rtol=1e-5, atol=1e-5)
            planned = redundant_compressed_sync_bytes(f, CODECS[codec])
            assert all(sum(map(request_bytes, rs)) == planned for rs in requests)
        assert all(torch.equal(world.replicas[k], world.replicas[0]) for k in range(world_size))
    own = [digests(outer_state_tensors(world.held(r)[0])).tolist() for r in range(world_size)]
    copies = [digests(outer_state_tensors(world.held(r)[1])).tolist() for r in range(world_size)]
    assert copies_disagreement(own, copies) is None


@pytest.mark.parametrize(
    ("codec", "fewer", "more"), [("int8", 6, 7), ("int4", 14, 15), ("int2", 28, 30)]
)
def test_compressed_redundant_syncs_move_fewer_bytes_than_fp32_ones_up_to_a_world_size(
    codec: str, fewer: int, more: int
) -> None:
    """The figures :mod:`zerofn.diloco.redundant_compressed_sync` states."""
    quantizer = DiLoCoConfig(2, 1, compression=codec).compression
    assert quantizer is not None
    for world_size, under in ((2, True), (fewer, True), (more, False)):
        f = plan_fragments([10**6], 1, world_size).fragments[0]
        assert (redundant_compressed_sync_bytes(f, quantizer) < sync_bytes(f)) == under


def interrupted_sync(
    world: CarriedWorld, fragment: int, lost: int, summed: Sequence[bool]
) -> list[SyncPosition]:
    """Every rank enters the sync of ``fragment``; if any survivor is to see
    its all-reduce complete, it completes, and exactly the survivors marked
    in ``summed`` take their outer steps; then rank ``lost`` is gone and
    every survivor's wait fails. The survivors' positions, in order."""
    ranks = range(world.plan.world_size)
    programs = [world.program(r, fragment) for r in ranks]
    requests = [next(p) for p in programs]
    survivors = [r for r in ranks if r != lost]
    if any(summed):
        responses = fulfil(requests)
        for r, saw in zip(survivors, summed, strict=True):
            if saw:
                programs[r].send(responses[r])  # the outer steps, then the gather
    return [SyncPosition(0, 1, 1, saw, taken=True) for saw in summed]


def regroup(
    world: CarriedWorld,
    fragment: int,
    survivors: list[int],
    positions: list[SyncPosition],
) -> list[Regrouped]:
    """Run :func:`regroup_program` on every survivor, as the adapter does."""
    recovery = sync_recovery(positions)
    f = world.plan.fragments[fragment]

    def program(new_rank: int) -> Any:
        old = survivors[new_rank]
        position = positions[new_rank]

        def finish() -> Any:
            held_sum = world.sums[old] if position.summed else None
            return f, held_sum, world.anchors[old][fragment], world.carried[old][fragment]

        regroup = regroup_program(
            recovery,
            position,
            world.plan,
            survivors,
            new_rank,
            finish,
            lambda: world.held(old, recovery, fragment),
            None if world.codec is None else (world.codec, fragment),
        )
        return answered_locally(regroup, OuterStep, world.answer(old))

    return run_programs([program(i) for i in range(len(survivors))])


@SETTINGS
@given(
    sizes_lists,
    st.integers(1, 3),
    st.integers(3, 5),
    st.sampled_from(sorted(OUTER)),
    st.integers(0, 2),
    st.sampled_from(sorted(CODECS)),
    st.data(),
    st.integers(0, 2**16),
)
def test_a_loss_inside_a_sync_regroups_into_a_world_that_lost_the_rank_before_or_after_it(
    sizes: list[int],
    fragments: int,
    world_size: int,
    outer: str,
    rounds: int,
    codec: str,
    data: st.DataObject,
    seed: int,
) -> None:
    """Whichever survivors saw the sync's sum complete (none, some or
    all), the survivors' outer state, own and carried, equals bit for bit
    that of a world that never lost the rank, cut for the survivors: after
    the sync when any survivor held its sum, before it otherwise. With
    compressed syncs, every survivor's replica is that world's, and its
    residual the mean of the survivors' there."""
    fragments = min(fragments, sum(sizes))
    plan = plan_fragments(sizes, fragments, world_size)
    params = replicated(sizes, world_size, seed)
    world = CarriedWorld(plan, params, OUTER[outer], CODECS[codec])
    for r in range(rounds):
        drift(params, seed + r)
        for fragment in range(fragments):
            world.sync(fragment)
    drift(params, seed + rounds)
    reference = copy.deepcopy(world)
    fragment = data.draw(st.integers(0, fragments - 1), label="fragment")
    lost = data.draw(st.integers(0, world_size - 1), label="lost")
    survivors = [r for r in range(world_size) if r != lost]
    summed = data.draw(
        st.lists(st.booleans(), min_size=len(survivors), max_size=len(survivors)), label="summed"
    )
    positions = interrupted_sync(world, fragment, lost, summed)
    recovery = sync_recovery(positions)
    assert recovery.forward == any(summed)
    if recovery.forward:
        reference.sync(fragment)
    whole = reference.consolidated()
    new_plan = plan_fragments(sizes, fragments, len(survivors))
    for new_rank, got in enumerate(regroup(world, fragment, survivors, positions)):
        want_own = shard(new_plan, whole, new_rank)
        want_carried = shard(new_plan, whole, carried_rank(new_rank, len(survivors)))
        assert got.plan == new_plan
        assert same_tensors(outer_state_tensors(got.own), outer_state_tensors(want_own))
        assert same_tensors(outer_state_tensors(got.carried), outer_state_tensors(want_carried))
        if world.codec is None:
            assert same_tensors(got.results, whole["anchor"])
            continue
        replica = reference.replicas[survivors[0]]
        assert all(torch.equal(reference.replicas[r], replica) for r in survivors)
        assert torch.equal(got.own["replica"], replica)
        residual = torch.stack([reference.residuals[r] for r in survivors]).mean(dim=0)
        assert torch.equal(got.own["residual"], residual)
        assert same_tensors(
            got.results, [replica[f.start : f.start + f.numel] for f in plan.fragments]
        )


def at(steps: int, sync: int, summed: bool, delay: int = 0, taken: bool = False) -> SyncPosition:
    return SyncPosition(steps, sync, sync + delay, summed, taken)


def test_the_last_sync_entered_decides_and_a_sum_nobody_could_hold_is_refused() -> None:
    inside = at(3, 4, False, taken=True)  # in its step at 4, the sync not summed
    back = sync_recovery([inside, at(2, 2, True)])
    assert (back.sync, back.forward, back.source) == (4, False, None)
    assert back.runs_again(inside) and inside.merges_now
    assert not back.runs_again(at(2, 2, True))
    stuck = at(1, 2, True, taken=True)  # summed sync 2, stuck in its gather
    assert sync_recovery([inside, stuck]).applies_consolidated(stuck)
    forward = sync_recovery([at(4, 4, True), at(3, 4, False, taken=True)])
    assert (forward.forward, forward.source) == (True, 0)
    assert forward.needs_sum(at(3, 4, False))
    assert forward.applies_consolidated(at(3, 4, False))
    assert not forward.applies_consolidated(at(4, 4, True))
    everyone = sync_recovery([at(3, 4, True), at(3, 4, True)])
    assert everyone.forward and everyone.source is None
    with pytest.raises(InconsistentSyncs, match="never entered"):
        sync_recovery([at(3, 4, True), at(1, 2, True)])
    with pytest.raises(InconsistentSyncs, match="no survivors"):
        sync_recovery([])


def test_with_a_delay_a_result_is_merged_at_its_due_step() -> None:
    """A sync started at 4 is due at 6: a survivor that failed in a poll at
    step 5 keeps the result for step 6; one that failed merging it at 6
    merges it now; one that merged it already needs nothing."""
    polling = at(4, 4, False, delay=2)  # failed before its inner step 5
    merging = at(5, 4, True, delay=2, taken=True)  # failed merging at 6
    done = at(6, 4, True, delay=2)
    forward = sync_recovery([polling, merging, done])
    assert forward.forward and forward.source == 1
    assert forward.applies_consolidated(polling) and not polling.merges_now
    assert forward.applies_consolidated(merging) and merging.merges_now
    assert not forward.applies_consolidated(done)
    starting = at(3, 4, False, delay=2, taken=True)  # failed starting it at 4
    back = sync_recovery([polling, starting])
    assert back.runs_again(polling) and back.runs_again(starting)
    assert not starting.merges_now


@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 8),
    st.booleans(),
    st.booleans(),
)
def test_positions_read_back_as_written(
    steps: int, sync: int, delay: int, summed: bool, taken: bool
) -> None:
    position = SyncPosition(steps, sync, sync + delay, summed, taken)
    assert SyncPosition.from_text(position.to_text()) == position
    with pytest.raises(ValueError, match="not a DiLoCo sync position"):
        SyncPosition.from_text(f"{steps}:{sync}:{int(summed)}")


def test_a_rank_lost_with_its_carrier_or_a_world_left_with_one_rank_is_refused() -> None:
    plan = plan_fragments([8, 4], 1, 4)
    world = CarriedWorld(plan, replicated([8, 4], 4, 0), OUTER["nesterov"])
    held = {r: world.held(r) for r in (0, 3)}
    with pytest.raises(ValueError, match="ranks 1 and 2 \\(its carrier\\) are both lost"):
        regrouped(plan, held, [0, 3], 0)
    with pytest.raises(ValueError, match="redundancy=2 needs 2 ranks"):
        regrouped(plan, {0: world.held(0)}, [0], 0)


@given(st.integers(1, 10**6), st.integers(2, 16), st.integers(1, 8), st.integers(0, 2))
def test_the_planner_counts_the_carried_copy_and_the_kept_sum(
    numel: int, world_size: int, fragments: int, state_tensors: int
) -> None:
    fragments = min(fragments, numel)
    plan = plan_fragments([numel], fragments, world_size)
    for rank in range(world_size):
        alone = outer_state_bytes(plan, rank, False, state_tensors)
        carried = outer_state_bytes(plan, carried_rank(rank, world_size), False, state_tensors)
        largest = max(f.numel for f in plan.fragments)
        assert outer_state_bytes(plan, rank, False, state_tensors, 2) == (
            alone + carried + 4 * largest
        )
        assert outer_state_bytes(plan, rank, False, state_tensors, 2, delayed=True) == (
            alone + carried + 8 * largest
        )
        # Compressed: the replica and residual of every element, and the
        # last sync's span of both as it found them.
        assert outer_state_bytes(plan, rank, True, state_tensors, 2) == (
            alone + carried + 8 * numel + 12 * largest
        )
    with pytest.raises(ValueError, match="redundancy is 1 or 2"):
        outer_state_bytes(plan, 0, True, state_tensors, 3)
