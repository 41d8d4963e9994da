"""Issue 35 item 3 on the CPU supervisor: several ranks lost together are one live re-layout.

* four of eight ranks (a whole 4-GPU node, here one replica) killed in the same forward;
* two ranks of different replicas killed 0.1 s apart from outside (SIGKILL to their pids):
  the poll that finds the first sees the second alive.

Both must be re-laid out live, once, with the survivors' processes kept, every step equal to an
uninterrupted single-process run of stock megatron-core (``stock_reference``), replicas bitwise
equal after the move, the reason in words, and no traceback anywhere in the job's output.
Before the fold (``control._reports``), the late death was "a second failure during the
re-layout" and the job fell back to a restart.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from nemo_nutp.common.procs import kill_session
from tests.helpers.launch import start_train
from tests.helpers.live import (
    BASE,
    JOB_TIMEOUT_S,
    TOL,
    check_live,
    check_steps,
    read_events,
    run_job,
    stock_reference,
)

EIGHT = ("health=none", "cluster.gpus_per_node=4", "checkpoint.interval=2")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_four_of_eight_ranks_killed_at_once_are_one_live_relayout(tmp_path: Path) -> None:
    steps = 5
    over = (*BASE, *EIGHT, f"train.steps={steps}")
    out = tmp_path / "node"
    faults = ",".join(f"kill:rank={s}:step=2:phase=forward" for s in range(4))
    rc, log = run_job(out, over, {"NUTP_FAULT": faults, "NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    rows = check_steps(out, stock_reference(over, steps, tmp_path), TOL)
    assert rows[0]["replica_tp"] == [[4], [4]] and rows[-1]["replica_tp"] == [[4]], rows[-1]
    (e,) = check_live(read_events(out), relayouts=1)
    assert e["ranks"] == [0, 1, 2, 3] and e["gpus"] == [0, 1, 2, 3], e
    assert "killed by signal 9 (SIGKILL)" in e["reason"] and "32768" not in e["reason"], e
    assert e["committed_step"] == 1, e


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_two_ranks_killed_a_tenth_of_a_second_apart_are_one_live_relayout(tmp_path: Path
                                                                           ) -> None:
    steps = 8
    over = (*BASE, *EIGHT, f"train.steps={steps}", "train.seed=11")
    out = tmp_path / "apart"
    log = tmp_path / "apart.log"
    proc = start_train([f"output.dir={out}", *over], log=log, env={"NUTP_LIVE_DIGEST": "1"})
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        events = out / "recovery" / "events.jsonl"
        while '"event": "checkpoint"' not in (events.read_text() if events.exists() else ""):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no step 2 save within the job timeout"
            time.sleep(0.02)
        (world,) = [e for e in read_events(out) if e["event"] == "live_world"]
        # ranks 1 and 6: different TP positions, so every unit keeps a holder (ranks 1 and 5
        # hold the same units: losing both is a correct fallback, "held by no survivor")
        os.kill(world["pids"][1], signal.SIGKILL)  # replica 0
        time.sleep(0.1)
        os.kill(world["pids"][6], signal.SIGKILL)  # replica 1, another TP position
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    rows = check_steps(out, stock_reference(over, steps, tmp_path), TOL)
    assert rows[-1]["replica_tp"] == [[3], [3]], rows[-1]
    ev = read_events(out)
    assert not [x for x in ev if x["event"] == "live_fallback"], ev
    (e,) = check_live(ev, relayouts=1)
    assert e["ranks"] == [1, 6], e
    assert "killed by signal 9 (SIGKILL)" in e["reason"], e
