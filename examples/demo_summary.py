"""The demo's measurements, reduced: from what each rank recorded of each run
(:class:`Measured`) to one :class:`RunSummary` per run, the numbers the table
and the figure show.

Pure functions of plain records, so the tests check them without training.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import attrs
from demo_runs import RunSpec
from zerofn_torch.traffic import Traffic

WARMUP_STEPS = 5  # left out of the timing means: first steps allocate and warm caches
MEMORY_ORDER = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_state",
    "exchange_buffers",
    "hook_state",
    "diloco_state",
)


@attrs.frozen
class Measured:
    """What one rank measured of one run.

    Attributes:
        losses: training loss on this rank's slice, per step.
        forward_backward: seconds per step (DDP's communication included).
        optimizer_step: seconds of ``optimizer.step()`` per step.
        local_step: seconds of that spent inside the AdamW stepping tensors.
        compute: ``(step, seconds)`` of forward+backward under ``no_sync``,
            run on that step's batch just before it.
        backward_payload: payload bytes by collective kind issued in
            ``zero_grad``, forward and backward, over the counted steps.
        after_payload: the same for ``optimizer.step()``.
        counted_steps: the steps the payloads were counted over (the last ones).
        memory: this rank's bytes by kind after the last step.
        held_out: ``(step, held-out loss)`` at each evaluation (the same on
            every rank: each evaluates half the windows, the sums are shared).
        fingerprints: a CRC-32 of this rank's parameters at each evaluation.
        sample: text sampled after training (empty unless asked for).
    """

    losses: tuple[float, ...]
    forward_backward: tuple[float, ...]
    optimizer_step: tuple[float, ...]
    local_step: tuple[float, ...]
    compute: tuple[tuple[int, float], ...]
    backward_payload: Mapping[str, int]
    after_payload: Mapping[str, int]
    counted_steps: int
    memory: Mapping[str, int]
    held_out: tuple[tuple[int, float], ...]
    fingerprints: tuple[int, ...]
    sample: bytes = b""


Results = Sequence[Mapping[str, Measured]]
"""Per rank, in rank order: run key -> what that rank measured."""


@attrs.frozen
class Sent:
    """Bytes one rank sends per step (ring estimate), by what they carry."""

    gradients: float  # in backward: DDP's all-reduce or PowerSGD's factors
    parameters: float  # after the optimizer step: ZeRO's updated shards
    sync: float  # DiLoCo's outer syncs, averaged over the steps between them

    @property
    def total(self) -> float:
        return self.gradients + self.parameters + self.sync


@attrs.frozen
class TimeSplit:
    """Rank 0's mean milliseconds per step (warm-up steps left out)."""

    compute: float  # forward+backward under no_sync
    backward_communication: float  # the rest of forward+backward: hook, all-reduce, waiting
    step_communication: float  # optimizer.step() outside the local AdamW: exchange, sync
    optimizer: float  # the local AdamW's step

    @property
    def communication(self) -> float:
        return self.backward_communication + self.step_communication

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.optimizer


@attrs.frozen
class Gap:
    """A run's final held-out loss against its baseline's."""

    baseline: str
    absolute: float  # nats/byte, this run minus the baseline
    relative: float  # absolute / the baseline's loss
    target: float | None  # the largest |relative| allowed, if any
    why_missed: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the target is met (``None``: no target)."""
        return None if self.target is None else abs(self.relative) <= self.target


@attrs.frozen
class RunSummary:
    """One run's numbers, as the report and the figure show them."""

    spec: RunSpec
    held_out: tuple[tuple[int, float], ...]
    train_loss: float  # rank 0, mean of the last 10 steps
    max_loss_difference: float | None  # vs the baseline, every step and rank
    gap: Gap | None
    memory: tuple[Mapping[str, int], ...]  # per rank
    sent: Sent
    time: TimeSplit | None  # None: no step was split (too few steps)
    identical: bool  # every rank's parameters bitwise equal at every evaluation

    @property
    def final_held_out(self) -> float:
        return self.held_out[-1][1]


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs[WARMUP_STEPS:] if len(xs) > WARMUP_STEPS else xs)


def time_split(m: Measured) -> TimeSplit | None:
    """Mean milliseconds per step: compute, communication in backward and in
    the optimizer step, the local optimizer step (``None`` if no step was split)."""
    if not m.compute:
        return None
    pairs = [(m.forward_backward[step], seconds) for step, seconds in m.compute]
    compute = statistics.fmean(c for _, c in pairs)
    backward = statistics.fmean(max(0.0, f - c) for f, c in pairs)
    after = [s - local for s, local in zip(m.optimizer_step, m.local_step, strict=True)]
    return TimeSplit(
        compute=1e3 * compute,
        backward_communication=1e3 * backward,
        step_communication=1e3 * _mean(after),
        optimizer=1e3 * _mean(m.local_step),
    )


def sent_per_step(spec: RunSpec, m: Measured, world_size: int) -> Sent:
    """Bytes one rank sends per step, ring estimate, split by what they carry."""
    steps = max(1, m.counted_steps)
    backward = Traffic(payload_bytes=dict(m.backward_payload)).sent_bytes(world_size) / steps
    after = Traffic(payload_bytes=dict(m.after_payload)).sent_bytes(world_size) / steps
    if spec.optimizer == "diloco":  # its sync may run on during backward: all of it is sync
        return Sent(gradients=0.0, parameters=0.0, sync=backward + after)
    return Sent(gradients=backward, parameters=after, sync=0.0)


def _gap(spec: RunSpec, mine: float, base: float) -> Gap:
    assert spec.baseline is not None
    return Gap(
        baseline=spec.baseline,
        absolute=mine - base,
        relative=(mine - base) / base,
        target=spec.target.relative if spec.target is not None else None,
        why_missed=spec.target.why_missed if spec.target is not None else "",
    )


def summarize(results: Results, specs: Sequence[RunSpec]) -> tuple[RunSummary, ...]:
    """One summary per run, in ``specs`` order.

    Raises:
        KeyError: a run missing from some rank's results.
    """
    world_size = len(results)
    finals = {s.key: results[0][s.key].held_out[-1][1] for s in specs}
    out = []
    for spec in specs:
        mine = [r[spec.key] for r in results]
        diff = gap = None
        if spec.baseline is not None:
            base = [r[spec.baseline] for r in results]
            diff = max(
                abs(a - b)
                for m, b_ in zip(mine, base, strict=True)
                for a, b in zip(m.losses, b_.losses, strict=True)
            )
            gap = _gap(spec, finals[spec.key], finals[spec.baseline])
        out.append(
            RunSummary(
                spec=spec,
                held_out=mine[0].held_out,
                train_loss=statistics.fmean(mine[0].losses[-10:]),
                max_loss_difference=diff,
                gap=gap,
                memory=tuple(m.memory for m in mine),
                sent=sent_per_step(spec, mine[0], world_size),
                time=time_split(mine[0]),
                identical=all(m.fingerprints == mine[0].fingerprints for m in mine),
            )
        )
    return tuple(out)


def memory_kinds(summaries: Sequence[RunSummary]) -> tuple[str, ...]:
    """The kinds of memory some rank of some run holds bytes of, known kinds first."""
    held = {k for s in summaries for mem in s.memory for k, v in mem.items() if v}
    return (*(k for k in MEMORY_ORDER if k in held), *sorted(held - set(MEMORY_ORDER)))


def total_memory(memory: Mapping[str, int]) -> int:
    """All of a rank's bytes."""
    return sum(memory.values())
