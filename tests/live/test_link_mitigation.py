"""Issue #36 item 3 end to end: a slow NIC planned around live, and the layout restored.

``nutp-train`` under the live control process, 8 gloo ranks in two 4-GPU scale-up domains, two
TP4 replicas, the default ``refine`` sync layout (each TP rank reduces its own units with the
same TP rank of the other replica, so every cross-replica group crosses domains), the emulated
scale-out network at ``RATE`` (the healthy sync is >= 25% of the step: asserted). From step
``K`` to ``UNTIL`` GPU 5's cross-domain traffic is 4x slower (``recovery.fault.kind=slow_link``).

The link watch names GPU 5 (``slow_link``, ``nic``) within 3 steps; the ladder prices its rungs
and takes the NIC-aware sync layout (``health.slow_links``: GPU 5 owns no cross-replica units,
its TP peers reduce them), applied by a live re-layout at the next step boundary (``cause:
slow_link``, no process started, no checkpoint read). While the fault still runs, no op crosses
GPU 5's NIC any more: every replica's slowest rate is the healthy one again. The median of the 5
steps after the re-layout is <= 1.25x that of the 5 healthy steps before the fault (the slowed
steps are >= 1.5x: asserted, so the test can fail). After ``UNTIL`` a re-probe finds the link
healthy (``link_recovered``) and a second live re-layout restores the original layout. Every
step's loss and grad norm equal an uninterrupted single-process run of stock megatron-core
within 1e-5, and the replicas are bitwise equal after each move.

Negative control (run by hand): with the mitigation's flag never set (``LinkProbe.mitigate``
returning before it asks), the steps after the alarm stay ~2.4x the healthy ones and the test
fails on the 1.25x bound."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

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

RATE = 0.25  # MB/s: ~0.3 s of emulated sync per step for the tiny model's 75 KB per rank
K, UNTIL, STEPS = 5, 15, 24
JOB = (*BASE, "health=none", "cluster.gpus_per_node=4", "parallel.tp_base=4",
       f"train.steps={STEPS}", "checkpoint.interval=100")
FAULT = (f"cluster.emulated_scale_out_mb_s={RATE}", "recovery.fault.kind=slow_link",
         "recovery.fault.rank=5", f"recovery.fault.step={K}", f"recovery.fault.until={UNTIL}",
         "recovery.fault.factor=4")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 180)
def test_slow_nic_is_planned_around_live_and_restored(tmp_path: Path) -> None:
    out = tmp_path / "link"
    rc, log = run_job(out, (*JOB, *FAULT), {"NUTP_LIVE_DIGEST": "1"})
    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    rows = check_steps(out, stock_reference(JOB, STEPS, tmp_path), TOL)
    ev = read_events(out)
    assert [e["event"] for e in ev].count("start") == 1, "a live re-layout restarted"
    assert not [e for e in ev if e["event"] in ("fault", "live_fallback")], ev

    (found,) = [e for e in ev if e["event"] == "slow_link"]
    assert found["gpus"] == [5] and found["kind"] == "nic", found
    assert K <= found["step"] <= K + 3 and found["rate_ratio"] <= 0.4, found
    ladder = [e for e in ev if e["event"] == "link_ladder"]
    assert [e["chosen"] for e in ladder] == ["sync_relayout", "restore"], ladder
    rungs = {r["action"]: r for r in ladder[0]["rungs"]}
    assert list(rungs) == ["ignore", "sync_relayout", "resplit", "exclude", "restart"]
    assert rungs["sync_relayout"]["predicted_step_s"] < rungs["ignore"]["predicted_step_s"]

    lives = [e for e in ev if e["event"] == "live_relayout"]
    assert [e["cause"] for e in lives] == ["slow_link", "slow_link"], lives
    go, back = lives
    assert go["reason"] == "slow link" and list(go["slow_links"]) == ["5"], go
    assert back["reason"] == "link recovered" and back["slow_links"] == {}, back
    for e in lives:
        assert e["processes_started"] == 0 and e["checkpoint_bytes_read"] == 0, e
        assert e["lost_steps"] == 0 and e["resume_step"] == e["committed_step"] + 1, e
        assert e["replica_tp"] == [[4], [4]], e
    digests = replica_digests(ev)
    assert sorted(digests) == [1, 2], digests
    for gen, reps in digests.items():
        assert len(set().union(*reps.values())) == 1, (gen, reps)  # replicas bitwise equal

    # the healthy sync is >= 25% of the step; the fault's steps are >= 1.5x the healthy ones
    t_healthy = statistics.median(r["step_time_s"] for r in rows[:K])
    assert rows[0]["scale_out_bytes_rank0"] / (RATE * 1e6) >= 0.25 * t_healthy
    m = go["resume_step"]
    assert m <= K + 4, go  # detected within 3 steps, re-laid out at the next boundary
    for r in rows[K:m]:
        assert r["step_time_s"] >= 1.5 * t_healthy, (r["step"], r["step_time_s"], t_healthy)
    after = rows[m:m + 5]
    assert all(r["step"] < UNTIL for r in after)  # the fault still runs
    t_after = statistics.median(r["step_time_s"] for r in after)
    assert t_after <= 1.25 * t_healthy, (t_after, t_healthy)
    for r in after:  # nothing crosses GPU 5's NIC: every replica's slowest GPU is healthy
        for rep in r["scale_out_mb_s"]:
            assert rep["gpu"] != 5 and rep["min"] >= RATE / 1.5, (r["step"], rep)
    (mit, restored) = [e for e in ev if e["event"] == "link_mitigation"]
    assert mit["action"] == "sync_relayout" and restored["action"] == "restore", (mit, restored)
    assert abs(mit["predicted_step_s"] / mit["measured_step_s"] - 1) <= 0.35, mit

    (rec,) = [e for e in ev if e["event"] == "link_recovered"]
    assert rec["gpus"] == [5] and rec["step"] >= UNTIL, rec
    assert back["committed_step"] >= rec["step"], (back, rec)
