"""Two nodes for real: ``torchrun --nnodes 2`` across two network namespaces
joined by a shaped 1 Gbit/s link, with a hierarchy.

- Inside a node, its 2 ranks train one model with DDP and zerofn's
  ``ZeroRedundancyOptimizer`` over a group of the node's ranks; their traffic
  stays on the node's unshaped loopback.
- Across nodes, the 2 ranks with the same local rank form a group, and
  ``zerofn_torch.averaging.DiLoCoOptimizer`` (wrapping the ZeRO optimizer)
  syncs the model over it every ``--sync-every`` steps: the only traffic on
  the shaped link, besides torchrun's rendezvous.

``--launch`` (needs root; see docs/links.md) makes the two namespaces with
``testbed.links.two_nodes``, starts one ``torchrun`` in each, waits,
reads the bytes that crossed the link from the veth pair's counters,
compares them with the plan, and removes the namespaces::

    python examples/train_two_nodes.py --launch --steps 40 --sync-every 10

What each node runs (the launcher adds the namespace, ``GLOO_SOCKET_IFNAME``
and the addresses)::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 10.87.0.1:29400 --rdzv-conf is_host=true \\
        --local-addr 10.87.0.1 examples/train_two_nodes.py --steps 40

(``is_host=false`` and ``--local-addr 10.87.0.2`` on the other node: the two
namespaces share one hostname, so torchrun can neither tell which node hosts
the store nor advertise a reachable address by itself.)

The launcher's ``testbed`` is the repository's network testbed, not part of
zerofn (it is not installed with it): ``--launch`` appends the repository's
root (the folder above ``examples/``) to ``sys.path`` to import it. The
workers need only zerofn.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.averaging import DiLoCoOptimizer

REPOSITORY = Path(__file__).resolve().parent.parent
"""The repository's root, where its network testbed (``testbed``) sits."""

NODES, PER_NODE = 2, 2
IN, OUT = 64, 10
STORE_PORT = 29400

# The band the counted link bytes must fall in: BAND times the plan, plus
# ALLOWANCE_BYTES at the top (see ``link_report``). Measured here (runs of 0
# to 40 steps, models of 1.2 and 4.5 MB, 1 Gbit/s): counted - planned was
# 0.2-0.35% of the plan (headers: TCP/IP/Ethernet per 64 KiB offload packet,
# acknowledgements) plus about 35 KB (rendezvous, store, connections) and
# 1.2 KB/s while the job runs (torchrun's keep-alives): 52 KB in a 15 s run
# without steps, 270 KB for 99 MB planned. 2% covers the headers 6 times
# over; 256 KiB covers the fixed part for a job of up to 3 minutes. Were DDP's
# gradients to cross the link, they alone would add about the plan again.
BAND = (1.0, 1.02)
ALLOWANCE_BYTES = 256 * 1024


def model(hidden: int) -> nn.Module:
    """The MLP every rank trains (the same initial weights everywhere)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, OUT),
    )


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's batch at a step: inputs, and a fixed teacher's labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(dim=1)


def planned_link_bytes(numel: int, syncs: int) -> int:
    """The bytes the cross-node groups must move over the link, both directions.

    A cross-node group has W = 2 ranks, one per node; the model has N fp32
    parameters, 4N bytes. Over the link go, per group:

    - DiLoCo's start: rank 0 broadcasts its parameters: 4N bytes;
    - each sync: one reduce per owner's slice (S = 4N / W = 2N bytes each),
      then one broadcast per slice from its owner (the all-gather). On gloo
      zerofn sends a reduce's contributions straight to the owner (an
      all-to-all; gloo's own reduce would move 1.5 S here), so each moves
      (W - 1) S, and a broadcast S: a sync moves W * S + W * S = 8N bytes,
      the bytes of one ring all-reduce of the model (2 (W - 1) / W * 4N per
      rank).

    There are 2 such groups (local rank 0's and local rank 1's), each
    syncing the whole model: ``2 * (4N + syncs * 8N)`` bytes.

    Args:
        numel: N, the model's parameter count.
        syncs: the syncs of the run.

    Returns:
        The planned bytes.
    """
    model_bytes = 4 * numel
    slice_bytes = model_bytes / NODES
    per_sync = NODES * (NODES - 1) * slice_bytes + NODES * slice_bytes
    return round(PER_NODE * (model_bytes + syncs * per_sync))


def all_reduce_link_bytes(numel: int, syncs: int) -> int:
    """:func:`planned_link_bytes` were each sync one ring all-reduce (8N bytes)."""
    model_bytes = 4 * numel
    return round(PER_NODE * (model_bytes + syncs * 2 * (NODES - 1) * model_bytes))


# ----- the training (one torchrun worker) --------------------------------------------------


def train(argv: Sequence[str] | None = None) -> None:
    """One worker of the two-node job (run by ``torchrun``)."""
    parser = argparse.ArgumentParser(
        description="DDP + ZeRO in a node, DiLoCo across nodes (a torchrun worker; "
        "--launch runs the whole job in two network namespaces, as root)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--summary", help="global rank 0 writes its summary here (JSON)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's store; GLOO_SOCKET_IFNAME picks the veth
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nodes = world_size // PER_NODE
    # torchrun numbers ranks node by node: node k holds ranks k*PER_NODE + i.
    # Every rank creates every group, in the same order.
    node_ranks = [list(range(k * PER_NODE, (k + 1) * PER_NODE)) for k in range(nodes)]
    cross_ranks = [list(range(i, world_size, PER_NODE)) for i in range(PER_NODE)]
    enumerate_groups: Any = dist.new_subgroups_by_enumeration  # untyped in torch
    inside, _ = enumerate_groups(node_ranks, backend="gloo")
    across, _ = enumerate_groups(cross_ranks, backend="gloo")

    net = model(args.hidden)
    numel = sum(p.numel() for p in net.parameters())
    ddp = DDP(net, process_group=inside)  # gradients averaged inside the node
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, inside, lr=1e-3)
    opt = DiLoCoOptimizer(zero, sync_every=args.sync_every, process_group=across)

    for step in range(args.steps):
        x, y = batch(rank, step, args.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()  # ZeRO's step inside the node; every H-th, DiLoCo's sync across
    syncs = args.steps // args.sync_every

    with torch.no_grad():
        x, y = batch(-1, 0, 512)  # held out, the same on every rank
        final = F.cross_entropy(net(x), y).item()
        # After the last sync every rank holds the same anchor: compare one
        # number per rank (the only other collective across nodes: 8 bytes).
        digest = torch.tensor([sum(p.double().sum().item() for p in net.parameters())])
        spread = digest.clone()
        dist.all_reduce(digest, op=dist.ReduceOp.MAX)
        dist.all_reduce(spread, op=dist.ReduceOp.MIN)
    same = bool(digest.item() == spread.item()) if args.steps % args.sync_every == 0 else None
    if rank == 0:
        summary = {
            "steps": args.steps,
            "sync_every": args.sync_every,
            "syncs": syncs,
            "numel": numel,
            "final_loss": final,
            "models_equal": same,
            "planned_link_bytes": planned_link_bytes(numel, syncs),
            "all_reduce_link_bytes": all_reduce_link_bytes(numel, syncs),
            # what DDP's gradient all-reduces send inside a node, all its
            # ranks together: per step, each of the P ranks sends
            # 2 (P - 1) / P * 4N bytes (ring all-reduce)
            "ddp_bytes_per_node": args.steps * 2 * (PER_NODE - 1) * 4 * numel,
        }
        print(
            f"steps {args.steps} (DiLoCo syncs {syncs}, H={args.sync_every}); "
            f"final loss {final:.4f}; model {numel:,} params; "
            f"all {world_size} ranks equal: {same}",
            flush=True,
        )
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary))
    dist.destroy_process_group()


# ----- the launcher (root) -----------------------------------------------------------------


def torchrun_argv(
    node_index: int, address: str, host: str, worker_args: Sequence[str]
) -> list[str]:
    """The ``torchrun`` command line for node ``node_index`` (0 hosts the store)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        str(PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{host}:{STORE_PORT}",
        "--rdzv-id",
        "zerofn-two-nodes",
        "--rdzv-conf",
        f"is_host={'true' if node_index == 0 else 'false'}",
        "--local-addr",
        address,
        "--max-restarts",
        "0",
        __file__,
        *worker_args,
    ]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop what is still running: each torchrun and its workers (own sessions)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def link_report(
    counted: int, planned: int, loopback: Sequence[int], ddp_bytes_per_node: int
) -> dict[str, Any]:
    """Counted link bytes against the plan, and where DDP's traffic went.

    The band: ``BAND[0] * planned <= counted <= BAND[1] * planned +
    ALLOWANCE_BYTES``. Counted bytes exceed the plan by the headers
    (TCP/IP/Ethernet per offload packet, acknowledgements) and by
    torchrun's rendezvous and store traffic (node b's agent and workers talk
    to the store on node a). DDP stayed inside the nodes if each node's
    loopback carried at least DDP's bytes and the link's excess over the
    plan is less than half of them.

    Args:
        counted: bytes the veth pair's ends sent, both directions.
        planned: :func:`planned_link_bytes`.
        loopback: bytes each node's loopback sent.
        ddp_bytes_per_node: bytes DDP's all-reduces send inside a node.

    Returns:
        The numbers and the verdicts ``within_band`` and ``ddp_inside``.
    """
    low, high = BAND[0] * planned, BAND[1] * planned + ALLOWANCE_BYTES
    return {
        "counted_link_bytes": counted,
        "planned_link_bytes": planned,
        "ratio": counted / planned if planned else float("inf"),
        "band": [low, high],
        "within_band": low <= counted <= high,
        "ddp_inside": all(b >= ddp_bytes_per_node for b in loopback)
        and (ddp_bytes_per_node == 0 or counted - planned < ddp_bytes_per_node / 2),
    }


def testbed_links() -> ModuleType:
    """The repository's ``testbed.links``, its root appended to ``sys.path``
    first: the testbed is a package of the repository, not of zerofn."""
    if str(REPOSITORY) not in sys.path:
        sys.path.append(str(REPOSITORY))
    from testbed import links

    return links


def launch(
    worker_args: Sequence[str], *, rate: str = "1gbit", timeout_s: float = 120.0
) -> dict[str, Any]:
    """Run the two-node job in two fresh namespaces; its summary and link bytes.

    Args:
        worker_args: the arguments of :func:`train` (without ``--summary``).
        rate: the link's rate, each direction.
        timeout_s: how long the job may take.

    Returns:
        Global rank 0's summary, with ``link`` (bytes per direction, each
        node's loopback bytes) and the report of :func:`link_report`.

    Raises:
        testbed.links.LinkUnavailable: namespaces cannot be made here.
        RuntimeError: a torchrun failed or timed out.
    """
    from tempfile import TemporaryDirectory

    links = testbed_links()
    with TemporaryDirectory(prefix="zerofn-two-nodes-") as tmp, links.two_nodes(rate) as link:
        summary_path = os.path.join(tmp, "summary.json")
        args = [*worker_args, "--summary", summary_path]
        before = link.link_bytes()
        loopback_before = [node.tx_bytes("lo") for node in link.nodes]
        procs: list[subprocess.Popen[bytes]] = []
        started = time.monotonic()
        try:
            for index, node in enumerate(link.nodes):
                env = node.env()
                env["OMP_NUM_THREADS"] = "1"
                argv = torchrun_argv(index, node.address, link.a.address, args)
                procs.append(subprocess.Popen(node.command(argv), env=env, start_new_session=True))
            for proc in procs:
                remaining = timeout_s - (time.monotonic() - started)
                try:
                    proc.wait(timeout=max(remaining, 0.1))
                except subprocess.TimeoutExpired as error:
                    raise RuntimeError(f"the two-node job took over {timeout_s:.0f} s") from error
        finally:
            _stop(procs)
        codes = [proc.returncode for proc in procs]
        if any(codes):
            raise RuntimeError(f"torchrun exited with {codes} (node a, node b)")
        crossed = link.link_bytes().since(before)
        loopback = [
            node.tx_bytes("lo") - b for node, b in zip(link.nodes, loopback_before, strict=True)
        ]
        summary: dict[str, Any] = json.loads(Path(summary_path).read_text())
    summary["seconds"] = time.monotonic() - started
    summary["link"] = {"a_to_b": crossed.a_to_b, "b_to_a": crossed.b_to_a, "loopback": loopback}
    summary.update(
        link_report(
            crossed.total, summary["planned_link_bytes"], loopback, summary["ddp_bytes_per_node"]
        )
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``--launch`` runs the job on two namespaces; otherwise this is a worker."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--launch" not in argv:
        train(argv)
        return 0
    argv.remove("--launch")
    # A SIGTERM (a test's timeout, say) unwinds like Ctrl-C: the torchruns are
    # stopped and the namespaces removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = None
    if "--summary" in argv:  # the launcher's own summary (with the link bytes)
        at = argv.index("--summary")
        out = argv[at + 1]
        del argv[at : at + 2]
    links = testbed_links()
    try:
        result = launch(argv)
    except links.LinkUnavailable as error:
        print(f"cannot make the two nodes here: {error}", file=sys.stderr)
        return 2
    link = result["link"]
    print(
        f"link bytes: {result['counted_link_bytes']:,} counted "
        f"(a->b {link['a_to_b']:,}, b->a {link['b_to_a']:,}) against "
        f"{result['planned_link_bytes']:,} planned (were each sync one ring all-reduce: "
        f"{result['all_reduce_link_bytes']:,}): {result['ratio']:.3f}x, "
        f"band {result['band'][0]:,.0f}..{result['band'][1]:,.0f}: "
        f"{'within' if result['within_band'] else 'OUTSIDE'}\n"
        f"inside the nodes (each node's loopback): {link['loopback'][0]:,} and "
        f"{link['loopback'][1]:,} bytes, DDP's all-reduces {result['ddp_bytes_per_node']:,} "
        f"per node: {'kept off the link' if result['ddp_inside'] else 'CROSSED THE LINK'}",
        flush=True,
    )
    if out:
        Path(out).write_text(json.dumps(result))
    ok = result["within_band"] and result["ddp_inside"] and result["models_equal"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
