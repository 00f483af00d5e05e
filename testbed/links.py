"""Shaped links on one machine: network namespaces, ``tc``, a veth pair, a delay line.

The repository's testbed for benchmarks and multi-node tests that must see
what a byte costs on a real link; it is not part of the library. Run from the
repository's root (or with it on ``sys.path``), it imports as ``testbed``.
:func:`shaped_loopback` makes one network namespace whose loopback is
shaped; :func:`two_nodes` makes two namespaces ("nodes") joined by a veth
pair shaped in each direction, each node keeping its own unshaped loopback
for the traffic inside it. Both are context managers that always remove
what they made, also when the body raises or is interrupted::

    from testbed.links import shaped_loopback

    with shaped_loopback("1gbit") as node:
        subprocess.run(node.command([sys.executable, "bench.py"]), env=node.env(), check=True)

Everything runs through ``ip`` and ``tc`` (iproute2, :mod:`testbed.namespaces`)
and needs root. No address used here exists outside the namespaces this
module creates: the namespaces have no route out and no interface but their
loopback and their end of the veth pair, so no traffic can leave them. Where
namespaces cannot be made, :func:`unavailable_reason` says why and the
context managers raise :class:`LinkUnavailable` with that reason, before
creating anything.

How the links are shaped (:func:`plan_shaping`, :mod:`testbed.shaping`):

- rate: a token bucket (``tbf``) as the egress qdisc of the interface. On
  the loopback, every packet (data and acknowledgements, both directions)
  passes the one qdisc, so the link is half duplex; the veth pair has one
  qdisc per end, so each direction has the full rate.
- delay (optional, :func:`two_nodes` only): the nodes are joined by a
  TUN device each instead of the veth pair, and a
  :class:`~testbed.delay_line.DelayLine` (a thread of the
  process that made the link) carries every packet from one to the other,
  holding it for ``delay``: a round trip takes twice ``delay``. It works
  on kernels built without ``netem`` (the machines this project's CI runs
  on are), the same way on every machine; :func:`unavailable_reason` with
  ``delay=True`` checks that a TUN device can be made.

Processes inside a namespace must tell gloo which interface to use
(``GLOO_SOCKET_IFNAME``): gloo otherwise resolves the hostname, which does
not resolve inside. :meth:`Node.env` sets it.

This module is the testbed's one entry: it also offers the parsers, the
shaping plan and the checks it is built from.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from testbed.delay_line import DelayLine, open_tun
from testbed.namespaces import (
    LinkUnavailable,
    add_namespace,
    fresh_name,
    in_namespace,
    netns_names,
    removed_on_exit,
    require,
    run,
    shape,
    unavailable_reason,
)
from testbed.shaping import Shaping, parse_delay, parse_rate, plan_shaping

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

SUBNET_PREFIX_LENGTH = 30
"""The veth pair's addresses: a /30 that exists only inside the two namespaces."""

NODE_ADDRESSES = ("10.87.0.1", "10.87.0.2")
"""Node ``a``'s and node ``b``'s address on the veth pair (private, namespace-only)."""

NODE_INTERFACES = ("veth-a", "veth-b")
"""Node ``a``'s and node ``b``'s end of the veth pair."""

DELAYED_INTERFACES = ("tun-a", "tun-b")
"""Node ``a``'s and node ``b``'s end of a delayed link (TUN devices)."""


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
        return in_namespace(self.name, argv)

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
        out = run(["ip", "-n", self.name, "-s", "-j", "link", "show", "dev", dev])
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
        out = run(in_namespace(self.name, ["tc", "-j", "qdisc", "show", "dev", dev]))
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
    require(delay=False)
    with removed_on_exit() as made:
        ns = name if name is not None else fresh_name()
        add_namespace(made, ns)
        shape(ns, "lo", shaping)
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
    require(delay=delay is not None)
    with removed_on_exit() as made, contextlib.ExitStack() as ends:
        base = fresh_name()
        names = (f"{base}-a", f"{base}-b")
        for ns in names:
            add_namespace(made, ns)
        if delay_us is None:
            interfaces = NODE_INTERFACES
            # Created straight inside the namespaces: no interface ever exists
            # outside them. Deleting either namespace deletes the pair.
            run(
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
            run(["ip", "-n", ns, "link", "set", dev, "addrgenmode", "none"])
            run(["ip", "-n", ns, "addr", "add", f"{address}/{SUBNET_PREFIX_LENGTH}", "dev", dev])
            shape(ns, dev, shaping)
            run(["ip", "-n", ns, "link", "set", dev, "up"])
            nodes.append(Node(ns, dev, address, shaping))
        pair = TwoNodes(nodes[0], nodes[1], delay_us)
        if delay_us is None:
            yield pair
        else:
            with DelayLine((fds[0], fds[1]), delay_us / 1e6).carrying():
                yield pair
