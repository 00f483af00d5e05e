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
from zerofn_torch.runtime.traffic import Traffic

WARMUP_STEPS = 5  # left out of the timings: first steps allocate and warm caches
TRAIN_WINDOW = 20  # the last steps whose training loss is averaged and compared
SPIKE_SPAN = 5  # steps either side of the largest difference, to tell a spike from a gap
SPIKE_FACTOR = 4  # a spike: a difference this many times the usual one around it
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
class Spread:
    """Milliseconds measured over several steps: their median and quartiles."""

    median: float
    q1: float
    q3: float
    samples: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Spread:
        """The spread of ``seconds`` (one value or more), in milliseconds.

        Raises:
            ValueError: no values.
        """
        if not seconds:
            raise ValueError("a spread needs at least one value")
        ms = [1e3 * x for x in seconds]
        if len(ms) == 1:
            return cls(ms[0], ms[0], ms[0], 1)
        q1, median, q3 = statistics.quantiles(ms, n=4, method="inclusive")
        return cls(median, q1, q3, len(ms))


@attrs.frozen
class TimeSplit:
    """Rank 0's milliseconds per step, as medians and quartiles over steps
    (warm-up steps left out). Each part is its own median, so the parts need
    not add up to the total's.

    Attributes:
        total: forward+backward plus ``optimizer.step()``, every step.
        compute: forward+backward under ``no_sync``, on the split steps.
        communication: the rest of forward+backward (hook, all-reduce,
            waiting) plus ``optimizer.step()`` outside the local AdamW
            (exchange, sync), on the split steps.
        optimizer: the local AdamW's step, every step.
    """

    total: Spread
    compute: Spread
    communication: Spread
    optimizer: Spread


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
class StepDifference:
    """The step where a run's training loss is farthest from its baseline's.

    Attributes:
        step: the step, counted from 1.
        rank: the rank whose losses differ most there.
        loss: this run's training loss there.
        baseline_loss: the baseline's.
        usual_difference: the median ``|loss - baseline's|`` on that rank
            over the ``SPIKE_SPAN`` steps either side: how far apart the two
            usually were around then.
        usual_higher: the median loss, over the same steps, of whichever of
            the two is higher at ``step``.
    """

    step: int
    rank: int
    loss: float
    baseline_loss: float
    usual_difference: float
    usual_higher: float

    @property
    def difference(self) -> float:
        return abs(self.loss - self.baseline_loss)

    @property
    def higher_is_baseline(self) -> bool:
        return self.baseline_loss > self.loss

    @property
    def spike(self) -> bool:
        """Whether the difference is one run's spike: more than ``SPIKE_FACTOR``
        times the usual difference around it, and most of it the higher
        run's own excursion above its usual loss (not the runs drifting apart)."""
        above = max(self.loss, self.baseline_loss) - self.usual_higher
        return self.difference > SPIKE_FACTOR * self.usual_difference and above > (
            self.difference / 2
        )


@attrs.frozen
class RunSummary:
    """One run's numbers, as the report and the figure show them.

    Attributes:
        train_loss: the mean training loss of the last ``train_window``
            steps, over every rank (each trains on its slice of the batch).
        train_window: how many of the last steps ``train_loss`` averages.
        train_gap: ``train_loss`` relative to the baseline's over the same
            steps (``None``: no baseline).
        losses_equal: whether every step's training loss on every rank equals
            the baseline's bitwise (``None``: no baseline).
        worst_step: where the training losses differ most from the
            baseline's (``None``: no baseline).
    """

    spec: RunSpec
    held_out: tuple[tuple[int, float], ...]
    train_loss: float
    train_window: int
    train_gap: float | None
    losses_equal: bool | None
    worst_step: StepDifference | None
    gap: Gap | None
    memory: tuple[Mapping[str, int], ...]  # per rank
    sent: Sent
    time: TimeSplit | None  # None: no step was split (too few steps)
    identical: bool  # every rank's parameters bitwise equal at every evaluation

    @property
    def final_held_out(self) -> float:
        return self.held_out[-1][1]

    @property
    def max_loss_difference(self) -> float | None:
        """The largest ``|training loss - baseline's|``, every step and rank."""
        return None if self.worst_step is None else self.worst_step.difference


def _after_warmup(xs: Sequence[float], steps: Sequence[int] | None = None) -> list[float]:
    """``xs`` without those of the first ``WARMUP_STEPS`` steps (``steps``:
    each value's step, default its index), unless that leaves none."""
    at = range(len(xs)) if steps is None else steps
    kept = [x for x, step in zip(xs, at, strict=True) if step >= WARMUP_STEPS]
    return kept or list(xs)


def time_split(m: Measured) -> TimeSplit | None:
    """Milliseconds per step, median and quartiles: the step, compute,
    communication (in backward and in the optimizer step), the local
    optimizer step (``None`` if no step was split)."""
    if not m.compute:
        return None
    split = [step for step, _ in m.compute]
    compute = [c for _, c in m.compute]
    communication = [
        max(0.0, m.forward_backward[step] - c) + m.optimizer_step[step] - m.local_step[step]
        for step, c in m.compute
    ]
    totals = [f + s for f, s in zip(m.forward_backward, m.optimizer_step, strict=True)]
    return TimeSplit(
        total=Spread.of(_after_warmup(totals)),
        compute=Spread.of(_after_warmup(compute, split)),
        communication=Spread.of(_after_warmup(communication, split)),
        optimizer=Spread.of(_after_warmup(m.local_step)),
    )


def window_mean(losses: Sequence[Sequence[float]], window: int) -> float:
    """The mean training loss of the last ``window`` steps, over every rank's ``losses``."""
    return statistics.fmean(x for rank in losses for x in rank[-window:])


def worst_step(mine: Sequence[Sequence[float]], base: Sequence[Sequence[float]]) -> StepDifference:
    """Where ``mine`` (per rank, per step) differs most from ``base`` (the
    first such step), and how the two compared around it.

    Raises:
        ValueError: no steps, or ``mine`` and ``base`` of different lengths.
    """
    if [len(m) for m in mine] != [len(b) for b in base]:
        raise ValueError("a run and its baseline must have as many ranks and steps")
    rank, step = max(
        ((r, i) for r, ms in enumerate(mine) for i in range(len(ms))),
        key=lambda at: abs(mine[at[0]][at[1]] - base[at[0]][at[1]]),
    )
    ms, bs = mine[rank], base[rank]
    higher = bs if bs[step] > ms[step] else ms
    around = [
        i
        for i in range(max(0, step - SPIKE_SPAN), min(len(ms), step + SPIKE_SPAN + 1))
        if i != step
    ] or [step]
    return StepDifference(
        step=step + 1,
        rank=rank,
        loss=ms[step],
        baseline_loss=bs[step],
        usual_difference=statistics.median(abs(ms[i] - bs[i]) for i in around),
        usual_higher=statistics.median(higher[i] for i in around),
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


def summarize(
    results: Results, specs: Sequence[RunSpec], train_window: int = TRAIN_WINDOW
) -> tuple[RunSummary, ...]:
    """One summary per run, in ``specs`` order; training losses compared over
    the last ``train_window`` steps (all of them, if fewer).

    Raises:
        KeyError: a run missing from some rank's results.
    """
    world_size = len(results)
    finals = {s.key: results[0][s.key].held_out[-1][1] for s in specs}
    losses = {s.key: [r[s.key].losses for r in results] for s in specs}
    window = max(1, min(train_window, len(results[0][specs[0].key].losses)))
    windowed = {key: window_mean(ls, window) for key, ls in losses.items()}
    out = []
    for spec in specs:
        mine = [r[spec.key] for r in results]
        gap = train_gap = equal = worst = None
        if spec.baseline is not None:
            base = losses[spec.baseline]
            equal = losses[spec.key] == base
            worst = worst_step(losses[spec.key], base)
            gap = _gap(spec, finals[spec.key], finals[spec.baseline])
            train_gap = (windowed[spec.key] - windowed[spec.baseline]) / windowed[spec.baseline]
        out.append(
            RunSummary(
                spec=spec,
                held_out=mine[0].held_out,
                train_loss=windowed[spec.key],
                train_window=window,
                train_gap=train_gap,
                losses_equal=equal,
                worst_step=worst,
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
