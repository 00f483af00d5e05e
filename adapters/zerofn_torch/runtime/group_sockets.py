"""The connections of the process groups a rank opened, and shutting them
once their world failed: what frees a rank that gloo left blocked inside a
collective zerofn does not wait on itself.

zerofn's own waits end when the job's alarm rings
(:mod:`zerofn_torch.runtime.heartbeat`). A collective that PyTorch issues
and waits for in C++ cannot be told: DDP's bucket rebuild at the second
forward after it is built, its buffer broadcast, its built-in all-reduce,
a user's own ``dist.broadcast``. A rank blocked there stays there while its
peers are alive and answer nothing (they went to the roll call), until the
group's timeout: 30 minutes by default. gloo's ``abort`` and ``shutdown``
do not end it (torch 2.13: both leave the connections open).

What does end it is a connection that closes. So a group zerofn opens is
opened by :func:`opened`, which notes the sockets it connected (the
process's sockets before and after), as belonging to that group, or to the
group whose world it serves (a background save's group). When a world's
alarm rings, the heartbeat calls :func:`shut` with the world's group (the
optimizer's): every socket noted for it is shut (``shutdown``, not
``close``: the descriptor stays gloo's, so its number cannot be reused
under it). Both ends' pending reads then fail at once: gloo raises
"Connection closed by peer" on this rank and on every rank connected to
it, and each joins the roll call.

Nothing else is touched: not another group's connections (a group the job
uses for its own bookkeeping goes on), not a listening socket (gloo's
accept loop aborts the process on one), not the job's store, not a
logger's connection. Only gloo groups are noted: NCCL's bootstrap sockets
are its own, and its waits end at the group's timeout. Where
``/proc/self/fd`` does not exist, nothing is noted and nothing shut.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch.distributed as dist

__all__ = ["init_process_group", "noted_sockets", "opened", "shut"]

G = TypeVar("G")

_FDS = "/proc/self/fd"


@attrs.frozen
class _Noted:
    """A socket a group opened: its descriptor, what the descriptor pointed
    at then (``socket:[inode]``, so a number reused later is left alone), and
    the group whose world's failure shuts it."""

    fd: int
    link: str
    owner: weakref.ref[Any]


_OPENING = threading.Lock()  # one group opened at a time, so each diff is one group's
_LOCK = threading.Lock()  # the state below; never held across a collective or a wait
_NOTED: list[_Noted] = []
_SHUT: weakref.WeakSet[Any] = weakref.WeakSet()  # groups whose world's alarm rang


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and what each points at."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:  # no procfs: nothing is noted
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile
            link = os.readlink(f"{_FDS}/{name}")
            if link.startswith("socket:"):
                found[int(name)] = link
    return found


def opened(create: Callable[[], G], part_of: Any | None = None) -> G:
    """``create()``, the sockets it connected noted as belonging to the group
    it made (``create()``'s result, or the default group when that is
    ``None``), or to ``part_of``: shut when :func:`shut` is called with it.

    The process's other threads should not open sockets meanwhile (those
    would be noted too); zerofn's heartbeat opens none after it starts.
    """
    with _OPENING:
        before = _sockets()
        group = create()
        after = _sockets()
    made = group if group is not None else dist.group.WORLD
    if not _gloo_only(made):
        return group  # NCCL's sockets are its own: never touched
    owner = made if part_of is None else part_of
    stores = _store_ports()
    noted = [
        _Noted(fd, link, weakref.ref(owner))
        for fd, link in sorted(after.items())
        if before.get(fd) != link and _is_peer_connection(fd, stores)
    ]
    # The heartbeat thread shuts from its ring, so this lock is never held
    # while a group is made: a creation that hangs must not stop the beats.
    with _LOCK:
        _NOTED.extend(noted)
        if owner in _SHUT:  # its world failed while it was being made
            for n in noted:
                _shut_one(n.fd)
    return group


def _gloo_only(group: Any) -> bool:
    """Whether ``group`` runs on gloo alone (the only backend whose
    connections are known to be plain sockets that fail cleanly)."""
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def _store_ports() -> frozenset[int]:
    """The port of the default group's store, if it is a TCP store (its
    clients' connections and, on the rank that serves it, their accepted
    ends: never shut, the roll call runs there)."""
    store = None
    with contextlib.suppress(RuntimeError, ValueError, AttributeError):
        store = dist.distributed_c10d._get_default_store()
    ports = set()
    while store is not None:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        store = getattr(store, "underlying_store", None)
    return frozenset(ports)


def _is_peer_connection(fd: int, store_ports: frozenset[int]) -> bool:
    """Whether ``fd`` is a connected TCP socket that is not the store's."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with sock:
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            ports = {sock.getsockname()[1], sock.getpeername()[1]}
        except OSError:  # not connected
            return False
    return not ports & store_ports


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(*args, **kwargs)``, its
    connections noted as the default group's (see :func:`opened`): a rank
    blocked inside one of PyTorch's own collectives of the default group is
    freed when the alarm of an optimizer's world over that group rings.
    Groups zerofn forms itself (after a loss, a join) are noted without
    asking."""
    opened(lambda: dist.init_process_group(*args, **kwargs))


def noted_sockets(group: Any) -> int:
    """How many sockets noted for ``group`` are still open (shut or not)."""
    with _LOCK:
        return len(_still_open(group))


def shut(group: Any) -> int:
    """Shut, in both directions, every socket noted for ``group`` and still
    open, now and for any group opened as part of it later. Returns how many
    were shut."""
    if group is None:
        return 0
    with _LOCK:
        _SHUT.add(group)
        return sum(_shut_one(n.fd) for n in _still_open(group))


def _still_open(group: Any) -> list[_Noted]:
    """The sockets noted for ``group`` whose descriptors still point at them."""
    current = _sockets()
    return [n for n in _NOTED if n.owner() is group and current.get(n.fd) == n.link]


def _shut_one(fd: int) -> bool:
    """Shut noted socket ``fd`` both ways (it was a connected one when noted,
    and its descriptor still points at it). Whether it was shut."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with sock:  # closes the duplicate only: ``fd`` stays open, shut
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # no longer connected
            return False
    return True
