"""Shaped links on one machine: network namespaces, ``tc``, a veth pair, a delay line.

For benchmarks and multi-node tests that must see what a byte costs on a real
link. :func:`shaped_loopback` makes one network namespace whose loopback is
shaped; :func:`two_nodes` makes two namespaces ("nodes") joined by a veth
pair shaped in each direction, each node keeping its own unshaped loopback
for the traffic inside it. Both are context managers that always remove
what they made, also when the body raises or is interrupted::

    from zerofn_torch.runtime.links import shaped_loopback

    with shaped_loopback("1gbit") as node:
        subprocess.run(node.command([sys.executable, "bench.py"]), env=node.env(), check=True)

Everything runs through ``ip`` and ``tc`` (iproute2) and needs root. No
address used here exists outside the namespaces this module creates: the
namespaces have no route out and no interface but their loopback and their
end of the veth pair, so no traffic can leave them. Where namespaces cannot
be made, :func:`unavailable_reason` says why and the context managers raise
:class:`LinkUnavailable` with that reason, before creating anything.

How the links are shaped (:func:`plan_shaping`):

- rate: a token bucket (``tbf``) as the egress qdisc of the interface. On
  the loopback, every packet (data and acknowledgements, both directions)
  passes the one qdisc, so the link is half duplex; the veth pair has one
  qdisc per end, so each direction has the full rate.
- delay (optional, :func:`two_nodes` only): the nodes are joined by a
  TUN device each instead of the veth pair, and a
  :class:`~zerofn_torch.runtime.delay_line.DelayLine` (a thread of the
  process that made the link) carries every packet from one to the other,
  holding it for ``delay``: a round trip takes twice ``delay``. It works
  on kernels built without ``netem`` (the machines this project's CI runs
  on are), the same way on every machine; :func:`unavailable_reason` with
  ``delay=True`` checks that a TUN device can be made.

Processes inside a namespace must tell gloo which interface to use
(``GLOO_SOCKET_IFNAME``): gloo otherwise resolves the hostname, which does
not resolve inside. :meth:`Node.env` sets it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from zerofn_torch.runtime.delay_line import DelayLine, open_tun

__all__ = [
    "LinkBytes",
    "LinkUnavailable",
    "Node",
    "Shaping",
    "TwoNodes",
    "netns_names",
    "parse_delay",
    "parse_rate",
    "plan_shaping",
    "shaped_loopback",
    "two_nodes",
    "unavailable_reason",
]

NAME_PREFIX = "zerofn-"
"""Every namespace this module creates is named ``zerofn-<pid>-<n>...``."""

SUBNET_PREFIX_LENGTH = 30
"""The veth pair's addresses: a /30 that exists only inside the two namespaces."""

NODE_ADDRESSES = ("10.87.0.1", "10.87.0.2")
"""Node ``a``'s and node ``b``'s address on the veth pair (private, namespace-only)."""

NODE_INTERFACES = ("veth-a", "veth-b")
"""Node ``a``'s and node ``b``'s end of the veth pair."""

DELAYED_INTERFACES = ("tun-a", "tun-b")
"""Node ``a``'s and node ``b``'s end of a delayed link (TUN devices)."""

# The loopback's MTU is 64 KiB, and TCP hands the veth pair 64 KiB
# segmentation-offload packets: the largest packet either qdisc sees.
_MAX_PACKET = 64 * 1024

# One process's counter for unique names; the pid keeps processes apart.
_counter = itertools.count()

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


class LinkUnavailable(RuntimeError):
    """Namespaces or shaped links cannot be made here; the message says why."""


# ----- what tc is told (pure) ---------------------------------------------------------


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


# ----- running ip and tc -----------------------------------------------------------------


class _CommandFailed(RuntimeError):
    """``ip`` or ``tc`` failed; ``said`` is what it wrote to stderr."""

    def __init__(self, argv: Sequence[str], code: int, said: str) -> None:
        super().__init__(f"`{' '.join(argv)}` failed (exit {code}): {said}")
        self.said = said


def _run(argv: Sequence[str], *, timeout: float = 30.0) -> str:
    """Run ``argv``; its stdout, or a RuntimeError with its stderr."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise _CommandFailed(argv, done.returncode, done.stderr.strip() or done.stdout.strip())
    return done.stdout


def _in(name: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", name, *argv]


def _fresh_name(kind: str = "") -> str:
    return f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}{kind}"


def netns_names() -> list[str]:
    """The network namespaces ``ip netns list`` shows (all, not only this module's).

    Returns:
        Their names, in the listed order.

    Raises:
        RuntimeError: ``ip netns list`` failed.
    """
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _shape(name: str, interface: str, shaping: Shaping) -> None:
    for argv in shaping.tc_commands(interface):
        try:
            _run(_in(name, argv))
        except _CommandFailed as error:
            if "kind is unknown" in error.said:
                kind = argv[argv.index("handle") + 2]
                raise LinkUnavailable(
                    f"this kernel has no {kind} qdisc (CONFIG_NET_SCH_{kind.upper()}): "
                    f"`{' '.join(argv)}` says {error.said!r}"
                ) from error
            raise


def _probe(name: str, delay: bool) -> str | None:
    """Make the probe namespace and what the links need inside it; a reason or None."""
    try:
        _run(["ip", "netns", "add", name])
    except _CommandFailed as error:
        return f"cannot create a network namespace: `ip netns add` says {error.said!r}"
    _run(["ip", "-n", name, "link", "set", "lo", "up"])
    steps = [("no veth pairs (CONFIG_VETH)", ["ip", "link", "add", "p0", "type", "veth"])]
    for argv in plan_shaping("1gbit").tc_commands("lo"):
        kind = argv[argv.index("handle") + 2]
        steps.append((f"no {kind} qdisc (CONFIG_NET_SCH_{kind.upper()})", argv))
    for why, argv in steps:
        try:
            _run(_in(name, argv))
        except _CommandFailed as error:  # the same sentence whatever the probe's name
            return f"this kernel has {why}: `{' '.join(argv)}` says {error.said!r}"
    if delay:
        try:
            os.close(open_tun(name, "probe"))
        except OSError as error:
            return f"a delayed link needs TUN devices (CONFIG_TUN, /dev/net/tun): {error}"
    return None


def unavailable_reason(*, delay: bool = False) -> str | None:
    """Why shaped links cannot be made here, or ``None`` if they can.

    Checks, in order and afresh on every call (nothing is cached): Linux,
    root, ``ip`` and ``tc`` on ``PATH``; then creates a probe namespace,
    shapes its loopback, adds a veth pair (and with ``delay`` a TUN device)
    inside it, and removes it (a few milliseconds).

    Args:
        delay: also make a TUN device (links with a delay).

    Returns:
        A sentence saying what is missing, or ``None``.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root; this process runs as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH: install iproute2 (apt-get install iproute2)"
    probe = _fresh_name("-probe")
    try:
        return _probe(probe, delay)
    except RuntimeError as error:
        return f"probing network namespaces failed: {error}"
    finally:
        with contextlib.suppress(RuntimeError):
            if probe in netns_names():
                _run(["ip", "netns", "del", probe])


def _require(delay: bool) -> None:
    reason = unavailable_reason(delay=delay)
    if reason is not None:
        raise LinkUnavailable(reason)


@contextlib.contextmanager
def _namespaces() -> Iterator[list[str]]:
    """Collect namespace names as they are created; delete them all on exit.

    Every name is deleted even if deleting another fails or is interrupted;
    then ``ip netns list`` must show none of them. A failure to remove is
    raised unless the body already raised (whose error then propagates).
    """
    made: list[str] = []
    failed = False
    try:
        yield made
    except BaseException:
        failed = True
        raise
    finally:
        interrupted: BaseException | None = None
        errors: list[str] = []
        for name in reversed(made):
            try:
                _run(["ip", "netns", "del", name])
            except RuntimeError as error:
                errors.append(str(error))
            except BaseException as error:  # KeyboardInterrupt: finish removing, then raise
                interrupted = interrupted or error
        left = [name for name in netns_names() if name in made] if made else []
        if interrupted is not None:
            raise interrupted
        if left:
            message = f"network namespaces {left} are still listed after removal: {errors}"
            if not failed:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _add(made: list[str], name: str) -> None:
    if name in netns_names():  # never adopt (and later delete) a namespace made elsewhere
        raise RuntimeError(f"network namespace {name!r} already exists")
    made.append(name)  # before it exists: an interrupt right after `add` still removes it
    _run(["ip", "netns", "add", name])
    _run(["ip", "-n", name, "link", "set", "lo", "up"])


# ----- the records -----------------------------------------------------------------------


@attrs.frozen
class LinkBytes:
    """Bytes sent over the veth pair, per direction (interface counters).

    The counters hold what the interfaces transmitted: payload, TCP/IP and
    Ethernet headers (one set per offload packet of up to 64 KiB), ARP.

    Attributes:
        a_to_b: bytes node ``a``'s end transmitted.
        b_to_a: bytes node ``b``'s end transmitted.
    """

    a_to_b: int
    b_to_a: int

    @property
    def total(self) -> int:
        """Both directions together."""
        return self.a_to_b + self.b_to_a

    def since(self, earlier: LinkBytes) -> LinkBytes:
        """The bytes sent after ``earlier`` was read.

        Args:
            earlier: a previous reading of the same link.

        Returns:
            The difference, per direction.
        """
        return LinkBytes(self.a_to_b - earlier.a_to_b, self.b_to_a - earlier.b_to_a)


@attrs.frozen
class Node:
    """A network namespace that processes run in.

    Attributes:
        name: the namespace's name (``ip netns``).
        interface: the interface its processes talk over (``lo`` for
            :func:`shaped_loopback`, its veth end for :func:`two_nodes`).
        address: its address on that interface.
        shaping: how that interface's egress is shaped.
    """

    name: str
    interface: str
    address: str
    shaping: Shaping

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace.

        Args:
            argv: the command line (its program is looked up on ``PATH``).

        Returns:
            ``["ip", "netns", "exec", name, *argv]``.
        """
        return _in(self.name, argv)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for processes inside: ``base`` with
        ``GLOO_SOCKET_IFNAME`` set to :attr:`interface`.

        Args:
            base: the environment to start from (default: this process's).

        Returns:
            A new dict.
        """
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = self.interface
        return env

    def tx_bytes(self, interface: str | None = None) -> int:
        """Bytes an interface of this namespace has transmitted.

        Args:
            interface: default :attr:`interface`; ``"lo"`` counts the traffic
                inside the namespace.

        Returns:
            The interface's ``tx_bytes`` counter.

        Raises:
            RuntimeError: ``ip`` failed (the namespace is gone, say).
        """
        dev = self.interface if interface is None else interface
        out = _run(["ip", "-n", self.name, "-s", "-j", "link", "show", "dev", dev])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def qdiscs(self, interface: str | None = None) -> list[dict[str, Any]]:
        """The qdiscs on an interface of this namespace, as ``tc -j`` gives them.

        Args:
            interface: default :attr:`interface`.

        Returns:
            One dict per qdisc (``"kind"``, ``"options"`` with ``"rate"`` in
            bytes per second for ``tbf``, ...).

        Raises:
            RuntimeError: ``tc`` failed.
        """
        dev = self.interface if interface is None else interface
        out = _run(_in(self.name, ["tc", "-j", "qdisc", "show", "dev", dev]))
        shown: list[dict[str, Any]] = json.loads(out)
        return shown


@attrs.frozen
class TwoNodes:
    """Two namespaces joined by a shaped link.

    Attributes:
        a: the first node (address ``10.87.0.1`` on ``veth-a``, or ``tun-a``
            with a delay).
        b: the second node (address ``10.87.0.2`` on ``veth-b`` or ``tun-b``).
        delay_us: each direction's one-way delay, or ``None`` (no delay line).
    """

    a: Node
    b: Node
    delay_us: int | None = None

    @property
    def nodes(self) -> tuple[Node, Node]:
        """``(a, b)``."""
        return (self.a, self.b)

    def link_bytes(self) -> LinkBytes:
        """Read the bytes each end of the link has sent so far.

        Returns:
            The counters; subtract an earlier reading with :meth:`LinkBytes.since`.

        Raises:
            RuntimeError: a namespace is gone.
        """
        return LinkBytes(self.a.tx_bytes(), self.b.tx_bytes())


# ----- the context managers --------------------------------------------------------------


@contextlib.contextmanager
def shaped_loopback(rate: str, *, name: str | None = None) -> Iterator[Node]:
    """A network namespace whose loopback is shaped to ``rate``.

    Processes run inside with :meth:`Node.command` and :meth:`Node.env`
    reach each other on ``127.0.0.1``; all their traffic shares the one
    shaped queue (half duplex).

    Args:
        rate: the loopback's rate, e.g. ``"1gbit"`` (see :func:`parse_rate`).
        name: the namespace's name (default ``zerofn-<pid>-<n>``, unique).

    Yields:
        The namespace, as a :class:`Node` on ``lo`` at ``127.0.0.1``.

    Raises:
        ValueError: a malformed rate (before anything is made).
        LinkUnavailable: namespaces cannot be made here; nothing was created.
        RuntimeError: ``ip`` or ``tc`` failed, or the namespace could not be
            removed.
    """
    shaping = plan_shaping(rate)
    _require(delay=False)
    with _namespaces() as made:
        ns = name if name is not None else _fresh_name()
        _add(made, ns)
        _shape(ns, "lo", shaping)
        yield Node(ns, "lo", "127.0.0.1", shaping)


@contextlib.contextmanager
def two_nodes(rate: str, *, delay: str | None = None) -> Iterator[TwoNodes]:
    """Two namespaces joined by a link whose each direction is shaped to ``rate``.

    Node ``a`` has ``10.87.0.1/30``, node ``b`` ``10.87.0.2/30``, on a veth
    pair (``veth-a``, ``veth-b``), or with a delay on two TUN devices
    (``tun-a``, ``tun-b``) joined by a delay line; the /30 is their only
    route, so traffic cannot leave them. Each node's loopback is up and
    unshaped: traffic between processes of one node (also to the node's
    own address, which the kernel delivers over the loopback) does not
    cross the link. IPv6 is not configured on the link, so the counters see
    only what processes send (and ARP on the veth pair).

    Args:
        rate: each direction's rate (see :func:`parse_rate`).
        delay: each direction's one-way delay, e.g. ``"20ms"`` (see
            :func:`parse_delay`), or ``None``.

    Yields:
        The two nodes; :meth:`TwoNodes.link_bytes` reads the link's counters.

    Raises:
        ValueError: a malformed rate or delay (before anything is made).
        LinkUnavailable: namespaces (or TUN devices, with a delay) cannot be
            made here; nothing was created.
        RuntimeError: ``ip`` or ``tc`` failed, a namespace could not be
            removed, or the delay line stopped while the body ran.
    """
    shaping = plan_shaping(rate)
    delay_us = None if delay is None else parse_delay(delay)
    _require(delay=delay is not None)
    with _namespaces() as made, contextlib.ExitStack() as ends:
        base = _fresh_name()
        names = (f"{base}-a", f"{base}-b")
        for ns in names:
            _add(made, ns)
        if delay_us is None:
            interfaces = NODE_INTERFACES
            # Created straight inside the namespaces: no interface ever exists
            # outside them. Deleting either namespace deletes the pair.
            _run(
                [
                    *("ip", "link", "add", interfaces[0], "netns", names[0], "type", "veth"),
                    *("peer", "name", interfaces[1], "netns", names[1]),
                ]
            )
        else:
            interfaces = DELAYED_INTERFACES
            fds = []
            for ns, dev in zip(names, interfaces, strict=True):
                fds.append(open_tun(ns, dev))
                ends.callback(os.close, fds[-1])  # after the line stops, before the namespaces go
        nodes = []
        for ns, dev, address in zip(names, interfaces, NODE_ADDRESSES, strict=True):
            _run(["ip", "-n", ns, "link", "set", dev, "addrgenmode", "none"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/{SUBNET_PREFIX_LENGTH}", "dev", dev])
            _shape(ns, dev, shaping)
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            nodes.append(Node(ns, dev, address, shaping))
        pair = TwoNodes(nodes[0], nodes[1], delay_us)
        if delay_us is None:
            yield pair
        else:
            with DelayLine((fds[0], fds[1]), delay_us / 1e6).carrying():
                yield pair
