"""Measured cost of a layout change: real small jobs with injected faults, per path and event.

For every registered *path* (how the job changes its layout) and every *event* (``kill``,
``hang``, ``gpu_back``, ``straggler``) this runs a tiny ``nutp-train`` job on this machine and
writes ``runs/bench/transitions.json``::

    {"schema": "nemo_nutp.bench.transitions/1", "job": {...},
     "paths": {"restart": {"kill": {detect_s, transition_s, lost_steps, step_s,
                                    checkpoint_bytes_read, processes_started,
                                    bytes_received_rank_max, ...}, ...}}}

``nutp simulate sim.transitions.measured=runs/bench/transitions.json`` reads it and scales it to
the scenario (``nemo_nutp/goodput/transitions.py``). A path that does not exist is absent.

Paths are a registry: ``PATHS[name] = fn`` with ``fn(event, opts) -> dict | None`` (None: the
path cannot handle that event). ``live`` (``recovery.mode=live``: every event) is one
such function: its entry comes from the run's ``live_relayout`` event (``transition_s`` =
``relayout_s``; also ``unblock_s``, ``recomputed_steps``, bytes received vs the lower bound,
``peak_memory_ratio``).

``restart`` (what the recovery supervisor does today, ``nemo_nutp/recovery/supervisor.py``):
numbers come from the run's own ``recovery/events.jsonl`` / ``recovery/summary.json``:
* ``detect_s``: fault -> detected (kill, hang: the supervisor's summary); GPU back: report seen
  -> restart decided (the wait for the next checkpoint, while training goes on); straggler:
  slowdown starts (``slow_fault``) -> the probe names the GPU (``straggler`` event);
* ``transition_s``: the job standing still: stop decided -> resumed (kill, hang, GPU back: the
  summary's ``restart_s``: stop the world, re-plan, start processes, init groups, load the
  checkpoint); straggler: the save of the checkpoint it stops at -> resumed (the world winds
  down after that save, then the same restart);
* ``lost_steps``: steps recomputed (summary); ``step_s``: median step wall time of the run
  (``metrics.jsonl``); ``checkpoint_bytes_read``: bytes of the checkpoint resumed from (every
  file of that ``iter_*`` directory, all ranks together); ``processes_started``: ranks of the
  new world; ``bytes_received_rank_max``: bytes a rank receives from its peers to take its new
  share: 0 on this path (all state comes back through the checkpoint, counted above).

``live_zero``: ``live`` with ``train.distributed_optimizer=true recovery.live_redundancy=true``
(kill, hang). ``live_spare``: ``live`` with one hot spare slice (``recovery.spares=1``; kill,
hang): the failed slice swapped for the spare's standby processes.

Usage: python benchmarks/transition_cost.py [--quick] [--paths restart] [--events kill,hang]
           [--out runs/bench/transitions.json]
(--quick: fewer steps and a shorter hang timeout; ~1-2 min per event on the shared 2 cores.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_nutp.common.procs import kill_session
from nemo_nutp.layout.serialize import write_json_atomic

EVENTS = ("kill", "hang", "gpu_back", "straggler")
FIELDS = ("detect_s", "transition_s", "lost_steps", "step_s", "checkpoint_bytes_read",
          "processes_started", "bytes_received_rank_max")
"""Every measured entry has these keys (the simulator reads them)."""

# A 4-GPU TP2 x DP2 job of the tiny model (cluster domains of 2 GPUs), checkpoint every 2 steps.
JOB = ("cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
       "parallel.tp_base=2", "health.failed_gpus=[]", "train.global_batch_size=16",
       "train.micro_batch_size=2", "train.seed=5", "checkpoint.interval=2",
       "recovery.enabled=true")
JOB_TIMEOUT_S = 900


@dataclass(frozen=True)
class Options:
    work: Path  # scratch directory of the jobs
    steps: int  # steps of each job
    fault_step: int  # step the fault fires at (kill, hang) / the slowdown starts (straggler)
    hang_timeout_s: float  # recovery.heartbeat_timeout_s of the hang job
    console: Console


PathFn = Callable[[str, Options], "dict[str, Any] | None"]
PATHS: dict[str, PathFn] = {}
"""name -> fn(event, opts): the measured entry of ``event`` on that path, or None."""


def path(name: str) -> Callable[[PathFn], PathFn]:
    """Register ``fn`` as the measurement of path ``name``."""
    def deco(fn: PathFn) -> PathFn:
        PATHS[name] = fn
        return fn
    return deco


# --------------------------------------------------------------------------- running a job



class Job:
    """``python -m nemo_nutp.train`` in a session of its own, output in ``<out>.log``; every
    process of the session is killed when the job is left."""

    def __init__(self, out: Path, overrides: list[str], env: dict[str, str] | None = None
                 ) -> None:
        self.out, self.log = out, out.with_suffix(".log")
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "nemo_nutp.train", f"output.dir={out}", *overrides]
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True,
                                         env={**os.environ, **(env or {})})
        self.deadline = time.monotonic() + JOB_TIMEOUT_S

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_session(self.proc.pid)
        self.proc.wait()

    def running(self) -> bool:
        if time.monotonic() > self.deadline:
            raise RuntimeError(f"job {self.out} ran past {JOB_TIMEOUT_S} s")
        return self.proc.poll() is None

    def wait(self) -> None:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = -1
        if rc != 0:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"job {self.out} exited {rc}:\n{tail}")


def _events(out: Path) -> list[dict[str, Any]]:
    p = out / "recovery" / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _newest_checkpoint(root: Path) -> int | None:
    try:
        return int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- restart path

def _restart_entry(out: Path, event: str) -> dict[str, Any]:
    """The measured entry of one restart from the run's own records (module docstring)."""
    (s,) = json.loads((out / "recovery" / "summary.json").read_text())
    ev = _events(out)
    (resumed,) = [e for e in ev if e["event"] == "resumed" and e["t"] >= s["detected_at"]]
    (start,) = [e for e in ev if e["event"] == "start" and e.get("attempt") == 1]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    detect, stopped_at = s["detect_s"], s["detected_at"]
    if event == "straggler":
        (found,) = [e for e in ev if e["event"] == "straggler"]
        slow = [e for e in ev if e["event"] == "slow_fault"]
        detect = found["t"] - min(e["t"] for e in slow)
        stopped_at = max(e["t"] for e in ev if e["event"] == "checkpoint"
                         and e["step"] == s["resume_step"] and e["t"] <= resumed["t"])
    return {
        "detect_s": float(detect), "transition_s": float(resumed["t"] - stopped_at),
        "lost_steps": int(s["lost_steps"]),
        "step_s": float(statistics.median(r["step_time_s"] for r in rows)),
        "checkpoint_bytes_read": _dir_bytes(Path(resumed["checkpoint"])),
        "processes_started": int(start["world_size"]), "bytes_received_rank_max": 0,
        "restart_s": float(s["restart_s"]), "resume_step": int(s["resume_step"]),
        "replica_tp_after": s["replica_tp"], "cause": s["cause"],
    }


def _run_kill_or_hang(event: str, opts: Options, out: Path) -> None:
    over = [*JOB, f"train.steps={opts.steps}"]
    if event == "hang":
        over.append(f"recovery.heartbeat_timeout_s={opts.hang_timeout_s}")
    with Job(out, over, env={"NUTP_FAULT": f"{event}:rank=1:step={opts.fault_step}"}) as job:
        job.wait()


def _run_gpu_back(opts: Options, out: Path, *extra: str) -> None:
    """GPU 3 starts failed (TP2 + TP1); once a checkpoint exists the health report gives it
    back, the supervisor restarts at the next checkpoint on TP2 + TP2 (``recovery.mode=live``
    in ``extra``: grows back live at the next step boundary instead)."""
    over = [*JOB, "health.failed_gpus=[3]", f"train.steps={opts.steps}", *extra]
    root = out / "checkpoints"
    with Job(out, over) as job:
        while _newest_checkpoint(root) is None:
            if not job.running():
                raise RuntimeError(f"gpu_back job ended before its first checkpoint: {job.log}")
            time.sleep(0.05)
        health = out / "recovery" / "health.json"
        tmp = health.with_suffix(".bench-tmp")
        tmp.write_text(json.dumps({"failed_gpus": []}))
        os.replace(tmp, health)
        job.wait()


def _run_straggler(opts: Options, out: Path, *extra: str, slow_from: int | None = None
                   ) -> None:
    """Rank 1 slowed 4x from ``fault_step``: the probe finds it, the world stops after the next
    checkpoint and the supervisor re-plans without it (TP2 + TP1; ``recovery.mode=live`` in
    ``extra``: every rank stops at the step boundary of the detection, re-planned live)."""
    over = [*JOB, f"train.steps={opts.steps}", "nutp.straggler_probe_interval=1",
            "nutp.straggler_window=3", "nutp.exclude_stragglers=true", *extra]
    start = opts.fault_step if slow_from is None else slow_from
    with Job(out, over, env={"NUTP_FAULT": f"slow:rank=1:factor=4:step={start}"}) as job:
        job.wait()


@path("restart")
def restart(event: str, opts: Options) -> dict[str, Any] | None:
    """Stop every rank, re-plan, restart the world from the newest checkpoint (supervisor)."""
    out = opts.work / f"restart_{event}"
    if event in ("kill", "hang"):
        _run_kill_or_hang(event, opts, out)
    elif event == "gpu_back":
        _run_gpu_back(opts, out)
    elif event == "straggler":
        _run_straggler(opts, out)
    else:
        return None
    return _restart_entry(out, event)


# --------------------------------------------------------------------------- live path

def _live_entry(out: Path) -> dict[str, Any]:
    """The measured entry of one live re-layout from the run's own records: ``transition_s``
    is ``relayout_s`` (detected -> first step of the new layout started), no checkpoint read,
    no process started (survivors' pids kept)."""
    (s,) = json.loads((out / "recovery" / "summary.json").read_text())
    ev = _events(out)
    (e,) = [x for x in ev if x["event"] == "live_relayout"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("step_time_s") is not None]
    if s["mode"] != "live":
        raise RuntimeError(f"{out}: the failure was not handled live: {s}")
    detect = s["detect_s"]
    if e["cause"] == "gpu_back":  # report seen -> stop requested (no checkpoint to wait for)
        (req,) = [x for x in ev if x["event"] == "scale_up_requested"]
        detect = e["detected_at"] - req["t"]
    elif e["cause"] == "straggler":  # slowdown starts -> the probe names the GPU
        (found,) = [x for x in ev if x["event"] == "straggler"]
        detect = found["t"] - min(x["t"] for x in ev if x["event"] == "slow_fault")
    return {
        "detect_s": float(detect), "transition_s": float(e["relayout_s"]),
        "lost_steps": int(e["lost_steps"]), "recomputed_steps": int(e["recomputed_steps"]),
        "step_s": float(statistics.median(times)),
        "checkpoint_bytes_read": int(e["checkpoint_bytes_read"]),
        "processes_started": int(e["processes_started"]),
        "bytes_received_rank_max": int(e["bytes_received_rank_max"]),
        "lower_bound_rank_max": int(e["lower_bound_rank_max"]),
        "peak_memory_ratio": float(e["peak_memory_ratio"]), "unblock_s": float(e["unblock_s"]),
        "relayout_s": float(e["relayout_s"]), "move_s": float(e["move_s"]),
        "resume_step": int(e["resume_step"]), "replica_tp_after": e["replica_tp"],
        "cause": e["cause"],
    }


def _live_fault(event: str, opts: Options, out: Path, over: list[str]) -> dict[str, Any]:
    """A kill or hang of rank 1 at the fault step in a live-mode job; its measured entry."""
    if event == "hang":
        over = [*over, f"recovery.heartbeat_timeout_s={opts.hang_timeout_s}"]
    with Job(out, over, env={"NUTP_FAULT": f"{event}:rank=1:step={opts.fault_step}"}) as job:
        job.wait()
    return _live_entry(out)


@path("live")
def live(event: str, opts: Options) -> dict[str, Any] | None:
    """``recovery.mode=live``: survivors keep their processes, re-plan, new groups, state moved
    in memory (``nemo_nutp/recovery/control.py``); GPU back: every rank stops at the next step
    boundary, one new process per returning GPU joins and receives its state from the
    survivors (``processes_started``: those new processes; ``transition_s``: request -> first
    step of the grown layout started); straggler: every rank stops at the step boundary of the
    detection, re-planned without it (``transition_s``: detection -> first step without it)."""
    if event == "gpu_back":
        out = opts.work / "live_gpu_back"
        _run_gpu_back(opts, out, "recovery.mode=live")
        return _live_entry(out)
    if event == "straggler":
        out = opts.work / "live_straggler"
        # 2.5x: the 4x slowed GPU is found, probe noise of shared cores in the new layout not
        # slowed from step 2: found at step 4, steps left to run without it (the restart path's
        # fault_step leaves none: it is found at the last step)
        _run_straggler(opts, out, "recovery.mode=live", "nutp.straggler_threshold=2.5",
                       slow_from=2)
        return _live_entry(out)
    if event not in ("kill", "hang"):
        return None
    return _live_fault(event, opts, opts.work / f"live_{event}",
                       [*JOB, "recovery.mode=live", f"train.steps={opts.steps}"])


@path("live_zero")
def live_zero(event: str, opts: Options) -> dict[str, Any] | None:
    """``live`` under the distributed optimizer with ``recovery.live_redundancy``: a failure's
    optimizer slices rebuilt from the survivors' primaries and the dead rank's copies
    (``relayout/zero_move.py``). Kill and hang only (a GPU back or a straggler under the
    distributed optimizer is the planned restart)."""
    if event not in ("kill", "hang"):
        return None
    return _live_fault(event, opts, opts.work / f"live_zero_{event}",
                       [*JOB, "recovery.mode=live", "train.distributed_optimizer=true",
                        "recovery.live_redundancy=true", f"train.steps={opts.steps}"])


@path("live_spare")
def live_spare(event: str, opts: Options) -> dict[str, Any] | None:
    """``live`` with ``recovery.spares=1``: the job's cluster grows by one TP slice held back as
    a hot spare, its standby processes started with the job; a kill or hang swaps the failed
    slice for it (the replica keeps its base TP; ``processes_started`` 0: the standbys were
    started before the failure; the spare's ranks receive their state from a healthy replica).
    Kill and hang only."""
    if event not in ("kill", "hang"):
        return None
    # the same two TP2 replicas, plus one spare slice: 6 GPUs, nodes of one domain each
    over = [o for o in JOB if not o.startswith(("cluster.num_gpus=", "cluster.gpus_per_node="))]
    return _live_fault(event, opts, opts.work / f"live_spare_{event}",
                       [*over, "cluster.num_gpus=6", "cluster.gpus_per_node=2",
                        "recovery.mode=live", "recovery.spares=1", f"train.steps={opts.steps}"])


# --------------------------------------------------------------------------- report

def table(res: dict[str, Any]) -> Table:
    t = Table(title="Layout transitions measured on this machine (tiny TP2 x DP2 job)")
    for col in ("path", "event", "detect s", "transition s", "lost steps", "step s",
                "ckpt MiB read", "procs started", "rank recv MiB"):
        t.add_column(col, justify="right")
    for p, evs in res["paths"].items():
        for e, r in evs.items():
            t.add_row(p, e, f"{r['detect_s']:.2f}", f"{r['transition_s']:.2f}",
                      str(r["lost_steps"]), f"{r['step_s']:.3f}",
                      f"{r['checkpoint_bytes_read'] / 2**20:.2f}", str(r["processes_started"]),
                      f"{r['bytes_received_rank_max'] / 2**20:.2f}")
    return t


def plot(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nemo_nutp.layout.serialize import atomic_path

    labels, det, tra, lost = [], [], [], []
    for p, evs in res["paths"].items():
        for e, r in evs.items():
            labels.append(f"{p}\n{e}")
            det.append(r["detect_s"])
            tra.append(r["transition_s"])
            lost.append(r["lost_steps"] * r["step_s"])
    fig, ax = plt.subplots(figsize=(1.4 * max(len(labels), 3) + 1, 3.8))
    x = range(len(labels))
    ax.bar(x, det, label="detect", color="C1")
    ax.bar(x, tra, bottom=det, label="transition (job stands still)", color="C3")
    ax.bar(x, lost, bottom=[a + b for a, b in zip(det, tra, strict=True)],
           label="recomputed steps", color="C7")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Cost of one layout change (tiny job, shared 2-core machine)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    try:
        with atomic_path(png, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, shorter hang timeout")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {list(PATHS)}")
    ap.add_argument("--events", default=",".join(EVENTS), help=f"of {list(EVENTS)}")
    ap.add_argument("--out", default="runs/bench/transitions.json")
    ap.add_argument("--work", default=None, help="scratch dir of the jobs (default: a temp dir)")
    a = ap.parse_args(argv)
    console = Console(width=max(Console().width, 120))
    paths = [p for p in a.paths.split(",") if p]
    events = [e for e in a.events.split(",") if e]
    for name, known in (("--paths", list(PATHS)), ("--events", list(EVENTS))):
        for v in paths if name == "--paths" else events:
            if v not in known:
                console.print(f"[red]error:[/] {name}={v!r}: unknown; known: {known}")
                return 2
    res: dict[str, Any] = {"schema": "nemo_nutp.bench.transitions/1",
                           "job": {"overrides": list(JOB), "model": "tiny", "quick": a.quick,
                                   "host_cpus": os.cpu_count()},
                           "paths": {}}
    with tempfile.TemporaryDirectory(prefix="nutp-transitions-") as tmp:
        work = Path(a.work or tmp)
        opts = Options(work, steps=8 if a.quick else 10, fault_step=5,
                       hang_timeout_s=6.0 if a.quick else 10.0, console=console)
        for p in paths:
            for e in events:
                t0 = time.perf_counter()
                console.print(f"[bold]{p}[/] / {e}: running a job ...")
                r = PATHS[p](e, opts)
                if r is None:
                    console.print(f"  {p} cannot handle {e}: absent")
                    continue
                missing = [k for k in FIELDS if k not in r]
                if missing:
                    raise RuntimeError(f"path {p} event {e}: entry lacks {missing}")
                r["bench_wall_s"] = time.perf_counter() - t0
                res["paths"].setdefault(p, {})[e] = r
                console.print(f"  done in {r['bench_wall_s']:.0f} s: detect {r['detect_s']:.2f}"
                              f" s, transition {r['transition_s']:.2f} s, lost "
                              f"{r['lost_steps']} steps")
    console.print(table(res))
    out = Path(a.out)
    write_json_atomic(res, out)
    plot(res, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
