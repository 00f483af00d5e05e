"""Old import paths of modules that moved into the ``zero``, ``overlap`` and
``hooks`` folders, kept working.

``import zerofn.partition`` (or ``from zerofn.powersgd.codec import ...``)
binds the module at its new path, ``zerofn.zero.partition``: one module
object under two names, so classes compare equal whichever path imported
them. New code should use the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    "zerofn.partition": "zerofn.zero.partition",
    "zerofn.layout": "zerofn.zero.layout",
    "zerofn.plan": "zerofn.zero.plan",
    "zerofn.exchange": "zerofn.zero.exchange",
    "zerofn.chunks": "zerofn.zero.chunks",
    "zerofn.optimizers": "zerofn.zero.optimizers",
    "zerofn.params": "zerofn.zero.params",
    "zerofn.precision": "zerofn.zero.precision",
    "zerofn.shard_state": "zerofn.zero.shard_state",
    "zerofn.sharded_checkpoint": "zerofn.zero.sharded_checkpoint",
    "zerofn.checkpoint_manifest": "zerofn.zero.checkpoint_manifest",
    "zerofn.ddp_buckets": "zerofn.overlap.ddp_buckets",
    "zerofn.overlap_step": "zerofn.overlap.step",
    "zerofn.overlap_hook": "zerofn.overlap.hook",
    "zerofn.hook": "zerofn.hooks.hook",
    "zerofn.gather": "zerofn.hooks.gather",
    "zerofn.quantization": "zerofn.hooks.quantization",
    "zerofn.sparsify": "zerofn.hooks.sparsify",
    "zerofn.error_feedback": "zerofn.hooks.error_feedback",
    "zerofn.powersgd": "zerofn.hooks.powersgd",
}
"""Old module path -> new one (a package's submodules follow it)."""


def _new_name(name: str) -> str | None:
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module already imported from the new one."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old path's spec on the module; put
        # its own (new) one back.
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        # First: a moved package's __path__ would otherwise let the path
        # finder load its submodules a second time under the old names.
        sys.meta_path.insert(0, _MovedFinder())
