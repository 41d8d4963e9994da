"""Issue 35 item 2: a hang, a straggler and a GPU coming back under the scripts ``nutp sbatch``
renders, submitted as rendered to the real Slurm test cluster (``tests/helpers/slurm_cluster.py``:
three slurmd with four fake GPUs each). Several events per job, to keep CI time down.

Both jobs run on two nodes with checkpoints every 2 steps, the straggler probe every step
(``nutp.exclude_stragglers``; threshold 2.5x: the 4x slowed GPU is found, the probe noise of 2
shared cores is not), hangs found after ``HEARTBEAT_S`` without a step heartbeat.

* Live mode (a control process and one agent per node), the default tiny job (GPU 7 failed: TP4
  on n1's GPUs 0-3, TP3 on n2's GPUs 4-6): GPU 1 slowed 4x from step 0 -> the probe
  names it, every rank stops at the same step boundary and GPU 1's process leaves: TP3+TP3, no
  process started; then slot 5 (GPU 5, node 1) hangs in its forward in that second world -> its
  node agent's digest shows the stall, the control process blames it ("hung ..."), kills it and
  the survivors re-lay out live: TP3+TP2. The straggler comes first: an injected slowdown is the
  first world's (after a live re-layout its rank number names another GPU), a phase hang can
  name its world (``gen=1``).
* Restart mode (the script's srun loop), two nodes of two GPUs (TP2+TP2: every attempt starts
  one interpreter per GPU slot, ~20-35 s on the shared cores, so four slots rather than eight):
  attempt 0, rank 3 hangs at step 2 -> the job-level aggregator blames it, attempt 1 runs TP2+TP1
  without GPU 3; the operator reports GPU 3 back (the health report rewritten) -> a planned
  restart at the next checkpoint, attempt 2 at TP2+TP2; there GPU 1 is slowed 4x (a fault of
  attempt 2: ``attempt=2``) -> found by the probe, the run stops after the next checkpoint and
  attempt 3 re-plans around it (TP2+TP1). Before, the srun loop took that stop for the job's
  end (exit 0 with steps left).

Each: every step's loss and grad norm equal to an uninterrupted single-process run of stock
megatron-core within 1e-5, only the hung or slow GPU blamed, reasons in words, no traceback in
the job's output, and the events and summary say what happened.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_nutp.common.ports import free_port
from tests.helpers.live import (
    BASE,
    JOB_TIMEOUT_S,
    TOL,
    check_live,
    check_steps,
    read_events,
    stock_reference,
)
from tests.helpers.slurm_cluster import PARTITION, SlurmCluster
from tests.helpers.slurm_jobs import LIVE, REPO, Watch, has_event, render, report_back, submit

HEARTBEAT_S = 10  # hang: no step heartbeat this long (a healthy step: ~0.4 s; margin for load)
STRAGGLERS = ("nutp.straggler_probe_interval=1", "nutp.straggler_window=3",
              "nutp.straggler_threshold=2.5", "nutp.exclude_stragglers=true",
              f"recovery.heartbeat_timeout_s={HEARTBEAT_S}")
LIVE_STEPS = 12
LIVE_JOB = (*BASE, *LIVE, *STRAGGLERS, f"train.steps={LIVE_STEPS}")
RESTART_STEPS = 14
# Four GPUs (two nodes of two): every attempt starts one interpreter per GPU slot, ~30 s on
# the shared cores for eight; half as many halve the restarts' cost.
RESTART_JOB = ("train.seed=7", "train.global_batch_size=12", "train.micro_batch_size=2",
               "train.clip_grad=0.5", "recovery.enabled=true", "cluster.num_gpus=4",
               "cluster.domain_size=2", "cluster.gpus_per_node=2", "parallel.tp_base=2",
               "health.failed_gpus=[]", "checkpoint.interval=2", *STRAGGLERS,
               f"train.steps={RESTART_STEPS}")


def _job(slurm: SlurmCluster, tmp_path: Path, over: tuple[str, ...], name: str,
         during: object = None, **env: str) -> tuple[str, dict[str, str], str]:
    """Render the script for ``over`` (+ ``output.dir``), submit it, call ``during(watch,
    deadline)`` while it runs, wait for its end; (job id, its final state, its output)."""
    out = tmp_path / "out"
    script = tmp_path / "job.sbatch"
    script.write_text(render((*over, f"output.dir={out}"), master_port=free_port(),
                             partition=PARTITION, account="nutp", repo=str(REPO),
                             job_name=name))
    job = submit(slurm, script, **env)
    watch = Watch(slurm, job)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        if callable(during):
            during(watch, deadline)
        watch.finish(deadline)
    finally:
        slurm.run("scancel", job, check=False)
    text = (tmp_path / f"{name}-{job}.out").read_text()
    assert "Traceback" not in text, text[-6000:]
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
        text[-6000:]
    return job, dict(watch.state), text


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_straggler_then_hang_on_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    job, _, text = _job(slurm, tmp_path, LIVE_JOB, "nutp-faults",
                        NUTP_FAULT="slow:rank=1:factor=4,hang:rank=5:step=6:phase=forward:gen=1",
                        NUTP_LIVE_DIGEST="1")
    out = tmp_path / "out"
    assert slurm.job_steps(job) == [0, 1]  # the control process and the agents: no other
    ev = read_events(out)
    names = [e["event"] for e in ev]
    assert "failure" not in names and "live_fallback" not in names, names
    excl, hang = check_live(ev, relayouts=2)
    # the straggler: only GPU 1, found by the probe (one event), its process left
    (found,) = [e for e in ev if e["event"] == "straggler"]
    assert found["gpu"] == 1, found
    assert (excl["cause"], excl["excluded_gpus"], excl["processes_started"]) == (
        "straggler", [1], 0), excl
    assert excl["reason"] == "straggler" and len(excl["pids"]) == 6, excl
    assert list(json.loads((out / "recovery" / "slow.json").read_text())["slow_gpus"]) == ["1"]
    # the hang: slot 5 (GPU 5, rank 4 of the second world), blamed from its node agent's digest
    assert (hang["cause"], hang["gpus"], hang["ranks"]) == ("hang", [5], [4]), hang
    assert "hung" in hang["reason"] and "signal" not in hang["reason"], hang
    (fault,) = [e for e in ev if e["event"] == "fault"]
    assert (fault["kind"], fault["rank"], fault["gen"]) == ("hang", 5, 1), fault
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [(s["mode"], s["cause"], s["gpus"]) for s in summary] == [
        ("live", "straggler", [1]), ("live", "hang", [5])], summary
    (detect,) = [s["detect_s"] for s in summary if s["cause"] == "hang"]
    assert HEARTBEAT_S - 1 <= detect < HEARTBEAT_S + 10, summary
    rows = check_steps(out, stock_reference(LIVE_JOB, LIVE_STEPS, tmp_path), TOL)
    layouts = [r["replica_tp"] for r in rows]
    a, b = excl["resume_step"], hang["resume_step"]
    assert layouts == ([[[4], [3]]] * a + [[[3], [3]]] * (b - a)
                       + [[[3], [2]]] * (LIVE_STEPS - b)), layouts
    assert "hung" in text, text[-3000:]
    print(f"slurm live: straggler excluded after step {a - 1} in {excl['relayout_s']:.2f} s; "
          f"hang detected in {detect:.1f} s, re-laid out in {hang['relayout_s']:.2f} s")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_restart_hang_gpu_back_straggler_on_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def during(watch: Watch, deadline: float) -> None:
        starts = lambda: [e for e in read_events(out) if e["event"] == "start"]  # noqa: E731
        watch.until(lambda: has_event(out, "start")() and len(starts()) >= 2, deadline,
                    "attempt 1")
        report_back(out, [3], [])  # GPU 3 is back

    _, _, text = _job(slurm, tmp_path, RESTART_JOB, "nutp-faults", during,
                      NUTP_FAULT="hang:rank=3:step=2,slow:rank=1:factor=4:attempt=2")
    ev = read_events(out)
    starts = [e for e in ev if e["event"] == "start"]
    assert [s["replica_tp"] for s in starts] == [[[2], [2]], [[2], [1]], [[2], [2]],
                                                 [[2], [1]]], starts
    assert [s["failed_gpus"] for s in starts] == [[], [3], [], []], starts
    (hang,) = [e for e in ev if e["event"] == "failure"]  # the only failure: the hang
    assert (hang["cause"], hang["ranks"], hang["gpus"]) == ("hang", [3], [3]), hang
    assert "hung" in hang["reason"] and "signal" not in hang["reason"], hang
    (back,) = [e for e in ev if e["event"] == "scale_up"]
    assert back["gpus"] == [3] and back["reason"] == "GPU back", back
    (found,) = [e for e in ev if e["event"] == "straggler"]
    assert found["gpu"] == 1, found
    (excl,) = [e for e in ev if e["event"] == "relayout"]
    assert (excl["cause"], excl["gpus"], excl["reason"]) == ("straggler", [1], "straggler"), excl
    assert excl["lost_steps"] == 0, excl
    assert json.loads((out / "recovery" / "health.json").read_text())["failed_gpus"] == []
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [(s["cause"], s["gpus"]) for s in summary] == [
        ("hang", [3]), ("gpu_back", [3]), ("straggler", [1])], summary
    assert "attempt 2 failed" in text and "attempt 3 failed" not in text, text[-3000:]
    rows = check_steps(out, stock_reference(RESTART_JOB, RESTART_STEPS, tmp_path), TOL)
    layouts = [r["replica_tp"] for r in rows]
    a, b, c = hang["resume_step"], back["resume_step"], excl["resume_step"]
    assert layouts == ([[[2], [2]]] * a + [[[2], [1]]] * (b - a) + [[[2], [2]]] * (c - b)
                       + [[[2], [1]]] * (RESTART_STEPS - c)), layouts
    print(f"slurm restart: hang detected in {summary[0]['detect_s']:.1f} s, resumed at step "
          f"{hang['resume_step']}; GPU back resumed at step {back['resume_step']}; straggler "
          f"excluded, resumed at step {excl['resume_step']}")
