"""The shaped-link testbed (``testbed.links``): namespaces are always
removed, the shaping is really applied (a timed transfer cannot beat the
rate), two nodes reach each other over the counted veth pair and nothing
else, and where namespaces cannot be made the reason is given before
anything is created.

Tests that make namespaces skip with ``unavailable_reason()``'s sentence
where it is not None (not root, no iproute2, no namespaces).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from testbed import links
from testbed.links import LinkUnavailable, shaped_loopback, two_nodes


def _need_namespaces(*, delay: bool = False) -> None:
    reason = links.unavailable_reason(delay=delay)
    if reason is not None:
        pytest.skip(reason)


# A sender and a receiver thread in one process, through 127.0.0.1: prints the
# seconds from the first byte sent to the receiver's acknowledgement of the last.
_TRANSFER = """
import socket, sys, threading, time
n = int(sys.argv[1])
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
got = []
def receive():
    conn, _ = server.accept()
    total = 0
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        total += len(chunk)
    conn.sendall(b"k")
    got.append(total)
thread = threading.Thread(target=receive)
thread.start()
client = socket.create_connection(server.getsockname())
payload = b"x" * n
start = time.perf_counter()
client.sendall(payload)
client.shutdown(socket.SHUT_WR)
assert client.recv(1) == b"k"
elapsed = time.perf_counter() - start
thread.join()
assert got == [n], got
print(elapsed)
"""

# Node b's side of an echo: listen on its veth address, say so, echo one
# connection until the peer closes its half.
_ECHO_SERVER = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    conn.sendall(chunk)
conn.close()
"""

# Node a's side: send n bytes to node b, read them all back; print the seconds.
_ECHO_CLIENT = """
import socket, sys, threading, time
address, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((address, port), timeout=20)
payload = b"y" * n
start = time.perf_counter()
def send():
    conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
sender = threading.Thread(target=send)
sender.start()
back = 0
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    back += len(chunk)
elapsed = time.perf_counter() - start
sender.join()
assert back == n, (back, n)
print(elapsed)
"""


def _echoed(pair: links.TwoNodes, client: str, port: int, arg: int) -> float:
    """Run an echo server on node b and ``client`` on node a (``address port
    arg``); the seconds the client prints."""
    b = pair.b
    server = subprocess.Popen(
        b.command([sys.executable, "-c", _ECHO_SERVER, b.address, str(port)]),
        env=b.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        seconds = float(_python(pair.a, client, b.address, port, arg))
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return seconds


def _python(node: links.Node, code: str, *args: object, timeout: float = 30.0) -> str:
    argv = node.command([sys.executable, "-c", code, *map(str, args)])
    done = subprocess.run(argv, env=node.env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


# ----- without namespaces: what tc is told --------------------------------------------


def test_rates_and_delays_parse_as_tc_reads_them() -> None:
    assert links.parse_rate("1gbit") == 10**9
    assert links.parse_rate("100Mbit") == 10**8
    assert links.parse_rate("2.5gbit") == 2_500_000_000
    assert links.parse_rate("125mbps") == 10**9  # bytes per second, as tc reads "bps"
    assert links.parse_delay("20ms") == 20_000
    assert links.parse_delay("1.5s") == 1_500_000
    for bad in ["fast", "1 gigabit", "-1gbit", "gbit", "100", "1kbit"]:
        with pytest.raises(ValueError, match="rate"):
            links.parse_rate(bad)
    for bad in ["soon", "0ms", "20"]:
        with pytest.raises(ValueError, match="delay"):
            links.parse_delay(bad)


def test_the_shaping_holds_the_largest_packet_and_queues_rather_than_drops() -> None:
    slow, fast = links.plan_shaping("100mbit"), links.plan_shaping("10gbit")
    assert slow.burst_bytes == 128 * 1024  # two 64 KiB packets
    assert fast.burst_bytes == 1_250_000  # 1 ms at 10 Gbit/s
    assert slow.limit_bytes == 4 * 1024 * 1024
    assert fast.limit_bytes == 62_500_000  # 50 ms at 10 Gbit/s
    assert slow.tc_commands("lo") == [
        [
            *("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf"),
            *("rate", "100000000bit", "burst", "131072", "limit", "4194304"),
        ]
    ]
    assert slow.seconds(12_500_000) == pytest.approx(1.0)


# ----- the skip path -------------------------------------------------------------------


def _no_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"ran a command: {args}")

    monkeypatch.setattr("testbed.namespaces.subprocess.run", refuse)


def test_not_root_says_so_and_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the root check comes after the Linux check")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    _no_commands(monkeypatch)
    reason = links.unavailable_reason()
    assert reason is not None
    assert "root" in reason and "1000" in reason
    with pytest.raises(LinkUnavailable) as raised, shaped_loopback("1gbit"):
        pass
    assert str(raised.value) == reason
    with pytest.raises(LinkUnavailable, match="root"), two_nodes("1gbit"):
        pass


def test_missing_tc_says_install_iproute2(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the tool check comes after the Linux check")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(
        "testbed.namespaces.shutil.which",
        lambda name: None if name == "tc" else real_which(name) or name,
    )
    _no_commands(monkeypatch)
    reason = links.unavailable_reason()
    assert reason is not None
    assert "`tc`" in reason and "iproute2" in reason
    with pytest.raises(LinkUnavailable) as raised, two_nodes("1gbit"):
        pass
    assert str(raised.value) == reason


def test_a_bad_rate_fails_before_anything_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_commands(monkeypatch)
    with pytest.raises(ValueError, match="rate"), shaped_loopback("fast"):
        pass


def test_a_delay_works_or_says_why_before_creating_anything() -> None:
    _need_namespaces()
    reason = links.unavailable_reason(delay=True)
    before = links.netns_names()
    if reason is None:
        with two_nodes("1gbit", delay="5ms") as pair:
            assert pair.delay_us == 5000
            assert pair.a.interface == "tun-a" and pair.b.interface == "tun-b"
            assert [q["kind"] for q in pair.a.qdiscs()] == ["tbf"]
    else:
        assert "TUN" in reason
        with pytest.raises(LinkUnavailable) as raised, two_nodes("1gbit", delay="5ms"):
            pass
        assert str(raised.value) == reason
    assert links.netns_names() == before


# ----- one shaped loopback ---------------------------------------------------------------


def test_leaving_removes_the_namespace_also_when_the_body_raises() -> None:
    _need_namespaces()
    before = links.netns_names()
    with shaped_loopback("1gbit") as node:
        assert node.name.startswith(f"zerofn-{os.getpid()}-")
        assert node.name in links.netns_names()
    assert links.netns_names() == before
    with pytest.raises(ZeroDivisionError), shaped_loopback("1gbit") as node:
        1 / 0  # noqa: B018
    assert node.name not in links.netns_names()
    with pytest.raises(KeyboardInterrupt), two_nodes("1gbit") as pair:
        raise KeyboardInterrupt
    assert links.netns_names() == before
    assert pair.a.name not in links.netns_names()


def test_an_existing_namespace_is_refused_not_adopted() -> None:
    _need_namespaces()
    with shaped_loopback("1gbit") as node:
        with (
            pytest.raises(RuntimeError, match="already exists"),
            shaped_loopback("1gbit", name=node.name),
        ):
            pass
        assert node.name in links.netns_names()  # the inner one did not delete it
    assert node.name not in links.netns_names()


def test_the_loopback_is_shaped_and_a_transfer_cannot_beat_the_rate() -> None:
    _need_namespaces()
    nbytes = 4_000_000
    with shaped_loopback("100mbit") as node:
        (tbf,) = node.qdiscs()
        assert tbf["kind"] == "tbf"
        assert tbf["options"]["rate"] == 100_000_000 // 8  # bytes per second
        assert node.env({})["GLOO_SOCKET_IFNAME"] == "lo"
        elapsed = float(_python(node, _TRANSFER, nbytes))
    # Physics, not a speed target: 4 MB at 100 Mbit/s take 0.32 s; the bucket
    # lets at most 128 KiB through ahead of the rate. Unshaped, this is ~2 ms.
    floor = node.shaping.seconds(nbytes)
    assert elapsed >= 0.8 * floor, f"{nbytes} bytes in {elapsed:.3f} s: faster than 100 Mbit/s"


# ----- two nodes -------------------------------------------------------------------------


def test_two_nodes_reach_each_other_over_the_counted_link_and_nothing_else() -> None:
    _need_namespaces()
    before = links.netns_names()
    nbytes, port = 2_000_000, 5555
    with two_nodes("100mbit") as pair:
        a, b = pair.nodes
        assert (a.address, b.address) == links.NODE_ADDRESSES
        assert a.env({})["GLOO_SOCKET_IFNAME"] == a.interface == "veth-a"
        assert [q["kind"] for q in a.qdiscs()] == ["tbf"]
        assert [q["kind"] for q in b.qdiscs()] == ["tbf"]
        assert all(q["kind"] != "tbf" for q in a.qdiscs("lo"))  # inside a node: unshaped
        for node in pair.nodes:  # the /30 is the only route: nothing can leave
            routes = subprocess.run(
                node.command(["ip", "route", "show", "table", "all"]),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "default" not in routes
            main = [r for r in routes.splitlines() if "table local" not in r and r.strip()]
            assert main and all(r.startswith("10.87.0.0/30 ") for r in main), routes

        start = pair.link_bytes()
        t0 = time.perf_counter()
        elapsed = _echoed(pair, _ECHO_CLIENT, port, nbytes)
        assert time.perf_counter() - t0 < 20
        crossed = pair.link_bytes().since(start)
    # Each direction carried the payload plus headers, and was shaped.
    assert crossed.a_to_b >= nbytes
    assert crossed.b_to_a >= nbytes
    assert crossed.total < 1.1 * 2 * nbytes
    assert elapsed >= 0.8 * pair.a.shaping.seconds(nbytes)
    assert links.netns_names() == before
    assert a.name not in links.netns_names() and b.name not in links.netns_names()


# Node a's side of a round trip: one byte to node b's echo and back, many times
# over one connection; print the shortest round trip's seconds.
_ROUND_TRIPS = """
import socket, sys, time
address, port, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((address, port), timeout=20)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
best = float("inf")
for _ in range(times):
    start = time.perf_counter()
    conn.sendall(b"p")
    assert conn.recv(1) == b"p"
    best = min(best, time.perf_counter() - start)
conn.close()
print(best)
"""


def test_a_delayed_link_holds_each_direction_for_the_delay_and_keeps_the_rate() -> None:
    _need_namespaces(delay=True)
    before = links.netns_names()
    nbytes, port, delay_s = 2_000_000, 5556, 0.010
    with two_nodes("100mbit", delay="10ms") as pair:
        assert (pair.a.address, pair.b.address) == links.NODE_ADDRESSES
        start = pair.link_bytes()
        round_trip = _echoed(pair, _ROUND_TRIPS, port, 5)
        # Each direction waits the delay once; the line's own time and the
        # processes' add a little (~0.3 ms measured on 2 cores).
        assert 2 * delay_s <= round_trip < 2 * delay_s + 0.010, round_trip
        elapsed = _echoed(pair, _ECHO_CLIENT, port, nbytes)
        assert elapsed >= 0.8 * pair.a.shaping.seconds(nbytes)
        crossed = pair.link_bytes().since(start)
    assert crossed.a_to_b >= nbytes and crossed.b_to_a >= nbytes
    assert crossed.total < 1.1 * 2 * nbytes
    assert links.netns_names() == before
