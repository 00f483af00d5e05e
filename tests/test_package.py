"""The package's shape: no import cycles, and only the driver's issuing
module, the object collectives and the launcher issue collectives."""

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
    allowed = {"zerofn_torch.issue", "zerofn_torch.object_collectives", "zerofn_torch.launch"}
    assert callers <= allowed, callers
