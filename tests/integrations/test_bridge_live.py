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
end. It also hangs a rank inside Bridge's backward: found by its silent heartbeat, blamed, laid
out live.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

from tests.helpers.bridge_live_jobs import JOB_TIMEOUT_S, LIVE, bridge_job

CLUSTER = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
           "health.failed_gpus=[3]", "nutp.replicas=null", "model.tensor_model_parallel_size=2"]
LIVE_ENV = {"NUTP_FAULT": "kill:rank=3:step=3:phase=vote:gen=1,"
                          "kill:rank=1:step=5:phase=optimizer:gen=2", "NUTP_LIVE_DIGEST": "1"}


@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_grow_and_two_kills_live_inside_bridge_equal_the_uninterrupted_run(tmp_path: Path
                                                                            ) -> None:
    from tests.helpers.live import replica_digests

    rows, ev, out = bridge_job(tmp_path, [*CLUSTER, *LIVE], LIVE_ENV, grow=True)
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
            "health.failed_gpus=[7]", "nutp.replicas=null",
            "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2",
            "optimizer.use_distributed_optimizer=true", "recovery.live_redundancy=true"]
    faults = "kill:rank=1:step=2:phase=gather,kill:rank=4:step=4:phase=backward:gen=1"
    rows, ev, _ = bridge_job(tmp_path, [*over, *LIVE], {**LIVE_ENV, "NUTP_FAULT": faults})
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


@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 1 min on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_a_hung_rank_is_found_and_laid_out_live_inside_bridge(tmp_path: Path) -> None:
    """Rank 2 (the TP1 replica) hangs in step 3's backward, inside Bridge's ``train()``: no
    heartbeat for ``recovery.heartbeat_timeout_s``, so the live control blames it (its peers
    wait in collectives), stops it, and the survivors re-lay out in their processes; step 3 is
    recomputed, every loss equals the uninterrupted run's (``bridge_job``)."""
    timeout_s = 15  # (6 s: under a CPU hog a healthy TP2 step went 6 s without a heartbeat)
    rows, ev, out = bridge_job(tmp_path, [*CLUSTER, *LIVE,
                                          f"recovery.heartbeat_timeout_s={timeout_s}"],
                               {"NUTP_FAULT": "hang:rank=2:step=3:phase=backward",
                                "NUTP_LIVE_DIGEST": "1"})
    (hang,) = [e for e in ev if e["event"] == "live_relayout"]
    assert (hang["cause"], hang["ranks"], hang["replica_tp"]) == ("hang", [2], [[2]]), hang
    assert (hang["committed_step"], hang["recomputed_steps"]) == (2, 1), hang
    assert hang["processes_started"] == 0 and "hung" in hang["reason"], hang
    (s,) = json.loads((out / "recovery" / "summary.json").read_text())
    assert timeout_s - 1 <= s["detect_s"] < timeout_s + 10, s
    assert [r["replica_tp"] for r in rows] == [[[2], [1]]] * 3 + [[[2]]] * 4
    print(f"hang under Bridge: detect {s['detect_s']:.2f} s, re-layout {s['relayout_s']:.2f} s")
