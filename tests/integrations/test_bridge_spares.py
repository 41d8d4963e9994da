"""Issue #35 item 4 on the NeMo path: hot spares under ``nutp-bridge recovery.mode=live``.

The shrunk vanilla GPT recipe (fp32, warmup then cosine, evaluation every 2 steps) on 6 CPU
"GPUs" in three 2-GPU domains, TP2 replicas, ``recovery.spares=1``: Bridge's ``train()`` runs
on GPUs 0-3 and the last slice (GPUs 4-5) stands by (its two processes started with the job,
imported, connected to the control process). Rank 1 is killed in step 2's forward: one live
re-layout swaps slice 0-1 for the spare; the layout stays [[2],[2]], no process starts inside
the transition, the spare's ranks receive their state from the other replica (no checkpoint
read). Every step's loss, grad norm and lr, and every validation loss, equal the uninterrupted
run of the same recipe in one process (``bridge_job``); replicas bitwise equal after the move."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

from tests.helpers.bridge_live_jobs import JOB_TIMEOUT_S, LIVE, bridge_job

CLUSTER = ["cluster.num_gpus=6", "cluster.domain_size=2", "cluster.gpus_per_node=2",
           "health.failed_gpus=[]", "nutp.replicas=null", "model.tensor_model_parallel_size=2",
           "recovery.spares=1"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_a_kill_with_a_free_spare_keeps_the_base_tp_inside_bridge(tmp_path: Path) -> None:
    from tests.helpers.live import replica_digests

    rows, ev, _ = bridge_job(tmp_path, [*CLUSTER, *LIVE],
                             {"NUTP_FAULT": "kill:rank=1:step=2:phase=forward",
                              "NUTP_LIVE_DIGEST": "1"})
    (standby,) = [e for e in ev if e["event"] == "spares_standby"]
    assert standby["slices"] == [[4, 5]], standby
    (world,) = [e for e in ev if e["event"] == "live_world"]
    (swap,) = [e for e in ev if e["event"] == "live_relayout"]
    assert swap["spares_used"] == [[4, 5]] and swap["replaced_slices"] == [[0, 1]], swap
    assert swap["replica_tp"] == [[2], [2]] and swap["processes_started"] == 0, swap
    assert set(swap["pids"]) <= set(world["pids"]) | set(standby["pids"]), swap
    assert set(standby["pids"]) <= set(swap["pids"]), swap  # the spares joined
    assert all(r["replica_tp"] == [[2], [2]] for r in rows), rows
    digests = replica_digests(ev)
    assert sorted(digests) == [1] and len(set().union(*digests[1].values())) == 1, digests
