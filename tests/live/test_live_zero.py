"""Issue 24 acceptance 3: the distributed optimizer survives a failure live
(``train.distributed_optimizer=true``, ``recovery.live_redundancy=true``, ``recovery.mode=live``).

One supervised job (TP2+TP2+TP1, fp32, clipping; no checkpoint exists while it runs: nothing can
be read back) loses three ranks at three phases of a step, each handled by a live re-layout
whose survivors rebuild the new layout's optimizer slices from their primaries and the dead
rank's copies (``relayout/zero_move.py``):

* slot 1 in its backward at step 1 (the step is discarded) -> TP2+TP1+TP1;
* slot 0 (the old store host) after the vote, with its slices updated but before the
  parameter all-gather (``gather``) at step 3: the step is committed, its update survives only
  in the survivors' slices and the dead rank's copy -> TP2+TP1;
* slot 2 between the sync and the vote at step 5 (discarded) -> TP1+TP1.

Every step's loss and grad norm is compared with an uninterrupted single-process run of stock
megatron-core (``tests/helpers/reference.py``) computed here; after each move every replica is
bitwise equal (parameter digests); at the end of the job again, and every optimizer slice's
copy equals its primary bit for bit (each copy updated on its own rank since the last move).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

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

ZERO = (*BASE, "cluster.num_gpus=6", "cluster.domain_size=2", "cluster.gpus_per_node=2",
        "parallel.tp_base=2", "health.failed_gpus=[5]", "train.distributed_optimizer=true",
        "recovery.live_redundancy=true", "checkpoint.interval=1000")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_distributed_optimizer_live_with_redundancy(tmp_path: Path) -> None:
    steps = 7
    over = (*ZERO, f"train.steps={steps}")
    faults = ("kill:rank=1:step=1:phase=backward,kill:rank=0:step=3:phase=gather:gen=1,"
              "kill:rank=2:step=5:phase=vote:gen=2")
    out = tmp_path / "zero_live"
    t0 = time.perf_counter()
    rc, log = run_job(out, over, {"NUTP_FAULT": faults, "NUTP_LIVE_DIGEST": "1"})
    job_s = time.perf_counter() - t0
    assert rc == 0, log[-6000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    assert rows[0]["replica_tp"] == [[2], [2], [1]]
    ev = read_events(out)
    assert not [e for e in ev if e["event"] in ("live_fallback", "failure", "resume")], \
        [e["event"] for e in ev]
    backward, gather, vote = check_live(ev, relayouts=3)
    assert (backward["committed_step"], backward["recomputed_steps"]) == (0, 1), backward
    assert gather["ranks"] == [2] and gather["committed_step"] == 3, gather  # slot 0: rank 2
    assert gather["recomputed_steps"] == 0, gather  # completed from the slices it left
    assert (vote["committed_step"], vote["recomputed_steps"]) == (4, 1), vote
    assert [e["replica_tp"] for e in (backward, gather, vote)] == [
        [[2], [1], [1]], [[2], [1]], [[1], [1]]]
    assert rows[-1]["replica_tp"] == [[1], [1]]
    for e in (backward, gather, vote):
        assert e["checkpoint_bytes_read"] == 0 and e["processes_started"] == 0, e
        # every rank receives exactly what it did not hold (slices and copies)
        assert 0 < e["bytes_received_rank_max"] == e["lower_bound_rank_max"], e
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    final = [e for e in ev if e["event"] == "live_final"]
    assert len({e["replica"] for e in final}) == 2 and len({e["digest"] for e in final}) == 1
    (slices,) = [e for e in ev if e["event"] == "live_final_slices"]
    assert slices["redundancy"] and slices["backup_max_diff"] == 0.0, slices
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [s["mode"] for s in summary] == ["live"] * 3, summary
    print(f"zero live: job {job_s:.1f} s; relayout_s",
          [round(e["relayout_s"], 2) for e in (backward, gather, vote)], "bytes received/bound",
          [(e["bytes_received_rank_max"], e["lower_bound_rank_max"])
           for e in (backward, gather, vote)])
