"""Losing a rank without stopping, on 3 real gloo ranks: DDP and
``ZeroRedundancyOptimizer(redundancy=2)`` (``examples/train_elastic.py``);
rank 2 exits at step K, either before its forward (the survivors' DDP
backward fails: they redo the step on 2 ranks) or right after its local step
(the survivors' exchange fails: they finish the step from rank 2's carrier).
The survivors go on to the end on 2 ranks; their parameters and optimizer
state equal, bit for bit, a reference that runs 3 ranks to the loss and then
2 fresh ranks from the consolidated state with the same batches. The bytes a
step sends do not change with ``redundancy=2``. Under torchrun with one agent
per node, the survivors of a node killed with ``SIGKILL`` recover the same
way and end with the same bits, on one machine's loopback and across two
network namespaces joined by a shaped link; their agents then wait at
torchrun's exit barrier for the dead node's agent."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import train_elastic as example
from torch.nn.parallel import DistributedDataParallel as DDP
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.elastic import recover
from zerofn_torch.roll_call import timeout_s as _timeout_s
from zerofn_torch.runtime.launch import run_local_world
from zerofn_torch.runtime.traffic import collective_traffic

from testbed.links import Node, netns_names, two_nodes, unavailable_reason
from zerofn.errors import CollectiveError


def reference_before(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """The first phase: ``steps`` steps on 3 ranks, then the state consolidated."""
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    ddp = example.make_ddp(model)
    for step in range(steps):
        example.train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if rank == 0 else None,
    }


def reference_after(rank: int, world_size: int, start: dict[str, Any], first: int) -> Any:
    """The second phase: 2 fresh ranks from the consolidated state, from step
    ``first`` on (their batches those of a world of 2, as the survivors')."""
    model = example.make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), start["params"], strict=True):
            p.copy_(value)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    zero.load_state_dict(start["state"])
    ddp = example.make_ddp(model)
    for step in range(first, example.STEPS):
        example.train_step(ddp, zero, step)
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": zero.state_dict() if rank == 0 else None,
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )


@pytest.mark.parametrize(
    "in_exchange",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # make test-slow: a second real kill
    ids=["lost before", "lost in exchange"],
)
def test_survivors_go_on_exactly_after_losing_a_rank(in_exchange: bool) -> None:
    lost, at = example.LOST, example.LOST_AT
    elastic = run_local_world(
        example.train, 3, in_exchange, timeout_s=example.TIMEOUT_S, may_exit=[lost]
    )
    assert elastic[lost] is None
    done_before = at + 1 if in_exchange else at
    first = run_local_world(reference_before, 3, done_before)[0]
    reference = run_local_world(reference_after, 2, first, done_before)
    for rank in (0, 1):
        ours = elastic[rank]
        assert ours is not None and ours["world_size"] == 2
        (recovery,) = ours["recoveries"]
        assert (recovery["step"], recovery["lost"], recovery["finished_step"]) == (
            at,
            (lost,),
            in_exchange,
        )
        assert all(
            torch.equal(a, b)
            for a, b in zip(ours["params"], reference[rank]["params"], strict=True)
        )
    assert same_state(elastic[0]["state"], reference[0]["state"])  # type: ignore[index]


def train_with_a_survivor_behind(rank: int, world_size: int) -> dict[str, Any] | None:
    """Rank LOST dies right after its local step of LOST_AT (inside the
    exchange); rank 0 fails in that step too, but earlier: after the
    gradients' all-reduce, before its local step (as if a collective of its
    own, clipping's, failed there). Rank 1 alone took the step and holds its
    gradients: the survivors stand at different points of one step."""
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    ddp = example.make_ddp(model)
    finished = []
    for step in range(example.STEPS):
        if rank == example.LOST and step == example.LOST_AT:
            example._exit_after_local_step(zero, example.exit_quietly)
        while True:
            try:
                if rank == 0 and step == example.LOST_AT and not finished:
                    zero.zero_grad()
                    x, y = example.batch(step, zero.rank, zero.world_size)
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                    raise CollectiveError("an all-reduce", "clipping", "the world", "a peer died")
                example.train_step(ddp, zero, step)
                break
            except (CollectiveError, RuntimeError) as error:
                survivors = recover(zero, error, deadline_s=example.DEADLINE_S)
                ddp = example.make_ddp(model, survivors.group)
                finished.append(survivors.finished_step)
                if survivors.finished_step:
                    break
    zero.consolidate_state_dict(to=0)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "finished": finished,
    }


@pytest.mark.slow
def test_survivors_at_different_points_of_a_step_agree_and_go_on_exactly() -> None:
    lost, at = example.LOST, example.LOST_AT
    ours = run_local_world(
        train_with_a_survivor_behind, 3, timeout_s=example.TIMEOUT_S, may_exit=[lost]
    )
    first = run_local_world(reference_before, 3, at + 1)[0]
    reference = run_local_world(reference_after, 2, first, at + 1)
    for rank in (0, 1):
        result = ours[rank]
        assert result is not None and result["finished"] == [True]  # step LOST_AT finished
        assert all(
            torch.equal(a, b)
            for a, b in zip(result["params"], reference[rank]["params"], strict=True)
        )


def step_bytes(rank: int, world_size: int, redundancy: int) -> dict[str, int]:
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, redundancy=redundancy, lr=0.01
    )
    ddp = DDP(model)
    example.train_step(ddp, zero, 0)
    with collective_traffic() as traffic:
        example.train_step(ddp, zero, 1)
    return dict(traffic.payload_bytes)


def test_redundant_shards_send_no_byte_more() -> None:
    one, two = run_local_world(step_bytes, 2, 1), run_local_world(step_bytes, 2, 2)
    assert one == two and one[0]


def test_recover_refuses_an_optimizer_with_one_copy_of_each_shard() -> None:
    run_local_world(_recover_without_redundancy, 2)


def _recover_without_redundancy(rank: int, world_size: int) -> None:
    zero = ZeroRedundancyOptimizer(example.make_model().parameters(), torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match="redundancy=2"):
        recover(zero, RuntimeError("a peer died"))


def test_a_failure_with_every_rank_alive_is_raised_again_unless_a_collective_failed() -> None:
    run_local_world(_recover_with_everyone_alive, 2)


def _recover_with_everyone_alive(rank: int, world_size: int) -> None:
    model = example.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, redundancy=2, lr=0.01)
    error = RuntimeError("a bug of the user's, not a lost rank")
    with pytest.raises(RuntimeError, match="a bug of the user's"):
        recover(zero, error, deadline_s=2.0)
    assert zero.world_size == 2 and zero.regroups == 0
    # A failed collective with every rank answering (a slow or paused rank
    # came back in time) is transient: the same world goes on, on a new group.
    transient = CollectiveError("an all-reduce", "a step", "the world", "timed out")
    survivors = recover(zero, transient, deadline_s=2.0)
    assert survivors.lost == () and survivors.world_size == 2 and not survivors.finished_step
    assert zero.world_size == 2 and zero.regroups == 1 and survivors.group is not None
    assert zero.generation == 1
    # A second optimizer in the same job is a world of its own: the first
    # one's alarm (raised by recover) and roll call are not its, so its steps
    # run and its own transient failure is recovered from its own roll call.
    dist.barrier(survivors.group)
    second = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, process_group=survivors.group, redundancy=2,
        lr=0.01,
    )  # fmt: skip
    assert second.generation == 2 and second.regroups == 0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    second.step()
    again = recover(second, transient, deadline_s=2.0)
    assert again.lost == () and second.generation == 3 and second.regroups == 1
    second.step()


# ----- under torchrun, one agent per node -------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ID = "zerofn-elastic"
TORCHRUN_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun_node(node: int, port: int, out_dir: Path, host: str = "127.0.0.1") -> list[str]:
    """The agent of node ``node`` of 3, one worker each: a static rendezvous,
    so node ``n``'s worker is rank ``n``, and node 0's agent hosts the job's
    store (the rendezvous's, and the workers' default store with it) at
    ``host``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=3",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        f"--master-addr={host}",
        f"--master-port={port}",
        f"--rdzv-id={RUN_ID}",
        "--max-restarts=0",
        os.path.join(ROOT, "examples", "train_elastic.py"),
        "--torchrun-worker",
        str(out_dir),
    ]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts each worker in
    a session of its own: killing the agent's session leaves them running)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _end(agent: subprocess.Popen[bytes]) -> None:
    """Kill an agent that is still running, and its workers."""
    if agent.poll() is None:
        for pid in [agent.pid, *_children(agent.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        agent.wait()


def _wait_for_text(path: Path, text: str, deadline: float) -> None:
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in {path.name}:\n{path.read_text()}"
        time.sleep(0.1)


def stand_in_at_the_exit_barrier(port: int, host: str = "127.0.0.1") -> None:
    """Check in at torchrun's exit barrier for the dead node's agent, with
    torch's own barrier, in the static rendezvous's store: the survivors'
    agents wait there for all 3 (300 s, not settable from the command line)."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import barrier

    tcp = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=False, timeout=timedelta(seconds=10)
    )
    store = dist.PrefixStore(RUN_ID, tcp)  # type: ignore[attr-defined]
    barrier(store, 3, _TERMINAL_STATE_SYNC_ID, barrier_timeout=10)


@attrs.frozen
class Agents:
    """Where the 3 agents run: each node's command line and environment
    (the loopback: as they are; two namespaces: inside one of them), and how
    the test stands in at the exit barrier for the dead node's agent."""

    command: Callable[[int, list[str]], list[str]]
    env: Callable[[int], dict[str, str]]
    stand_in: Callable[[], None]


def run_three_agents(tmp_path: Path, port: int, host: str, agents_at: Agents) -> None:
    """Start the 3 agents, let node 2's worker kill itself, and check that
    the survivors' agents reach torchrun's exit barrier with their workers
    done, then leave it with status 0 once the test stands in there."""
    lost, survivors = example.LOST, (0, 1)
    logs = [tmp_path / f"node{n}.log" for n in range(3)]
    deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
    agents: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        for node in range(3):
            output = stack.enter_context(open(logs[node], "wb"))
            agents.append(
                subprocess.Popen(
                    agents_at.command(node, torchrun_node(node, port, tmp_path, host)),
                    cwd=ROOT,
                    # The agents say when they wait at the barrier.
                    env={**agents_at.env(node), "LOGLEVEL": "INFO"},
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            stack.callback(_end, agents[-1])
        # The killed node's agent fails (no restart left), and the job's
        # store, in node 0's agent, lives on.
        assert agents[lost].wait(deadline - time.monotonic()) != 0
        assert "exitcode  : -9" in logs[lost].read_text()
        # The survivors' workers recover, finish and exit 0; their agents
        # then wait for all 3 agents at torchrun's exit barrier...
        for node in survivors:
            _wait_for_text(logs[node], "Waiting 300 seconds for other agents", deadline)
            assert agents[node].poll() is None
        # ...which lets them go, with status 0, once the dead one's place is
        # taken. Standing in is torch's business, not zerofn's: where the
        # agents' store no longer answers, they are ended instead (below).
        try:
            agents_at.stand_in()
        except (RuntimeError, ValueError) as e:  # DistNetworkError is a RuntimeError
            warnings.warn(f"could not stand in at torchrun's exit barrier: {e}", stacklevel=1)
        else:
            for node in survivors:
                assert agents[node].wait(min(30.0, deadline - time.monotonic())) == 0


def check_the_survivors_results(tmp_path: Path) -> None:
    """The survivors' saved results: the recovery they went through, and the
    same bits as the in-process run (equal, above, to the reference)."""
    lost, survivors = example.LOST, (0, 1)
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    ours = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in survivors]
    in_process = run_local_world(
        example.train, 3, False, timeout_s=example.TIMEOUT_S, may_exit=[lost]
    )
    for rank in survivors:
        assert ours[rank]["world_size"] == 2
        (recovery,) = ours[rank]["recoveries"]
        assert (recovery["step"], recovery["lost"], recovery["finished_step"]) == (
            example.LOST_AT,
            (lost,),
            False,
        )
        assert all(
            torch.equal(a, b)
            for a, b in zip(ours[rank]["params"], in_process[rank]["params"], strict=True)
        )
    assert same_state(ours[0]["state"], in_process[0]["state"])


@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 60)
@pytest.mark.slow  # make test-slow: 3 torchrun agents, a real SIGKILL
def test_under_torchrun_with_an_agent_per_node_the_survivors_go_on(tmp_path: Path) -> None:
    port = free_port()
    on_loopback = Agents(
        command=lambda node, argv: argv,
        env=lambda node: dict(os.environ),
        stand_in=lambda: stand_in_at_the_exit_barrier(port),
    )
    run_three_agents(tmp_path, port, "127.0.0.1", on_loopback)
    check_the_survivors_results(tmp_path)


def _stand_in_inside(node: Node, port: int) -> None:
    """Stand in at the exit barrier from inside ``node`` (the store's address
    is reachable only there)."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        "from test_elastic import stand_in_at_the_exit_barrier as stand_in; "
        f"stand_in({port}, {node.address!r})"
    )
    done = subprocess.run(
        node.command([sys.executable, "-c", code]), cwd=ROOT, capture_output=True, timeout=60
    )
    if done.returncode:
        raise RuntimeError(done.stderr.decode(errors="replace")[-2000:])


@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 90)
@pytest.mark.slow  # make test-slow: 3 torchrun agents on two namespaces, a real SIGKILL
def test_a_node_lost_across_a_link_leaves_the_others_going(tmp_path: Path) -> None:
    """The launch the docs give, on two machines for real: nodes 0 and 1 (the
    store's host among them) in one network namespace, node 2 in another,
    joined by a shaped 1 Gbit/s veth pair; node 2's worker dies with
    ``SIGKILL`` and the two others go on, talking over their node's address."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = netns_names()
    with two_nodes("1gbit") as link:
        where = (link.a, link.a, link.b)
        port = free_port()
        across = Agents(
            command=lambda node, argv: where[node].command(argv),
            env=lambda node: where[node].env(),
            stand_in=lambda: _stand_in_inside(link.a, port),
        )
        crossed = link.link_bytes()
        run_three_agents(tmp_path, port, link.a.address, across)
        crossed = link.link_bytes().since(crossed)
    # Node 2's worker took part in the job (its rendezvous, the first steps'
    # all-reduces) over the link, in both directions.
    assert crossed.a_to_b > 0 and crossed.b_to_a > 0
    assert netns_names() == before
    check_the_survivors_results(tmp_path)


def _late_start_then_short_group(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 reaches its first collective 2 s after rank 0 (a slow start),
    on the default group; then a group with a 1 s timeout, on which rank 1
    is late again: rank 0's all-reduce must fail at that timeout."""
    if rank == 1:
        time.sleep(2.0)
    dist.barrier()  # the default group's timeout lets the slow start through
    group = dist.new_group(timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(2.5)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        failed = None
    except RuntimeError as e:
        failed = str(e)
    waited = time.monotonic() - began
    # kept: the timeout recover gives the group it makes after a loss
    return {"failed": failed, "waited": waited, "kept": _timeout_s(group)}


@pytest.mark.timeout(120)
def test_a_short_timeout_group_after_a_slow_start() -> None:
    """What docs/resilience.md recommends: start-up on the default timeout,
    training on a group made afterwards with a short one."""
    first = run_local_world(_late_start_then_short_group, 2, timeout_s=60.0)[0]
    assert first["failed"] is not None and 0.9 <= first["waited"] < 2.4
    assert first["kept"] == 1.0
