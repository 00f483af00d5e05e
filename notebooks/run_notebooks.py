"""Execute every notebook in this directory; fail on the first error.

Used by ``make notebooks`` (and so by CI). The committed ``.ipynb`` files stay
without outputs: each executed copy, with its figures, is written to
``notebooks/out/`` (ignored by git) instead.

Usage: ``python notebooks/run_notebooks.py [NOTEBOOK ...]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 300


def run(path: Path) -> float:
    """Execute ``path`` with the kernel's working directory set to notebooks/;
    return the seconds it took."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - started
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    nbformat.write(notebook, out / path.name)
    return elapsed


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or sorted(HERE.glob("[0-9]*.ipynb"))
    if not paths:
        print("no notebooks found", file=sys.stderr)
        return 1
    for path in paths:
        print(f"executing {path.name} ...", flush=True)
        print(f"  ok in {run(path):.1f} s (executed copy: notebooks/out/{path.name})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
