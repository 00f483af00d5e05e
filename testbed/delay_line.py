"""A delay line between two network namespaces: a WAN's one-way delay, in user space.

Kernels built without ``netem`` cannot delay packets in a qdisc. This module
does what netem would: each namespace gets a TUN device (a network interface
whose packets a process reads and writes), and a thread of this process
reads every packet one namespace sends, holds it for the delay, and writes
it into the other. The rate stays the kernel's (a ``tbf`` on each TUN
device's egress, so a packet is serialized at the rate and then travels for
the delay, as on a real link); the line adds the delay alone.

The TUN devices carry TCP's segmentation-offload packets whole (``virtio``
headers, ``IFF_VNET_HDR``): TCP still segments at the 1500-byte MTU, so its
congestion window grows as on a real WAN, while the line moves up to 64 KiB
per read. Measured on a 2-core machine: the line adds about 0.15 ms per
direction to the delay it is given and carries 1 Gbit/s; it is meant for
delays of a millisecond and more.

Only :mod:`testbed.links` uses this; its ``two_nodes(rate, delay=...)`` makes
the namespaces, the devices' addresses and their shaping.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import os
import select
import struct
import threading
import time
from collections.abc import Iterator

__all__ = ["NETNS_DIR", "DelayLine", "open_tun"]

# <linux/if_tun.h> and <sched.h>.
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM_TSO4_TSO6 = 0x01 | 0x02 | 0x04
_CLONE_NEWNET = 0x40000000

# A virtio header (10 bytes) and the largest offload packet (64 KiB).
_READ_SIZE = 64 * 1024 + 64

NETNS_DIR = "/var/run/netns"
"""Where ``ip netns add`` binds its namespaces, by name."""


def open_tun(namespace: str, name: str) -> int:
    """Create TUN device ``name`` inside network namespace ``namespace``.

    The device exists while the returned descriptor is open and is never
    visible outside the namespace: a short-lived thread enters the namespace,
    opens ``/dev/net/tun`` there and names the device, and exits (this
    process's other threads stay where they are).

    Args:
        namespace: a namespace ``ip netns add`` made (found in :data:`NETNS_DIR`).
        name: the device's name inside it (at most 15 characters).

    Returns:
        The device's descriptor, non-blocking; its reads and writes are whole
        IP packets after a virtio header. Close it to remove the device.

    Raises:
        OSError: the namespace cannot be entered or the device cannot be
            made (not root, no ``/dev/net/tun``, a name taken).
    """
    opened: list[int] = []
    failed: list[BaseException] = []

    def inside() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ns = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
            try:
                if libc.setns(ns, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"cannot enter namespace {namespace!r}: setns")
            finally:
                os.close(ns)
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                flags = _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), flags))
                fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM_TSO4_TSO6)
            except BaseException:
                os.close(fd)
                raise
            opened.append(fd)
        except BaseException as error:  # raised again in the caller's thread
            failed.append(error)

    thread = threading.Thread(target=inside, name=f"open-tun-{name}")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return opened[0]


class DelayLine:
    """Carries packets between two TUN devices, each held ``delay_s`` on the way.

    :meth:`carrying` runs it for the length of a ``with`` block. It owns
    neither descriptor (the caller closes them, after the block).

    Args:
        ends: the two devices' descriptors (from :func:`open_tun`).
        delay_s: the one-way delay, the same in both directions.

    Raises:
        ValueError: a negative delay, or the same descriptor twice.
    """

    def __init__(self, ends: tuple[int, int], delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s} must not be negative")
        if ends[0] == ends[1]:
            raise ValueError("a delay line joins two different devices; got one twice")
        self._ends = ends
        self._delay_s = delay_s
        self.packets = [0, 0]
        """Packets carried from ``ends[0]`` to ``ends[1]``, and back."""

    @contextlib.contextmanager
    def carrying(self) -> Iterator[DelayLine]:
        """Carry packets until the block ends.

        Yields:
            This line.

        Raises:
            RuntimeError: the line stopped carrying while the block ran (a
                device gone, say); raised when the block ends without an
                error of its own.
        """
        wake_read, wake_write = os.pipe()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self._forward(wake_read)
            except BaseException as error:  # reported when the block ends
                failed.append(error)

        thread = threading.Thread(target=run, name="delay-line", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            os.write(wake_write, b"x")
            thread.join()
            os.close(wake_read)
            os.close(wake_write)
        if failed:
            raise RuntimeError(f"the delay line stopped carrying packets: {failed[0]!r}") from (
                failed[0]
            )

    def _forward(self, wake: int) -> None:
        # Packets in flight towards each end, oldest first: with one delay for
        # all, the order they arrive in is the order they become due in.
        held: tuple[collections.deque[tuple[float, bytes]], ...] = (
            collections.deque(),
            collections.deque(),
        )
        watched = [*self._ends, wake]
        while True:
            due = [queue[0][0] for queue in held if queue]
            wait = max(0.0, min(due) - time.monotonic()) if due else None
            # select, not poll: its timeout has microseconds, poll's whole milliseconds.
            readable = select.select(watched, [], [], wait)[0]
            if wake in readable:
                return
            for side, fd in enumerate(self._ends):
                if fd in readable:
                    self._take(fd, held[1 - side], side)
            now = time.monotonic()
            for side, queue in enumerate(held):
                while queue and queue[0][0] <= now:
                    os.write(self._ends[side], queue.popleft()[1])

    def _take(self, fd: int, queue: collections.deque[tuple[float, bytes]], side: int) -> None:
        due = time.monotonic() + self._delay_s
        while True:
            try:
                packet = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                return
            if not packet:  # a TUN device never reads empty; its other end is gone
                raise ConnectionError(f"descriptor {fd} reached its end")
            queue.append((due, packet))
            self.packets[side] += 1
