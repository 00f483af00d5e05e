"""Dynamic loss scaling for fp16, as a state machine.

An fp16 loss is multiplied by a scale before backward so that small
gradients do not flush to zero; a step whose gradients overflowed is skipped
and the scale backs off, and after enough finite steps in a row it grows.
:func:`update_loss_scale` is that schedule, with ``torch.amp.GradScaler``'s
defaults (:class:`LossScaleConfig`); the tensors it scales stay in the
adapter (``zerofn_torch.LossScaler``).
"""

from __future__ import annotations

import math

import attrs

from zerofn.validators import int_at_least

__all__ = ["LossScaleConfig", "LossScaleState", "init_loss_scale", "update_loss_scale"]


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite positive number, got {value}")


def _above_one(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 1.0 or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number above 1, got {value}")


def _below_one(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must lie strictly between 0 and 1, got {value}")


@attrs.frozen
class LossScaleConfig:
    """Dynamic loss scaling, with ``torch.amp.GradScaler``'s defaults.

    Attributes:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by this after
            ``growth_interval`` steps in a row with finite gradients.
        backoff_factor: the scale is multiplied by this on a step whose
            gradients are not finite (that step is skipped).
        growth_interval: finite steps in a row before the scale grows.
    """

    init_scale: float = attrs.field(default=2.0**16, validator=_positive)
    growth_factor: float = attrs.field(default=2.0, validator=_above_one)
    backoff_factor: float = attrs.field(default=0.5, validator=_below_one)
    growth_interval: int = attrs.field(default=2000, validator=int_at_least(1))


@attrs.frozen
class LossScaleState:
    """Where dynamic loss scaling stands.

    Attributes:
        scale: the factor the loss is multiplied by.
        growth_tracker: finite steps in a row since the scale last changed.
    """

    scale: float = attrs.field(validator=_positive)
    growth_tracker: int = attrs.field(default=0)


def init_loss_scale(config: LossScaleConfig) -> LossScaleState:
    """The state before the first step."""
    return LossScaleState(config.init_scale)


def update_loss_scale(
    config: LossScaleConfig, state: LossScaleState, found_nonfinite: bool
) -> LossScaleState:
    """The scale after a step.

    Args:
        config: the schedule.
        state: the scale the step's loss was multiplied by.
        found_nonfinite: whether any rank's gradients held inf or nan (the
            step was skipped).

    Returns:
        Backed off after a skipped step; grown after ``growth_interval``
        finite steps in a row; otherwise the same scale, one step further.
    """
    if found_nonfinite:
        return LossScaleState(state.scale * config.backoff_factor, 0)
    if state.growth_tracker + 1 >= config.growth_interval:
        return LossScaleState(state.scale * config.growth_factor, 0)
    return LossScaleState(state.scale, state.growth_tracker + 1)
