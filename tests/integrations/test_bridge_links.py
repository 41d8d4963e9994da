"""Issue #36 under ``nutp-bridge`` (Bridge's own ``train()``, ``recovery.mode=live``): the
per-step scale-out rates, the slow-link watch and its mitigation, as under ``nutp-train``.

The shrunk vanilla GPT recipe (fp32, warmup then cosine, evaluation every 2 steps) on 4 CPU
"GPUs" in two 2-GPU scale-up domains, two TP2 replicas, the emulated scale-out network at
``RATE``; from step ``K`` to ``UNTIL`` GPU 3's cross-domain traffic is 4x slower. Then:

* every healthy step's rates are the emulated one; under the fault GPU 3 and its sync partner
  read 4x slower (``metrics.jsonl``'s ``scale_out_mb_s``, from the same ``parallel/comm.py``
  counters and all-reduce as ``nutp-train``'s);
* ``slow_link`` names GPU 3 (``nic``) within 3 steps; the ladder takes the NIC-aware sync
  layout, applied by a live re-layout inside Bridge's loop (``Boundary``; ``cause:
  slow_link``, no process started, no checkpoint read); while the fault still runs nothing
  crosses GPU 3's NIC any more; after ``UNTIL`` a re-probe finds it healthy and a second live
  re-layout restores the layout;
* every step's loss, grad norm and lr, and every validation loss, equal the uninterrupted run
  of the same recipe in one process (``bridge_job``); replicas bitwise equal after each move.

Step times are not bounded here (Bridge's CPU steps vary by 2x on this machine); the
``nutp-train`` test (``tests/live/test_link_mitigation.py``) bounds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

from tests.helpers.bridge_live_jobs import JOB_TIMEOUT_S, LIVE, bridge_job

RATE = 0.2  # MB/s: ~0.9 s of sync per step for the tiny recipe's 177 KB per rank
K, UNTIL, END = 5, 11, 16
CLUSTER = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
           "health.failed_gpus=[]", "nutp.replicas=null", "model.tensor_model_parallel_size=2",
           f"cluster.emulated_scale_out_mb_s={RATE}", "recovery.fault.kind=slow_link",
           "recovery.fault.rank=3", f"recovery.fault.step={K}", f"recovery.fault.until={UNTIL}",
           "recovery.fault.factor=4"]


def _near(x: float, want: float, tol: float = 1.5) -> bool:
    return want / tol <= x <= want * tol


@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_slow_nic_planned_around_live_inside_bridge(tmp_path: Path) -> None:
    from tests.helpers.live import replica_digests

    rows, ev, _ = bridge_job(tmp_path, [*CLUSTER, *LIVE], {"NUTP_LIVE_DIGEST": "1"}, end=END)
    (found,) = [e for e in ev if e["event"] == "slow_link"]
    assert found["gpus"] == [3] and found["kind"] == "nic" and K <= found["step"] <= K + 3
    assert [e["chosen"] for e in ev if e["event"] == "link_ladder"] == ["sync_relayout",
                                                                        "restore"]
    lives = [e for e in ev if e["event"] == "live_relayout"]
    assert [(e["cause"], e["reason"]) for e in lives] == [("slow_link", "slow link"),
                                                          ("slow_link", "link recovered")]
    go, back = lives
    assert list(go["slow_links"]) == ["3"] and back["slow_links"] == {}, lives
    for e in lives:
        assert e["processes_started"] == 0 and e["replica_tp"] == [[2], [2]], e
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():
        assert len(set().union(*reps.values())) == 1, (gen, reps)  # replicas bitwise equal

    m = go["resume_step"]
    for r in rows[:K]:  # healthy: every replica at the emulated rate
        assert all(_near(x["min"], RATE) for x in r["scale_out_mb_s"]), r
    for r in rows[K:m]:  # the fault: GPU 3 and its partner 4x slower
        assert {x["gpu"] for x in r["scale_out_mb_s"]} == {1, 3}, r
        assert all(_near(x["min"], RATE / 4) for x in r["scale_out_mb_s"]), r
    for r in rows[m:UNTIL]:  # the fault still runs; nothing crosses GPU 3's NIC
        assert all(x["gpu"] != 3 and _near(x["min"], RATE) for x in r["scale_out_mb_s"]), r
    assert back["committed_step"] >= UNTIL, back
