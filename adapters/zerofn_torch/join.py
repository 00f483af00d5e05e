"""``Join``, ``Joinable``, ``JoinHook``: training on uneven inputs.

The decisions (who is first, what a joined rank does after each count) come
from :mod:`zerofn.join`; this module runs the all-reduces and the hooks.

A failure anywhere in a joined rank's part raises
:class:`zerofn.errors.CollectiveError` naming what failed: Join's own
all-reduces go through the driver (:func:`zerofn_torch.runtime.issue.issue`), and
every join hook runs inside :func:`zerofn_torch.runtime.collective_errors.guarded`,
DDP's own included (PyTorch's hook fails with the transport's plain
``RuntimeError``). A ``CollectiveError`` a hook raises itself (ZeRO's step)
passes through as it is.

No announcement is left in flight once a join context is done: each rank
waits for its previous one before announcing again and at the context's exit
(every rank has posted its match by then, so this costs no wait). A
completion callback still pending when the program ends would run on a gloo
worker thread during interpreter teardown.

It interoperates with PyTorch's join protocol in both directions: PyTorch's
``DistributedDataParallel`` (a PyTorch ``Joinable``) works inside this
``Join``, and zerofn's ``ZeroRedundancyOptimizer`` works inside PyTorch's. Both
sides read the same ``_join_config`` attribute fields.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as torch_join
from torch.nn.parallel import DistributedDataParallel

from zerofn.comm import AllReduce
from zerofn.join import DISABLED, JoinProgress, first_mismatch, join_configs, next_join_step
from zerofn_torch.runtime.collective_errors import guarded
from zerofn_torch.runtime.issue import issue

__all__ = ["Join", "JoinHook", "Joinable"]

_ANNOUNCED = "_zerofn_join_announced"
"""The joinable attribute holding its latest announcement, until awaited."""

Stage = Literal["main_hook", "post_hook"]
"""Which of a join hook's methods runs: shadowing a round, or finishing."""


class JoinHook(torch_join.JoinHook):
    """What a joined rank runs in place of a joinable's collectives.

    A subclass of PyTorch's ``JoinHook``, so PyTorch's ``Join`` runs it too.

    Override :meth:`main_hook` (run once per round while other ranks still
    train: shadow one iteration's collectives) and :meth:`post_hook` (run once
    when every rank has joined).
    """

    def main_hook(self) -> None:
        """Shadow one training iteration's collectives (default: nothing)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Finish up after all ranks joined (default: nothing).

        Args:
            is_last_joiner: whether this rank was the last to join.
        """


class Joinable(ABC):
    """A class whose collectives a joined rank can shadow.

    Subclasses call ``Joinable.__init__`` and, before each iteration's
    collectives, :meth:`Join.notify_join_context`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._join_config = DISABLED

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this joinable.

        Args:
            **kwargs: the keyword arguments given to :class:`Join`.
        """

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """The device for the join context's own all-reduces."""

    @property
    @abstractmethod
    def join_process_group(self) -> Any:
        """The process group for the join context's own all-reduces."""


# PyTorch's joinables (DDP among them) follow the same protocol.
Joinable.register(torch_join.Joinable)  # type: ignore[type-abstract]


def _hook_collectives(joinable: Any, stage: Stage) -> str:
    """What a joinable's join hook communicates, for error messages.

    Args:
        joinable: the joinable whose hook runs.
        stage: ``"main_hook"`` (shadowing one round) or ``"post_hook"``
            (after every rank joined).

    Returns:
        A phrase naming the hook and, for DDP's, the collectives it shadows
        or issues.
    """
    if isinstance(joinable, DistributedDataParallel):
        # PyTorch's hook is opaque to the driver: say which of DDP's
        # collectives it stands for, so the message points at DDP.
        if stage == "main_hook":
            return "DDP's join hook (shadowing DDP's buffer broadcast and gradient all-reduces)"
        return "DDP's join hook (broadcasting the final model from the last rank to join)"
    return f"the join hook of {type(joinable).__name__} ({stage})"


class Join:
    """Context manager that lets ranks with fewer inputs join early.

    Inside it, a rank that runs out of inputs keeps running every joinable's
    :meth:`JoinHook.main_hook` (shadowing the collectives of the ranks still
    training) until all ranks are done, then every :meth:`JoinHook.post_hook`.

    Args:
        joinables: the participating joinables (e.g. a DDP model and a ZeRO
            optimizer); their hooks run in this order.
        enable: turn uneven-input handling on (off: the context does nothing).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as
            soon as one rank runs out, instead of shadowing.
        **kwargs: passed to every joinable's ``join_hook``.

    Raises:
        ValueError: no joinables, or joinables on different process groups.
    """

    def __init__(
        self,
        joinables: list[Any],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        configs = join_configs(len(joinables), enable, throw_on_early_termination)
        groups = [j.join_process_group for j in joinables]
        mismatch = first_mismatch(groups)
        if mismatch is not None:
            raise ValueError(
                f"joinable {mismatch} uses another process group than joinable 0; a join "
                "context needs one process group"
            )
        self._joinables = joinables
        self._hooks = [j.join_hook(**kwargs) for j in joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        for joinable, config in zip(joinables, configs, strict=True):
            joinable._join_config = config
        self._process_group = groups[0]
        self._device = joinables[0].join_device
        self._rank = dist.get_rank(self._process_group)

    def __enter__(self) -> Join:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Shadow the other ranks until all have joined, then run the post-hooks.

        Raises:
            RuntimeError: with ``throw_on_early_termination``, when this rank
                ran out before the others.
            zerofn.errors.CollectiveError: a collective of this rank's part
                failed (a peer died or hung past the group's timeout): Join's
                count of running ranks, or a join hook's (DDP's included).
        """
        try:
            self._finish(exc_type is not None)
        finally:
            # Out of the context, the joinables announce nothing and refuse
            # nothing (their configs say "not in a join context").
            for joinable in self._joinables:
                joinable._join_config = DISABLED

    def _finish(self, failed: bool) -> None:
        if not self._enable or failed:
            # An exception in the body propagates as it is; waiting for an
            # announcement then could block until the group's timeout.
            return
        _settle_announcement(self._joinables[0])
        progress = JoinProgress()
        while not progress.all_joined:
            # Running ranks add 1 in notify_join_context; a joined rank adds 0.
            running = self._all_reduce(0.0, "counting the ranks still running")
            progress, action = next_join_step(progress, running, self._throw)
            if action == "terminate":
                self._all_reduce(1.0, "telling the others it ran out of inputs")
                raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")
            if action == "shadow":
                self._warn_if_skewed(progress)
                self._run_hooks("main_hook", f"shadowing round {progress.rounds}")
        self._run_hooks("post_hook", "finishing after every rank joined", progress.is_last_joiner)

    def _warn_if_skewed(self, progress: JoinProgress) -> None:
        """Warn once this rank has shadowed many rounds (heavy input skew).

        Args:
            progress: this rank's place in the shadowing loop.
        """
        if progress.skewed:
            warnings.warn(
                f"rank {self._rank} has shadowed {progress.rounds} iterations of ranks "
                "with more inputs; uneven inputs this skewed slow training down",
                stacklevel=3,
            )

    def _run_hooks(self, stage: Stage, doing: str, is_last_joiner: bool = False) -> None:
        """Run every joinable's ``stage`` hook, in the joinables' order.

        Args:
            stage: ``"main_hook"`` or ``"post_hook"``.
            doing: what this rank is doing, for error messages.
            is_last_joiner: for ``post_hook``.

        Raises:
            zerofn.errors.CollectiveError: a hook failed. Any error counts:
                the hooks exist to issue collectives, and a joined rank that
                stops answering leaves its peers out of step, so the group
                is unusable whatever the cause (kept as ``__cause__``).
        """
        purpose = f"Join: rank {self._rank} {doing}"
        for joinable, hook in zip(self._joinables, self._hooks, strict=True):
            with guarded(_hook_collectives(joinable, stage), purpose, self._process_group):
                if stage == "main_hook":
                    hook.main_hook()
                else:
                    hook.post_hook(is_last_joiner)

    def _all_reduce(self, value: float, doing: str) -> int:
        """Sum this rank's ``value`` over the context's group (what this rank is
        ``doing``, for error messages)."""
        request = AllReduce((torch.full((1,), value, device=self._device),))
        (total,) = issue(request, self._process_group, f"Join: rank {self._rank} {doing}").wait()
        return int(total.item())

    @staticmethod
    def notify_join_context(joinable: Any) -> Any:
        """Announce that this rank runs another iteration.

        Joinables call this before each iteration's collectives. Only the
        first joinable of a context communicates (one all-reduce of 1 that
        matches the joined ranks' count); with ``throw_on_early_termination``
        a second all-reduce tells whether some rank ran out, and if so this
        raises on every rank.

        Returns:
            The announcing all-reduce (a future) for the first joinable, else
            ``None``. This rank waits for it before its next announcement
            and at the context's exit; with ``throw_on_early_termination`` it
            is already done.

        Raises:
            RuntimeError: some rank ran out and the context throws.
            zerofn.errors.CollectiveError: the announcement failed (a peer died
                or timed out).
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AssertionError(
                f"{type(joinable).__name__} did not call Joinable.__init__ in its constructor"
            )
        if not config.is_first_joinable or not config.enable:
            return None
        _settle_announcement(joinable)
        device, group = joinable.join_device, joinable.join_process_group
        purpose = f"Join: {type(joinable).__name__} announcing another iteration"
        announced = issue(AllReduce((torch.ones(1, device=device),)), group, purpose)
        if config.throw_on_early_termination:
            asked = f"Join: {type(joinable).__name__} asking whether a rank ran out"
            (stop,) = issue(AllReduce((torch.zeros(1, device=device),)), group, asked).wait()
            announced.wait()  # posted before the question: done by now, and not left in flight
            if stop.item():
                raise RuntimeError(
                    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
                )
            return announced
        _keep_announcement(joinable, announced)
        return announced


def _keep_announcement(joinable: Any, announced: torch.futures.Future[Any]) -> None:
    """Keep ``announced`` on ``joinable`` until :func:`_settle_announcement`.

    Args:
        joinable: the first joinable of a join context.
        announced: its announcement, in flight.
    """
    try:
        setattr(joinable, _ANNOUNCED, announced)
    except AttributeError:  # a joinable with __slots__: nowhere to keep it, so wait now
        announced.wait()


def _settle_announcement(joinable: Any) -> None:
    """Wait for ``joinable``'s announcement still in flight, if any.

    Every rank has posted the all-reduce it matches by the time this runs (a
    running rank's next announcement or its context's exit follows a whole
    iteration), so this does not block for long.

    Args:
        joinable: the first joinable of a join context.

    Raises:
        zerofn.errors.CollectiveError: the announcement failed.
    """
    announced = getattr(joinable, _ANNOUNCED, None)
    if announced is not None:
        setattr(joinable, _ANNOUNCED, None)
        announced.wait()
