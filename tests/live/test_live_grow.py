"""Issue 24 acceptance 1: grow back live (``recovery.mode=live``) under the CPU supervisor.

A job starts at TP3+TP3 (GPUs 3 and 7 failed in its health report). While it trains, the
operator reports both GPUs back (the health report is rewritten, as an operator would). The
control process stops every rank at the step boundary their vote agrees on, re-plans with the
same planner (TP4+TP4), starts one new process per returning GPU, and the new world continues
with the survivors in the same processes and the state moved in memory (no checkpoint is
saved while the job runs: nothing can be read back). Every step's loss and grad norm is compared
with an uninterrupted single-process run of *stock* megatron-core (``tests/helpers/
reference.py``, clipping on), computed here; replicas are bitwise equal after each move. Then a
returned GPU's process is killed: an ordinary live re-layout, the joiner a full member.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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
    stock_reference,
)


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_grow_back_tp3_tp3_to_tp4_tp4_live(tmp_path: Path) -> None:
    """TP3+TP3 -> TP4+TP4 live when GPUs 3 and 7 come back; then the returned GPU 7's new
    process (slot 7) is killed in its forward at step 5: a live re-layout to TP4+TP3 with the
    joiners as ordinary members of the world."""
    steps = 8
    # interval > steps: no checkpoint exists while the job runs (recovery needs an interval)
    over = (*BASE, "health.failed_gpus=[3,7]", "checkpoint.interval=1000",
            f"train.steps={steps}", "train.lr_warmup_iters=3", "train.lr_decay_style=linear")
    out = tmp_path / "grow"
    out.mkdir()
    log = tmp_path / "grow.log"
    proc = start_train([f"output.dir={out}", *over], log=log,
                       env={"NUTP_LIVE_DIGEST": "1",
                            "NUTP_FAULT": "kill:rank=7:step=5:phase=forward:gen=1"})
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        events = out / "recovery" / "events.jsonl"
        while "live_world" not in (events.read_text() if events.exists() else ""):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no world within the job timeout"
            time.sleep(0.05)
        # the world is up (its ranks still building): report the GPUs back
        health = out / "recovery" / "health.json"
        assert json.loads(health.read_text())["failed_gpus"] == [3, 7]
        tmp = health.with_suffix(".test-tmp")
        tmp.write_text(json.dumps({"failed_gpus": []}))
        os.replace(tmp, health)
        reported_at = time.time()
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)  # every step, no gap: no step lost
    layouts = [r["replica_tp"] for r in rows]
    k = layouts.index([[4], [4]])
    assert 1 <= k < 5 and layouts == [[[3], [3]]] * k + [[[4], [4]]] * (5 - k) + [
        [[4], [3]]] * (steps - 5), layouts
    ev = read_events(out)
    names = [e["event"] for e in ev]
    assert names.count("start") == 1 and "failure" not in names and "live_fallback" not in names
    grow, kill = [e for e in ev if e["event"] == "live_relayout"]
    assert (grow["cause"], grow["gpus"], grow["joiners"]) == ("gpu_back", [3, 7], [3, 7]), grow
    assert grow["resume_step"] == grow["committed_step"] + 1 == k, grow
    assert grow["lost_steps"] == 0 and grow["recomputed_steps"] == 0, grow
    assert grow["processes_started"] == 2 and grow["checkpoint_bytes_read"] == 0
    assert "resumed" not in names, "nothing was read back"
    assert not [e for e in ev if e["event"] == "checkpoint" and e["t"] < kill["t"]], ev
    assert grow["replica_tp"] == [[4], [4]] and grow["world_size"] == 8, grow
    (first,) = [e for e in ev if e["event"] == "live_world"]
    assert set(first["pids"]) < set(grow["pids"]) and len(set(grow["pids"])) == 8, (first, grow)
    # every joiner received exactly what it did not hold (the lower bound), nothing more
    assert grow["bytes_received_rank_max"] == grow["lower_bound_rank_max"] > 0, grow
    assert grow["t"] - reported_at < 30, (grow["t"], reported_at)
    # the joiner killed later: an ordinary live re-layout
    assert (kill["ranks"], kill["gpus"], kill["replica_tp"]) == ([7], [7], [[4], [3]]), kill
    assert (kill["committed_step"], kill["recomputed_steps"], kill["lost_steps"]) == (4, 1, 0)
    assert set(kill["pids"]) < set(grow["pids"]) and kill["processes_started"] == 0, kill
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():  # replicas bitwise equal after each move
        assert len(set().union(*reps.values())) == 1, (gen, reps)
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [(s["mode"], s["cause"]) for s in summary] == [("live", "gpu_back"),
                                                           ("live", "exit")], summary
    print(f"grow back: relayout_s {grow['relayout_s']:.3f} (boundary wait "
          f"{grow['unblock_s']:.3f} s), move {grow['move_s']:.3f} s, resumed at step {k}")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_straggler_excluded_and_returned_live(tmp_path: Path) -> None:
    """Issue 24 acceptance 2: GPU 1 of a TP2+TP2 job slowed 4x
    (``NUTP_FAULT=slow:rank=1:factor=4``): the probe names it, every rank stops at the same step
    boundary and the job continues at TP2+TP1 without it (its process exits, the others keep
    theirs); the operator then gives it back (removes it from ``recovery/slow.json``): a new process
    for GPU 1 joins, TP2+TP2 again. No restart, every step against stock megatron-core."""
    steps = 14
    over = (*BASE, "cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
            "parallel.tp_base=2", "health.failed_gpus=[]", "checkpoint.interval=1000",
            "nutp.straggler_probe_interval=1", "nutp.straggler_window=3",
            # 2.5x: the 4x slowed GPU is found, probe noise of 2 shared cores is not (at
            # 1.5x the lone TP1 rank was flagged at 0.57 under load)
            "nutp.straggler_threshold=2.5", "nutp.exclude_stragglers=true",
            f"train.steps={steps}")
    out = tmp_path / "slow"
    out.mkdir()
    log = tmp_path / "slow.log"
    events = out / "recovery" / "events.jsonl"
    proc = start_train([f"output.dir={out}", *over], log=log,
                       env={"NUTP_LIVE_DIGEST": "1", "NUTP_FAULT": "slow:rank=1:factor=4"})
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while '"cause": "straggler"' not in (events.read_text() if events.exists() else ""):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no straggler re-layout in time"
            time.sleep(0.05)
        slow = out / "recovery" / "slow.json"
        assert list(json.loads(slow.read_text())["slow_gpus"]) == ["1"]
        tmp = slow.with_suffix(".test-tmp")
        tmp.write_text(json.dumps({"slow_gpus": {}}))
        os.replace(tmp, slow)  # GPU 1 is healthy again
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    layouts = [r["replica_tp"] for r in rows]
    a = layouts.index([[2], [1]])
    b = layouts.index([[2], [2]], a)
    assert layouts == [[[2], [2]]] * a + [[[2], [1]]] * (b - a) + [[[2], [2]]] * (steps - b)
    ev = read_events(out)
    names = [e["event"] for e in ev]
    assert names.count("start") == 1 and "failure" not in names and "live_fallback" not in names
    assert names.count("straggler") == 1, names
    excl, back = [e for e in ev if e["event"] == "live_relayout"]
    assert (excl["cause"], excl["excluded_gpus"], excl["processes_started"]) == (
        "straggler", [1], 0), excl
    assert (back["cause"], back["returned_gpus"], back["processes_started"]) == (
        "gpu_back", [1], 1), back
    for e, k in ((excl, a), (back, b)):
        assert e["resume_step"] == e["committed_step"] + 1 == k, (e, k)
        assert e["lost_steps"] == 0 and e["recomputed_steps"] == 0, e
        assert e["checkpoint_bytes_read"] == 0
    (first,) = [e for e in ev if e["event"] == "live_world"]
    assert set(excl["pids"]) < set(first["pids"]) and len(excl["pids"]) == 3, (first, excl)
    assert set(excl["pids"]) < set(back["pids"]) and len(back["pids"]) == 4, (excl, back)
    assert "resumed" not in names
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():
        assert len(set().union(*reps.values())) == 1, (gen, reps)
    print(f"straggler live: excluded after step {a - 1} in {excl['relayout_s']:.3f} s, back "
          f"after step {b - 1} in {back['relayout_s']:.3f} s")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_failure_during_grow_back_falls_back_to_restart(tmp_path: Path) -> None:
    """TP2+TP1 (GPU 3 failed), GPU 3 reported back, and rank 0 killed inside that re-layout
    (after its boundary report): the grow falls back to the restart path, logged with its
    reason; the new process started for GPU 3 is killed, not left behind; the restart marks
    GPU 0 failed, resumes from the newest checkpoint, and every step equals stock."""
    steps = 8
    over = (*BASE, "cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
            "parallel.tp_base=2", "health.failed_gpus=[3]", "checkpoint.interval=2",
            f"train.steps={steps}")
    out = tmp_path / "twice"
    out.mkdir()
    log = tmp_path / "twice.log"
    events = out / "recovery" / "events.jsonl"
    proc = start_train([f"output.dir={out}", *over], log=log,
                       env={"NUTP_FAULT": "kill:rank=0:step=0:phase=relayout"})
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while "live_world" not in (events.read_text() if events.exists() else ""):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no world within the job timeout"
            time.sleep(0.05)
        health = out / "recovery" / "health.json"
        tmp = health.with_suffix(".test-tmp")
        tmp.write_text(json.dumps({"failed_gpus": []}))
        os.replace(tmp, health)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        ev = read_events(out)
        (joiners,) = [e for e in ev if e["event"] == "live_joiners"]
        for pid in joiners["pids"]:  # killed by the fallback, not left to time out
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        kill_session(proc.pid)
        proc.wait()
    assert rc == 0, log.read_text()[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    check_steps(out, ref, TOL)
    (fb,) = [e for e in ev if e["event"] == "live_fallback"]
    assert "second failure during the re-layout" in fb["reason"], fb
    (fail,) = [e for e in ev if e["event"] == "failure"]
    assert fail["gpus"] == [0], fail
    assert not [e for e in ev if e["event"] == "live_relayout"]
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [s["mode"] for s in summary] == ["restart"], summary
