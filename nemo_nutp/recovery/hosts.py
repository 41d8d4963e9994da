"""Where the live control process's ranks run: this machine, or node agents on a cluster.

The control loop (``control.run_world``) is one piece of code for both; it only asks a host
to start a world's ranks, start one returning GPU's process, and stop processes, and it sees
every process through the same small handle (``pid``, ``exitcode``, ``kill()``,
``join(timeout)``):

* ``LocalHost`` (the CPU supervisor, ``nutp-train recovery.mode=live``): forked from one fork
  server on this machine (``world.PRELOAD``); a handle is the ``multiprocessing`` process.
* ``AgentHost`` (Slurm, ``nutp sbatch ... recovery.mode=live``): one node agent per node
  (``recovery/agent.py``, one srun task each) starts and kills its node's processes on
  request, reports their exits and is its node's watchdog for hangs (``watch``: the control
  loop's hang check reads node digests, O(nodes) per poll, instead of every rank's files).
  Requests and reports go through the control process's own store (``agent_store``): per node
  one command key at a time (``agent<n>/cmd<seq>``, the agent blocks on it), its reply
  (``agent<n>/re<seq>``), one append-only exit log for the whole job (``exits``, with the
  counter ``exits_n``: the control process reads it only when the counter moved, one request
  per poll, O(1)) and each agent's liveness beat (``agent<n>/beat``, read with one
  ``multi_get`` per ``BEAT_CHECK_S``, O(nodes)): an agent silent for ``AGENT_LOST_S``
  lost its node, whose processes then count as dead (exit code ``decisions.lost_code(node)``,
  reported as "node agent <name> lost", the node's Slurm name from its agent, never as a
  signal).

Detection bound: a lost node's processes count as dead at most ``AGENT_LOST_S + BEAT_CHECK_S``
(plus one poll) after its agent's last beat; that is well inside the survivors' wait for the
abort (``live.link.ABORT_WAIT_S``), so a whole node lost at once is one live re-layout, not a
survivor giving up (``tests/recovery/test_hosts.py`` checks the two against each other).

Guarantees: a handle's ``exitcode`` is None until its process ended (or its node was lost),
then stays fixed; ``kill`` is idempotent; ``stop`` returns when every handle has an exit code
or ``STOP_TIMEOUT_S`` passed. Not guaranteed: a process's ``pid`` names a process on its own
node only.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from ..health.decisions import lost_code
from .world import RankEntry

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

AGENT_LOST_S = 5.0  # five missed beats: the node is lost
BEAT_S = 1.0  # an agent's liveness beat
BEAT_CHECK_S = 1.0
STOP_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 120.0


class Proc(Protocol):
    """One rank's process as the control loop sees it."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class Host(Protocol):
    """Where a world's rank processes run: this machine (``LocalHost``) or a cluster's node
    agents (``AgentHost``). The control loop (``control.run_world``) and the supervisor use
    nothing else of it."""

    address: str  # how the ranks reach the control process

    @property
    def node_names(self) -> tuple[str, ...]:
        """Node id -> its name, for reasons (``node agent n2 lost``); () on one machine."""

    def start_world(self, job: JobConfig, plan: Plan, env: dict[str, str]) -> list[Proc]:
        """Start every rank of ``plan`` (rank r on GPU ``plan.rank_to_gpu[r]``)."""

    def start_joiner(self, slot: int, job: JobConfig, old_plan: Plan, gpu: int, gen: int,
                     env: dict[str, str]) -> Proc:
        """Start a returning GPU's process, to join world ``gen`` (grow back)."""

    def start_standby(self, job: JobConfig, gpu: int, env: dict[str, str]) -> Proc:
        """Start a hot spare's standby process for ``gpu`` (``world.standby_main``)."""

    def stop(self, procs: list[Proc]) -> None:
        """Kill ``procs`` and wait for them (whole process groups)."""

    def watch(self, w: Any, *, started: float, rec: Any) -> Any:
        """The hang watch over ``w``'s ranks (node digests), or None: read the ranks' files."""

    def close(self) -> None:
        """Release what the host holds (agents told to stop)."""


class LocalProc:
    """A forked rank on this machine (its own process group: its helpers die with it)."""

    def __init__(self, p: Any) -> None:
        self._p = p

    @property
    def pid(self) -> int | None:
        return int(self._p.pid) if self._p.pid is not None else None

    @property
    def exitcode(self) -> int | None:
        code = self._p.exitcode
        return None if code is None else int(code)

    def kill(self) -> None:
        try:
            os.killpg(self._p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            self._p.kill()  # not yet its own group leader, or gone

    def join(self, timeout: float | None = None) -> None:
        self._p.join(timeout)


class LocalHost:
    """Ranks forked on this machine (the CPU supervisor's live mode)."""

    address = "127.0.0.1"

    @property
    def node_names(self) -> tuple[str, ...]:
        return ()  # one machine: no node is lost without this process

    def __init__(self, entry: RankEntry | None = None) -> None:
        """``entry``: how a rank and a joiner start (default ``nutp-train``'s;
        ``nutp-bridge`` passes its own)."""
        import multiprocessing as mp

        self.entry = entry or RankEntry()
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(self.entry.preload))

    def start_world(self, job: JobConfig, plan: Plan, env: dict[str, str]) -> list[Proc]:
        procs = [self._ctx.Process(target=self.entry.target,
                                   args=(r, plan.world_size, job, plan, 0, env))
                 for r in range(plan.world_size)]
        for p in procs:
            p.start()
        return [LocalProc(p) for p in procs]

    def start_joiner(self, slot: int, job: JobConfig, old_plan: Plan, gpu: int, gen: int,
                     env: dict[str, str]) -> Proc:
        p = self._ctx.Process(target=self.entry.join,
                              args=(slot, job, old_plan, gpu, gen, env))
        p.start()
        return LocalProc(p)

    def start_standby(self, job: JobConfig, gpu: int, env: dict[str, str]) -> Proc:
        from .world import standby_main

        p = self._ctx.Process(target=standby_main, args=(self.entry.join, job, gpu, env))
        p.start()
        return LocalProc(p)

    def stop(self, procs: list[Proc]) -> None:
        for p in procs:  # kill whole groups: a killed rank's checkpoint writer would outlive it
            p.kill()
        for p in procs:
            p.join()

    def watch(self, w: Any, *, started: float, rec: Any) -> Any:
        """No hang aggregator: on one machine the control loop reads the ranks' files."""
        return None

    def close(self) -> None:
        pass


def agent_key(node: int, what: str) -> str:
    return f"agent{node}/{what}"


@dataclass
class RemoteProc:
    """A rank started by a node agent."""

    host: AgentHost
    id: int  # the control process's number for it (never reused in a job)
    node: int
    pid: int | None = None

    @property
    def exitcode(self) -> int | None:
        return self.host.exitcode(self.id)

    def kill(self) -> None:
        if self.exitcode is None:
            self.host.kill([self])

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.02)


@dataclass
class AgentHost:
    """Ranks started by the node agents of a cluster job (``recovery/agent.py``)."""

    store: Any  # the control process's store (``agent_store``)
    nodes: int
    gpus_per_node: int
    address: str  # how the ranks reach this control process (its host name)
    reply_timeout_s: float = REPLY_TIMEOUT_S  # an agent's answer (the first: its container start)
    entry: RankEntry = field(default_factory=RankEntry)
    """How the agents start a rank and a joiner (``world.RankEntry``: ``nutp-train``'s by
    default, ``nutp-bridge``'s from its control process); it travels with the job."""
    _seq: dict[int, int] = field(default_factory=dict)
    _next_id: int = 0
    _exits: dict[int, int] = field(default_factory=dict)
    _exits_n: int = 0
    _checked: float = 0.0
    _beats_checked: float = 0.0
    _live: dict[int, RemoteProc] = field(default_factory=dict)
    _lost: set[int] = field(default_factory=set)
    _beats: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # last value, seen at
    _names: dict[int, str] = field(default_factory=dict)  # node -> name (``wait_names``)

    @property
    def node_names(self) -> tuple[str, ...]:
        """Each node's name as its agent reported it (its index until it did)."""
        return tuple(self._names.get(n, str(n)) for n in range(self.nodes))

    def wait_names(self) -> tuple[str, ...]:
        """Wait until every node's agent has said which node it is (``agent<n>/host``, the first
        thing an agent does), at most ``reply_timeout_s``; the names by node id."""
        keys = [agent_key(n, "host") for n in range(self.nodes)]
        deadline = time.monotonic() + self.reply_timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node agents did not start within {self.reply_timeout_s:.0f} "
                                   "s")
            time.sleep(0.05)
        self._names = {n: v.decode() for n, v in enumerate(self.store.multi_get(keys))}
        return self.node_names

    # -- requests ---------------------------------------------------------------------

    def _request(self, node: int, op: dict[str, Any]) -> int:
        seq = self._seq.get(node, 0)
        self._seq[node] = seq + 1
        self.store.set(agent_key(node, f"cmd{seq}"), json.dumps(op))
        return seq

    def _replies(self, sent: dict[int, int]) -> dict[int, dict[str, Any]]:
        keys = {n: agent_key(n, f"re{s}") for n, s in sent.items()}
        deadline = time.monotonic() + self.reply_timeout_s
        while not self.store.check(list(keys.values())):
            lost = [n for n in keys if n in self._lost_nodes()]
            if lost:
                raise RuntimeError(f"node agent {lost[0]} lost while starting processes")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node agents did not answer within "
                                   f"{self.reply_timeout_s:.0f} s")
            time.sleep(0.02)
        replies = {n: json.loads(self.store.get(k)) for n, k in keys.items()}
        for n, r in replies.items():
            if "error" in r:
                raise RuntimeError(f"node agent {n}: {r['error']}")
        return replies

    def _new(self, node: int) -> RemoteProc:
        p = RemoteProc(self, self._next_id, node)
        self._next_id += 1
        self._live[p.id] = p
        return p

    def start_world(self, job: JobConfig, plan: Plan, env: dict[str, str]) -> list[Proc]:
        """One ``start`` per node with that node's ranks. The job config and the rank entry
        (``entry``) travel pickled (a few KB); each agent plans from the job with the same
        ``build_plan`` as the supervisor (the plan itself is O(W)), checks its rank -> GPU map
        is the one posted, and starts the entry's ranks."""
        gpn = self.gpus_per_node
        procs = [self._new(g // gpn) for g in plan.rank_to_gpu]
        by_node: dict[int, list[list[int]]] = {}
        for r, (g, p) in enumerate(zip(plan.rank_to_gpu, procs, strict=True)):
            by_node.setdefault(g // gpn, []).append([r, g, p.id])
        key = f"job{procs[0].id}"
        self.store.set(key, pickle.dumps((job, self.entry)))
        common = {"op": "start", "key": key, "rank_to_gpu": list(plan.rank_to_gpu), "env": env}
        sent = {n: self._request(n, {**common, "ranks": ranks}) for n, ranks in by_node.items()}
        for reply in self._replies(sent).values():
            for pid_of in reply["pids"]:
                self._live[int(pid_of[0])].pid = int(pid_of[1])
        return list(procs)

    def start_joiner(self, slot: int, job: JobConfig, old_plan: Plan, gpu: int, gen: int,
                     env: dict[str, str]) -> Proc:
        """The returning GPU's process, started by its node's agent (the stopped world's plan
        travels pickled: the live planner's plans depend on the previous one)."""
        p = self._new(gpu // self.gpus_per_node)
        key = f"joiner{p.id}"
        self.store.set(key, pickle.dumps((job, old_plan, self.entry)))
        sent = {p.node: self._request(p.node, {"op": "join", "id": p.id, "slot": slot,
                                               "gpu": gpu, "gen": gen, "key": key,
                                               "env": env})}
        p.pid = int(self._replies(sent)[p.node]["pids"][0][1])
        return p

    def start_standby(self, job: JobConfig, gpu: int, env: dict[str, str]) -> Proc:
        """A hot spare's standby process, started by its node's agent (``agent._standby``)."""
        p = self._new(gpu // self.gpus_per_node)
        key = f"standby{p.id}"
        self.store.set(key, pickle.dumps((job, self.entry)))
        sent = {p.node: self._request(p.node, {"op": "standby", "id": p.id, "gpu": gpu,
                                               "key": key, "env": env})}
        p.pid = int(self._replies(sent)[p.node]["pids"][0][1])
        return p

    def kill(self, procs: list[RemoteProc]) -> None:
        by_node: dict[int, list[int]] = {}
        for p in procs:
            by_node.setdefault(p.node, []).append(p.id)
        for n, ids in by_node.items():
            if n not in self._lost:
                self._request(n, {"op": "kill", "ids": ids})

    def stop(self, procs: list[Proc]) -> None:
        remote = [p for p in procs if isinstance(p, RemoteProc) and p.exitcode is None]
        self.kill(remote)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in remote:
            p.join(max(0.0, deadline - time.monotonic()))

    def watch(self, w: Any, *, started: float, rec: Any) -> Any:
        """The hang check of world ``w`` (``control.World``): each node's agent runs the node
        watchdog (``aggregate.NodeWatch``) over its ranks' heartbeat and stack files and
        publishes one digest per ``NODE_POLL_S``; the returned ``aggregate.Aggregator`` reads
        all digests in one ``multi_get`` per poll (O(nodes)), the details only after a stall.
        One ``watch`` request per node per world."""
        import torch.distributed as dist

        from ..health.aggregate import Aggregator, StoreSource, node_ranks, preset

        prefix = f"watch{w.gen}.{self._next_id}/"  # a world of its own (ids are never reused)
        store = dist.PrefixStore(prefix, self.store)
        preset(store, self.nodes)
        for n in range(self.nodes):
            ranks = node_ranks(w.plan.rank_to_gpu, self.gpus_per_node, n)
            if ranks and n not in self._lost:
                self._request(n, {"op": "watch", "prefix": prefix, "dir": str(w.hb),
                                  "ranks": ranks})
        return Aggregator(StoreSource(store, self.nodes), w.plan.world_size,
                          timeout_s=rec.heartbeat_timeout_s,
                          startup_timeout_s=rec.startup_timeout_s, started_at=started)

    def close(self) -> None:
        """The job is over: every agent kills what is left on its node and exits."""
        for n in range(self.nodes):
            if n not in self._lost:
                self._request(n, {"op": "exit"})

    # -- reports ----------------------------------------------------------------------

    def exitcode(self, pid_id: int) -> int | None:
        now = time.monotonic()
        if now - self._checked >= 0.01:
            self._checked = now
            self._refresh(now)
        return self._exits.get(pid_id)

    def _refresh(self, now: float) -> None:
        n = self.store.add("exits_n", 0)
        if n != self._exits_n:
            self._exits_n = n
            for line in self.store.get("exits").decode().split("\n"):
                if line:
                    i, code = line.split()
                    self._exits.setdefault(int(i), int(code))
        if now - self._beats_checked >= BEAT_CHECK_S:
            self._beats_checked = now
            for node in self._lost_nodes():
                for p in self._live.values():
                    if p.node == node:
                        self._exits.setdefault(p.id, lost_code(node))

    def _lost_nodes(self) -> set[int]:
        """Nodes whose agent's beat (a counter) did not move for ``AGENT_LOST_S`` of this
        process's clock (no clock is compared across nodes)."""
        keys = [agent_key(n, "beat") for n in range(self.nodes)]
        if self.store.check(keys):
            now = time.monotonic()
            for n, b in enumerate(self.store.multi_get(keys)):
                last = self._beats.get(n)
                if last is None or last[0] != b:
                    self._beats[n] = (b, now)
                elif now - last[1] > AGENT_LOST_S:
                    self._lost.add(n)
        return self._lost


def agent_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> Any:
    """The control process's store for its node agents (the control process serves it)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=True)
