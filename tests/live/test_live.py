"""Issue 23 acceptance: live re-layout (``recovery.mode=live``) under the CPU supervisor.

Each test runs one supervised job (``python -m nemo_nutp.train``) with faults injected at the
phases of a step (``live/inject.py``: ``NUTP_LIVE_FAULT``; ``NUTP_FAULT`` for a crash inside
a save) and compares every step's loss and grad norm with an uninterrupted single-process run of
*stock* megatron-core (``tests/helpers/reference.py``: megatron's GPTModel, DDP and optimizer,
clipping included) on the same global batches, computed here. It also checks that the survivors
kept their processes (pids), that there is one ``start`` event, that no committed step was lost
and at most the in-flight one recomputed, and that every replica is bitwise equal after each
re-layout (the ranks' parameter digest per replica, ``NUTP_LIVE_DIGEST``).

Several failures run in one job (each loses one GPU), so one spawn covers many phases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_nutp.config import load_config, plan_request
from nemo_nutp.layout import build_plan
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
from tests.helpers.parity import BF16_TOL

# megatron's warmup + cosine decay: its clock (successful updates) must survive every re-layout
COSINE = ("train.lr_warmup_iters=2", "train.lr_decay_style=cosine", "train.min_lr=3e-4")


def _layout(*overrides: str) -> list[list[int]]:
    plan = build_plan(plan_request(load_config(list(overrides))))
    return [list(r.tp) for r in plan.replicas]


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_relayout_tp4_tp3_phases_and_rank0(tmp_path: Path) -> None:
    """TP4+TP3 (fp32, clipping, warmup + cosine), five live re-layouts in one job (down to TP2
    on 2 GPUs): a
    crash inside a save; rank 0 (the old store host) killed in its forward; a rank killed
    between sync and the vote (the step is discarded everywhere); one killed after the vote
    inside the optimizer step (the survivors complete the step); one more in its forward."""
    steps = 8
    over = (*BASE, "checkpoint.interval=2", f"train.steps={steps}", *COSINE)
    faults = ",".join(["save_crash:rank=1:step=2", "kill:rank=0:step=2:phase=forward:gen=1",
                       "kill:rank=4:step=3:phase=vote:gen=2",
                       "kill:rank=5:step=4:phase=optimizer:gen=3",
                       "kill:rank=6:step=6:phase=forward:gen=4"])
    out = tmp_path / "phases"
    rc, log = run_job(out, over, {"NUTP_FAULT": faults,
                               "NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    assert _layout(*over) == rows[0]["replica_tp"] == [[4], [3]]
    lives = check_live(read_events(out), relayouts=5)
    save, rank0, vote, opt, last = lives
    assert (save["committed_step"], save["recomputed_steps"]) == (1, 0), save  # in step 2's save
    assert rank0["ranks"] == [0] and rank0["committed_step"] == 1, rank0
    assert (vote["committed_step"], vote["recomputed_steps"]) == (2, 1), vote  # discarded
    assert (opt["committed_step"], opt["recomputed_steps"]) == (4, 0), opt  # completed
    assert (last["committed_step"], last["recomputed_steps"]) == (5, 1), last
    assert rows[-1]["replica_tp"] == last["replica_tp"]
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [s["mode"] for s in summary] == ["live"] * 5, summary
    for e in lives:
        assert e["bytes_received_rank_max"] <= 1.25 * e["lower_bound_rank_max"] + (32 << 20)
        assert e["relayout_s"] < 10 and e["unblock_s"] < 1.0, e
    print("live (relayout_s, unblock_s):", [(round(e["relayout_s"], 3),
                                              round(e["unblock_s"], 3)) for e in lives])


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_a_hang_after_a_live_relayout_is_blamed_and_relaid_out_live(tmp_path: Path) -> None:
    """Rank 1 killed in its forward at step 1 (TP3+TP3 live), then slot 5 hangs in its forward
    at step 4 of that second world: its peers wait in its collectives, the control loop reads
    that world's stack files (each rank's watcher followed it there, ``watch.follow_world``)
    and blames slot 5 alone -- a live re-layout to TP3+TP2, not "all ranks stalled" and a
    restart, which is what happened while the watchers stayed on world 0's files."""
    steps, timeout_s = 8, 10
    over = (*BASE, "checkpoint.interval=2", f"train.steps={steps}",
            f"recovery.heartbeat_timeout_s={timeout_s}")
    out = tmp_path / "hang"
    rc, log = run_job(out, over, {"NUTP_FAULT": "kill:rank=1:step=1:phase=forward,"
                                                "hang:rank=5:step=4:phase=forward:gen=1",
                                  "NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    kill, hang = check_live(read_events(out), relayouts=2)
    assert (kill["cause"], kill["gpus"]) == ("exit", [1]), kill
    # slot 5 is GPU 5, rank 4 of the second world (GPUs 0, 2, 3, 4, 5, 6)
    assert (hang["cause"], hang["ranks"], hang["gpus"]) == ("hang", [4], [5]), hang
    assert "hung" in hang["reason"] and "behind its peers" in hang["reason"], hang
    (s,) = [x for x in json.loads((out / "recovery" / "summary.json").read_text())
            if x["cause"] == "hang"]
    assert timeout_s - 1 <= s["detect_s"] < timeout_s + 10, s
    rows = check_steps(out, stock_reference(over, steps, tmp_path), TOL)
    assert rows[-1]["replica_tp"] == [[3], [2]], rows[-1]
    print(f"hang after a re-layout: detect {s['detect_s']:.2f} s, relayout_s "
          f"{hang['relayout_s']:.2f}")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_relayout_pp2_bf16_sp_and_twice(tmp_path: Path) -> None:
    """Pipeline stages (pp=2, [[2,2],[2,1]]), bf16, sequence parallelism, clipping: a rank
    killed in its backward (live); then one killed inside the sync buckets (buckets posted, not
    finished) and a second failure during that re-layout: it falls back to the restart path,
    logged; every step equals stock bf16 within the bf16 tolerance."""
    steps = 5
    over = (*BASE, "parallel.pp=2", "parallel.tp_base=2", "parallel.sequence_parallel=true",
            "train.precision=bf16", "checkpoint.interval=2", f"train.steps={steps}")
    out = tmp_path / "pp2"
    faults = ("kill:rank=1:step=1:phase=backward,kill:rank=4:step=3:phase=sync:gen=1,"
              "kill:rank=6:phase=relayout:gen=1")
    rc, log = run_job(out, over, {"NUTP_FAULT": faults, "NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, BF16_TOL)
    assert rows[0]["replica_tp"] == [[2, 2], [2, 1]]
    ev = read_events(out)
    (back,) = check_live(ev[:[e["event"] for e in ev].index("failure")], relayouts=1)
    assert (back["committed_step"], back["recomputed_steps"]) == (0, 1), back
    (fb,) = [e for e in ev if e["event"] == "live_fallback"]
    assert "second failure during the re-layout" in fb["reason"], fb
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [s["mode"] for s in summary] == ["live", "restart"], summary


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_distributed_optimizer_falls_back_to_restart(tmp_path: Path) -> None:
    """The distributed optimizer's dead slices exist nowhere else: the failure takes the restart
    path with its reason logged, and the continuation is exact."""
    steps = 4
    over = (*BASE, "nutp.replicas=[2,1]", "train.distributed_optimizer=true",
            "checkpoint.interval=2", f"train.steps={steps}")  # synchronous: step 2's save is
    # complete before the fault at step 3 (an async write may still run then, under load)
    out = tmp_path / "zero"
    rc, log = run_job(out, over, {"NUTP_FAULT": "kill:rank=1:step=3:phase=forward"})
    assert rc == 0, log[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    check_steps(out, ref, TOL)
    ev = read_events(out)
    (fb,) = [e for e in ev if e["event"] == "live_fallback"]
    assert "train.distributed_optimizer" in fb["reason"], fb
    assert not [e for e in ev if e["event"] == "live_relayout"]
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [s["mode"] for s in summary] == ["restart"] and summary[0]["resume_step"] == 2
