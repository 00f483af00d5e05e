"""Simulated worlds that lose or gain ranks (``redundancy=2``), rebuilt by
the core functions ``zerofn_torch.elastic`` runs on a real one: the plan
after a loss or a join (:mod:`zerofn.zero.elastic.redundancy`) and the regroup
(:func:`zerofn.zero.elastic.regroup.regroup_program`), over the plain step's
simulated ranks (:mod:`zerofn.testing.zero`)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from zerofn.testing.world import run_programs
from zerofn.testing.zero import SimulatedRank, param_groups_of
from zerofn.zero.elastic.redundancy import Regrouping, plan_after_join, plan_after_loss
from zerofn.zero.elastic.regroup import regroup_program
from zerofn.zero.rank import build_rank

__all__ = ["grown_by", "survivors_of"]


def survivors_of(
    ranks: Sequence[SimulatedRank], lost: Sequence[int], interrupted: bool = False
) -> list[SimulatedRank]:
    """The simulated world after ranks ``lost`` are gone (``redundancy=2``),
    rebuilt as ``zerofn_torch.elastic.recover`` rebuilds a real one: the
    survivors' plan (:func:`~zerofn.zero.elastic.redundancy.plan_after_loss`), the
    moves delivered, each survivor re-built from what it knew
    (:func:`~zerofn.zero.elastic.regroup.regrouped`).

    Args:
        ranks: the world before the loss.
        lost: the ranks that are gone.
        interrupted: the loss came in a step's exchange, after every local
            step: the survivors finish the step (the lost shards' updates
            from their carried copies, then the exchange on the new world).

    Returns:
        The survivors, in their new rank order.

    Raises:
        ValueError: what :func:`~zerofn.zero.elastic.redundancy.plan_after_loss` refuses.
    """
    regrouping = plan_after_loss(ranks[0].zero.plan, lost)
    alive = [ranks[old] for old in regrouping.survivors]
    return _regrouped_world(alive, regrouping, finish_step=interrupted)


def grown_by(ranks: Sequence[SimulatedRank], joiners: int) -> list[SimulatedRank]:
    """The simulated world once ``joiners`` new ranks join (``redundancy=2``),
    grown as ``zerofn_torch.elastic`` grows a real one: the plan
    (:func:`~zerofn.zero.elastic.redundancy.plan_after_join`), each joiner built as its
    own optimizer builds it and handed rank 0's parameters, the moves
    delivered, every rank re-built (:func:`~zerofn.zero.elastic.regroup.regrouped`).

    Returns:
        The running ranks, then the joiners, in rank order.
    """
    first = ranks[0].zero
    regrouping = plan_after_join(first.plan, joiners)
    size = len(regrouping.old_ranks)
    newcomers = []
    for new in range(len(ranks), size):
        mine = [p.detach().clone() for p in ranks[0].params]
        options = attrs.evolve(first.options, rank=new, world_size=size)
        newcomers.append(
            SimulatedRank(
                mine, build_rank(param_groups_of(first.plan, mine), options, regrouping.plan)
            )
        )
    return _regrouped_world([*ranks, *newcomers], regrouping)


def _regrouped_world(
    world: Sequence[SimulatedRank], regrouping: Regrouping, *, finish_step: bool = False
) -> list[SimulatedRank]:
    """Every rank of the new world rebuilt (new rank = position) by the
    core's :func:`~zerofn.zero.elastic.regroup.regroup_program`, which the adapter's
    ``regroup`` drives too."""
    programs = [
        regroup_program(
            sim.zero, param_groups_of(regrouping.plan, sim.params), regrouping, new,
            finish_step=finish_step,
        )
        for new, sim in enumerate(world)
    ]  # fmt: skip
    rebuilt = run_programs(programs, purpose="regrouping the simulated world")
    return [SimulatedRank(sim.params, zero) for sim, zero in zip(world, rebuilt, strict=True)]
