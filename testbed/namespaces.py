"""Network namespaces through ``ip`` and ``tc`` (iproute2): made, shaped, and
always removed; and whether they can be made here at all.

:mod:`testbed.links` builds its links from these. Everything needs root.
Where namespaces cannot be made, :func:`unavailable_reason` says why, and
:func:`require` raises :class:`LinkUnavailable` with that reason before
anything is created.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence

from testbed.delay_line import open_tun
from testbed.shaping import Shaping, plan_shaping

__all__ = [
    "NAME_PREFIX",
    "LinkUnavailable",
    "add_namespace",
    "fresh_name",
    "in_namespace",
    "netns_names",
    "removed_on_exit",
    "require",
    "run",
    "shape",
    "unavailable_reason",
]

NAME_PREFIX = "zerofn-"
"""Every namespace the testbed creates is named ``zerofn-<pid>-<n>...``."""

# One process's counter for unique names; the pid keeps processes apart.
_counter = itertools.count()


class LinkUnavailable(RuntimeError):
    """Namespaces or shaped links cannot be made here; the message says why."""


class _CommandFailed(RuntimeError):
    """``ip`` or ``tc`` failed; ``said`` is what it wrote to stderr."""

    def __init__(self, argv: Sequence[str], code: int, said: str) -> None:
        super().__init__(f"`{' '.join(argv)}` failed (exit {code}): {said}")
        self.said = said


def run(argv: Sequence[str], *, timeout: float = 30.0) -> str:
    """Run ``argv`` (``ip`` or ``tc``) and return its stdout.

    Args:
        argv: the command line.
        timeout: seconds it may take.

    Returns:
        What it wrote to stdout.

    Raises:
        RuntimeError: it exited with an error; the message holds its stderr.
    """
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise _CommandFailed(argv, done.returncode, done.stderr.strip() or done.stdout.strip())
    return done.stdout


def in_namespace(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside namespace ``name``.

    Args:
        name: the namespace.
        argv: the command line (its program is looked up on ``PATH``).

    Returns:
        ``["ip", "netns", "exec", name, *argv]``.
    """
    return ["ip", "netns", "exec", name, *argv]


def fresh_name(kind: str = "") -> str:
    """A namespace name no other call of any process makes: ``zerofn-<pid>-<n><kind>``.

    Args:
        kind: a suffix, e.g. ``"-probe"``.

    Returns:
        The name.
    """
    return f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}{kind}"


def netns_names() -> list[str]:
    """The network namespaces ``ip netns list`` shows (all, not only the testbed's).

    Returns:
        Their names, in the listed order.

    Raises:
        RuntimeError: ``ip netns list`` failed.
    """
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kind(argv: Sequence[str]) -> str:
    """The qdisc a ``tc qdisc add ... handle H KIND ...`` command line adds."""
    return argv[list(argv).index("handle") + 2]


def shape(name: str, interface: str, shaping: Shaping) -> None:
    """Shape ``interface``'s egress inside namespace ``name``.

    Args:
        name: the namespace.
        interface: the interface inside it.
        shaping: what ``tc`` is told (:func:`~testbed.shaping.plan_shaping`).

    Raises:
        LinkUnavailable: the kernel lacks the qdisc.
        RuntimeError: ``tc`` failed otherwise.
    """
    for argv in shaping.tc_commands(interface):
        try:
            run(in_namespace(name, argv))
        except _CommandFailed as error:
            if "kind is unknown" in error.said:
                kind = _kind(argv)
                raise LinkUnavailable(
                    f"this kernel has no {kind} qdisc (CONFIG_NET_SCH_{kind.upper()}): "
                    f"`{' '.join(argv)}` says {error.said!r}"
                ) from error
            raise


def _probe(name: str, delay: bool) -> str | None:
    """Make the probe namespace and what the links need inside it; a reason or None."""
    try:
        run(["ip", "netns", "add", name])
    except _CommandFailed as error:
        return f"cannot create a network namespace: `ip netns add` says {error.said!r}"
    run(["ip", "-n", name, "link", "set", "lo", "up"])
    steps = [("no veth pairs (CONFIG_VETH)", ["ip", "link", "add", "p0", "type", "veth"])]
    for argv in plan_shaping("1gbit").tc_commands("lo"):
        kind = _kind(argv)
        steps.append((f"no {kind} qdisc (CONFIG_NET_SCH_{kind.upper()})", argv))
    for why, argv in steps:
        try:
            run(in_namespace(name, argv))
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
    probe = fresh_name("-probe")
    try:
        return _probe(probe, delay)
    except RuntimeError as error:
        return f"probing network namespaces failed: {error}"
    finally:
        with contextlib.suppress(RuntimeError):
            if probe in netns_names():
                run(["ip", "netns", "del", probe])


def require(*, delay: bool) -> None:
    """Raise where shaped links cannot be made; see :func:`unavailable_reason`.

    Args:
        delay: the links need TUN devices too.

    Raises:
        LinkUnavailable: with :func:`unavailable_reason`'s sentence.
    """
    reason = unavailable_reason(delay=delay)
    if reason is not None:
        raise LinkUnavailable(reason)


@contextlib.contextmanager
def removed_on_exit() -> Iterator[list[str]]:
    """Collect namespace names as they are created; delete them all on exit.

    Every name is deleted even if deleting another fails or is interrupted;
    then ``ip netns list`` must show none of them. A failure to remove is
    raised unless the body already raised (whose error then propagates).

    Yields:
        The list :func:`add_namespace` appends each name to.

    Raises:
        RuntimeError: a namespace is still listed after its removal.
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
                run(["ip", "netns", "del", name])
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


def add_namespace(made: list[str], name: str) -> None:
    """Create namespace ``name`` with its loopback up, recorded in ``made``
    (a :func:`removed_on_exit` list) before it exists, so that an interrupt
    right after the creation still removes it.

    Args:
        made: the names to remove on exit.
        name: the new namespace's name.

    Raises:
        RuntimeError: a namespace of that name exists already (it is never
            adopted, so never deleted), or ``ip`` failed.
    """
    if name in netns_names():
        raise RuntimeError(f"network namespace {name!r} already exists")
    made.append(name)
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])
