"""Every feature of the training stack, and a run of any set of them on real
gloo ranks: what the composition tests drive and what writes the table of
pairs in ``docs/compositions.md``.

A configuration is a set of :data:`FEATURES` names. :func:`run_configuration`
builds it the way the docs show each feature (DDP, its hook, the ZeRO
optimizer, its wrappers, a scheduler and a loss scaler), trains a few steps
with the feature's actions (a group added, parameters written from outside,
a checkpoint round trip, uneven inputs under ``Join``) and checks after every
step what needs no reference: the replicas that should agree do, bit for
bit, and every value is finite; and, where PyTorch's own ZeRO optimizer can
run the same configuration (:data:`REFERENCED`), that the parameters equal
its parameters bit for bit. It answers ``"works"``, or the refusal the
stack raised before anything moved; a failure or a refusal after training
began raises.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import LossScaler, ZeroRedundancyOptimizer, verify_replicas
from zerofn_torch.averaging import DiLoCoOptimizer, PeriodicModelAverager, PostLocalSGDOptimizer
from zerofn_torch.checkpoint import load_sharded, save_sharded
from zerofn_torch.hooks import (
    PostLocalSGDState,
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    hook_with_zero_step,
    post_localSGD_hook,
    powerSGD_hook,
)
from zerofn_torch.join import Join
from zerofn_torch.runtime.object_collectives import all_gather_objects

STEPS = 4
LR = 1e-2


@attrs.frozen
class Feature:
    """One feature as a user turns it on.

    Attributes:
        name: its name in the table.
        option: how a user asks for it (shown in the table; a refusal of a
            pair names both options by one of their ``words``).
        words: what a refusal naming this feature says (any one of them).
    """

    name: str
    option: str
    words: tuple[str, ...]


FEATURES: tuple[Feature, ...] = (
    Feature("balanced", 'partition="balanced"', ("balanced", "partition")),
    Feature("flat", 'partition="flat"', ("flat", "partition")),
    Feature("masters", "bf16 parameters, master_dtype=torch.float32", ("master",)),
    Feature("int8", 'exchange_compression="int8"', ("compress", "int8")),
    Feature("overlap", "overlap_with_ddp=True + hook_with_zero_step", ("overlap",)),
    Feature("redundancy", "redundancy=2", ("redundancy",)),
    Feature("bucket_view", "parameters_as_bucket_view=True", ("bucket",)),
    Feature("gather", "gather_during_forward=True", ("gather",)),
    Feature("powersgd", "DDP hook powerSGD_hook", ("PowerSGD", "hook", "comm")),
    Feature("bf16_hook", "DDP hook bf16_compress_hook", ("bf16", "hook", "comm")),
    Feature("add_group", "add_param_group", ("param group", "add_param_group")),
    Feature("scheduler", "LR scheduler + zerofn_torch.LossScaler", ("scaler", "scheduler")),
    Feature("outside_write", "param.copy_ between steps", ("write",)),
    Feature("consolidated", "consolidate_state_dict + load_state_dict", ("state dict",)),
    Feature("sharded", "save_sharded + load_sharded", ("sharded", "checkpoint")),
    Feature("join", "Join([ddp, optimizer]), uneven inputs", ("Join",)),
    Feature("diloco", "DiLoCoOptimizer(optimizer, sync_every=2)", ("DiLoCo",)),
    Feature("post_local", "PostLocalSGDOptimizer + post_localSGD_hook", ("PostLocalSGD", "local")),
)
NAMES = tuple(f.name for f in FEATURES)


REFERENCED = frozenset(
    {
        "balanced", "flat", "bucket_view", "gather", "add_group", "outside_write",
        "consolidated", "sharded",
    }
)  # fmt: skip
"""Features whose configurations PyTorch's own ZeRO optimizer can run beside
zerofn's (exact, fp32): there the parameters must equal PyTorch's bit for bit."""

EXCLUSIVE = (frozenset({"balanced", "flat"}),)
"""Features that are values of one option: no configuration holds two."""


def pairs() -> list[tuple[str, str]]:
    """Every pair of features that can be asked for together, in the table's order."""
    return [p for p in itertools.combinations(NAMES, 2) if frozenset(p) not in EXCLUSIVE]


class Refused(Exception):
    """The stack refused the configuration before anything moved."""


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model.to(dtype)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _agree(model: torch.nn.Module, group: Any, what: str) -> None:
    """Every rank of ``group`` holds bitwise the same finite parameters."""
    mine = _flat(model)
    if not torch.isfinite(mine).all():
        raise AssertionError(f"{what}: a parameter is not finite")
    every = all_gather_objects(mine, group, f"compositions: {what}")
    if not all(torch.equal(every[0], other) for other in every[1:]):
        raise AssertionError(f"{what}: the replicas differ")


@attrs.frozen(eq=False)
class Groups:
    """The process groups a configuration trains over, on 4 ranks: the world;
    and for DiLoCo, workers of 2 ranks ({0, 1}, {2, 3}: DDP and ZeRO inside
    each) synced across ({0, 2}, {1, 3}); ``singles``: each rank alone (the
    post-local phase's subgroup)."""

    world: Any
    workers: tuple[Any, Any]
    across: tuple[Any, Any]
    singles: tuple[Any, ...]

    @classmethod
    def make(cls, world_size: int) -> Groups:
        def group(ranks: list[int] | None = None) -> Any:
            return dist.new_group(ranks, timeout=timedelta(seconds=20))

        return cls(
            group(),
            (group([0, 1]), group([2, 3])),
            (group([0, 2]), group([1, 3])),
            tuple(group([r]) for r in range(world_size)),
        )


def _ddp_hook(features: frozenset[str], groups: Groups, rank: int, inner: Any) -> tuple[Any, Any]:
    """The DDP communication hook and its state the features ask for (one per model)."""
    on = features.__contains__
    if on("post_local"):
        return PostLocalSGDState(inner, groups.singles[rank], 2), post_localSGD_hook
    if on("powersgd"):
        state = PowerSGDState(inner, matrix_approximation_rank=1)
        return state, bf16_compress_wrapper(powerSGD_hook) if on("bf16_hook") else powerSGD_hook
    if on("bf16_hook"):
        return inner, bf16_compress_hook
    return None, allreduce_hook


def _build(features: frozenset[str], groups: Groups, rank: int) -> dict[str, Any]:
    """Everything the configuration trains with; raises :class:`Refused`."""
    on = features.__contains__
    inner = groups.workers[rank // 2] if on("diloco") else groups.world
    model = _model(torch.bfloat16 if on("masters") else torch.float32)
    try:
        ddp = DDP(model, process_group=inner)
        params = list(model[0].parameters()) if on("add_group") else list(model.parameters())
        options: dict[str, Any] = {"lr": LR, "process_group": inner}
        if on("balanced") or on("flat"):
            options["partition"] = "balanced" if on("balanced") else "flat"
        if on("masters"):
            options["master_dtype"] = torch.float32
        if on("int8"):
            options["exchange_compression"] = "int8"
        if on("redundancy"):
            options["redundancy"] = 2
        if on("bucket_view"):
            options["parameters_as_bucket_view"] = True
        if on("gather"):
            options["gather_during_forward"] = True
        zero = ZeroRedundancyOptimizer(
            params, torch.optim.Adam, overlap_with_ddp=on("overlap"), **options
        )
        scaler = LossScaler(init_scale=2.0**4) if on("scheduler") else None
        state, hook = _ddp_hook(features, groups, rank, inner)
        if on("overlap"):
            hook = hook_with_zero_step(hook, ddp, zero, loss_scaler=scaler)
        ddp.register_comm_hook(state, hook)
        opt: torch.optim.Optimizer = zero
        if on("post_local"):
            opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(2, 2, inner))
        if on("diloco"):
            opt = DiLoCoOptimizer(opt, sync_every=2, process_group=groups.across[rank % 2])
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if on("scheduler") else None
        join = Join([ddp, opt]) if on("join") else None
    except (ValueError, TypeError, RuntimeError) as e:
        raise Refused(str(e)) from e
    built = {
        "model": model, "ddp": ddp, "zero": zero, "opt": opt, "scaler": scaler,
        "scheduler": scheduler, "join": join, "groups": groups, "rank": rank, "inner": inner,
    }  # fmt: skip
    if features <= REFERENCED:  # PyTorch's ZeRO beside it, on the same gradients
        theirs = _model(torch.float32)
        built["reference"] = (theirs, DDP(theirs, process_group=inner))
        built["reference_opt"] = TorchZero(
            list(theirs[0].parameters()) if on("add_group") else list(theirs.parameters()),
            torch.optim.Adam,
            process_group=inner,
            lr=LR,
        )
    return built


def _loss(ddp: DDP, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 6, generator=g).to(next(ddp.parameters()).dtype)
    return ddp(x).float().square().mean()


def _backward(built: dict[str, Any], step: int) -> None:
    loss = _loss(built["ddp"], step, built["rank"])
    scaler = built["scaler"]
    (loss if scaler is None else scaler.scale(loss)).backward()


def _reference_step(built: dict[str, Any], features: frozenset[str], step: int) -> None:
    """PyTorch's ZeRO takes the same step, with the same actions."""
    built["zero"].wait()  # reading parameters outside a forward (a no-op without a gather)
    theirs, ddp = built["reference"]
    opt = built["reference_opt"]
    opt.zero_grad()
    _loss(ddp, step, built["rank"]).backward()
    opt.step()
    if "add_group" in features and step == 1:
        opt.add_param_group({"params": list(theirs[2].parameters())})
    if "outside_write" in features and step == 2:
        with torch.no_grad():
            for p in theirs.parameters():
                p.mul_(0.5)
    if not torch.equal(_flat(built["model"]), _flat(theirs)):
        raise AssertionError(f"after step {step}: the parameters differ from PyTorch's ZeRO")


def _step(built: dict[str, Any], features: frozenset[str]) -> None:
    opt, scaler, zero = built["opt"], built["scaler"], built["zero"]
    if "overlap" in features:  # backward stepped; DiLoCo still runs its schedule
        if "diloco" in features:
            opt.step()
        if scaler is not None:
            scaler.update()
    elif scaler is not None and opt is zero:
        try:
            scaler.unscale_(zero)
        except RuntimeError as e:  # refused before anything of this step moved
            raise Refused(f"(at the first unscale_) {e}") from e
        scaler.step(zero)
        scaler.update()
    else:
        opt.step()
    if built["scheduler"] is not None:
        built["scheduler"].step()


def _actions(built: dict[str, Any], features: frozenset[str], step: int, folder: str) -> None:
    model, zero, opt, group = built["model"], built["zero"], built["opt"], built["inner"]
    if "add_group" in features and step == 1:
        try:
            opt.add_param_group({"params": list(model[2].parameters())})
        except (ValueError, TypeError, RuntimeError) as e:
            raise Refused(f"(when the group is added) {e}") from e
    if "outside_write" in features and step == 2:
        zero.wait()  # writing parameters outside a forward
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    if "consolidated" in features and step == 3:
        zero.consolidate_state_dict(to=0)
        full = zero.state_dict() if zero.rank == 0 else None
        (full,) = all_gather_objects(full, group, "compositions: the state dict")[:1]
        zero.load_state_dict(full)
    if "sharded" in features and step == 3:
        path = os.path.join(folder, "ckpt")
        if "diloco" in features:  # each worker saves its own shards
            path = os.path.join(path, f"worker{built['rank'] // 2}")
        save_sharded(opt, path)
        load_sharded(opt, path)


def _check(built: dict[str, Any], features: frozenset[str], step: int) -> None:
    """The replicas agree wherever the configuration says they must: within
    a DiLoCo worker after every step and everywhere after a sync; under
    post-local SGD everywhere while it warms up and after each averaging."""
    built["zero"].wait()  # reading parameters outside a forward
    groups: Groups = built["groups"]
    if "diloco" in features:
        _agree(built["model"], built["inner"], f"within a worker after step {step}")
        if step % 2 == 0:
            _agree(built["model"], groups.world, f"after the sync at step {step}")
        return
    if "post_local" in features and step > 2 and step % 2:
        return  # the local phase, between averagings
    _agree(built["model"], groups.world, f"after step {step}")
    if "redundancy" in features:
        verify_replicas(built["model"], groups.world, optimizer=built["zero"])


def run_configuration(features: Iterable[str], groups: Groups, rank: int, folder: str) -> str:
    """Build and train ``features`` on ``groups``.

    Returns:
        ``"works"``, or ``"refused: <message>"``: raised before anything moved
        (while building, or by the call that adds a param group).

    Raises:
        AssertionError: a replica differs or a value is not finite.
        Exception: anything else raised once training began.
    """
    chosen = frozenset(features)
    unknown = chosen - set(NAMES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}")
    try:
        built = _build(chosen, groups, rank)
        steps = STEPS + (rank % 2 if "join" in chosen else 0)  # uneven inputs
        join = built["join"]
        with join if join is not None else _Nothing():
            for step in range(1, steps + 1):
                built["opt"].zero_grad()
                _backward(built, step)
                _step(built, chosen)
                _actions(built, chosen, step, folder)
                if "reference" in built:
                    _reference_step(built, chosen, step)
                if join is None:
                    _check(built, chosen, step)
    except Refused as e:
        return f"refused: {e}"
    built["zero"].wait()
    if not {"diloco", "post_local"} & chosen:
        _agree(built["model"], groups.world, "at the end")
    if "redundancy" in chosen:  # every carried copy is still its owner's state
        verify_replicas(built["model"], groups.world, optimizer=built["zero"])
    return "works"


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_pairs(
    rank: int, world_size: int, chosen: list[tuple[str, ...]], folder: str
) -> dict[str, str]:
    """:func:`run_configuration` of each configuration in ``chosen`` on every
    rank (``folder`` is shared by the ranks). A configuration that fails on
    any rank is recorded as ``"FAILS: ..."`` on all of them, and the next one
    runs on new groups (the default group, which no configuration uses,
    carries the ranks' outcomes)."""
    out = {}
    groups = Groups.make(world_size)
    for i, features in enumerate(chosen):
        where = os.path.join(folder, str(i))
        if os.environ.get("ZEROFN_COMPOSITIONS_VERBOSE"):
            print(f"rank {rank}: {'+'.join(features)}", file=sys.stderr, flush=True)
        try:
            outcome = run_configuration(features, groups, rank, where)
        except Exception as e:  # recorded: the test reports every failure
            outcome = f"FAILS: {type(e).__name__}: {e}"
        every = all_gather_objects(outcome, dist.group.WORLD, "compositions: the outcome")
        failed = [o for o in every if o.startswith("FAILS")]
        out["+".join(features)] = failed[0] if failed else outcome
        if failed:
            groups = Groups.make(world_size)
    return out


BEGIN = "<!-- compositions:begin -->"
END = "<!-- compositions:end -->"


def table(outcomes: dict[str, str]) -> str:
    """The generated block of ``docs/compositions.md``: every pair of
    features as a matrix (``=``, ``ok``, or ``R<n>`` for the n-th refusal),
    then each refusal's message, as the stack raised it."""
    refusals: list[str] = []
    cell: dict[frozenset[str], str] = {}
    for a, b in pairs():
        outcome = outcomes["+".join((a, b))]
        if outcome == "works":
            cell[frozenset((a, b))] = "=" if {a, b} <= REFERENCED else "ok"
            continue
        refusals.append(f"{a} + {b}: {outcome.removeprefix('refused: ')}")
        cell[frozenset((a, b))] = f"R{len(refusals)}"
    for exclusive in EXCLUSIVE:
        cell[exclusive] = "-"
    header = "| | " + " | ".join(f"`{n}`" for n in NAMES) + " |"
    lines = [
        BEGIN,
        "_Written by `tests/test_compositions.py` (`make test-slow`) from the runs it checks: "
        f"{len(pairs())} pairs of {len(NAMES)} features, 4 gloo ranks. `=`: works, and equals "
        "PyTorch's ZeRO optimizer run beside it bit for bit after every step; `ok`: works (the "
        "replicas that must agree do after every step); `R<n>`: refused, reason n below; `-`: "
        "two values of one option._",
        "",
        "| feature | how it is asked for |",
        "| --- | --- |",
        *(f"| `{f.name}` | {f.option} |" for f in FEATURES),
        "",
        header,
        "| --- " * (len(NAMES) + 1) + "|",
    ]
    for a in NAMES:
        row = ["" if a == b else cell[frozenset((a, b))] for b in NAMES]
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", *(f"{i}. {text.replace('|', '/')}" for i, text in enumerate(refusals, 1))]
    lines.append(END)
    return "\n".join(lines)


def names_both(pair: tuple[str, str], message: str) -> bool:
    """Whether a refusal's message names both features of ``pair``."""
    by_name = {f.name: f for f in FEATURES}
    lower = message.lower()
    return all(any(w.lower() in lower for w in by_name[n].words) for n in pair)
