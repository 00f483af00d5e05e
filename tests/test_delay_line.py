"""The delay line (``testbed.delay_line``) on socket pairs, no root
needed: every packet arrives whole, in order, no sooner than the delay and
not much later; a line that cannot carry says so when it is left."""

from __future__ import annotations

import socket
import time

import pytest

from testbed.delay_line import DelayLine


def _ends() -> tuple[tuple[socket.socket, socket.socket], tuple[socket.socket, socket.socket]]:
    # SEQPACKET keeps each write one message, as a TUN device keeps each packet.
    one = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    two = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in (one[0], two[0]):
        sock.setblocking(False)
    return one, two


def test_packets_cross_whole_in_order_after_the_delay_both_ways() -> None:
    (line_a, node_a), (line_b, node_b) = _ends()
    delay = 0.030
    packets = [bytes([i]) * (100 + i) for i in range(20)]
    with DelayLine((line_a.fileno(), line_b.fileno()), delay).carrying() as line:
        sent = time.monotonic()
        for packet in packets:
            node_a.send(packet)
        node_b.send(b"back")
        node_b.settimeout(5)
        node_a.settimeout(5)
        got = [node_b.recv(1 << 16) for _ in packets]
        arrived = time.monotonic() - sent
        assert node_a.recv(1 << 16) == b"back"
    assert got == packets
    assert delay <= arrived < delay + 0.5
    assert line.packets == [len(packets), 1]
    for sock in (line_a, node_a, line_b, node_b):
        sock.close()


def test_a_line_that_cannot_deliver_raises_when_left() -> None:
    (line_a, node_a), (line_b, node_b) = _ends()
    node_b.close()  # the far end is gone: delivering there fails
    line = DelayLine((line_a.fileno(), line_b.fileno()), 0.001)
    with pytest.raises(RuntimeError, match="stopped carrying packets"), line.carrying():
        node_a.send(b"lost")
        time.sleep(0.1)
    for sock in (line_a, node_a, line_b):
        sock.close()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        DelayLine((3, 4), -1.0)
    with pytest.raises(ValueError, match="two different"):
        DelayLine((3, 3), 0.01)
