"""Issue #35 item 4: hot spares under the live control process (``recovery.spares``).

12 CPU "GPUs" in three 4-GPU domains, TP4: the plan trains two replicas on GPUs 0-7 and holds
back the last slice (GPUs 8-11) as a spare, whose four standby processes start with the job
(imported, connected to the control process's store) and wait.

1. Rank 1 (GPU 1) is killed in step 2's forward while the spare is free: one live re-layout
   swaps GPUs 0-3's slice for the spare. The replica keeps its base TP (the layout stays
   [[4],[4]]), no process starts inside the transition (the new world's processes all existed
   before the failure: the survivors and the standbys), the spare's ranks receive weights and
   optimizer state from the other replica (no checkpoint read), and GPUs 0, 2, 3 are held back.
2. A rank of the new world is killed at step 4: no spare is left, so NUTP's degraded layout
   runs ([[4],[3]]).

Every step's loss and grad norm equal an uninterrupted single-process run of stock
megatron-core within 1e-5; replicas are bitwise equal after each move; no traceback."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_nutp.common.procs import kill_session
from tests.helpers.launch import start_train
from tests.helpers.live import (
    BASE,
    JOB_TIMEOUT_S,
    TOL,
    check_steps,
    read_events,
    replica_digests,
    run_job,
    stock_reference,
)

STEPS = 7
JOB = (*BASE, "health=none", "cluster.num_gpus=12", "cluster.gpus_per_node=4",
       "parallel.tp_base=4", "recovery.spares=1", f"train.steps={STEPS}",
       "checkpoint.interval=100")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_kill_with_a_free_spare_keeps_the_base_tp_live(tmp_path: Path) -> None:
    out = tmp_path / "spares"
    faults = "kill:rank=1:step=2:phase=forward,kill:rank=5:step=4:phase=forward:gen=1"
    rc, log = run_job(out, JOB, {"NUTP_FAULT": faults, "NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    rows = check_steps(out, stock_reference(JOB, STEPS, tmp_path), TOL)
    ev = read_events(out)
    names = [e["event"] for e in ev]
    assert names.count("start") == 1 and "live_fallback" not in names, names
    (standby,) = [e for e in ev if e["event"] == "spares_standby"]
    assert standby["slices"] == [[8, 9, 10, 11]], standby
    (world,) = [e for e in ev if e["event"] == "live_world"]
    swap, degrade = [e for e in ev if e["event"] == "live_relayout"]

    assert swap["spares_used"] == [[8, 9, 10, 11]] and swap["replaced_slices"] == [[0, 1, 2, 3]]
    assert swap["replica_tp"] == [[4], [4]] and swap["spares_free"] == 0, swap
    assert swap["processes_started"] == 0 and swap["checkpoint_bytes_read"] == 0, swap
    before = set(world["pids"]) | set(standby["pids"])
    assert set(swap["pids"]) <= before, (swap["pids"], before)  # no process started
    assert set(standby["pids"]) <= set(swap["pids"]), swap  # the spares joined
    assert swap["bytes_received_rank_max"] > 0, swap  # state moved to them, not read back

    assert degrade["replica_tp"] == [[4], [3]] and degrade["spares_used"] == [], degrade
    assert degrade["processes_started"] == 0, degrade
    assert [r["replica_tp"] for r in rows] == [[[4], [4]]] * 4 + [[[4], [3]]] * 3
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():  # replicas bitwise equal after every move
        assert len(set().union(*reps.values())) == 1, (gen, reps)


def _wait_event(out: Path, proc: Any, log: Path, name: str, deadline: float) -> dict[str, Any]:
    while True:
        found = [e for e in (read_events(out) if (out / "recovery" / "events.jsonl").exists()
                             else []) if e["event"] == name]
        if found:
            return found[0]
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, f"no {name} within the job timeout"
        time.sleep(0.05)


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_gpu_back_refills_the_spares_first(tmp_path: Path) -> None:
    """Rank 1 killed at step 2: the spare (GPUs 8-11) takes slice 0-3's place. GPU 1 is then
    reported back (the health report rewritten, as an operator would): slice 0-3 is whole again
    and becomes the spare, its four standby processes started; the layout does not change (no
    grow). A rank of the new world killed from outside is then swapped for that refilled spare:
    the layout stays [[4],[4]]. Every step exact against stock megatron-core."""
    steps = 40
    job = (*JOB[:-2], f"train.steps={steps}", "checkpoint.interval=100")
    out, log = tmp_path / "refill", tmp_path / "refill.log"
    proc = start_train([f"output.dir={out}", *job], log=log,
                       env={"NUTP_FAULT": "kill:rank=1:step=2:phase=forward",
                            "NUTP_LIVE_DIGEST": "1"})
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        swap = _wait_event(out, proc, log, "live_relayout", deadline)
        health = out / "recovery" / "health.json"
        assert json.loads(health.read_text())["failed_gpus"] == [1]
        tmp = health.with_suffix(".test-tmp")
        tmp.write_text(json.dumps({"failed_gpus": []}))
        os.replace(tmp, health)  # GPU 1 is back
        refill = _wait_event(out, proc, log, "spare_refilled", deadline)
        os.kill(swap["pids"][0], signal.SIGKILL)  # a rank of the new world
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    rows = check_steps(out, stock_reference(job, steps, tmp_path), TOL)
    ev = read_events(out)
    assert refill["slices"] == [[0, 1, 2, 3]] and refill["spares_free"] == 1, refill
    first, second = [e for e in ev if e["event"] == "live_relayout"]
    assert first["spares_used"] == [[8, 9, 10, 11]], first
    assert second["spares_used"] == [[0, 1, 2, 3]] and second["replica_tp"] == [[4], [4]]
    assert set(refill["pids"]) <= set(second["pids"]), (refill, second)  # they joined
    assert second["processes_started"] == 0, second
    assert not [e for e in ev if e["event"] in ("scale_up_requested", "live_fallback")], ev
    assert all(r["replica_tp"] == [[4], [4]] for r in rows)
