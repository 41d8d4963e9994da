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
nvidia-resiliency-ext's ``ft_launcher``); that wiring is in ``train/elastic.py``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import ATTEMPT, EVENTS, HEARTBEAT_DIR, requeued
from ..common.events import log_event, read_events
from ..health import nodes, watch
from ..health.check import FailureCheck, hang_in
from ..health.decisions import job_for, lost_steps, next_failed, straggler_relayout
from .world import Attempt, RankEntry, stop_procs

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan
    from .hosts import Host

POLL_S = 0.05  # exit codes (and, while a planned restart waits, the newest checkpoint)
def _run_world(cfg: JobConfig, job: JobConfig, plan: Plan,
               failed: frozenset[int], attempt: int, rdir: Path,
               console: Any, host: Host | None = None, entry: RankEntry | None = None
               ) -> Attempt:
    if job.recovery.mode == "live":  # survivors keep their processes (recovery/control.py)
        assert entry is None or host is None, "a host starts its own entry's ranks"
        from .control import run_world

        return run_world(cfg, job, plan, failed, attempt, rdir, console, host, entry)
    entry = entry or RankEntry()
    from ..common.ports import free_port

    hb = rdir / f"heartbeats.{attempt}"
    hb.mkdir(parents=True, exist_ok=True)
    env = {ATTEMPT: str(attempt), HEARTBEAT_DIR: str(hb), EVENTS: str(rdir / "events.jsonl")}
    # Ranks fork from one server that imported torch and megatron once (a clean interpreter,
    # no threads, no process group): a restart does not pay ~6 CPU-s of imports per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(entry.preload))
    port = free_port()
    world = plan.world_size
    procs = [ctx.Process(target=entry.target, args=(r, world, job, plan, port, env))
             for r in range(world)]
    started = time.time()
    for p in procs:
        p.start()
    rec = job.recovery
    health_watch = watch.HealthWatch(cfg, job, plan, failed, rdir, console)
    check = FailureCheck(started)
    while True:
        time.sleep(POLL_S)
        now = time.time()
        v = check.poll({r: p.exitcode for r, p in enumerate(procs)}, now=now,
                       hang=lambda t: hang_in(hb, world, now=t, started=started, rec=rec),
                       health=health_watch.poll)
        failure, cause, scale = v.failure, v.cause, v.scale_up
        if v.done or failure is not None or scale is not None:
            break
    detected = time.time()
    where = {r: watch.read_where(hb, r) for r in (failure.ranks if failure is not None else ())}
    stop_procs(procs)
    return Attempt(failure is None and scale is None, failure,
                   None if failure is None else cause, scale, detected,
                   watch.last_done(hb, world), tuple(plan.rank_to_gpu), where,
                   time.time() - detected)


def _finish(console: Any, rdir: Path, attempt: int) -> int:
    log_event("finished", file=rdir / "events.jsonl", attempt=attempt)
    summary = watch.summary(read_events(rdir / "events.jsonl"))
    (rdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    watch.print_summary(console, summary)
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


def _record_failure(job: JobConfig, res: Attempt, failed: frozenset[int], rdir: Path, console: Any,
                    attempt: int) -> frozenset[int]:
    """Mark the blamed GPUs failed (health report) and log; returns the new failed set."""
    assert res.failure is not None
    health = rdir / "health.json"
    gpus = tuple(res.rank_to_gpu[r] for r in res.failure.ranks)
    resume_step = watch.resume_step(job.checkpoint_dir)
    failed = next_failed(failed, gpus, watch.read_health(health))
    watch.write_health(health, failed)
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


def supervise(cfg: JobConfig, console: Any, host: Host | None = None,
              entry: RankEntry | None = None) -> int:
    """Run the job to completion through failures and planned restarts. Returns an exit code.
    ``host`` (``recovery.mode=live`` only, ``hosts.py``): where the ranks run; default this
    machine. The Slurm control process (``launch/control.py``) passes its node agents, which
    carry the job's rank entry (``hosts.AgentHost.entry``). ``entry`` (without ``host``): how a
    rank starts on this machine; default ``nutp-train``'s (``world.RankEntry``; ``nutp-bridge``
    passes Bridge's)."""
    from rich.markup import escape

    from ..common.plan_report import replicas_table
    from ..config import plan_request
    from ..layout import build_plan

    rdir = Path(cfg.output.dir) / "recovery"
    rdir.mkdir(parents=True, exist_ok=True)
    events, health = rdir / "events.jsonl", rdir / "health.json"
    requeue = requeued()  # a run after the first: the health report and node table carry over
    watch.archive_previous_run(rdir, watch.CARRIED if requeue else ())
    failed = frozenset(cfg.health.as_report().failed_gpus)
    names = host.node_names if host is not None else ()
    if names:  # the agents' nodes in Slurm's order: GPU ids of this allocation
        gpn = cfg.cluster.gpus_per_node
        if requeue:
            table, report = nodes.read_table(rdir), watch.read_health(health)
            if table is not None and report is not None:
                # the run before's report (the job's health.failed_gpus included), carried with
                # its hosts: the job's own ids would name this allocation's nodes
                failed = nodes.carry(table, report, names, gpn)
            log_event("requeued", file=events, run=requeue, hosts=list(names),
                      failed_gpus=sorted(failed))
            console.print(f"[yellow]recovery:[/] requeued run {requeue} on {', '.join(names)}: "
                          f"failed GPUs {sorted(failed)} (carried over with their hosts)")
        nodes.write_table(rdir, nodes.place(None, list(names), cfg.cluster.num_gpus // gpn))
    slow: dict[int, float] = {}  # stragglers found while running (nutp.exclude_stragglers)
    watch.write_health(health, failed)
    attempt = restarts = 0
    while True:
        failed = next_failed(failed, (), watch.read_health(health))
        job = job_for(cfg, failed, slow)
        try:
            plan = build_plan(plan_request(job))
        except ValueError as e:  # too few GPUs left for any layout: one line, not a traceback
            if not attempt:
                raise  # the job's own input: the caller prints it (exit 2)
            log_event("finished", file=events, attempt=attempt, error=str(e))
            console.print(f"[red]recovery:[/] no layout can run on the GPUs left, stopping: "
                          f"{escape(str(e))}")
            return 1
        if attempt:
            console.print(replicas_table(plan))
        log_event("start", file=events, attempt=attempt, failed_gpus=sorted(failed),
                  world_size=plan.world_size, replica_tp=watch.layout_of(plan))
        started = time.time()
        res = _run_world(cfg, job, plan, failed, attempt, rdir, console, host, entry)
        found = straggler_relayout(read_events(events), started) if res.ok else None
        if res.ok and found is None:
            return _finish(console, rdir, attempt)
        if found is not None:  # the same path as a failed GPU: re-plan, resume (not a failure)
            slow.update(found)
            step = watch.resume_step(job.checkpoint_dir)
            log_event("relayout", file=events, attempt=attempt, cause="straggler",
                      gpus=sorted(found), slow_gpus={str(g): v for g, v in found.items()},
                      reason="straggler", lost_steps=0, resume_step=step)
            console.print(f"[yellow]recovery:[/] straggler GPUs {sorted(found)} (relative speed "
                          f"{', '.join(f'{v:.2f}' for v in found.values())}): re-planning and "
                          f"resuming from step {step}")
        elif res.scale_up is not None:
            _record_scale_up(res, rdir, console, attempt)
        elif res.failure is not None and res.failure.bad_input:  # each rank printed why
            log_event("finished", file=events, attempt=attempt, error="bad input")
            return 2
        else:
            failed = _record_failure(job, res, failed, rdir, console, attempt)
            if restarts == cfg.recovery.max_restarts:
                console.print(f"[red]recovery:[/] giving up after {restarts} restarts")
                return 1
            restarts += 1
        attempt += 1


