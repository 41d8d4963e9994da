"""``nutp-bridge recovery.mode=live``: Bridge's own ``train()`` through live re-layouts.

The shrunk vanilla GPT recipe (fp32, warmup then cosine: every step has its own lr; evaluation
every 2 steps) runs as ``python -m nemo_nutp.launch.bridge_cli`` on a 4-GPU CPU cluster with
GPU 3 failed: replicas [2,1]. Three re-layouts in one job, the survivors in their processes,
the state moved in memory (``checkpoint.save`` is set, as recovery requires, and nothing is
read back):

1. GPU 3 is reported back while the world starts (the health report rewritten, as an operator
   would): at the step boundary the vote agrees on, a new process joins for GPU 3 and the
   layout grows to [2,2] (the joiner receives weights and optimizer state from the survivors);
2. that joiner (rank 3) is killed inside the vote of step 3: the step is discarded everywhere
   and recomputed by the [2,1] world;
3. rank 1 is killed after the vote of step 5, inside its optimizer phase: the survivors
   complete the step from the gradients they hold, and [1,1] continues at step 6.

Every step's loss and grad norm equals the uninterrupted run's (one process, the same recipe)
within 1e-5, its lr exactly (1e-12), and every validation loss within 1e-5; replicas are
bitwise equal after every move; one ``start`` event, no step lost, no checkpoint read.

The bench tier (``NUTP_BENCH=1``) adds pipeline stages with the distributed optimizer and its
live redundancy (``recovery.live_redundancy``): [[2,2],[2,1]] on 8 GPUs (GPU 7 failed), rank 1
killed after its slices are updated and before the parameter all-gather (the step is committed;
its update survives in the survivors' slices and the dead rank's copies), then rank 4 (of the new
world) in its backward: the same comparison, and every slice's copy equal to its primary at the
end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

TOL = 1e-5
END = 7  # train_iters
SCHEDULE = ["scheduler.lr_warmup_iters=1", "scheduler.lr_decay_style=cosine",
            f"scheduler.lr_decay_iters={END}", "optimizer.lr=0.01", "optimizer.min_lr=0.001",
            f"train.train_iters={END}", "validation.eval_interval=2", "validation.eval_iters=1",
            "dataset.data_sharding=false"]
CLUSTER = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
           "failures.failed_gpus=[3]", "nutp.replicas=null", "model.tensor_model_parallel_size=2"]
FAULTS = "kill:3:3:vote:1,kill:1:5:optimizer:2"
JOB_TIMEOUT_S = 480


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _live_job(tmp_path: Path, overrides: list[str], faults: str, *, grow: bool
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """One supervised ``nutp-bridge`` live job (``grow``: GPU 3 reported back as it starts)
    and the uninterrupted run of the same recipe (one process) beside it: (the job's metrics
    rows, after checking every step and validation loss against the uninterrupted run's;
    its recovery events; its output dir)."""
    from nemo_nutp.common.procs import kill_session
    from tests.helpers.bridge_jobs import PARITY, RECIPE, TINY, run_worker
    from tests.helpers.dist import spawn
    from tests.helpers.live import metric_rows, read_events

    out, ckpt, ref_dir = tmp_path / "run", tmp_path / "ckpt", tmp_path / "ref"
    ref_dir.mkdir()
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "nemo_nutp.launch.bridge_cli", "--recipe", RECIPE,
           "--config-file", str(TINY), "--output-dir", str(out), *PARITY, *SCHEDULE,
           *overrides, "recovery.enabled=true", "recovery.mode=live", f"checkpoint.save={ckpt}",
           "checkpoint.save_interval=1000"]
    env = {**os.environ, "NUTP_LIVE_FAULT": faults, "NUTP_LIVE_DIGEST": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)
    try:
        if grow:
            _report_back(out, proc, log)
        # the uninterrupted run (one process, megatron's own optimizer) beside the live job
        spawn(run_worker, 1, ([*SCHEDULE, "model.tensor_model_parallel_size=1",
                               "nutp.replicas=[1]"],), ref_dir)
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    want = json.loads((ref_dir / "run_result.json").read_text())
    assert len({row["lr"] for row in want}) == END  # a schedule that moves every step
    rows = metric_rows(out)  # every step, no gap
    assert len(rows) == END
    for r, w in zip(rows, want, strict=True):
        assert _rel(r["lr"], w["lr"]) <= 1e-12, (r, w)
        assert _rel(r["loss"], w["loss"]) <= TOL, (r, w)
        assert _rel(r["grad_norm"], w["grad_norm"]) <= TOL, (r, w)
    ref_evals = json.loads((ref_dir / "bridge_rank0.json").read_text())["evals"]
    assert [e["step"] for e in ref_evals] == list(range(2, END + 1, 2)), ref_evals
    got_evals = {r["step"] + 1: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(got_evals) == [e["step"] for e in ref_evals], got_evals
    for e in ref_evals:
        assert _rel(got_evals[e["step"]], e["val_loss"]) <= TOL, (got_evals, e)
    ev = read_events(out)
    names = [e["event"] for e in ev]
    assert "resumed" not in names and "failure" not in names and "live_fallback" not in names
    assert names.count("start") == 1, "a live re-layout restarted"
    lives = [e for e in ev if e["event"] == "live_relayout"]
    for e in lives:  # nothing lost, nothing read back
        assert e["lost_steps"] == 0 and e["recomputed_steps"] <= 1, e
        assert e["resume_step"] == e["committed_step"] + 1, e
        assert e["checkpoint_bytes_read"] == 0, e
    assert not list(ckpt.glob("iter_*")) or all(  # no save before the end: nothing to read
        int(p.name[5:]) == END for p in ckpt.glob("iter_*"))
    assert (out / "goodput.json").is_file() and (out / "training.png").is_file()
    return rows, ev, out


def _report_back(out: Path, proc: subprocess.Popen[str], log: Path) -> None:
    """Once the first world is up (its ranks still building): GPU 3 is healthy again."""
    events = out / "recovery" / "events.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "live_world" not in (events.read_text() if events.exists() else ""):
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, "no world within the job timeout"
        time.sleep(0.05)
    health = out / "recovery" / "health.json"
    assert json.loads(health.read_text())["failed_gpus"] == [3]
    tmp = health.with_suffix(".test-tmp")
    tmp.write_text(json.dumps({"failed_gpus": []}))
    os.replace(tmp, health)


@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_grow_and_two_kills_live_inside_bridge_equal_the_uninterrupted_run(tmp_path: Path
                                                                            ) -> None:
    from tests.helpers.live import replica_digests

    rows, ev, out = _live_job(tmp_path, CLUSTER, FAULTS, grow=True)
    grow, vote, opt = lives = [e for e in ev if e["event"] == "live_relayout"]
    k = grow["resume_step"]
    assert (grow["cause"], grow["joiners"], grow["replica_tp"]) == ("gpu_back", [3], [[2], [2]])
    assert grow["recomputed_steps"] == 0 and grow["processes_started"] == 1 and 1 <= k <= 3
    (first,) = [e for e in ev if e["event"] == "live_world"]
    assert set(first["pids"]) < set(grow["pids"]), (first, grow)  # survivors kept theirs
    assert set(opt["pids"]) < set(vote["pids"]) < set(grow["pids"]), (grow, vote, opt)
    assert vote["processes_started"] == opt["processes_started"] == 0
    assert (vote["ranks"], vote["replica_tp"]) == ([3], [[2], [1]]), vote
    assert (vote["committed_step"], vote["recomputed_steps"]) == (2, 1), vote  # discarded
    assert (opt["ranks"], opt["replica_tp"]) == ([1], [[1], [1]]), opt
    assert (opt["committed_step"], opt["recomputed_steps"]) == (5, 0), opt  # completed
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2, 3], digests
    for gen, reps in digests.items():  # replicas bitwise equal after every move
        assert len(set().union(*reps.values())) == 1, (gen, reps)
    layouts = [r["replica_tp"] for r in rows]
    assert layouts == [[[2], [1]]] * k + [[[2], [2]]] * (3 - k) + [[[2], [1]]] * 3 + \
        [[[1], [1]]], layouts
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [(s["mode"], s["cause"]) for s in summary] == [("live", "gpu_back"), ("live", "exit"),
                                                           ("live", "exit")], summary
    print("live under Bridge (cause, relayout_s):",
          [(e["cause"], round(e["relayout_s"], 3)) for e in lives])


@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 2 min on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_pipeline_and_distributed_optimizer_live_with_redundancy(tmp_path: Path) -> None:
    from tests.helpers.live import replica_digests

    over = ["cluster.num_gpus=8", "cluster.domain_size=2", "cluster.gpus_per_node=8",
            "failures.failed_gpus=[7]", "nutp.replicas=null",
            "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2",
            "optimizer.use_distributed_optimizer=true", "recovery.live_redundancy=true"]
    rows, ev, _ = _live_job(tmp_path, over, "kill:1:2:gather:0,kill:4:4:backward:1",
                            grow=False)
    gather, back = [e for e in ev if e["event"] == "live_relayout"]
    assert rows[0]["replica_tp"] == [[2, 2], [2, 1]], rows[0]
    assert (gather["committed_step"], gather["recomputed_steps"]) == (2, 0), gather
    assert (back["committed_step"], back["recomputed_steps"]) == (3, 1), back
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():
        assert len(set().union(*reps.values())) == 1, (gen, reps)
    (final,) = [e for e in ev if e["event"] == "live_final_slices"]
    assert final["redundancy"] and final["backup_max_diff"] == 0.0, final
    print("live under Bridge, pp=2 + ZeRO (relayout_s):",
          [round(e["relayout_s"], 3) for e in (gather, back)])
