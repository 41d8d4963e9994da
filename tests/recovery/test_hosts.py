"""The cluster host of the live control loop (``recovery/hosts.py``) and its node agent
(``recovery/agent.py``), without training: a real TCPStore on loopback, no rank processes.

What the end-to-end test (``tests/launch/test_sbatch_live.py``) cannot reach cheaply: the exit
log read once per counter change, a node whose agent stops beating (its processes count as
dead), the agent's answers to ``kill``/``exit`` and its exit when the control store goes away.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from nemo_nutp.common.ports import free_port
from nemo_nutp.health.decisions import exit_words, lost_code
from nemo_nutp.live import link
from nemo_nutp.recovery import agent, control, hosts


def _store(port: int, master: bool):
    return hosts.agent_store("127.0.0.1", port, is_master=master, timeout_s=30)


def test_a_lost_node_is_found_well_inside_the_survivors_abort_wait() -> None:
    """A node lost with its agent reports no exits: the control process learns of it only
    from the agent's silent beat. It must act (set the abort) before the survivors, whose step
    already failed, stop waiting for the abort (``link.ABORT_WAIT_S``) and exit: else the
    re-layout sees their exits as a second failure and falls back to a restart. The bound:
    ``AGENT_LOST_S`` + one beat check + the control loop's poll, with half the wait to spare
    (a loaded host)."""
    bound = hosts.AGENT_LOST_S + hosts.BEAT_CHECK_S + 0.05 + control.POLL_S
    assert bound <= link.ABORT_WAIT_S / 2, (bound, link.ABORT_WAIT_S)
    assert hosts.AGENT_LOST_S >= 3 * hosts.BEAT_S  # a late beat or two is not a lost node


def test_exit_log_and_lost_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "AGENT_LOST_S", 0.3)
    monkeypatch.setattr(hosts, "BEAT_CHECK_S", 0.0)
    port = free_port()
    store = _store(port, True)
    h = hosts.AgentHost(store, nodes=2, gpus_per_node=4, address="127.0.0.1")
    a, b, c = h._new(0), h._new(0), h._new(1)
    peer = _store(port, False)  # what the agents write
    for n in (0, 1):
        peer.add(hosts.agent_key(n, "beat"), 1)
    assert [p.exitcode for p in (a, b, c)] == [None, None, None]
    peer.append("exits", f"{b.id} -9\n")
    peer.add("exits_n", 1)
    time.sleep(0.02)
    assert [p.exitcode for p in (a, b, c)] == [None, -9, None]
    # node 1's agent stops beating, node 0's goes on: only node 1's process is lost
    deadline = time.monotonic() + 10
    while c.exitcode is None:
        peer.add(hosts.agent_key(0, "beat"), 1)
        assert time.monotonic() < deadline, "a silent agent's node was never found lost"
        time.sleep(0.05)
    assert (a.exitcode, b.exitcode, c.exitcode) == (None, -9, lost_code(1))
    assert exit_words(c.exitcode) == "node agent 1 lost"  # never a signal
    h.kill([a, c])  # the lost node gets no request
    assert peer.check([hosts.agent_key(0, "cmd0")])
    assert not peer.check([hosts.agent_key(1, "cmd0")])


def test_agent_answers_and_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "BEAT_S", 0.05)
    port = free_port()
    store = _store(port, True)
    h = hosts.AgentHost(store, nodes=1, gpus_per_node=4, address="127.0.0.1")
    node = agent.Agent("127.0.0.1", port, 0, timeout_s=30)
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(node.run()), daemon=True)
    t.start()
    h._replies({0: h._request(0, {"op": "kill", "ids": [5]})})  # nothing to kill: answered
    store.set("bad", "not a pickle")
    with pytest.raises(RuntimeError, match="node agent 0: UnpicklingError"):
        h._replies({0: h._request(0, {"op": "start", "key": "bad"})})
    beat = int(store.add(hosts.agent_key(0, "beat"), 0))
    h.close()
    t.join(timeout=30)
    assert codes == [0] and int(store.add(hosts.agent_key(0, "beat"), 0)) >= beat


def test_agent_exits_when_the_control_store_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "BEAT_S", 0.05)
    port = free_port()
    store = _store(port, True)
    node = agent.Agent("127.0.0.1", port, 0, timeout_s=5)
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(node.run()), daemon=True)
    t.start()
    time.sleep(0.2)
    del store  # the control process is gone
    t.join(timeout=60)
    assert codes == [agent.EXIT_LOST]


def test_hang_found_from_the_agents_node_digests(tmp_path, monkeypatch) -> None:
    """The control loop's hang check under the agents (``AgentHost.watch``): node 0's agent
    digests its ranks' heartbeat files, the aggregator reads the digests and blames the rank
    that progressed least once every heartbeat is older than the timeout; nothing before."""
    from types import SimpleNamespace

    monkeypatch.setattr(agent, "BEAT_S", 0.05)
    port = free_port()
    store = _store(port, True)
    h = hosts.AgentHost(store, nodes=2, gpus_per_node=4, address="127.0.0.1")
    node = agent.Agent("127.0.0.1", port, 0, timeout_s=30)
    threading.Thread(target=node.run, daemon=True).start()
    now = time.time()
    for r, step in enumerate([5, 5, 4, 5]):  # rank 2 is behind
        (tmp_path / f"rank{r}").write_text(f"compute {step} {now - 100:.3f}")
    w = SimpleNamespace(gen=0, hb=tmp_path, plan=SimpleNamespace(rank_to_gpu=[0, 1, 2, 3],
                                                                 world_size=4))
    rec = SimpleNamespace(heartbeat_timeout_s=300.0, startup_timeout_s=600.0)
    agg = h.watch(w, started=now - 200, rec=rec)
    deadline = time.monotonic() + 20
    while agg.last_done is None:  # the digest arrived
        assert agg.poll(time.time()) is None  # younger than the timeout: no hang
        assert time.monotonic() < deadline, "no node digest published"
        time.sleep(0.05)
    assert agg.last_done == 4
    agg.timeout_s = 10.0
    failure = agg.poll(time.time())
    assert failure is not None and failure.ranks == (2,), failure
    h.close()


AGENT_DIES = """
import multiprocessing as mp, os, sys, time


def rank(env, ready):
    from nemo_nutp.recovery.world import enter  # imported here: the agent stays light

    enter(env)
    open(ready, "w").close()
    time.sleep(300)


if __name__ == "__main__":
    ready = sys.argv[1]
    ctx = mp.get_context("forkserver")  # as the agent starts its ranks
    p = ctx.Process(target=rank, args=({"NUTP_AGENT_PID": str(os.getpid())}, ready))
    p.start()
    print(p.pid, flush=True)
    while not os.path.exists(ready):  # the rank is watching this process
        time.sleep(0.05)
    os.kill(os.getpid(), 9)  # the agent is killed: no cleanup of its own
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\\tZ" not in f.read().split("State:")[1].split("\\n")[0]
    except (OSError, IndexError):
        return False


def test_ranks_die_with_their_agent(tmp_path) -> None:
    """An agent killed while its node lives leaves no rank running (its fork server exits with
    it, and the ranks ask for SIGKILL when their parent dies)."""
    import subprocess
    import sys

    from nemo_nutp.recovery.world import AGENT_PID

    assert AGENT_PID == "NUTP_AGENT_PID"  # what the script sets, as the agent does (_env)
    script = tmp_path / "agent_dies.py"
    script.write_text(AGENT_DIES)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ready")],
                       capture_output=True, text=True, timeout=240)
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, "a rank outlived its agent"
        time.sleep(0.05)


def test_the_agent_starts_the_entry_the_control_process_sends(tmp_path, monkeypatch) -> None:
    """What a rank runs is the control process's choice (``AgentHost.entry``: ``nutp-train``'s
    by default, ``nutp-bridge control`` sends Bridge's), carried with the job to the agent,
    which starts that entry -- for the world's ranks and for a returning GPU's process -- with
    each rank's device on its node; never its own default."""
    from functools import partial

    from nemo_nutp.common.env import EVENTS
    from nemo_nutp.config import load_config, plan_request
    from nemo_nutp.layout import build_plan
    from nemo_nutp.recovery.world import RankEntry
    from tests.helpers.entries import record_join, record_rank

    monkeypatch.setattr(agent, "BEAT_S", 0.05)
    job = load_config(["cluster.num_gpus=8", "cluster.gpus_per_node=4",
                       "health.failed_gpus=[3]"])
    plan = build_plan(plan_request(job))
    port = free_port()
    store = _store(port, True)
    entry = RankEntry(partial(record_rank, str(tmp_path)), (), partial(record_join,
                                                                       str(tmp_path)))
    h = hosts.AgentHost(store, nodes=2, gpus_per_node=4, address="127.0.0.1", entry=entry)
    nodes = [agent.Agent("127.0.0.1", port, n, timeout_s=30) for n in (0, 1)]
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]
    for t in threads:
        t.start()
    procs = h.start_world(job, plan, {"TEST_MARKER": "bridge"})
    joiner = h.start_joiner(7, job, plan, 3, 1, {EVENTS: str(tmp_path / "events.jsonl")})
    for p in [*procs, joiner]:
        p.join(60)
    assert [p.exitcode for p in [*procs, joiner]] == [0] * (plan.world_size + 1)
    for r, gpu in enumerate(plan.rank_to_gpu):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == {"world": plan.world_size, "local": gpu % 4,
                       "rank_to_gpu": list(plan.rank_to_gpu), "marker": "bridge"}, got
    assert json.loads((tmp_path / "join7.json").read_text()) == {"gpu": 3, "gen": 1}
    h.close()
    for t in threads:
        t.join(30)


def test_an_exit_the_fork_server_lost_waits_for_the_agent_to_end_first(monkeypatch) -> None:
    """A node being stopped (Slurm sets it DOWN: SIGTERM to every process of the agents' step
    there) can lose the agent's fork server before the agent itself. multiprocessing then says
    255 for every rank the server forked -- not their exit, an unknown one -- and an agent that
    reported it at once made the control process blame "exit code 255" instead of the lost
    node (the clean-clone CI of 1b35b2d, ``test_live_node_set_down_is_relaid_out_live``). Such
    an exit is reported only after ``agent.SERVER_GRACE_S`` (a stopped node's agent is gone by
    then: its silent beat names the node), and a rank the server orphaned is killed first."""
    import multiprocessing as mp
    import os
    import signal

    monkeypatch.setattr(agent, "BEAT_S", 0.05)
    monkeypatch.setattr(agent, "SERVER_GRACE_S", 1.5)
    port = free_port()
    store = _store(port, True)
    node = agent.Agent("127.0.0.1", port, 0, timeout_s=30)
    threading.Thread(target=node.run, daemon=True).start()
    proc = node._ctx.Process(target=time.sleep, args=(300,))
    node._add(7, proc)
    with open(f"/proc/{proc.pid}/stat") as f:  # the rank's parent: the fork server
        server = int(f.read().rsplit(")", 1)[1].split()[1])
    assert server != os.getpid()
    os.kill(server, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 1.0:  # inside the grace: nothing reported
        assert not store.check(["exits"]), store.get("exits")
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while not store.check(["exits"]):
        assert time.monotonic() < deadline, "the exit was never reported"
        time.sleep(0.05)
    assert time.monotonic() - killed >= 1.5
    assert store.get("exits").decode() == "7 255\n"
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously
    while _alive(proc.pid):
        assert time.monotonic() < deadline, "the orphaned rank was left running"
        time.sleep(0.05)
    node.done.set()
    mp.get_context("forkserver")  # later tests start a new server (ensure_running)
