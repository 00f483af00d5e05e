"""What ``tc`` is told to shape a link: rates and delays read as ``tc`` reads
them, and the token bucket chosen for a rate. Pure: nothing here runs a
command.
"""

from __future__ import annotations

import math
import re

import attrs

__all__ = ["Shaping", "parse_delay", "parse_rate", "plan_shaping"]

# The loopback's MTU is 64 KiB, and TCP hands the veth pair 64 KiB
# segmentation-offload packets: the largest packet either qdisc sees.
_MAX_PACKET = 64 * 1024

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_DELAY_UNITS = {"us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 10**6, "sec": 10**6}
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]+)\s*")


def parse_rate(rate: str) -> int:
    """Bits per second of a ``tc`` rate such as ``"1gbit"`` or ``"100mbit"``.

    Args:
        rate: a number and one of ``tc``'s units: ``bit``, ``kbit``,
            ``mbit``, ``gbit``, ``tbit`` (bits per second, powers of 1000) or
            ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps`` (bytes per
            second, as ``tc`` reads them); case does not matter.

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: not a rate, or below 8 kbit/s.
    """
    match = _QUANTITY.fullmatch(rate)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _RATE_UNITS:
        raise ValueError(
            f"rate {rate!r}: expected a number and one of {', '.join(_RATE_UNITS)} "
            "(e.g. '1gbit', '100mbit')"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit: no useful link is that slow")
    return bits


def parse_delay(delay: str) -> int:
    """Microseconds of a ``tc`` time such as ``"20ms"``.

    Args:
        delay: a number and one of ``us``, ``ms``, ``s`` (also ``usec``,
            ``msec``, ``sec``).

    Returns:
        The delay in whole microseconds.

    Raises:
        ValueError: not a time, or not positive.
    """
    match = _QUANTITY.fullmatch(delay)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _DELAY_UNITS:
        raise ValueError(f"delay {delay!r}: expected a number and one of us, ms, s (e.g. '20ms')")
    micros = round(float(match.group(1)) * _DELAY_UNITS[unit])
    if micros <= 0:
        raise ValueError(f"delay {delay!r} must be positive")
    return micros


@attrs.frozen
class Shaping:
    """How an interface's egress is shaped: what ``tc`` is told.

    Attributes:
        bits_per_second: the token bucket's rate.
        burst_bytes: the bucket's size: bytes an idle link passes at once.
        limit_bytes: bytes the token bucket's queue holds before it drops.
    """

    bits_per_second: int
    burst_bytes: int
    limit_bytes: int

    def seconds(self, nbytes: int) -> float:
        """Seconds ``nbytes`` take at the rate (headers and burst not counted).

        Args:
            nbytes: bytes to send.

        Returns:
            ``nbytes * 8 / bits_per_second``.
        """
        return nbytes * 8 / self.bits_per_second

    def tc_commands(self, interface: str) -> list[list[str]]:
        """The ``tc`` command lines that shape ``interface``'s egress.

        Args:
            interface: the interface, inside the namespace the commands run in.

        Returns:
            One ``tc qdisc add`` per qdisc, root first (one: the ``tbf``).
        """
        return [
            [
                *("tc", "qdisc", "add", "dev", interface, "root", "handle", "1:", "tbf"),
                *("rate", f"{self.bits_per_second}bit", "burst", str(self.burst_bytes)),
                *("limit", str(self.limit_bytes)),
            ]
        ]


def plan_shaping(rate: str) -> Shaping:
    """Choose the token bucket's parameters for a link of ``rate``.

    - burst: the larger of two 64 KiB packets and 1 ms at the rate. It must
      hold the largest packet (the loopback's MTU and TCP's offload packets
      are 64 KiB; a bigger packet would be dropped), and a bucket that fills
      in 1 ms keeps the timer work per packet low at 10 Gbit/s while an idle
      link gets at most 1 ms of traffic ahead of the rate.
    - limit (the queue): the larger of 4 MiB and 50 ms at the rate. A drop
      costs TCP a retransmission (on the loopback hundreds of milliseconds),
      far more than the rate; a queue only delays. TCP keeps about two
      packets per connection queued, so 4 MiB lets 32 connections of
      64 KiB packets queue without a drop (measured: a 10 ms queue lost 320
      packets and a fifth of the rate to 16 connections at 100 Mbit/s), and
      50 ms covers faster senders.

    Args:
        rate: see :func:`parse_rate`.

    Returns:
        The shaping, for :meth:`Shaping.tc_commands`.

    Raises:
        ValueError: a malformed rate.
    """
    bits = parse_rate(rate)
    per_second = bits / 8
    burst = max(2 * _MAX_PACKET, math.ceil(per_second / 1000))
    limit = max(4 * 1024 * 1024, math.ceil(per_second * 0.050))
    return Shaping(bits, burst, limit)
