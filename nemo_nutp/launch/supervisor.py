"""Recovery supervisor of ``nutp-train`` (``recovery.enabled=true``), CPU/gloo worlds.

The supervisor plans the job, spawns the plan's world (one process per rank), and watches exit
codes and per-rank heartbeats. When a rank dies or hangs past ``recovery.heartbeat_timeout_s`` it
kills the rest, marks the rank's GPU failed in the health report (``<output.dir>/recovery/
health.json``; an operator removes a GPU there to report it back), re-plans with the job's
policy and restarts from the newest complete checkpoint. Every event is appended with a
timestamp to ``recovery/events.jsonl``; ``recovery/summary.json`` has one entry per restart:
detection and restart wall time and recomputed (lost) steps.

On GPU clusters the same decisions apply per restart of ``torchrun``/``srun`` (or
nvidia-resiliency-ext's ``ft_launcher``); that wiring is not in this module.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.events import log_event, read_events
from .recovery import Failure, Progress, blame_exits, blame_hang, job_for, lost_steps, next_failed

POLL_S = 0.05


@dataclass
class Attempt:
    ok: bool
    failure: Failure | None
    detected_at: float
    last_done: int | None  # highest completed step index over ranks
    rank_to_gpu: tuple[int, ...]


def _read_progress(hb_dir: Path, world: int) -> dict[int, Progress | None]:
    out: dict[int, Progress | None] = {}
    for r in range(world):
        try:
            phase, step, t = (hb_dir / f"rank{r}").read_text().split()
            out[r] = Progress(phase, int(step), float(t))
        except (OSError, ValueError):
            out[r] = None
    return out


def _rank_main(rank: int, world: int, cfg: Any, plan: Any, port: int,
               env: dict[str, str]) -> None:
    os.setpgrp()  # own process group: the supervisor can stop the rank with its helpers
    os.environ.update(env)
    from .train import _run_rank

    _run_rank(rank, world, rank, cfg, plan, port)


def _run_world(cfg: Any, plan: Any, attempt: int, rdir: Path) -> Attempt:
    from .ports import free_port

    hb = rdir / f"heartbeats.{attempt}"
    hb.mkdir(parents=True, exist_ok=True)
    env = {"NUTP_ATTEMPT": str(attempt), "NUTP_HEARTBEAT_DIR": str(hb),
           "NUTP_EVENTS": str(rdir / "events.jsonl")}
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, plan.world_size, cfg, plan, port, env))
             for r in range(plan.world_size)]
    started = time.time()
    for p in procs:
        p.start()
    rec = cfg.recovery
    failure: Failure | None = None
    while True:
        time.sleep(POLL_S)
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        failure = blame_exits(codes)
        if failure is None and all(c == 0 for c in codes.values()):
            break
        if failure is None:
            failure = blame_hang(_read_progress(hb, plan.world_size), now=time.time(),
                                 timeout_s=rec.heartbeat_timeout_s, started_at=started,
                                 startup_timeout_s=rec.startup_timeout_s)
        if failure is not None:
            break
    detected = time.time()
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
    dones = [p.step for p in _read_progress(hb, plan.world_size).values()
             if p is not None and p.phase == "done"]
    starts = [p.step - 1 for p in _read_progress(hb, plan.world_size).values()
              if p is not None and p.phase == "start"]
    last = max(dones + starts) if dones or starts else None
    return Attempt(failure is None, failure, detected, last, tuple(plan.rank_to_gpu))


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
    """Per restart: detection (fault -> detected), restart (detected -> resumed), lost steps."""
    out: list[dict[str, Any]] = []
    fault_t = None
    for e in events:
        if e["event"] == "fault":
            fault_t = e["t"]
        elif e["event"] == "failure":
            out.append({"detected_at": e["t"], "ranks": e["ranks"], "gpus": e["gpus"],
                        "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": None if fault_t is None else e["t"] - fault_t})
            fault_t = None
        elif e["event"] == "resumed" and out and "restart_s" not in out[-1]:
            out[-1].update(restart_s=e["t"] - out[-1]["detected_at"], resume_step=e["step"],
                           replica_tp=e["replica_tp"])
    return out


def supervise(cfg: Any, console: Any) -> int:
    """Run the job to completion through failures. Returns a process exit code."""
    from ..config import plan_request
    from ..layout import build_plan
    from .plan_report import replicas_table

    rdir = Path(cfg.output.dir) / "recovery"
    rdir.mkdir(parents=True, exist_ok=True)
    events, health = rdir / "events.jsonl", rdir / "health.json"
    failed = frozenset(cfg.failures.health().failed_gpus)
    _write_health(health, failed)
    resume_step = 0
    for attempt in range(cfg.recovery.max_restarts + 1):
        failed = next_failed(failed, (), _read_health(health))
        job = job_for(cfg, failed)
        plan = build_plan(plan_request(job))
        if attempt:
            console.print(replicas_table(plan))
        log_event("start", file=events, attempt=attempt, failed_gpus=sorted(failed),
                  world_size=plan.world_size, replica_tp=[list(r.tp) for r in plan.replicas])
        res = _run_world(job, plan, attempt, rdir)
        if res.ok:
            log_event("finished", file=events, attempt=attempt)
            summary = _summary(read_events(events))
            (rdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            _print_summary(console, summary)
            return 0
        assert res.failure is not None
        gpus = tuple(res.rank_to_gpu[r] for r in res.failure.ranks)
        from ..checkpoint import find_latest
        from ..checkpoint.store import read_marker

        latest = find_latest(job.checkpoint_dir) if job.checkpoint_dir else None
        marker = read_marker(latest) if latest is not None else None
        resume_step = int(marker["step"]) if marker else 0
        failed = next_failed(failed, gpus, _read_health(health))
        _write_health(health, failed)
        log_event("failure", file=events, attempt=attempt, ranks=list(res.failure.ranks),
                  gpus=list(gpus), reason=res.failure.reason,
                  lost_steps=lost_steps(res.last_done, resume_step), resume_step=resume_step)
        console.print(f"[yellow]recovery:[/] ranks {list(res.failure.ranks)} (GPUs "
                      f"{list(gpus)}) failed: {res.failure.reason}; restarting from step "
                      f"{resume_step}")
    console.print(f"[red]recovery:[/] giving up after {cfg.recovery.max_restarts} restarts")
    return 1


def _print_summary(console: Any, summary: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not summary:
        return
    t = Table(title="Recovery")
    for col in ("failed GPUs", "reason", "detect s", "restart s", "lost steps", "new TP"):
        t.add_column(col)
    for s in summary:
        det = "-" if s["detect_s"] is None else f"{s['detect_s']:.2f}"
        t.add_row(str(s["gpus"]), s["reason"], det, f"{s.get('restart_s', float('nan')):.2f}",
                  str(s["lost_steps"]), str(s.get("replica_tp")))
    console.print(t)
