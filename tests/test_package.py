"""The package's shape: no import cycles, only the driver's issuing module
issues collectives, and every documented import path imports."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = {"zerofn": ROOT / "zerofn", "zerofn_torch": ROOT / "adapters" / "zerofn_torch"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """Modules imported when ``path`` is imported (not inside functions or
    ``if TYPE_CHECKING``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {
        name: {
            imported
            for imported in _top_level_imports(path)
            # a package's submodule may import the package being initialized
            if imported in modules and imported != name and not name.startswith(imported + ".")
        }
        for name, path in modules.items()
    }
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        for nxt in graph[name]:
            if nxt in trail:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif len(trail) < 12:
                visit(nxt, [*trail, nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, cycles[0]


def test_only_the_issuing_modules_and_the_launcher_call_torch_distributed_collectives() -> None:
    collectives = {
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce",
        "reduce_scatter",
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
    }
    callers = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in collectives
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
            ):
                callers.add(name)
    assert callers == {"zerofn_torch.runtime.issue"}, callers


def _documented_paths() -> set[str]:
    """Every dotted ``zerofn_torch...`` name the README and the docs pages
    mention (in prose, code and cross-references)."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found: set[str] = set()
    for page in pages:
        found.update(re.findall(r"\bzerofn_torch(?:\.[A-Za-z_][A-Za-z0-9_]*)+", page.read_text()))
    return found


def test_every_documented_adapter_name_imports() -> None:
    """Each documented ``zerofn_torch`` path resolves: a module, or a name in
    one (a class, a function, a method of a class); the public faces the
    drop-in documents are among them."""
    import importlib

    names = _documented_paths()
    assert {
        "zerofn_torch.hooks",
        "zerofn_torch.checkpoint",
        "zerofn_torch.join",
        "zerofn_torch.averaging",
        "zerofn_torch.compat",
    } <= {n for n in names if n.count(".") == 1}
    unresolved = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attribute in parts[cut:]:
                    target = getattr(target, attribute)
            except AttributeError:
                unresolved.append(name)
            break
        else:
            unresolved.append(name)
    assert not unresolved, unresolved


def test_the_public_faces_keep_their_import_paths() -> None:
    import zerofn_torch
    from zerofn_torch.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
    from zerofn_torch.checkpoint import latest_checkpoint, load_sharded, save_sharded
    from zerofn_torch.compat import TorchTypedZeroRedundancyOptimizer
    from zerofn_torch.diloco import DiLoCoOptimizer
    from zerofn_torch.hooks import (
        PowerSGDState,
        allreduce_hook,
        hook_with_zero_step,
        powerSGD_hook,
    )
    from zerofn_torch.join import Join
    from zerofn_torch.zero import ZeroRedundancyOptimizer

    assert zerofn_torch.ZeroRedundancyOptimizer is ZeroRedundancyOptimizer
    assert all(
        callable(x)
        for x in (
            PeriodicModelAverager, PostLocalSGDOptimizer, latest_checkpoint, load_sharded,
            save_sharded, TorchTypedZeroRedundancyOptimizer, DiLoCoOptimizer, PowerSGDState,
            allreduce_hook, hook_with_zero_step, powerSGD_hook, Join, zerofn_torch.LossScaler,
        )
    )  # fmt: skip


def test_moved_modules_keep_their_old_import_paths_name_by_name() -> None:
    """Every module that moved into a subpackage of ``zerofn.zero`` imports
    under its old path as the same module, and every public name of it
    imports from the old path (``from zerofn.zero.redundancy import ...``)."""
    import importlib

    from zerofn.zero.old_paths import MOVED

    assert MOVED
    for old, new in MOVED.items():
        moved = importlib.import_module(new)
        assert importlib.import_module(old) is moved, old
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is still a file"
        names = getattr(moved, "__all__", [])
        assert names, f"{new} lists no public names"
        for name in names:
            namespace: dict[str, object] = {}
            exec(f"from {old} import {name}", namespace)
            assert namespace[name] is getattr(moved, name), f"{old}.{name}"


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """``pyproject.toml`` lists packages by name (not found by search): every
    folder with an ``__init__.py`` must be in it, or a built wheel lacks it."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join([package, *init.parent.relative_to(folder).parts])
        for package, folder in SOURCES.items()
        for init in folder.rglob("__init__.py")
    }
    assert folders <= listed, sorted(folders - listed)
