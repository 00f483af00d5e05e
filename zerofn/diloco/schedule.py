"""When each fragment syncs and when its result is applied: pure functions of
the inner step count.

Steps are counted as *completed* inner steps: ``t = 1`` is the moment right
after the first inner step. With ``H = sync_every`` and ``P = fragments``
the fragments take turns every ``H / P`` steps, fragment ``p`` first at
``t = (p + 1) * H / P`` and then every ``H`` steps, so fragment ``P - 1``
syncs at ``t = H, 2H, ...`` (with one fragment: DiLoCo's every ``H`` steps).
A sync that starts at ``t`` is applied at ``t + delay``.
"""

from __future__ import annotations

from zerofn.diloco.config import DiLoCoConfig

__all__ = ["applied_at", "first_sync", "fragment_synced_at"]


def _check_step(t: int) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"an inner step count must be an int >= 0, got {t!r}")


def fragment_synced_at(config: DiLoCoConfig, t: int) -> int | None:
    """The fragment whose sync starts once ``t`` inner steps are done.

    Args:
        config: the run's configuration.
        t: completed inner steps (0: none yet).

    Returns:
        The fragment's index, or ``None`` when no sync starts at ``t``.

    Raises:
        ValueError: ``t`` is not an int >= 0.
    """
    _check_step(t)
    if t == 0:
        return None
    phase = t % config.sync_every
    if phase % config.stride:
        return None
    return (phase // config.stride - 1) % config.fragments


def first_sync(config: DiLoCoConfig, fragment: int) -> int:
    """The completed-step count at which ``fragment`` syncs for the first time.

    Raises:
        ValueError: ``fragment`` is not one of the configuration's.
    """
    if not 0 <= fragment < config.fragments:
        raise ValueError(f"fragment {fragment} is not in 0..{config.fragments - 1}")
    return (fragment + 1) * config.stride


def applied_at(config: DiLoCoConfig, started: int) -> int:
    """The completed-step count at which a sync started at ``started`` is applied."""
    _check_step(started)
    return started + config.delay
