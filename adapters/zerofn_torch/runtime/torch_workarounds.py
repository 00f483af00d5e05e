"""Workarounds for PyTorch behaviour that aborts a process at its exit.

All four guard against one hazard. A gloo process group's worker thread
completes a collective's future, runs the callbacks attached to it, and then
lets go of the finished collective; several of those steps take the GIL on
that thread. Once the main thread has begun to finalize the interpreter,
CPython ends a thread that asks for the GIL, or that is still waiting for it
(CPython 3.11, the version checked here, with ``pthread_exit``); unwinding
PyTorch's C++ frames then ends the process with SIGABRT (exit status -6 as
:mod:`subprocess` reports it), after a script whose every line ran, saying::

    terminate called without an active exception

or ``Fatal Python error: PyEval_SaveThread: the function must be called with
the GIL held ...`` followed by ``Python runtime state: finalizing``. PyTorch's
issue 38228 describes the same ending for other threads of PyTorch's.

Two kinds of step take the GIL there. A callback takes it unconditionally:
still running when finalization begins, it aborts the process. The release
of a Python object that PyTorch keeps for C++ (a tensor's, an object stashed
in the thread's state) takes it only while ``Py_IsInitialized()`` is true,
which stops being so the moment finalization begins (after that the object
is left unreleased and nothing aborts, as observed on 2.13.0); it aborts the process when the
worker thread starts it just before that moment and waits for a GIL that
the main thread keeps until then, a race with the end of the main thread's
last wait for a collective.

Each unit below names the step it keeps off the worker thread, the PyTorch
source that takes the GIL there, the versions it was checked on, and the
name that switches it off; ``tests/test_torch_workarounds.py`` runs each one
with and without it:

* :func:`hold_second_references` (``second_references``): the tensors of a
  finished collective;
* :func:`keep_held_for_good` (``kept_for_good``): the same tensors, through
  the interpreter's teardown;
* :func:`without_backward_context` (``no_backward_context``): the
  ``contextvars.Context`` that backward stashes in the thread's state, which
  gloo copies into each collective;
* :func:`counted` and :func:`settle_at_exit` (``settled_callbacks``): the
  callbacks themselves.

For tests only, the environment variable ``ZEROFN_WITHOUT_WORKAROUND`` names
workarounds to leave out, comma-separated (read once, when this module is
imported; an unknown name is an error), so that a test can show the failure
each one prevents. A process started with it may abort at its exit: never set
it outside a test.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

__all__ = [
    "ENVIRONMENT",
    "EXIT_WAIT_S",
    "HELD",
    "WORKAROUNDS",
    "Held",
    "counted",
    "hold_second_references",
    "is_on",
    "keep_held_for_good",
    "settle",
    "settle_at_exit",
    "without_backward_context",
]

_LOG = logging.getLogger(__name__)

ENVIRONMENT = "ZEROFN_WITHOUT_WORKAROUND"
"""The environment variable that switches workarounds off (tests only)."""

WORKAROUNDS = ("second_references", "kept_for_good", "no_backward_context", "settled_callbacks")
"""The names :data:`ENVIRONMENT` may hold."""


def _switched_off() -> frozenset[str]:
    names = {name.strip() for name in os.environ.get(ENVIRONMENT, "").split(",")} - {""}
    unknown = names - set(WORKAROUNDS)
    if unknown:
        raise ValueError(f"{ENVIRONMENT}: no workaround is named {sorted(unknown)}: {WORKAROUNDS}")
    return frozenset(names)


_OFF = _switched_off()


def is_on(name: str) -> bool:
    """Whether the workaround ``name`` (one of :data:`WORKAROUNDS`) runs in
    this process: all do, unless :data:`ENVIRONMENT` named it at import."""
    if name not in WORKAROUNDS:
        raise ValueError(f"no workaround is named {name!r}: {WORKAROUNDS}")
    return name not in _OFF


# ----- second_references, kept_for_good: the tensors of a finished collective ------


class Held(NamedTuple):
    """A tensor handed to a collective, and a second C++ reference to it (a
    one-element ``torch._C.ScriptList``: not a view, which would hold the
    root of a view's base, nor a Python reference, which PyTorch's count of
    C++ references leaves out)."""

    tensor: torch.Tensor
    reference: Any


HELD: dict[int, Held] = {}
"""By the tensor's identity: the tensors handed to collectives that something
else may still hold (a collective in flight, or one not yet released by its
worker thread, and whatever held the tensor anyway)."""

_HELD_LOCK = threading.Lock()
# PyTorch's count of a tensor's C++ references (private): without it, nothing
# is held.
_COUNTS = hasattr(torch.Tensor, "_use_count")


def _new_lock_in_child() -> None:
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_in_child)


def _use_count(tensor: torch.Tensor) -> int:
    count: int = tensor._use_count()  # type: ignore[attr-defined]
    return count


def hold_second_references(tensors: Iterable[torch.Tensor]) -> None:
    """Give each of ``tensors`` (handed to a collective) a second C++
    reference in :data:`HELD`, and release those held earlier that nothing
    else holds any more (their use count is 2: their Python object's
    reference and the held one), by this thread, which has the GIL.

    The bug: a tensor that has a Python object keeps that object alive while
    C++ holds further references to it, and when the count of C++ references
    drops from 2 to 1 (the Python object's own), whichever thread drops it
    gives the Python object back, taking the GIL (the note "PyObject
    preservation for Tensor and Storages" in ``c10/util/intrusive_ptr.h``;
    ``TensorImpl::decref_pyobject``). Gloo's ``AsyncWork``
    (``torch/csrc/distributed/c10d/ProcessGroupGloo.hpp``) holds a
    collective's tensors, and the worker thread lets go of it just after the
    future's callbacks: when the collective was a tensor's last holder but
    its Python object, that thread takes the GIL, racing the main thread's
    exit (see the module's description). With the held reference the
    worker's release never is that one.

    Torch versions: observed on 2.13.0 (CPython 3.11); not checked on
    others. ``torch.Tensor._use_count`` is private; a torch without it holds
    nothing here. Without it, a release staged to race the exit aborted
    every run; at a real exit it aborted from 1 in 16 to 11 in 12 runs,
    depending on the machine's load.

    Switched off by ``second_references``: nothing is held.
    """
    if not _COUNTS or not is_on("second_references"):
        return
    with _HELD_LOCK:
        free = [key for key, held in HELD.items() if _use_count(held.tensor) <= 2]
        released = [HELD.pop(key) for key in free]
        for tensor in tensors:
            HELD[id(tensor)] = Held(tensor, torch._C.ScriptList([tensor]))
    # Released outside the lock: the references first (each its tensor's last
    # C++ one but its Python object's), then the tensors.
    references = [held.reference for held in released]
    let_go = [held.tensor for held in released]
    del released
    del references
    del let_go


def keep_held_for_good() -> None:
    """At the interpreter's exit (:mod:`zerofn_torch.runtime.issue` registers
    it): release what nothing holds any more, then keep :data:`HELD` for
    good, never released (one more Python reference to it, ``Py_IncRef``;
    the process's exit frees the memory).

    What it guards against: the interpreter's teardown releasing the held
    references while worker threads still hold collectives of those tensors;
    a worker's release would then be the one that gives a tensor's Python
    object back (see :func:`hold_second_references`).

    That failure is not reproduced on 2.13.0 with CPython 3.11: the teardown
    runs after finalization began, when a worker's release leaves the Python
    object unreleased instead of taking the GIL (a release staged after
    finalization began, with no second reference at all, exited cleanly),
    and the teardown did not release :data:`HELD` in the scenario tried
    anyway. Not checked on other versions.

    Switched off by ``kept_for_good``: nothing is done at exit.
    """
    if not is_on("kept_for_good"):
        return
    hold_second_references(())
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(HELD))


# ----- no_backward_context: the Context backward stashes in the thread's state ------


@contextmanager
def without_backward_context() -> Iterator[None]:
    """Inside, the thread's state holds no ``contextvars.Context`` stashed by
    backward; it is put back afterwards. zerofn starts its collectives inside.

    The bug: while it runs the autograd engine (DDP's hooks, zerofn's among
    them, run then) ``torch.autograd.graph._engine_run_backward`` stashes a
    copy of the caller's ``contextvars`` in the thread's state, under the key
    ``"context"`` (``torch._C._stash_obj_in_tls``), and removes it when
    backward returns (its own comment there says why: the holder's
    destructor needs the GIL). Gloo keeps a copy of the issuing thread's
    state with each collective (``AsyncWork``'s ``at::ThreadLocalState``, in
    ``ProcessGroupGloo.hpp``), and with it a reference to that Context, in a
    ``c10::SafePyObject`` whose destructor takes the GIL. Once backward has
    returned, the collective's copy is often the Context's last holder, and
    the worker thread releases it when it lets go of the collective, racing
    the main thread's exit (see the module's description).

    Torch versions: observed on 2.13.0 (CPython 3.11); not checked on others.
    A torch that stashes nothing there, or cannot remove it
    (``torch._C._remove_obj_from_tls``, private), is left as it is. Without
    it, a release staged to race the exit aborted every run; at a real exit
    (the collective started by zerofn's driver inside backward) from 1 in 16
    to 7 in 16 runs, depending on the machine's load.

    Switched off by ``no_backward_context``: the Context stays.
    """
    if not is_on("no_backward_context") or not (
        hasattr(torch._C, "_remove_obj_from_tls")
        and hasattr(torch._C, "_is_key_in_tls")
        and torch._C._is_key_in_tls("context")
    ):
        yield
        return
    context = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", context)


# ----- settled_callbacks: the exit waits for the callbacks still running ------------

EXIT_WAIT_S = 60.0
"""Seconds the interpreter's exit waits for callbacks still running: far more
than any of zerofn's takes, bounded so that one stuck in user code nested in
it cannot hang the exit for ever."""


class _Running:
    """How many counted callbacks have started and are not yet let go of."""

    def __init__(self) -> None:
        # Reentrant: a callback may be let go of (and uncounted) by a
        # collection that happens while this thread holds the lock.
        self.changed = threading.Condition(threading.RLock())
        self.count = 0


_RUNNING = _Running()


def _forget_in_child() -> None:
    # The threads that ran the counted callbacks do not exist in a forked child.
    global _RUNNING
    _RUNNING = _Running()


os.register_at_fork(after_in_child=_forget_in_child)


class _Count:
    """One callback's place in :data:`_RUNNING`: taken when the callback
    starts, given back when this object is deallocated, which happens when
    PyTorch lets go of the callback (on the thread that ran it, with the GIL,
    after the future it completed has woken its waiters and the callbacks
    nested in it have returned; until then that thread still needs the GIL).
    The callback itself is released first, while still counted: freeing what
    it holds may take the GIL again."""

    __slots__ = ("_fn", "_in")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn: Callable[[Any], Any] | None = fn
        self._in: _Running | None = None  # where it was counted (a forked child counts anew)

    def take(self) -> Callable[[Any], Any]:
        """Count it (once); the callback."""
        fn = self._fn
        assert fn is not None
        if self._in is None:
            self._in = running = _RUNNING
            with running.changed:
                running.count += 1
        return fn

    def __del__(self) -> None:
        self._fn = None
        running = self._in
        if running is not None:
            try:
                with running.changed:
                    running.count -= 1
                    running.changed.notify_all()
            except Exception:  # the interpreter's own teardown: nothing waits any more
                pass


def _run_counted(count: _Count, fut: Any) -> Any:
    fn = count.take()
    # No frame may keep the count: a traceback kept with an error (a failed
    # program's, in its future) keeps every frame down to the caller's.
    del count
    return fn(fut)


def counted(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` as a future's callback that :func:`settle` waits for, from the
    moment it starts running until PyTorch lets go of it: the one reference
    to its count is PyTorch's, through a ``functools.partial`` (C code, so no
    frame refers to it; hand it to ``torch._C.Future``'s methods, not to
    ``torch.futures.Future``'s Python ones, whose frames would).

    The bug: PyTorch runs a collective's callbacks on the process group's
    worker thread, and they go on after the future a caller waits for is
    complete: each ``set_result`` in a chain of callbacks returns to Python,
    and PyTorch then releases each callback, taking the GIL again, whether
    or not the interpreter is finalizing (``PythonFunctionGuard``'s
    destructor, in ``torch/csrc/jit/python/pybind_utils.h``). A main thread
    that reaches the end of the script meanwhile finalizes the interpreter
    under them: SIGABRT. Nothing of PyTorch's waits for them;
    :func:`settle_at_exit` does, for every callback made here.

    Torch versions: observed on 2.13.0 (CPython 3.11); not checked on others.
    """
    return functools.partial(_run_counted, _Count(fn))


def settle(timeout: float | None = None) -> bool:
    """Wait until no callback made by :func:`counted` is running or still
    held by PyTorch, releasing the GIL meanwhile (so the threads that run
    them can finish). Never call it from inside such a callback (it would
    wait for itself). A callback that never starts (its future never
    completes) is never counted, so nothing waits for it.

    Args:
        timeout: the most seconds to wait (``None``: as long as it takes).

    Returns:
        Whether none is left.
    """
    with _RUNNING.changed:
        return _RUNNING.changed.wait_for(lambda: _RUNNING.count == 0, timeout)


def settle_at_exit() -> None:
    """At the interpreter's exit (:mod:`zerofn_torch.runtime.futures`
    registers it before any module that may start callbacks at exit, so it
    runs after them): :func:`settle`, at most :data:`EXIT_WAIT_S` seconds,
    then log an error naming how many are left.

    The bug: see :func:`counted`. Without it, an exit while zerofn's
    callbacks still run on the worker thread aborted every run (CPython's
    ``Fatal Python error: PyEval_SaveThread``).

    Torch versions: observed on 2.13.0 (CPython 3.11); not checked on others.

    Switched off by ``settled_callbacks``: the exit does not wait.
    """
    if not is_on("settled_callbacks"):
        return
    if not settle(EXIT_WAIT_S):
        _LOG.error(
            "%d future callback(s) still running after %.0f s at exit; a worker thread "
            "that takes the GIL once the interpreter finalizes aborts the process",
            _RUNNING.count,
            EXIT_WAIT_S,
        )
