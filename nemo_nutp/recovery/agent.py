"""Node agent of ``recovery.mode=live`` on a cluster: starts and kills its node's rank processes
for the control process, reports their exits.

One agent per node (one srun task each, ``nutp sbatch ... recovery.mode=live``); the agent
trains nothing and decides nothing. It connects to the control process's store
(``hosts.agent_store``) and serves three threads of work:

* **commands** (one blocking wait on ``agent<node>/cmd<seq>`` at a time, no polling): ``start``
  (a world's ranks on this node: the pickled job config, planned here with the same
  ``build_plan`` and checked against the posted rank -> GPU map, and the job's rank entry,
  ``world.RankEntry``: what a rank runs -- ``nutp-train``'s ``world.rank_main`` or
  ``nutp-bridge``'s Bridge rank -- as the control process says, never chosen here), ``join``
  (one returning GPU's process, the entry's ``join``; the stopped world's plan pickled; logged
  as the event ``agent_join``), ``watch`` (be the node watchdog of a new world:
  ``aggregate.NodeWatch`` over its ranks' heartbeat and stack files, one digest per
  half-second; the previous world's watchdog stops), ``kill`` (SIGKILL to the processes'
  groups), ``exit`` (kill what is left, leave 0); each answered on ``re<seq>``;
* **exits**: the main thread waits on its processes' sentinels and appends ``"<id> <code>"`` to
  the job's exit log (``exits``, counter ``exits_n``);
* **liveness**: a counter ``agent<node>/beat`` bumped every ``hosts.BEAT_S``.

Processes fork from one fork server per agent that imported torch and megatron once (the
entry's ``preload``, from the first ``start`` or ``join``), as the CPU supervisor's do; each
rank drives local GPU ``gpu % gpus_per_node`` of its node, and ends with the agent
(``common.env.AGENT_PID``: an agent that is killed leaves no rank behind, as a lost node
would). If the control process's store stops
answering, the agent kills its processes and exits 3 (nobody is left to re-plan); with
``--max-requeues`` (``nutp sbatch --requeue``) it first resubmits the job's script, which resumes
from the newest checkpoint, and cancels the old job (``resubmit``).

Cost: per agent O(ranks on its node) processes and one store request per exit, per command and
per beat; nothing per training step.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

from ..common.env import AGENT_PID, EVENTS, REQUEUED, SLURM_NODE_NAME, requeued
from .hosts import BEAT_S, agent_key, agent_store
from .world import RankEntry

EXIT_LOST = 3  # the control process's store is gone
SERVER_LOST = 255
"""What multiprocessing says for a process whose fork server is gone: not its exit, an unknown
one (the server, which waits on its children, died first)."""
SERVER_GRACE_S = 3.0
"""How long such an exit waits before it is reported. A node that Slurm stops (set DOWN, the
step cancelled there) signals every process of the agents' step, the fork server possibly
before the agent: reported at once, the ranks' "exit code 255" reached the control process
before the agent's silence did, and the failure was blamed on the ranks' exits instead of the
lost node. The agent is gone well inside the grace (``KillWait`` applies only to processes
that survive SIGTERM; the agent does not handle it)."""


def _env(op: dict[str, Any]) -> dict[str, str]:
    """A rank's environment: the control process's, and this agent's pid (``world.enter``: the
    rank ends when the agent does)."""
    return {**op["env"], AGENT_PID: str(os.getpid())}


class Agent:
    def __init__(self, host: str, port: int, node: int, *, timeout_s: float,
                 max_requeues: int = 0) -> None:
        import multiprocessing as mp

        self.max_requeues = max_requeues  # > 0: resubmit the job when the control is lost
        self.events: str | None = None  # the job's event log, from the first start request
        self.node = node
        # how the reasons name this node: Slurm's node name (several slurmd may share a host)
        self.name = os.environ.get(SLURM_NODE_NAME) or socket.gethostname()
        self.cmds = agent_store(host, port, is_master=False, timeout_s=timeout_s)
        self.reports = agent_store(host, port, is_master=False, timeout_s=timeout_s)
        self._report_lock = threading.Lock()
        self._ctx = mp.get_context("forkserver")
        self._entry: RankEntry | None = None  # the job's, from its first start or join
        self.watcher = agent_store(host, port, is_master=False, timeout_s=timeout_s)
        self._watching = 0  # the newest ``watch`` request (older watchdog threads stop)
        self._procs: dict[int, Any] = {}  # id -> multiprocessing process, while it runs
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.code = 0

    # -- commands -------------------------------------------------------------------------

    def _start(self, op: dict[str, Any]) -> list[list[int]]:
        from ..config import plan_request
        from ..layout import build_plan

        job, entry = pickle.loads(self.cmds.get(op["key"]))
        self._use(entry)
        plan = build_plan(plan_request(job))
        if list(plan.rank_to_gpu) != op["rank_to_gpu"]:
            raise RuntimeError(f"node {self.node} planned rank_to_gpu={list(plan.rank_to_gpu)} "
                               f"but the control process posted {op['rank_to_gpu']} (the same "
                               "code and config on every node?)")
        gpn = job.cluster.gpus_per_node
        started = []
        for rank, gpu, pid_id in op["ranks"]:
            p = self._ctx.Process(target=entry.target, args=(rank, plan.world_size, job, plan,
                                                              0, _env(op)),
                                  kwargs={"local": gpu % gpn})
            started.append(self._add(pid_id, p))
        return started

    def _join(self, op: dict[str, Any]) -> list[list[int]]:
        from ..common.events import log_event

        job, old_plan, entry = pickle.loads(self.cmds.get(op["key"]))
        self._use(entry)
        p = self._ctx.Process(target=entry.join, args=(op["slot"], job, old_plan, op["gpu"],
                                                       op["gen"], _env(op)))
        started = self._add(op["id"], p)
        log_event("agent_join", file=op["env"][EVENTS], node=self.node, gpu=op["gpu"],
                  slot=op["slot"], gen=op["gen"], pid=started[1])
        return [started]

    def _standby(self, op: dict[str, Any]) -> list[list[int]]:
        """A hot spare's standby process on this node (``world.standby_main``): the entry's
        joiner once the control process wakes it."""
        from ..common.events import log_event
        from .world import standby_main

        job, entry = pickle.loads(self.cmds.get(op["key"]))
        self._use(entry)
        p = self._ctx.Process(target=standby_main, args=(entry.join, job, op["gpu"], _env(op)))
        started = self._add(op["id"], p)
        log_event("agent_standby", file=op["env"][EVENTS], node=self.node, gpu=op["gpu"],
                  pid=started[1])
        return [started]

    def _use(self, entry: RankEntry) -> None:
        """The job's rank entry: the first one names the fork server's preload (the server
        starts with the first process and keeps it); a later preload that differs is an
        error (a job has one entry)."""
        if self._entry is None:
            self._entry = entry
            self._ctx.set_forkserver_preload(list(entry.preload))
        elif entry.preload != self._entry.preload:
            raise RuntimeError(f"node {self.node}: the control process changed the ranks' "
                               f"preload from {self._entry.preload} to {entry.preload}")

    def _add(self, pid_id: int, p: Any) -> list[int]:
        p.start()
        with self._lock:
            self._procs[pid_id] = p
        return [pid_id, int(p.pid)]

    def _kill(self, ids: list[int]) -> None:
        with self._lock:
            procs = [self._procs[i] for i in ids if i in self._procs]
        for p in procs:
            try:  # the rank's own process group: its checkpoint writer helpers die with it
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()

    def _watch(self, op: dict[str, Any]) -> None:
        """This node's watchdog for a new world: its ranks' files -> one digest per period."""
        import torch.distributed as dist

        from ..health.aggregate import NODE_POLL_S, NodeWatch

        self._watching += 1
        mine = self._watching
        nw = NodeWatch(Path(op["dir"]), op["ranks"], self.node,
                       dist.PrefixStore(op["prefix"], self.watcher))

        def run() -> None:
            while self._watching == mine and not self.done.is_set():
                try:
                    nw.poll()
                except Exception:  # a store hiccup: the next period publishes again
                    pass
                time.sleep(NODE_POLL_S)

        threading.Thread(target=run, name="nutp-node-watch", daemon=True).start()

    def serve(self) -> None:
        """The command thread."""
        seq = 0
        while not self.done.is_set():
            key = agent_key(self.node, f"cmd{seq}")
            try:
                self.cmds.wait([key], timedelta(seconds=60))
            except Exception:
                try:  # a timeout renews the wait; a store that does not answer ends the agent
                    if not self.cmds.check([key]):
                        continue
                except Exception:
                    self._lost()
                    return
            op = json.loads(self.cmds.get(key))
            reply: dict[str, Any] = {"pids": []}
            try:
                if op["op"] == "start":
                    self.events = op.get("env", {}).get(EVENTS, self.events)
                    reply["pids"] = self._start(op)
                elif op["op"] == "join":
                    reply["pids"] = self._join(op)
                elif op["op"] == "standby":
                    reply["pids"] = self._standby(op)
                elif op["op"] == "kill":
                    self._kill(op["ids"])
                elif op["op"] == "watch":
                    self._watch(op)
                elif op["op"] == "exit":
                    self.done.set()
            except Exception as e:  # answered: the control process raises it
                reply["error"] = f"{type(e).__name__}: {e}"
            self.cmds.set(agent_key(self.node, f"re{seq}"), json.dumps(reply))
            seq += 1

    def _lost(self) -> None:
        if self.code != EXIT_LOST:
            print(f"nutp agent {self.node} ({self.name}): the control process is lost (its "
                  "store does not answer); stopping this node's ranks", flush=True)
        self.code = EXIT_LOST
        self.done.set()

    # -- reports --------------------------------------------------------------------------

    def beat(self) -> None:
        misses = 0
        while not self.done.wait(BEAT_S):
            try:
                with self._report_lock:
                    self.reports.add(agent_key(self.node, "beat"), 1)
                misses = 0
            except Exception:
                misses += 1
                if misses >= 5:
                    self._lost()

    def _report(self, pid_id: int, code: int) -> None:
        try:
            with self._report_lock:
                self.reports.append("exits", f"{pid_id} {code}\n")
                self.reports.add("exits_n", 1)
        except Exception:
            self._lost()

    def reap(self) -> None:
        """The main thread: report every process's exit until told to stop."""
        while not self.done.is_set():
            with self._lock:
                running = dict(self._procs)
            if not running:
                time.sleep(0.1)
                continue
            wait_sentinels([p.sentinel for p in running.values()], timeout=0.2)
            ended = {i: p for i, p in running.items() if p.exitcode is not None}
            if any(p.exitcode == SERVER_LOST for p in ended.values()):
                self._server_lost(ended)
            for i, p in ended.items():
                p.join()
                with self._lock:
                    del self._procs[i]
                self._report(i, int(p.exitcode))

    def _server_lost(self, ended: dict[int, Any]) -> None:
        """Exits that may be the fork server's loss (``SERVER_LOST``): wait ``SERVER_GRACE_S``
        (an agent whose node is being stopped ends in it, unreported), then kill what the
        server left running (the rank's process group) before reporting them."""
        self.done.wait(SERVER_GRACE_S)
        for p in ended.values():
            if p.exitcode == SERVER_LOST:
                for kill in (os.killpg, os.kill):  # its group (``world.enter``), else itself
                    try:
                        kill(p.pid, signal.SIGKILL)
                        break
                    except (ProcessLookupError, PermissionError):
                        pass

    def run(self) -> int:
        with self._report_lock:
            self.reports.set(agent_key(self.node, "host"), self.name)  # ``AgentHost.wait_names``
            self.reports.add(agent_key(self.node, "beat"), 1)
        threading.Thread(target=self.serve, name="nutp-agent-cmds", daemon=True).start()
        threading.Thread(target=self.beat, name="nutp-agent-beat", daemon=True).start()
        self.reap()
        with self._lock:
            left = list(self._procs)
        self._kill(left)
        if self.code == EXIT_LOST and self.max_requeues:
            # the run's recovery folder (shared by every node), else where the job's output is
            where = (Path(self.events).parent if self.events is not None
                     else Path(os.environ.get("SLURM_SUBMIT_DIR", ".")))
            done = resubmit(os.environ.get("SLURM_JOB_ID"), self.max_requeues, where)
            print(f"nutp agent {self.node} ({self.name}): {done.line}", flush=True)
            if self.events is not None:  # this node's output may have gone with the batch host
                from ..common.events import log_event

                log_event("control_lost", file=self.events, node=self.node, host=self.name,
                          requeue=done.line)
            if done.cancel is not None:
                print(f"nutp agent {self.node} ({self.name}): {cancel(done.cancel)}",
                      flush=True)
        return self.code


@dataclass(frozen=True)
class Requeue:
    """What an agent did about its job after the control process was lost."""

    line: str
    """One line saying it (the ``control_lost`` event's ``requeue``)."""
    cancel: str | None = None
    """The old job, to cancel once the line is logged (cancelling it ends this agent too)."""


def _sbatch_env(requeue: int) -> dict[str, str]:
    """This agent's environment for ``sbatch``: the job's own (the submitter's, as Slurm passed
    it on) without what Slurm set for this job and step -- ``SLURM_*`` (but ``SLURM_CONF``),
    ``SLURMD_*``, ``SRUN_*``: inherited, they would steer the new job's ``srun`` calls (CPUs per
    task, tasks per node) -- and with the resubmission's count (``env.requeued``)."""
    env = {k: v for k, v in os.environ.items()
           if k == "SLURM_CONF" or not k.startswith(("SLURM_", "SLURMD_", "SRUN_"))}
    env[REQUEUED] = str(requeue)
    return env


def resubmit(job: str | None, max_requeues: int, lock_dir: Path) -> Requeue:
    """Resubmit ``job``'s batch script as a fresh job after its control process was lost (its
    host, the batch host, failed), to resume from the newest checkpoint.

    Slurm neither ends nor requeues a ``--no-kill`` job whose batch host fails, and a job that
    ``scontrol requeue`` gives a new allocation after losing a node cannot start GPU job steps
    on Slurm 22.05 (``_step_get_gres_cnt ... node offset invalid``). So the script Slurm keeps
    (``scontrol write batch_script``) goes to ``sbatch`` with ``NUTP_REQUEUED`` = the runs so far
    + 1 (``env.requeued``: the health report and node table carry over, injected faults do not
    fire again) and ``--dependency=afterany:<job>`` (it starts once the old job has ended, on
    the nodes Slurm has then: never a DOWN one); the caller cancels ``job`` (``Requeue.cancel``).
    At most ``max_requeues`` runs after the first (``recovery.max_restarts``). Of the agents
    left, the first to create ``<lock_dir>/resubmit.<job>`` (the run's shared recovery folder)
    resubmits; the others leave it."""
    import shutil

    if not job:
        return Requeue("not under Slurm (no SLURM_JOB_ID): nothing to resubmit")
    done = requeued()
    if done >= max_requeues:
        return Requeue(f"job {job} is run {done + 1} of this job already, the last one "
                       f"recovery.max_restarts={max_requeues} allows: not resubmitted again")
    exes = {n: shutil.which(n) for n in ("scontrol", "sbatch", "scancel")}
    missing = [n for n, exe in exes.items() if exe is None]
    if missing:
        return Requeue(f"{', '.join(missing)} not in this container: resubmit job {job} by "
                       f"hand (`scontrol write batch_script {job} - | {REQUEUED}={done + 1} "
                       f"sbatch`; it resumes from the newest checkpoint) and cancel it")
    lock = lock_dir / f"resubmit.{job}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return Requeue(f"another node's agent resubmits job {job} ({lock})")
    except OSError as e:
        return Requeue(f"cannot create {lock} ({e.strerror}): resubmit job {job} by hand")

    def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess:
        return _run([exes[cmd[0]] or cmd[0], *cmd[1:]], **kw)

    with os.fdopen(fd, "w") as f:
        script = run("scontrol", "write", "batch_script", job, "-")
        if script.returncode != 0 or not script.stdout.startswith("#!"):
            f.write("failed\n")
            return Requeue(f"scontrol write batch_script {job}: {_why(script)}: resubmit the "
                           "job by hand")
        where = os.environ.get("SLURM_SUBMIT_DIR")  # where the first run's output went
        new = run("sbatch", "--parsable", f"--dependency=afterany:{job}",
                  *([f"--chdir={where}"] if where else []), input=script.stdout,
                  env=_sbatch_env(done + 1))
        if new.returncode != 0:
            f.write("failed\n")
            return Requeue(f"sbatch of job {job}'s script: {_why(new)}: resubmit the job by "
                           "hand")
        new_id = new.stdout.strip().split(";")[0]
        f.write(f"{new_id}\n")
    return Requeue(f"resubmitted job {job}'s script as job {new_id} (run {done + 2}; it "
                   f"starts when job {job} has ended and resumes from the newest checkpoint); "
                   f"cancelling job {job}", cancel=job)


def cancel(job: str) -> str:
    """``scancel job``: the old job, once its resubmission is logged (Slurm ends this agent,
    part of it, too). One line if it fails."""
    import shutil

    r = _run([shutil.which("scancel") or "scancel", job])
    if r.returncode == 0:
        return f"cancelled job {job}"
    return f"scancel {job}: {_why(r)}: cancel it by hand (its resubmission waits for its end)"


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """``cmd``'s result; one that cannot start or takes over a minute fails with the reason in
    ``stderr`` (never an exception)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, -1, "", f"{cmd[0]}: {e}")


def _why(r: subprocess.CompletedProcess) -> str:
    return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m nemo_nutp.recovery.agent",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--control", required=True, metavar="HOST:PORT",
                    help="the control process's store")
    ap.add_argument("--node", type=int, default=None,
                    help="this node's index (default: SLURM_NODEID)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for the control process to come up")
    ap.add_argument("--max-requeues", type=int, default=0,
                    help="resubmit the job's script when the control process is lost, at "
                         "most this many times per job (0: never; `nutp sbatch --requeue`)")
    args = ap.parse_args(argv)
    node = args.node if args.node is not None else int(os.environ.get("SLURM_NODEID", "0"))
    host, port = args.control.rsplit(":", 1)
    return Agent(host, int(port), node, timeout_s=args.timeout,
                 max_requeues=args.max_requeues).run()


if __name__ == "__main__":
    raise SystemExit(main())
