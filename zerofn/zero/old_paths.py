"""The import paths of modules that moved into :mod:`zerofn.zero`'s
subpackages (or into another module), kept working: ``import
zerofn.zero.redundancy`` gives the module ``zerofn.zero.elastic.redundancy``
itself (one module object under two names), so code written against the old
paths, and objects pickled under them, still load. New code imports the
subpackages' paths."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    "zerofn.zero.checkpoint_manifest": "zerofn.zero.checkpoint.manifest",
    "zerofn.zero.checkpoint_run": "zerofn.zero.checkpoint.run",
    "zerofn.zero.sharded_checkpoint": "zerofn.zero.checkpoint.sharded",
    "zerofn.zero.compressed_exchange": "zerofn.zero.compressed.exchange",
    "zerofn.zero.compressed_payloads": "zerofn.zero.compressed.payloads",
    "zerofn.zero.compressed_finish": "zerofn.zero.compressed.finish",
    "zerofn.zero.carried": "zerofn.zero.elastic.carried",
    "zerofn.zero.redundancy": "zerofn.zero.elastic.redundancy",
    "zerofn.zero.piece_state": "zerofn.zero.elastic.piece_state",
    "zerofn.zero.regroup": "zerofn.zero.elastic.regroup",
    "zerofn.zero.recovery_point": "zerofn.zero.elastic.recovery_point",
    "zerofn.zero.liveness": "zerofn.zero.elastic.liveness",
    "zerofn.zero.partition": "zerofn.zero.planning.partition",
    "zerofn.zero.layout": "zerofn.zero.planning.layout",
    "zerofn.zero.plan": "zerofn.zero.planning.plan",
    "zerofn.zero.chunks": "zerofn.zero.planning.chunks",
    "zerofn.zero.precision": "zerofn.zero.mixed_precision.precision",
    "zerofn.zero.masters": "zerofn.zero.mixed_precision.masters",
    "zerofn.zero.loss_scale": "zerofn.zero.mixed_precision.loss_scale",
    "zerofn.zero.arguments": "zerofn.zero.params",
}
"""Old module path -> where the module lives now."""


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in :data:`MOVED`, and loads it as the moved module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # The import system keeps the module's own name and spec (it sets
        # only what is missing), so this is the moved module, unchanged.
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the moved module ran when it was first imported."""


def install() -> None:
    """Let the old paths import (once per process; :mod:`zerofn.zero` calls it)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
