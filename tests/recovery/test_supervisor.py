"""Issue 6 acceptance: automatic recovery at reduced TP, crash during a save, hang, GPU back.

* Kill test: the default 7-rank TP4+TP3 job, checkpoints every 2 steps, rank 1 SIGKILLed at step
  5; the supervisor marks GPU 1 failed, re-plans (TP3+TP3), resumes from step 4 and finishes.
  Every step's loss equals an uninterrupted single-process TP1 run on the same global batches.
* Crash during save: rank 1 of a TP2+TP1 job dies inside the save of step 4; the restart loads
  step 2 (the partial directory is ignored) and finishes with the reference losses.
* Hang: rank 5 (TP3 replica) of the same job hangs at step 5; its peers block in its
  collectives (same step heartbeat), yet only rank 5 is blamed (its stack watcher shows it
  outside any collective); its GPU is marked failed, the job re-plans, finishes with the
  reference losses and recomputes at most one checkpoint interval.
* GPU back: the test reports GPU 7 back (rewrites the health report) once a checkpoint exists;
  the supervisor restarts at the next checkpoint on the full 8-GPU layout without losing a
  committed step; losses equal the reference.

Expected layouts come from the planner (``build_plan``) for the expected failed GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nemo_nutp.common.procs import kill_session
from nemo_nutp.config import load_config, plan_request
from nemo_nutp.layout import build_plan
from tests.helpers.launch import start_train

TOL = 1e-5
COMMON = ("train.seed=7", "train.global_batch_size=12", "train.micro_batch_size=2")
JOB_TIMEOUT_S = 600
HEARTBEAT_S = 6.0
"""Hang tests: no sign of progress for this long is a hang. Signs of progress include stack
changes and CPU use seen by each rank's watcher, so saves and the end-of-run report (several
seconds on a loaded 2-core machine) do not count; detection takes about this long."""


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _leftovers(sid: int, grace_s: float = 20.0) -> list[str]:
    """Processes of session ``sid`` still alive ``grace_s`` after its leader exited (their
    command lines)."""
    deadline = time.monotonic() + grace_s
    while (pids := _session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes()
                       .replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            pass
    return out




class _Job:
    """``python -m nemo_nutp.train`` in a session of its own; output in ``<out>.log``. Every
    process of the session is killed when the job is left (a broken test fails, never hangs
    nor leaves ranks behind)."""

    def __init__(self, out: Path, *overrides: str, steps: int = 6,
                 env: dict[str, str] | None = None) -> None:
        self.log = out.with_suffix(".log")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.proc = start_train([f"output.dir={out}", *COMMON, f"train.steps={steps}",
                                 *overrides], log=self.log, env=env)
        self.deadline = time.monotonic() + JOB_TIMEOUT_S

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_session(self.proc.pid)
        self.proc.wait()

    def running(self) -> bool:
        assert time.monotonic() < self.deadline, f"job ran past {JOB_TIMEOUT_S} s"
        return self.proc.poll() is None

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = -1
        self.left = _leftovers(self.proc.pid)  # after a clean exit: orphans
        return rc, self.log.read_text()


def _train(out: Path, *overrides: str, steps: int = 6, env: dict[str, str] | None = None
           ) -> tuple[int, str]:
    with _Job(out, *overrides, steps=steps, env=env) as job:
        return job.wait()


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _rows(out)]


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return rows


def _layout(*overrides: str) -> tuple[int, list[list[int]], tuple[int, ...]]:
    """World size, replica TP degrees and rank -> GPU of the planner's plan for a job."""
    plan = build_plan(plan_request(load_config([*COMMON, *overrides])))
    return plan.world_size, [list(r.tp) for r in plan.replicas], tuple(plan.rank_to_gpu)


def _events(out: Path) -> list[dict[str, Any]]:
    text = (out / "recovery" / "events.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[float]]:
    """Losses of an uninterrupted single-process TP1 run of ``steps`` steps (cached)."""
    cache: dict[int, list[float]] = {}

    def get(steps: int) -> list[float]:
        if steps not in cache:
            out = tmp_path_factory.mktemp(f"ref{steps}")
            rc, log = _train(out, "nutp.replicas=[1]", "health=none", steps=steps)
            assert rc == 0, log[-6000:]
            cache[steps] = _losses(out)
        return cache[steps]

    return get


@pytest.fixture(scope="module")
def reference(references: Callable[[int], list[float]]) -> list[float]:
    return references(6)


def _check(out: Path, ref: list[float]) -> list[dict]:
    losses = _losses(out)
    assert len(losses) == len(ref)
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) <= TOL * abs(b), (losses, ref)
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    good = json.loads((out / "goodput.json").read_text())
    assert good["restart_gpu_s"] > 0 and good["checkpoint_gpu_s"] > 0
    return summary


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_kill_rank_recovers_at_reduced_tp(tmp_path: Path, reference: list[float]) -> None:
    out = tmp_path / "kill"
    rc, log = _train(out, "checkpoint.interval=2", "recovery.enabled=true",
                     "recovery.fault.kind=kill", "recovery.fault.rank=1", "recovery.fault.step=5")
    assert rc == 0, log[-6000:]
    (s,) = _check(out, reference)
    assert s["gpus"] == [1] and "signal 9" in s["reason"]
    assert s["resume_step"] == 4 and s["replica_tp"] == [[3], [3]]
    assert s["lost_steps"] <= 2  # at most the checkpoint interval is recomputed
    print(f"kill test: detect {s['detect_s']:.2f} s, restart {s['restart_s']:.2f} s, "
          f"lost steps {s['lost_steps']}")
    health = json.loads((out / "recovery" / "health.json").read_text())
    assert health["failed_gpus"] == [1, 7]
    assert "Recovery" in log


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_crash_during_save_resumes_previous_checkpoint(tmp_path: Path,
                                                      reference: list[float]) -> None:
    out = tmp_path / "savecrash"
    rc, log = _train(out, "nutp.replicas=[2,1]", "checkpoint.interval=2",
                     "recovery.enabled=true", "recovery.fault.kind=save_crash",
                     "recovery.fault.rank=1", "recovery.fault.step=4")
    assert rc == 0, log[-6000:]
    (s,) = _check(out, reference)
    assert s["resume_step"] == 2
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert any(".tmp-" in n and n.startswith("iter_0000004") for n in ckpts), ckpts
    assert "iter_0000006" in ckpts


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_rank_killed_during_async_save_resumes_previous_checkpoint(
        tmp_path: Path, reference: list[float]) -> None:
    """checkpoint.async_save: rank 1 is SIGKILLed right after its background write of step 4
    started (training had resumed). Its writers die with it (no process of the job is left
    after it exits); the restart loads step 2 (the half-written directory is never loaded);
    the losses equal the reference; goodput charges the stall, the write time beside it. The
    interval is ``auto`` clamped to 2: the auto path runs (start line, re-derivation after
    each save), the value stays deterministic."""
    out = tmp_path / "asynccrash"
    with _Job(out, "nutp.replicas=[2,1]", "checkpoint.interval=auto", "checkpoint.interval_min=2",
              "checkpoint.interval_max=2", "checkpoint.async_save=true",
              "recovery.enabled=true", "recovery.fault.kind=save_crash",
              "recovery.fault.rank=1", "recovery.fault.step=4") as job:
        rc, log = job.wait()
        left = job.left
    assert rc == 0, log[-6000:]
    assert left == [], f"processes outlived the job: {left}"
    assert "interval auto (Young/Daly): 2 steps" in log and "interval auto: 2 steps" in log, log
    (s,) = _check(out, reference)
    assert s["resume_step"] == 2
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert any(".tmp-" in n and n.startswith("iter_0000004") for n in ckpts), ckpts
    assert "iter_0000006" in ckpts
    events = _events(out)
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert saved and all(e["background"] for e in saved), saved
    fault_t = next(e["t"] for e in events if e["event"] == "fault")
    assert not any(e["step"] == 4 and e["t"] < fault_t for e in saved), saved  # never completed
    good = json.loads((out / "goodput.json").read_text())
    assert good["checkpoint_write_s"] > 0, good


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_hung_rank_is_blamed_not_its_blocked_peers(tmp_path: Path,
                                                  reference: list[float]) -> None:
    hung, step, interval = 5, 5, 2
    world, before, gpus = _layout()
    failed = sorted(set(load_config(list(COMMON)).health.as_report().failed_gpus) | {gpus[hung]})
    new_world, after, _ = _layout(f"health.failed_gpus={failed}")
    out = tmp_path / "hang"
    rc, log = _train(out, f"checkpoint.interval={interval}", "recovery.enabled=true",
                     f"recovery.heartbeat_timeout_s={HEARTBEAT_S}",
                     env={"NUTP_FAULT": f"hang:rank={hung}:step={step}"})
    assert rc == 0, log[-6000:]
    (s,) = _check(out, reference)
    assert s["cause"] == "hang" and "hung" in s["reason"], s
    assert s["ranks"] == [hung] and s["gpus"] == [gpus[hung]], s
    assert json.loads((out / "recovery" / "health.json").read_text())["failed_gpus"] == failed
    assert s["resume_step"] == step // interval * interval
    assert s["lost_steps"] <= interval
    assert s["replica_tp"] == after != before
    # no progress for the timeout, then found within a few watcher/poll periods
    assert HEARTBEAT_S <= s["detect_s"] < HEARTBEAT_S + 10, s
    # what the rank watchers saw when the world was stopped: the peers blocked in collectives
    # (TP peers in its forward, the other replica in the gradient sync), the hung rank not
    hb = out / "recovery" / "heartbeats.0"
    waiting = {r: (hb / f"rank{r}.stack").read_text().split()[0] == "1" for r in range(world)}
    assert waiting == {r: r != hung for r in range(world)}, waiting
    (failure,) = [e for e in _events(out) if e["event"] == "failure"]
    assert "faults.py" in failure["where"][str(hung)], failure
    (restart,) = [e for e in _events(out) if e["event"] == "start" and e["attempt"] == 1]
    assert restart["world_size"] == new_world == world - 1
    rows = _rows(out)
    assert [r["replica_tp"] for r in rows] == [before] * s["resume_step"] + [after] * (
        len(rows) - s["resume_step"])
    print(f"hang test: detect {s['detect_s']:.2f} s, restart {s['restart_s']:.2f} s, "
          f"lost steps {s['lost_steps']}")


def _newest_checkpoint(root: Path) -> int | None:
    try:
        step = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
        return int(json.loads((root / f"iter_{step:07d}" / "nutp_checkpoint.json").read_text(
        ))["step"])
    except (OSError, ValueError):
        return None


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_gpu_back_restarts_on_the_full_layout_at_the_next_checkpoint(
        tmp_path: Path, references: Callable[[int], list[float]]) -> None:
    steps, interval = 10, 2
    ref = references(steps)
    _, before, _ = _layout()
    configured = set(load_config(list(COMMON)).health.as_report().failed_gpus)
    assert configured, "the default job has a failed GPU to give back"
    full_world, full, _ = _layout("health=none")
    out = tmp_path / "back"
    root = out / "checkpoints"
    with _Job(out, f"checkpoint.interval={interval}", "recovery.enabled=true",
              steps=steps) as job:
        while _newest_checkpoint(root) is None:
            assert job.running(), "job ended before its first checkpoint:\n" + job.log.read_text()
            time.sleep(0.05)
        health = out / "recovery" / "health.json"
        assert set(json.loads(health.read_text())["failed_gpus"]) == configured
        tmp = health.with_suffix(".test-tmp")
        tmp.write_text(json.dumps({"failed_gpus": []}))
        reported_at, base = time.time(), _newest_checkpoint(root)
        os.replace(tmp, health)
        rc, log = job.wait()
    assert rc == 0, log[-6000:]
    assert base is not None and base + interval < steps, "report came too late to test"
    (s,) = _check(out, ref)
    assert (s["cause"], s["reason"], s["gpus"]) == ("gpu_back", "GPU back", sorted(configured))
    assert s["replica_tp"] == full != before
    # the first checkpoint completed after the report, not the one that existed then
    assert base < s["resume_step"] < steps and s["resume_step"] % interval == 0, (base, s)
    assert s["lost_steps"] < interval, s  # at most the steps run while the supervisor reacted
    assert s["restart_s"] > 0
    ev = _events(out)
    (req,) = [e for e in ev if e["event"] == "scale_up_requested"]
    (stop,) = [e for e in ev if e["event"] == "scale_up"]
    # the report is read about every second
    assert reported_at <= req["t"] < reported_at + 10 and req["base_step"] >= base, (req, base)
    assert req["t"] < stop["t"] and stop["step"] == s["resume_step"], (req, stop)
    (restart,) = [e for e in ev if e["event"] == "start" and e["attempt"] == 1]
    assert restart["failed_gpus"] == [] and restart["world_size"] == full_world
    assert not [e for e in ev if e["event"] == "failure"]
    assert json.loads((out / "recovery" / "health.json").read_text())["failed_gpus"] == []
    rows = _rows(out)
    assert [r["replica_tp"] for r in rows] == [before] * s["resume_step"] + [full] * (
        steps - s["resume_step"])
    assert "GPU back" in log
    print(f"GPU back test: report -> stop {s['detect_s']:.2f} s (waiting for the checkpoint), "
          f"restart {s['restart_s']:.2f} s, lost steps {s['lost_steps']}, resumed at step "
          f"{s['resume_step']} (newest checkpoint at the report: {base})")


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_no_layout_left_after_a_failure_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Issue 35: when the GPUs left after a failure fit no layout (here one TP2 replica and
    parallel.min_tp=2: a lost rank leaves one GPU), the supervisor stops with one line naming
    why, exit 1, instead of the planner's ValueError traceback."""
    out = tmp_path / "none_left"
    rc, log = _train(out, "cluster.num_gpus=2", "cluster.domain_size=2",
                     "cluster.gpus_per_node=2", "health=none",
                     "parallel.tp_base=2", "parallel.min_tp=2", "checkpoint.interval=1",
                     "recovery.enabled=true", "recovery.fault.kind=kill",
                     "recovery.fault.rank=1", "recovery.fault.step=1", steps=3)
    assert rc == 1, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    text = " ".join(log.split())
    assert "no layout can run on the GPUs left, stopping:" in text, log[-3000:]
    assert "parallel.min_tp" in text, log[-3000:]
