"""Recovery supervisor of ``nutp-train`` (``recovery.enabled=true``), CPU/gloo worlds.

The supervisor plans the job, starts the plan's world (one process per rank, forked from a
``forkserver`` that imported torch and megatron once, so restarts skip the imports), and
watches exit codes, per-rank step heartbeats and what each rank's stack watcher reports. It
restarts the world in two cases:

* **failure**: a rank dies, or hangs: no step heartbeat for ``recovery.heartbeat_timeout_s``
  (between steps, i.e. in checkpoint saves and the end-of-run report, also no activity of any
  rank: a stack change, or CPU use outside communication by its main thread or its child
  processes). A rank killed by a signal is blamed, not the peers that then lost their
  connection. In a hang the ranks blocked in collectives are victims; the rank(s) not blocked
  on communication are blamed (see ``recovery.blame_hang``). Each rank runs a stack watcher
  thread for this (``heartbeats.<attempt>/rank<r>.stack``); the failure event records where
  the blamed ranks' main threads were.
  The supervisor kills the rest, marks the blamed ranks' GPUs failed in the health report
  (``<output.dir>/recovery/health.json``), re-plans with the job's policy and restarts from
  the newest complete checkpoint; at most ``recovery.max_restarts`` times.
* **GPU back** (planned restart): the health report is read about every second while a world
  runs; an operator who removes GPUs from ``failed_gpus`` reports them back. If that changes
  the layout, the supervisor waits until a checkpoint newer than the one complete when it saw
  the report is complete, stops the world, re-plans at the fuller layout and resumes from that
  checkpoint (lost steps: only those finished between that save and the stop, usually 0).
  Planned restarts do not count against ``max_restarts``. Without checkpointing (or with
  ``checkpoint.resume=false``) it does not restart: the GPUs are used at the next restart.
  Returned GPUs are also picked up by any restart after a failure.

Guarantees: every event is appended with a timestamp to ``recovery/events.jsonl`` (``start``,
``failure``, ``scale_up_requested``, ``scale_up``, ``gpu_back`` for a deferred one,
``finished``; ranks add ``fault``, ``checkpoint``, ``resumed``); ``recovery/summary.json`` (also
printed as a table at the end) has one entry per restart: cause (``exit``, ``hang`` or
``gpu_back``), GPUs, reason, ``detect_s`` (fault -> detected; for GPU back: report seen ->
restart decided, i.e. the wait for the checkpoint), ``restart_s`` (detected -> resumed), lost
(recomputed) steps and the new replica TP degrees. Not guaranteed: a rank that hangs inside a
collective (every rank then waits on communication) is not blamed, the same layout restarts;
a rank that loops forever inside a save is not found; lost steps after a planned restart may
be > 0 when a step is shorter than the supervisor's reaction to a finished save.

On GPU clusters the same decisions apply per restart of ``torchrun``/``srun`` (or
nvidia-resiliency-ext's ``ft_launcher``); that wiring is in ``launch/elastic.py``.
"""

from __future__ import annotations

import json
import linecache
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.events import log_event, read_events
from .recovery import (
    Activity,
    Failure,
    Progress,
    blame_exits,
    blame_hang,
    is_comm_wait,
    job_for,
    lost_steps,
    next_failed,
    returned_gpus,
    scale_up_blocker,
    scale_up_due,
)

POLL_S = 0.05  # exit codes (and, while a planned restart waits, the newest checkpoint)
HANG_POLL_S = 0.5  # heartbeats and stack watcher reports
HEALTH_POLL_S = 1.0  # the health report, for GPUs reported back
SAMPLE_S = 0.5  # rank side: stack watcher period
PRELOAD = ("nemo_nutp.launch.supervisor", "nemo_nutp.launch.train", "nemo_nutp.train.loop",
           "nemo_nutp.train.session", "nemo_nutp.checkpoint.hooks",
           "megatron.core.dist_checkpointing")
"""Imported once by the fork server the ranks start from."""
CPU_EPS_S = 0.002  # CPU use between two samples that counts as activity


@dataclass(frozen=True)
class ScaleUp:
    """A planned restart: ``gpus`` reported back (seen at ``requested_at``), resuming from the
    checkpoint of ``step``."""

    gpus: tuple[int, ...]
    requested_at: float
    step: int


@dataclass
class Attempt:
    ok: bool
    failure: Failure | None
    cause: str | None  # "exit" or "hang" with a failure
    scale_up: ScaleUp | None
    detected_at: float
    last_done: int | None  # highest completed step index over ranks
    rank_to_gpu: tuple[int, ...]
    where: dict[int, str]  # blamed rank -> innermost frame of its main thread
    stop_s: float  # time taken to kill and reap the world


def _read_progress(hb_dir: Path, world: int) -> dict[int, Progress | None]:
    out: dict[int, Progress | None] = {}
    for r in range(world):
        try:
            phase, step, t = (hb_dir / f"rank{r}").read_text().split()
            out[r] = Progress(phase, int(step), float(t))
        except (OSError, ValueError):
            out[r] = None
    return out


def _read_activity(hb_dir: Path, world: int) -> dict[int, Activity | None]:
    out: dict[int, Activity | None] = {}
    for r in range(world):
        try:
            waiting, changed, t = (hb_dir / f"rank{r}.stack").read_text().split("\n")[0].split()
            out[r] = Activity(waiting == "1", float(changed), float(t))
        except (OSError, ValueError):
            out[r] = None
    return out


def _cpu_s(main_clock: int) -> float:
    """CPU seconds of the rank's main thread plus its live child processes (helpers such as
    checkpoint writers the main thread waits for); the rank's other threads are left out."""
    total = time.clock_gettime(main_clock)
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no procfs: the main thread only
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            kids = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for pid in kids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def _watch_stack(path: Path, main: threading.Thread) -> None:
    """Rank side, a daemon thread: every ``SAMPLE_S`` write ``waiting changed_t t`` and the
    innermost frame of the main thread: is it blocked on communication, when did it last show
    activity (its stack changed, or, outside communication, it or its child processes used
    CPU), now. Works while the main thread is blocked in C: collectives and sleeps release
    the GIL."""
    clock = time.pthread_getcpuclockid(main.ident or 0)
    last: tuple[tuple[str, int], ...] = ()
    changed, cpu = time.time(), _cpu_s(clock)
    tmp = path.with_name(path.name + ".tmp")
    while True:
        frame = sys._current_frames().get(main.ident or -1)
        stack = []
        f = frame
        while f is not None:
            stack.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        del frame, f
        now, used = time.time(), _cpu_s(clock)
        waiting = bool(stack) and is_comm_wait(stack[0][0], linecache.getline(*stack[0][:2]))
        # CPU used while waiting for peers (a Work.wait() polls) is not progress
        if tuple(s[:2] for s in stack) != last or (not waiting and used - cpu > CPU_EPS_S):
            last, changed = tuple(s[:2] for s in stack), now
        cpu = used
        where = f"{stack[0][0]}:{stack[0][1]} in {stack[0][2]}" if stack else "-"
        try:
            tmp.write_text(f"{int(waiting)} {changed} {now}\n{where}\n")
            os.replace(tmp, path)
        except OSError:
            pass
        time.sleep(SAMPLE_S)


def _read_where(hb_dir: Path, rank: int) -> str:
    """Innermost frame of ``rank``'s main thread as its stack watcher last saw it."""
    try:
        return (hb_dir / f"rank{rank}.stack").read_text().split("\n")[1]
    except (OSError, IndexError):
        return "?"


def _rank_main(rank: int, world: int, cfg: Any, plan: Any, port: int,
               env: dict[str, str]) -> None:
    os.setpgrp()  # own process group: the supervisor can stop the rank with its helpers
    os.environ.update(env)
    threading.Thread(target=_watch_stack, name="nutp-stack-watch", daemon=True,
                     args=(Path(env["NUTP_HEARTBEAT_DIR"]) / f"rank{rank}.stack",
                           threading.main_thread())).start()
    from .train import _run_rank

    _run_rank(rank, world, rank, cfg, plan, port)


def _latest_step(root: str | None) -> int | None:
    """Step of the newest complete checkpoint (the ``latest`` pointer, marker checked)."""
    from ..checkpoint.store import read_marker

    if root is None:
        return None
    try:
        name = (Path(root) / "latest").read_text().strip()
    except OSError:
        return None
    marker = read_marker(Path(root) / name) if name else None
    return None if marker is None else int(marker["step"])


class _HealthWatch:
    """While a world runs: GPUs reported back in the health report -> a planned restart at the
    first checkpoint newer than the one complete when the report was seen."""

    def __init__(self, cfg: Any, job: Any, plan: Any, failed: frozenset[int], rdir: Path,
                 console: Any) -> None:
        self.cfg, self.job, self.failed, self.rdir, self.console = cfg, job, failed, rdir, console
        self.layout = _layout(plan)
        self.next_read = 0.0
        self.seen: frozenset[int] = frozenset()
        self.pending: tuple[frozenset[int], float, int | None] | None = None

    def poll(self, now: float) -> ScaleUp | None:
        if now >= self.next_read:
            self.next_read = now + HEALTH_POLL_S
            self._read(now)
        if self.pending is None:
            return None
        gpus, since, base = self.pending
        latest = _latest_step(self.job.checkpoint_dir)
        if not scale_up_due(base_step=base, latest_step=latest, total_steps=self.job.train.steps):
            return None
        assert latest is not None
        return ScaleUp(tuple(sorted(gpus)), since, latest)

    def _read(self, now: float) -> None:
        back = returned_gpus(self.failed, _read_health(self.rdir / "health.json"))
        if back == self.seen:
            return
        self.seen = back
        if not back:  # reported failed again before the restart: nothing to do
            self.pending = None
            return
        from ..config import plan_request
        from ..layout import build_plan

        events = self.rdir / "events.jsonl"
        fuller = build_plan(plan_request(job_for(self.cfg, self.failed - back)))
        why = ("the layout does not change" if _layout(fuller) == self.layout
               else scale_up_blocker(self.job))
        if why is not None:
            log_event("gpu_back", file=events, gpus=sorted(back), deferred=why)
            self.console.print(f"[yellow]recovery:[/] GPUs {sorted(back)} reported back; {why}: "
                               "they are used at the next restart")
            self.pending = None
            return
        base = (self.pending[2] if self.pending is not None
                else _latest_step(self.job.checkpoint_dir))
        since = self.pending[1] if self.pending is not None else now
        self.pending = (back, since, base)
        log_event("scale_up_requested", file=events, gpus=sorted(back), base_step=base,
                  world_size=fuller.world_size, replica_tp=[list(r.tp) for r in fuller.replicas])
        self.console.print(f"[green]recovery:[/] GPUs {sorted(back)} reported back; restarting "
                           f"at {_layout(fuller)} after the next checkpoint")


def _layout(plan: Any) -> list[list[int]]:
    return [list(r.tp) for r in plan.replicas]


def _stop(procs: list[Any]) -> None:
    for p in procs:
        # Survivors block in collectives with the dead rank; checkpoint writer helpers of a
        # killed rank would outlive it (and hold the job's stdout), so kill whole groups.
        if p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join()


def _last_done(hb: Path, world: int) -> int | None:
    beats = [p for p in _read_progress(hb, world).values() if p is not None]
    done = [p.step if p.phase == "done" else p.step - 1 for p in beats]
    return max(done) if done else None


def _run_world(cfg: Any, job: Any, plan: Any, failed: frozenset[int], attempt: int, rdir: Path,
               console: Any) -> Attempt:
    from .ports import free_port

    hb = rdir / f"heartbeats.{attempt}"
    hb.mkdir(parents=True, exist_ok=True)
    env = {"NUTP_ATTEMPT": str(attempt), "NUTP_HEARTBEAT_DIR": str(hb),
           "NUTP_EVENTS": str(rdir / "events.jsonl")}
    # Ranks fork from one server that imported torch and megatron once (a clean interpreter,
    # no threads, no process group): a restart does not pay ~6 CPU-s of imports per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    port = free_port()
    world = plan.world_size
    procs = [ctx.Process(target=_rank_main, args=(r, world, job, plan, port, env))
             for r in range(world)]
    started = time.time()
    for p in procs:
        p.start()
    rec = job.recovery
    watch = _HealthWatch(cfg, job, plan, failed, rdir, console)
    failure, cause, scale, next_hang = None, None, None, started
    while True:
        time.sleep(POLL_S)
        now = time.time()
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        failure, cause = blame_exits(codes), "exit"
        if failure is None and all(c == 0 for c in codes.values()):
            break
        if failure is None and now >= next_hang:
            next_hang = now + HANG_POLL_S
            failure, cause = blame_hang(
                _read_progress(hb, world), now=now, timeout_s=rec.heartbeat_timeout_s,
                started_at=started, startup_timeout_s=rec.startup_timeout_s,
                activity=_read_activity(hb, world)), "hang"
        if failure is None:
            scale = watch.poll(now)
        if failure is not None or scale is not None:
            break
    detected = time.time()
    where = {r: _read_where(hb, r) for r in (failure.ranks if failure is not None else ())}
    _stop(procs)
    return Attempt(failure is None and scale is None, failure,
                   None if failure is None else cause, scale, detected,
                   _last_done(hb, world), tuple(plan.rank_to_gpu), where,
                   time.time() - detected)


def _read_health(path: Path) -> frozenset[int] | None:
    try:
        return frozenset(json.loads(path.read_text())["failed_gpus"])
    except (OSError, ValueError, KeyError):
        return None


def _write_health(path: Path, failed: frozenset[int]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"failed_gpus": sorted(failed)}) + "\n")
    os.replace(tmp, path)


def _summary(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per restart: detection (fault -> detected; GPU back: report seen -> restart decided),
    restart (detected -> resumed: stopping the world included), lost steps, new layout."""
    out: list[dict[str, Any]] = []
    fault_t = None
    for e in events:
        if e["event"] == "fault":
            fault_t = e["t"]
        elif e["event"] == "failure":
            t = e.get("detected_at", e["t"])
            out.append({"detected_at": t, "cause": e.get("cause"), "ranks": e["ranks"],
                        "gpus": e["gpus"], "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": None if fault_t is None else t - fault_t})
            fault_t = None
        elif e["event"] == "scale_up":
            t = e.get("detected_at", e["t"])
            out.append({"detected_at": t, "cause": "gpu_back", "ranks": [],
                        "gpus": e["gpus"], "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": t - e["requested_at"]})
        elif e["event"] == "resumed" and out and "restart_s" not in out[-1]:
            out[-1].update(restart_s=e["t"] - out[-1]["detected_at"], resume_step=e["step"],
                           replica_tp=e["replica_tp"])
    return out


def _finish(console: Any, rdir: Path, attempt: int) -> int:
    log_event("finished", file=rdir / "events.jsonl", attempt=attempt)
    summary = _summary(read_events(rdir / "events.jsonl"))
    (rdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _print_summary(console, summary)
    return 0


def _record_scale_up(res: Attempt, rdir: Path, console: Any, attempt: int) -> None:
    s = res.scale_up
    assert s is not None
    lost = lost_steps(res.last_done, s.step)
    log_event("scale_up", file=rdir / "events.jsonl", attempt=attempt, gpus=list(s.gpus),
              reason="GPU back", requested_at=s.requested_at, detected_at=res.detected_at,
              stop_s=res.stop_s, step=s.step, lost_steps=lost, resume_step=s.step)
    console.print(f"[green]recovery:[/] planned restart for GPUs {list(s.gpus)} back; resuming "
                  f"from step {s.step} (lost steps: {lost})")


def _record_failure(job: Any, res: Attempt, failed: frozenset[int], rdir: Path, console: Any,
                    attempt: int) -> frozenset[int]:
    """Mark the blamed GPUs failed (health report) and log; returns the new failed set."""
    from ..checkpoint import find_latest
    from ..checkpoint.store import read_marker

    assert res.failure is not None
    health = rdir / "health.json"
    gpus = tuple(res.rank_to_gpu[r] for r in res.failure.ranks)
    latest = find_latest(job.checkpoint_dir) if job.checkpoint_dir else None
    marker = read_marker(latest) if latest is not None else None
    resume_step = int(marker["step"]) if marker else 0
    failed = next_failed(failed, gpus, _read_health(health))
    _write_health(health, failed)
    log_event("failure", file=rdir / "events.jsonl", attempt=attempt, cause=res.cause,
              detected_at=res.detected_at, stop_s=res.stop_s, ranks=list(res.failure.ranks),
              gpus=list(gpus), reason=res.failure.reason,
              lost_steps=lost_steps(res.last_done, resume_step), resume_step=resume_step,
              where={str(r): w for r, w in res.where.items()})
    console.print(f"[yellow]recovery:[/] ranks {list(res.failure.ranks)} (GPUs {list(gpus)}) "
                  f"failed: {res.failure.reason}; restarting from step {resume_step}")
    for r, w in res.where.items():
        console.print(f"  rank {r} was at {w}")
    return failed


def supervise(cfg: Any, console: Any) -> int:
    """Run the job to completion through failures and planned restarts. Returns an exit code."""
    from ..config import plan_request
    from ..layout import build_plan
    from .plan_report import replicas_table

    rdir = Path(cfg.output.dir) / "recovery"
    rdir.mkdir(parents=True, exist_ok=True)
    events, health = rdir / "events.jsonl", rdir / "health.json"
    failed = frozenset(cfg.failures.health().failed_gpus)
    _write_health(health, failed)
    attempt = restarts = 0
    while True:
        failed = next_failed(failed, (), _read_health(health))
        job = job_for(cfg, failed)
        plan = build_plan(plan_request(job))
        if attempt:
            console.print(replicas_table(plan))
        log_event("start", file=events, attempt=attempt, failed_gpus=sorted(failed),
                  world_size=plan.world_size, replica_tp=_layout(plan))
        res = _run_world(cfg, job, plan, failed, attempt, rdir, console)
        if res.ok:
            return _finish(console, rdir, attempt)
        if res.scale_up is not None:
            _record_scale_up(res, rdir, console, attempt)
        else:
            failed = _record_failure(job, res, failed, rdir, console, attempt)
            if restarts == cfg.recovery.max_restarts:
                console.print(f"[red]recovery:[/] giving up after {restarts} restarts")
                return 1
            restarts += 1
        attempt += 1


def _print_summary(console: Any, summary: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not summary:
        return
    t = Table(title="Recovery")
    for col in ("GPUs", "reason", "detect s", "restart s", "lost steps", "new TP"):
        t.add_column(col)
    for s in summary:
        det = "-" if s["detect_s"] is None else f"{s['detect_s']:.2f}"
        t.add_row(str(s["gpus"]), s["reason"], det, f"{s.get('restart_s', float('nan')):.2f}",
                  str(s["lost_steps"]), str(s.get("replica_tp")))
    console.print(t)
