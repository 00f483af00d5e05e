"""Two nodes for real: ``examples/train_two_nodes.py --launch`` runs
``torchrun --nnodes 2 --nproc-per-node 2`` in two network namespaces joined by
a shaped 1 Gbit/s veth pair (DDP + ZeRO inside each node, DiLoCo across), and
the bytes that crossed the link, counted by the veth pair, must match the
plan: the DiLoCo syncs' bytes plus headers and torchrun's rendezvous, and
none of DDP's gradients.

Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2, no namespaces).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.links import netns_names, unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_two_nodes.py"


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_two_node_torchrun_moves_the_planned_bytes_over_the_link(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = netns_names()
    summary_path = tmp_path / "summary.json"
    argv = [sys.executable, str(EXAMPLE), "--launch", "--steps", "10", "--sync-every", "5"]
    argv += ["--hidden", "256", "--summary", str(summary_path)]
    # The launcher removes its namespaces on SIGINT/SIGTERM: stop it that way
    # if it overruns, never with SIGKILL first.
    launcher = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = launcher.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=20)
        pytest.fail(f"the two-node job overran 150 s:\n{output.decode(errors='replace')}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    log = output.decode(errors="replace")
    assert launcher.returncode == 0, log
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 10 and summary["syncs"] == 2
    assert summary["models_equal"] is True, log  # the hierarchy kept all 4 ranks in step
    low, high = summary["band"]
    counted, planned = summary["counted_link_bytes"], summary["planned_link_bytes"]
    assert low <= counted <= high, f"{counted} link bytes against {planned} planned\n{log}"
    # Both directions carried their share of the syncs: each rank of a
    # cross-node group sends its slices' reductions and broadcasts.
    link = summary["link"]
    assert link["a_to_b"] > 0.4 * planned and link["b_to_a"] > 0.3 * planned
    # DDP's gradients (and ZeRO's shards) stayed on each node's loopback.
    assert summary["ddp_inside"] is True, log
    assert all(b >= summary["ddp_bytes_per_node"] for b in link["loopback"])
    assert netns_names() == before
