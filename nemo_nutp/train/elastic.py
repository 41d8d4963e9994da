"""Recovery under an external launcher: ``torchrun --max-restarts``, ``ft_launcher``, srun loops.

``nutp-train recovery.enabled=true`` started by a launcher (``RANK``/``WORLD_SIZE`` in the
environment) runs one worker per GPU *slot* of the cluster (launcher rank ``r`` = GPU ``r``,
node-major, as ``torchrun --nproc-per-node=<GPUs per node>`` and srun's block order number
them). The launcher restarts the whole worker group when one worker dies (torchrun/ft_launcher
``--max-restarts``; ft_launcher also when a rank stops sending heartbeats). Each attempt:

1. every worker joins the launcher's rendezvous store (no process group yet), probes its device
   (CUDA: a small matmul within ``recovery.probe_timeout_s``; CPU: always healthy) and posts the
   result;
2. worker 0 decides the failed GPUs: the health report (``<output.dir>/recovery/health.json``,
   the operator's truth; a GPU removed from it is back), plus GPUs whose probe failed, plus the
   GPUs *blamed* for the previous attempt's end: a rank that left no exit record died without a
   word (SIGKILL, segfault, lost GPU); ranks that raised or were terminated by the launcher wrote
   one. A hang found by the watchdog (below) blames the ranks it names. It writes the health
   report and the attempt record, logs timestamped events, and posts the decision;
3. every worker builds the same plan from the decision (the job's policy re-plans degrees);
   workers in the plan form a fresh default process group over the store (rank = plan rank,
   NCCL on CUDA, gloo on CPU) and resume from the newest complete checkpoint; a worker whose GPU
   is failed or unused waits idle until the plan's rank 0 posts that the job finished;
4. every plan rank runs the stack watcher of ``watch.py``, its files and step heartbeats on
   the node's own disk; the node's lowest plan rank publishes one digest of its node's ranks
   to the store every half-second, and a job-level aggregator process started by launcher
   rank 0 (``aggregate.py``: O(1) work per training rank, O(W) off the training ranks) reads
   all digests in one request and, when progress stalls past
   ``recovery.heartbeat_timeout_s``, records the blamed ranks (those behind their peers in
   their collectives, or not blocked in collectives: ``recovery.blame_hang``) and sets the
   ``abort`` key, so every worker exits and the launcher restarts the group. A thread on plan
   rank 0 reads the health report: GPUs reported back trigger a planned restart at the
   first checkpoint completed after the report (``scaleup.<attempt>.json``), and the next
   attempt plans the fuller layout. A straggler found with ``nutp.exclude_stragglers`` is a
   planned restart too: the run stops after the next checkpoint, plan rank 0 records it
   (``straggler.<attempt>.json``) and ends the attempt, and the next attempt re-plans with it
   as a slow GPU (kept in every later attempt's record). Under ft_launcher
   (nvidia-resiliency-ext) every worker also sends the rank monitor liveness heartbeats from a
   thread, so a worker frozen as a whole is terminated by ft_launcher (keep
   ``recovery.heartbeat_timeout_s`` below ft_launcher's ``--ft-rank-heartbeat-timeout`` so the
   watchdog, which can name the rank that hung, acts first).

Events (``recovery/events.jsonl``) and the per-restart summary (``recovery/summary.json``) have
the same form as under the CPU supervisor (``recovery/supervisor.py``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import (
    ATTEMPT,
    DEBUG,
    EVENTS,
    HEARTBEAT_DIR,
    NODE_INDEX,
    SLURM_NODE_NAME,
    requeued,
)
from ..common.events import log_event, read_events
from ..health import aggregate, nodes, watch
from ..health.decisions import Failure, job_for, lost_steps, next_failed
from ..layout.serialize import write_json_atomic

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

EXIT_SCALE_UP = 76  # worker exit code for a planned restart: GPUs reported back
EXIT_ABORT = 77  # another worker ended the attempt (store key "abort"), or the store is gone
CONTROL_S = 1.0  # retry period of the control thread while the store does not answer
WAIT_S = 60.0  # one blocking wait on the abort key lasts this long, then it is renewed
HOST_GRACE_S = 1.0  # the store's host outlives an abort this long: the others see the abort,
# not a closed store (whose errors every worker printed, C++ frames included)


@dataclass(frozen=True)
class LauncherEnv:
    rank: int
    world: int
    local_rank: int
    attempt: int
    slot: int
    """This worker's GPU slot in the cluster's numbering (see ``gpu_slot``)."""


def gpu_slot(env: dict[str, str], world: int, local_rank: int, gpus_per_node: int) -> int:
    """The cluster GPU this worker drives: node index x GPUs per node + local rank.

    The node index must be stable across restarts (a failed GPU must stay the same physical
    GPU), which neither a launcher's global rank nor torchrun's ``GROUP_RANK`` is (the c10d
    rendezvous numbers nodes in join order). So it is ``NUTP_NODE_INDEX`` if set, else Slurm's
    ``SLURM_NODEID``; a single-node world needs neither (node 0)."""
    if not 0 <= local_rank < gpus_per_node:
        raise ValueError(f"LOCAL_RANK={local_rank}: must be < cluster.gpus_per_node="
                         f"{gpus_per_node} (one worker per GPU)")
    for key in (NODE_INDEX, "SLURM_NODEID"):
        if key in env:
            if not env[key].isdigit():
                raise ValueError(f"{key}={env[key]!r}: must be the node index (0, 1, ...)")
            return int(env[key]) * gpus_per_node + local_rank
    if world > gpus_per_node:
        raise ValueError(f"WORLD_SIZE={world} spans several nodes: set {NODE_INDEX} (or run "
                         "under Slurm, which sets SLURM_NODEID) so GPU slots stay the same "
                         "physical GPUs across restarts")
    return local_rank


def attempt_number(env: dict[str, str]) -> int:
    """The launcher's restart count: torchrun/ft_launcher's, else ours (``NUTP_ATTEMPT``, set by
    the srun loop of ``nutp sbatch``). A requeued Slurm job is a new allocation: attempt 0."""
    for key in ("TORCHELASTIC_RESTART_COUNT", ATTEMPT):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def check_world(cfg: JobConfig, world: int) -> None:
    """One worker per GPU slot of the nodes the launcher runs on (before any process group
    exists). Fewer nodes than the cluster's are allowed: a lost node's GPUs count as failed
    (``decide``, ``health/nodes.py``)."""
    c = cfg.cluster
    if world > c.num_gpus or world % c.gpus_per_node:
        raise ValueError(
            f"recovery.enabled=true under a launcher needs one worker per GPU slot: the launcher's "
            f"WORLD_SIZE={world} but cluster.num_gpus={c.num_gpus} with cluster.gpus_per_node="
            f"{c.gpus_per_node} (start cluster.gpus_per_node workers per node, on at most "
            f"{c.num_gpus // c.gpus_per_node} nodes)")


def host_name(env: dict[str, str]) -> str:
    """This worker's node as the node table keys it (``health/nodes.py``): Slurm's node name,
    else ``node<k>`` of the launcher's node index (``gpu_slot``), else ``node0``."""
    if env.get(SLURM_NODE_NAME):
        return env[SLURM_NODE_NAME]
    for key in (NODE_INDEX, "SLURM_NODEID"):
        if env.get(key, "").isdigit():
            return f"node{int(env[key])}"
    return "node0"


# ---------------------------------------------------------------------------------------------
# Evidence of an attempt (files under <output.dir>/recovery, one directory per attempt)
# ---------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def blame_previous(record: dict[str, Any], exits: dict[int, dict[str, Any]],
                   hang: dict[str, Any] | None) -> Failure | None:
    """Who ended the previous attempt (pure).

    ``record``: that attempt's decision (``rank_to_gpu``); ``exits``: exit records by GPU slot;
    ``hang``: the watchdog's finding, if any. A hang names its ranks. Otherwise every plan rank
    without an exit record died without a word and is blamed; if none wrote one, nobody is
    blamed; if all did, the rank whose error record is earliest is blamed, and nobody if the
    launcher or the control thread ended them all (the same layout restarts).

    A post-mortem, not the running world's failure check (``health/check.py``): the attempt has
    ended and its processes are gone, so it judges the exit records and the watchdog's hang
    record they left on disk (written by workers, signal handlers and the aggregator, which
    already polled for hangs), not live exit codes polled on a period."""
    gpus = record["rank_to_gpu"]
    if hang is not None and hang["ranks"]:
        return Failure(tuple(hang["ranks"]), hang["reason"])
    silent = tuple(r for r, g in enumerate(gpus) if g not in exits)
    if silent and len(silent) < len(gpus):
        return Failure(silent, "died without an exit record (killed, crashed or lost its GPU)")
    if silent:
        return None  # nothing tells the ranks apart (the whole group was SIGKILLed): same GPUs
    # Every rank left a record. A rank that raised writes its record before it ends the attempt
    # (abort key, process exit), so the peers' errors and aborts come after it: the earliest
    # error is the cause (e.g. an ECC error or OOM on one GPU). Only terminations: nobody.
    errors = sorted((exits[g]["t"], r) for r, g in enumerate(gpus)
                    if exits[g].get("status") == "error")
    if errors:
        r = errors[0][1]
        return Failure((r,), f"raised first: {exits[gpus[r]].get('detail', '')}"[:300])
    return None


class ExitRecorder:
    """Writes this worker's exit record ``exits.<attempt>/gpu<slot>``: on return, on an
    exception, and on SIGTERM/SIGINT from the launcher even while the main thread is blocked in a
    collective (the C-level signal handler wakes a thread through ``signal.set_wakeup_fd``).
    A worker that leaves no record died without a word."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.path = directory / f"gpu{slot}"
        self._lock = threading.RLock()  # the main thread's handler may interrupt a write
        self._done = False
        self._pid = os.getpid()

    def write(self, status: str, detail: str = "") -> None:
        with self._lock:
            if self._done or os.getpid() != self._pid:  # not in a forked helper
                return
            write_json_atomic({"status": status, "detail": detail[-500:], "t": time.time(),
                               "pid": os.getpid()}, self.path)
            self._done = True

    def install(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        stop = (signal.SIGTERM, signal.SIGINT)

        def on_signal(signum: int, _frame: Any) -> None:  # main thread, when it gets there
            self.write("terminated", f"signal {signum}")
            os._exit(128 + signum)

        for sig in stop:
            signal.signal(sig, on_signal)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def watch() -> None:
            while True:  # the wakeup fd carries every handled signal: act on ours only
                data = os.read(r, 1)
                if not data or data[0] in stop:
                    break
            if os.getpid() != self._pid:
                return
            signum = data[0] if data else signal.SIGTERM
            self.write("terminated", f"signal {signum}")
            os._exit(128 + signum)

        threading.Thread(target=watch, name="nutp-exit-record", daemon=True).start()


def read_exits(directory: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    if directory.is_dir():
        for p in directory.glob("gpu*"):
            rec = _read_json(p)
            if rec is not None and p.name[3:].isdigit():
                out[int(p.name[3:])] = rec
    return out


# ---------------------------------------------------------------------------------------------
# Device probe, decision, watchdog, ft_launcher heartbeats
# ---------------------------------------------------------------------------------------------


def probe_device(local_rank: int, timeout_s: float) -> str | None:
    """None if this worker's device computes; else why not. CPU workers are always healthy."""
    import torch

    if not torch.cuda.is_available():
        return None
    box: list[str | None] = ["probe timed out"]

    def run() -> None:
        try:
            torch.cuda.set_device(local_rank)
            x = torch.ones(256, 256, device=f"cuda:{local_rank}")
            ok = float((x @ x).sum().item()) == 256.0 ** 3
            box[0] = None if ok else "wrong matmul result"
        except Exception as e:  # any CUDA error means the device is unusable
            box[0] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0]


def place_workers(cfg: JobConfig, rdir: Path, posts: list[dict[str, Any]]
                  ) -> tuple[list[int], nodes.Placement]:
    """Each worker's GPU slot (by launcher rank) from the node table: ``index(host) x GPUs per
    node + local GPU``, so a slot names the same physical GPU whatever Slurm's node ids are
    this attempt. Hosts are placed in Slurm's node order (the provisional slots)."""
    gpn = cfg.cluster.gpus_per_node
    first: dict[str, int] = {}
    for w in posts:
        first[w["host"]] = min(first.get(w["host"], w["slot"]), w["slot"])
    present = sorted(first, key=first.__getitem__)
    placed = nodes.place(nodes.read_table(rdir), present, cfg.cluster.num_gpus // gpn)
    slots = [placed.index[w["host"]] * gpn + w["local"] for w in posts]
    if len(set(slots)) != len(slots):
        dup = next(s for s in slots if slots.count(s) > 1)
        raise ValueError(f"two workers drive GPU slot {dup} (host "
                         f"{placed.table[dup // gpn]!r}, local GPU {dup % gpn}): one worker "
                         "per GPU (LOCAL_RANK) per node")
    return slots, placed


def lost_nodes(gpus: list[int], absent: tuple[int, ...], gpn: int, names: dict[int, str]
               ) -> Failure | None:
    """The previous attempt's failure when nodes it ran on are not in this allocation: their
    ranks are blamed, with the node named -- not the peers whose collectives then failed."""
    lost = set(absent)
    ranks = tuple(r for r, g in enumerate(gpus) if g // gpn in lost)
    if not ranks:
        return None
    hosts = sorted({names.get(gpus[r] // gpn, str(gpus[r] // gpn)) for r in ranks})
    return Failure(ranks, f"node{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} lost "
                          "(not in this attempt's allocation)")


def decide(cfg: JobConfig, rdir: Path, attempt: int, posts: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """Worker 0: each worker's GPU slot and the failed GPUs of this attempt; writes the node
    table, health report, record and events. ``posts``: by launcher rank, each worker's
    ``host``, ``local`` GPU, provisional ``slot`` (Slurm's node id) and device ``probe``."""
    from ..config import plan_request
    from ..layout import build_plan

    events, health = rdir / "events.jsonl", rdir / "health.json"
    requeue = requeued() if attempt == 0 else 0
    if attempt == 0:  # evidence of an earlier run is not this run's (a requeued run keeps the
        watch.archive_previous_run(rdir, watch.CARRIED if requeue else ())  # health, nodes)
    gave_up = _read_json(rdir / "gave_up.json")
    if gave_up is not None:  # a later attempt of a job that has no plan: stay given up
        return gave_up
    try:
        slots, placed = place_workers(cfg, rdir, posts)
    except ValueError as e:
        return {"error": str(e), "failed_gpus": []}
    probes = {slots[r]: w["probe"] for r, w in enumerate(posts)}
    gpn = cfg.cluster.gpus_per_node
    absent = nodes.node_gpus(placed.absent, gpn)
    names = {i: h for i, h in enumerate(placed.table) if h is not None}
    # The newest attempt that decided (an attempt whose worker 0 died before deciding left
    # nothing; its predecessor's evidence is what ended the run of plans).
    prev_n = next((k for k in range(attempt - 1, -1, -1)
                   if (rdir / f"attempt.{k}.json").exists()), None)
    prev = _read_json(rdir / f"attempt.{prev_n}.json") if prev_n is not None else None
    current = (frozenset(prev["failed_gpus"]) if prev is not None
               else frozenset(cfg.health.as_report().failed_gpus))
    if requeue:  # the run before this one's failed GPUs: the node table keeps their hosts
        current |= watch.read_health(health) or frozenset()
    reported = _read_json(health)
    reported_set = (frozenset(reported["failed_gpus"]) if reported is not None and attempt
                    else None)
    blamed: tuple[int, ...] = ()
    # stragglers excluded so far (nutp.exclude_stragglers): GPU -> relative speed
    slow = {int(g): float(v) for g, v in ((prev or {}).get("slow_gpus") or {}).items()}
    if prev is not None:
        exits = read_exits(rdir / f"exits.{prev_n}")
        hang = _read_json(rdir / f"hang.{prev_n}.json")
        scale = _read_json(rdir / f"scaleup.{prev_n}.json")
        slowed = _read_json(rdir / f"straggler.{prev_n}.json")
        gpus = prev["rank_to_gpu"]
        last = (_read_json(rdir / f"progress.{prev_n}.json") or {}).get("last_done")
        resume = watch.resume_step(cfg.checkpoint_dir)
        # Detection: the watchdog's finding, else the first exit record that is not a clean
        # end (the launcher's reaction to the failure), else now.
        times = sorted(e["t"] for e in exits.values() if e.get("status") != "ok")
        if scale is not None:
            log_event("scale_up", file=events, attempt=prev_n, gpus=scale["gpus"],
                      reason="GPU back", requested_at=scale["requested_at"],
                      detected_at=scale["detected_at"], step=scale["step"],
                      lost_steps=lost_steps(last, resume), resume_step=resume)
        elif slowed is not None:  # nutp.exclude_stragglers: planned, as the CPU supervisor's
            slow.update({int(g): float(v) for g, v in slowed["gpus"].items()})
            log_event("relayout", file=events, attempt=prev_n, cause="straggler",
                      gpus=sorted(int(g) for g in slowed["gpus"]), slow_gpus=slowed["gpus"],
                      reason="straggler", detected_at=slowed["detected_at"],
                      lost_steps=lost_steps(last, resume), resume_step=resume)
        else:
            failure = lost_nodes(gpus, placed.absent, gpn, names) or \
                blame_previous(prev, exits, hang)
            blamed = () if failure is None else tuple(gpus[r] for r in failure.ranks)
            detected = (hang["detected_at"] if hang is not None
                        else times[0] if times else time.time())
            log_event("failure", file=events, attempt=prev_n,
                      cause="hang" if hang is not None else "exit", detected_at=detected,
                      ranks=[] if failure is None else list(failure.ranks), gpus=list(blamed),
                      reason="worker group failed (no rank to blame)" if failure is None
                      else failure.reason, lost_steps=lost_steps(last, resume),
                      resume_step=resume, where={} if hang is None else hang["where"])
    failed = next_failed(current, blamed, reported_set)
    failed -= nodes.node_gpus(placed.replaced, gpn)  # a new machine in a gone one's place
    failed |= {g for g, why in probes.items() if why is not None}
    failed |= absent  # not in this allocation: its GPUs cannot run
    job = job_for(cfg, frozenset(failed), slow)
    try:
        plan = build_plan(plan_request(job))
    except ValueError as e:
        log_event("gave_up", file=events, attempt=attempt, failed_gpus=sorted(failed),
                  reason=str(e))
        out = {"error": str(e), "failed_gpus": sorted(failed)}
        write_json_atomic(out, rdir / "gave_up.json")
        return out
    watch.write_health(health, frozenset(failed))
    nodes.write_table(rdir, placed)
    record = {"attempt": attempt, "failed_gpus": sorted(failed), "slots": slots,
              "rank_to_gpu": list(plan.rank_to_gpu), "t": time.time(),
              "slow_gpus": {str(g): v for g, v in sorted(slow.items())},
              "probes": {str(g): why for g, why in probes.items() if why is not None}}
    write_json_atomic(record, rdir / f"attempt.{attempt}.json")
    log_event("start", file=events, attempt=attempt, failed_gpus=sorted(failed),
              world_size=plan.world_size, replica_tp=[list(r.tp) for r in plan.replicas])
    return record


def start_health_watch(cfg: JobConfig, job: JobConfig, plan: Plan,
                       failed: frozenset[int], rdir: Path,
                       attempt: int, exits: ExitRecorder, console: Any, control: Control
                       ) -> Callable[[int], None]:
    """Plan rank 0, a daemon thread: GPUs reported back in the health report end the attempt
    (``control.abort``: every worker exits, so the launcher restarts the group) at the first
    checkpoint newer than the one complete when the report was seen (``scaleup.<attempt>.json``),
    so the next attempt plans the fuller layout without losing a committed step (the launcher
    counts it as a restart). O(1) per period: one small file read. Hangs are the job-level
    aggregator's (``aggregate.py``), not a training rank's. Returns the check for every
    completed save (``train_rank``'s ``on_checkpoint``)."""
    health = watch.HealthWatch(cfg, job, plan, failed, rdir, console)
    lock = threading.Lock()

    def check() -> None:
        with lock:
            now = time.time()
            scale = health.poll(now)
            if scale is None:
                return
            write_json_atomic({"gpus": list(scale.gpus), "requested_at": scale.requested_at,
                               "step": scale.step, "detected_at": now},
                              rdir / f"scaleup.{attempt}.json")
            exits.write("scale_up", f"GPUs {list(scale.gpus)} back")
            control.abort("scale_up")
            control.exit(EXIT_SCALE_UP)

    def run() -> None:
        while True:
            time.sleep(0.5)
            check()

    threading.Thread(target=run, name="nutp-health-watch", daemon=True).start()
    # The poll alone can miss the boundary: a short run may complete its next checkpoint and
    # its final one within one period. The training thread checks at each completed save too.
    return lambda step: check()


def start_ft_heartbeats(interval_s: float = 1.0) -> Any:
    """Under ft_launcher (nvidia-resiliency-ext): send the rank monitor a heartbeat from a thread
    every ``interval_s``. A worker whose process freezes as a whole (even its threads stop) is
    then terminated by ft_launcher and, leaving no exit record, blamed; a stalled *step* (peers
    blocked in a hung rank's collective) is the watchdog's business, which can name the rank
    that progressed least. No-op outside ft_launcher or without nvidia-resiliency-ext."""
    if not os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
        return None
    try:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    except ImportError:
        return None
    client = RankMonitorClient()
    client.init_workload_monitoring()

    def run() -> None:
        while True:
            try:
                client.send_heartbeat()
            except Exception as e:  # keep beating: a silent thread would get us killed
                print(f"nutp: ft_launcher heartbeat failed: {e}", flush=True)
            time.sleep(interval_s)

    threading.Thread(target=run, name="nutp-ft-heartbeat", daemon=True).start()
    return client


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class Control:
    """The attempt's in-band control over the rendezvous store, so an attempt ends as a whole
    whatever the launcher does (srun without --kill-on-bad-exit waits for every task):

    * ``abort(why)`` (any worker leaving abnormally) sets the key ``abort``; every worker's
      control thread (blocked in one ``wait`` on that key) wakes, writes its exit record and
      exits;
    * a store that stops answering (its host, launcher rank 0, died) ends the worker too;
    * ``leave()`` at a normal end: a barrier, so the store's host exits last."""

    def __init__(self, store: Any, exits: ExitRecorder, world: int, host: bool,
                 waiter: Any = None) -> None:
        self.store, self.exits, self.world, self.host = store, exits, world, host
        self.waiter = waiter if waiter is not None else store
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """One blocking ``wait`` on the ``abort`` key (no polling: W ranks would make W store
        requests per second); ``waiter`` is a store client of its own (a TCPStore client runs
        one request at a time, so a pending wait would hold up the process group's)."""
        def run() -> None:
            misses = 0
            while not self._stopped.is_set():
                try:
                    self.waiter.wait(["abort"], timedelta(seconds=WAIT_S))
                    aborted = True
                except Exception:  # timed out (no abort yet), or the store is gone
                    try:
                        aborted = bool(self.waiter.check(["abort"]))
                        misses = 0
                    except Exception:
                        misses += 1
                        if misses < 5 or self._stopped.is_set():
                            time.sleep(CONTROL_S)
                            continue
                        self.exits.write("aborted", "rendezvous store unreachable")
                        os._exit(EXIT_ABORT)
                if aborted and not self._stopped.is_set():
                    self.exits.write("aborted", "another worker ended the attempt")
                    self.exit(EXIT_ABORT)

        self._thread = threading.Thread(target=run, name="nutp-control", daemon=True)
        self._thread.start()

    def exit(self, code: int) -> None:
        """End this worker now (after the attempt was aborted); the store's host last."""
        if self.host:
            time.sleep(HOST_GRACE_S)
        os._exit(code)

    def abort(self, why: str) -> None:
        try:
            self.store.set("abort", why)
        except Exception:
            pass

    def leave(self, timeout_s: float = 120.0) -> None:
        """A normal end, two barriers: every worker has left (``left``), then the host wakes
        every control thread (``abort`` = ``done``: a stopped thread ends on it) and exits only
        after each worker's thread ended (``quiet``). A control thread still blocked in its
        ``wait`` when the host's store closes throws inside the C++ call while its interpreter
        shuts down: ``terminate called without an active exception``, SIGABRT, and the srun
        loop counted the finished job's attempt as failed (found on the Slurm test cluster)."""
        self._stopped.set()
        deadline = time.time() + timeout_s
        try:
            self.store.add("left", 1)
            if not self.host:
                thread = self._thread
                if thread is not None:  # woken by the host's "done", or the store gone
                    thread.join(max(0.0, min(deadline - time.time(), WAIT_S + 5 * CONTROL_S)))
                self.store.add("quiet", 1)
                return
            while self.store.add("left", 0) < self.world and time.time() < deadline:
                time.sleep(0.2)
            self.store.set("abort", "done")
            while self.store.add("quiet", 0) < self.world - 1 and time.time() < deadline:
                time.sleep(0.05)
        except Exception:
            pass


def _client(timeout: timedelta) -> Any:
    """A store client of its own to the launcher's rendezvous store (``MASTER_ADDR``/
    ``MASTER_PORT``, as ``env://`` uses them)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout, wait_for_workers=False)


def _spawn_aggregator(cfg: JobConfig, rdir: Path, attempt: int, prefix: str, world: int) -> None:
    rec = cfg.recovery
    aggregate.spawn(host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                    prefix=prefix, rdir=rdir, attempt=attempt, world=world,
                    nodes=cfg.cluster.num_gpus // cfg.cluster.gpus_per_node,
                    timeout_s=rec.heartbeat_timeout_s, startup_timeout_s=rec.startup_timeout_s)


def run_worker(cfg: JobConfig, env: LauncherEnv, console: Any,
               train: Callable[..., None] | None = None) -> int:
    """One attempt of one worker. Returns the process exit code. ``train(job, plan, *,
    device, on_checkpoint)``: a plan rank's training inside the attempt's process group
    (default ``nutp-train``'s ``loop.train_rank``; ``nutp-bridge`` passes Bridge's,
    ``launch/bridge_cli.py: worker_train``)."""
    import torch
    import torch.distributed as dist

    rdir = Path(cfg.output.dir) / "recovery"
    rdir.mkdir(parents=True, exist_ok=True)
    exits = ExitRecorder(rdir / f"exits.{env.attempt}", env.slot)
    exits.install()
    if cfg.recovery.mode == "live" and env.rank == 0 and env.attempt == 0:
        # Never silent: torchrun/ft_launcher/srun restart the whole worker group.
        note = ("recovery.mode=live needs a control process outside the ranks (the CPU "
                "supervisor, or `nutp sbatch --launcher srun`); torchrun and ft_launcher restart "
                "every worker when one exits, so failures take the restart path")
        console.print(f"[yellow]recovery:[/] {note}")  # (events.jsonl is archived later)
    control: Control | None = None
    try:
        timeout = timedelta(seconds=cfg.recovery.startup_timeout_s)
        base, _, _ = next(dist.rendezvous("env://", env.rank, env.world, timeout=timeout))
        prefix = f"nutp/attempt{env.attempt}/"
        store = dist.PrefixStore(prefix, base)
        control = Control(store, exits, env.world, host=env.rank == 0,
                          waiter=dist.PrefixStore(prefix, _client(timeout)))
        control.start()
        why = probe_device(env.local_rank, cfg.recovery.probe_timeout_s)
        store.set(f"worker/{env.rank}", json.dumps({
            "slot": env.slot, "host": host_name(dict(os.environ)), "local": env.local_rank,
            "probe": why}))
        if env.rank == 0:
            keys = [f"worker/{r}" for r in range(env.world)]
            store.wait(keys, timeout)
            posts = [json.loads(v) for v in store.multi_get(keys)]
            decision = decide(cfg, rdir, env.attempt, posts)
            if "error" not in decision:
                aggregate.preset(store, cfg.cluster.num_gpus // cfg.cluster.gpus_per_node)
            store.set("decision", json.dumps(decision))
        decision = json.loads(store.get("decision"))
        if "error" in decision:
            console.print(f"[red]recovery:[/] no plan for failed GPUs "
                          f"{decision['failed_gpus']}: {decision['error']}")
            exits.write("gave_up", decision["error"])
            control.leave()
            return 2
        failed = frozenset(decision["failed_gpus"])
        slot = int(decision["slots"][env.rank])  # by host name (health/nodes.py)
        exits.path = exits.path.with_name(f"gpu{slot}")
        job = job_for(cfg, failed, {int(g): float(v) for g, v in
                                    (decision.get("slow_gpus") or {}).items()})
        gpn = cfg.cluster.gpus_per_node
        if env.rank == 0:  # the job-level hang aggregator: its own process, off the ranks
            _spawn_aggregator(cfg, rdir, env.attempt, prefix, len(decision["rank_to_gpu"]))
        from ..config import plan_request
        from ..layout import build_plan

        plan = build_plan(plan_request(job))
        if list(plan.rank_to_gpu) != decision["rank_to_gpu"]:
            raise RuntimeError(f"GPU slot {slot} planned rank_to_gpu={list(plan.rank_to_gpu)}"
                               f" but worker 0 decided {decision['rank_to_gpu']} (same code and "
                               "config on every node?)")
        if slot not in plan.rank_to_gpu:  # failed or unused GPU: wait for the end
            start_ft_heartbeats()
            while True:  # one blocking wait at a time, no polling
                try:
                    store.wait(["finished"], timedelta(seconds=WAIT_S))
                    break
                except Exception:  # timed out (the job goes on), or the store is gone
                    if store.check(["finished"]):
                        break
            exits.write("ok", "idle")
            control.leave()
            return 0
        prank = plan.rank_to_gpu.index(slot)
        # Heartbeat and stack files on this node's own disk (tmpfs), read by the node watchdog
        hb_dir = aggregate.node_dir(str(int(decision["t"] * 1000)), env.attempt)
        hb_dir.mkdir(parents=True, exist_ok=True)
        os.environ.update({ATTEMPT: str(env.attempt), HEARTBEAT_DIR: str(hb_dir),
                           EVENTS: str(rdir / "events.jsonl")})
        if prank == 0:
            from ..common.plan_report import replicas_table

            console.print(replicas_table(plan))
        start_ft_heartbeats()
        # Watched from here on: a start-up that stalls (a peer never joins the process group, a
        # checkpoint load that hangs) is found like a hang inside training.
        watch.start_stack_watcher(hb_dir / f"rank{prank}.stack")
        local = aggregate.node_ranks(plan.rank_to_gpu, gpn, slot // gpn)
        if prank == local[0]:  # the node watchdog: this node's ranks -> one digest
            aggregate.NodeWatch(hb_dir, local, slot // gpn,
                                dist.PrefixStore(prefix, _client(timeout))).start()
        on_checkpoint = None
        if prank == 0:
            on_checkpoint = start_health_watch(cfg, job, plan, failed, rdir, env.attempt, exits,
                                               console, control)
        device = None
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank)
            device = torch.device("cuda", env.local_rank)
            backend = "nccl"
            # NCCL errors and timeouts become exceptions (an exit record), not a silent abort.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        else:
            from ..compat.cpu import apply_cpu_patches

            apply_cpu_patches()
            torch.set_num_threads(1)
            backend = "gloo"
        # Collectives wait longer than the watchdog, which names the rank that hung.
        pg_timeout = timedelta(seconds=max(600.0, 3 * cfg.recovery.heartbeat_timeout_s))
        dist.init_process_group(backend, store=dist.PrefixStore("train/", store), rank=prank,
                                world_size=plan.world_size, timeout=pg_timeout)
        stopped: dict[str, Any] = {}  # nutp.exclude_stragglers: (resume step, stragglers)
        try:
            if train is None:
                from .loop import train_rank

                train_rank(job, plan, device=device, on_checkpoint=on_checkpoint,
                           on_stop=lambda step, slow: stopped.update(step=step, slow=slow))
            else:  # nutp-bridge's worker (exclude_stragglers: its own planned stop)
                train(job, plan, device=device, on_checkpoint=on_checkpoint)
        finally:
            dist.destroy_process_group()
        if stopped:
            _straggler_restart(rdir, env.attempt, prank, stopped, exits, control)
        if prank == 0:
            log_event("finished", file=rdir / "events.jsonl", attempt=env.attempt)
            _write_summary(rdir, console)
            store.set("finished", "1")
        exits.write("ok")
        control.leave()
        return 0
    except BaseException as e:
        exits.write("error", f"{type(e).__name__}: {e}")
        if control is not None:
            control.abort(f"slot {env.slot}: {type(e).__name__}")
        if not isinstance(e, Exception) or os.environ.get(DEBUG) == "1":
            raise
        from .worker import report_error

        # one line on stderr, the traceback in <output.dir>/logs (exit 2: bad input, else 1)
        raise SystemExit(report_error(cfg.output.dir, env.rank, e)) from None


def _straggler_restart(rdir: Path, attempt: int, prank: int, stopped: dict[str, Any],
                       exits: ExitRecorder, control: Control) -> None:
    """The run stopped after a checkpoint to exclude a straggler (``nutp.exclude_stragglers``,
    the same step on every rank): a planned restart, as for GPUs reported back. Plan rank 0
    records the stragglers (``straggler.<attempt>.json``: the next attempt's worker 0 re-plans
    with them as slow GPUs and logs ``relayout``) and ends the attempt; the other ranks wait for
    that (their control thread exits them). Never returns."""
    if prank == 0:
        write_json_atomic({"gpus": {str(g): v for g, v in sorted(stopped["slow"].items())},
                           "step": stopped["step"], "detected_at": time.time()},
                          rdir / f"straggler.{attempt}.json")
        exits.write("straggler", f"GPUs {sorted(stopped['slow'])} excluded")
        control.abort("straggler")
        control.exit(EXIT_SCALE_UP)
    while True:  # the abort (or the store gone) ends this worker: its control thread
        time.sleep(CONTROL_S)


def _write_summary(rdir: Path, console: Any) -> None:
    summary = watch.summary(read_events(rdir / "events.jsonl"))
    write_json_atomic(summary, rdir / "summary.json")
    watch.print_summary(console, summary)
