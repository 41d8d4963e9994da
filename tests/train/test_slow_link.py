"""Issue #36 items 4 and 1 end to end: ``nutp-train`` on 8 gloo ranks, two 4-GPU scale-up
domains, two TP4 replicas (the default ``refine`` sync layout: each TP rank's sync group pairs it
with the same TP rank of the other replica, so every cross-replica bucket crosses domains).

One run without emulation, one with ``cluster.emulated_scale_out_mb_s`` and a ``slow_link``
fault on rank 5 (GPU 5) for steps 4-6: the losses are the same bits (the delay changes time,
never math); on healthy steps every replica's measured scale-out rate is within 1.5x of the
emulated one and the step grows by about the emulated sync time; under the fault GPU 5 and its
sync partner GPU 1 (they share every cross-domain op, so timing alone cannot tell which end is
slow) drop by about 4x, the other GPUs do not, and the step grows again."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import run_train

RATE = 0.25  # MB/s: ~0.3 s of emulated sync per step for the tiny model's 75 KB per rank
FACTOR = 4.0
K, UNTIL, STEPS = 4, 7, 9
BASE = ["health.failed_gpus=[]", "parallel.tp_base=4", f"train.steps={STEPS}"]


def _train(out: Path, *overrides: str) -> list[dict]:
    env = {"NUTP_EVENTS": str(out / "events.jsonl")}
    out.mkdir(parents=True)
    r: subprocess.CompletedProcess[str] = run_train([f"output.dir={out}", *BASE, *overrides],
                                                    env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _near(x: float, want: float, tol: float = 1.5) -> bool:
    return want / tol <= x <= want * tol


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_emulated_network_and_slow_link(tmp_path: Path) -> None:
    plain = _train(tmp_path / "plain")
    slow = _train(tmp_path / "slow", f"cluster.emulated_scale_out_mb_s={RATE}",
                  "recovery.fault.kind=slow_link", "recovery.fault.rank=5",
                  f"recovery.fault.step={K}", f"recovery.fault.until={UNTIL}",
                  f"recovery.fault.factor={FACTOR}")
    assert [r["loss"] for r in slow] == [r["loss"] for r in plain]  # bit for bit
    assert [r["replica_tp"] for r in slow] == [[[4], [4]]] * STEPS

    healthy = [r for r in slow if not K <= r["step"] < UNTIL]
    for r in healthy:
        for rep in r["scale_out_mb_s"]:
            assert _near(rep["min"], RATE) and _near(rep["max"], RATE), (r["step"], rep)
    # the step grows by about the emulated sync time (rank 0's cross-domain bytes / rate)
    sync_s = slow[0]["scale_out_bytes_rank0"] / (RATE * 1e6)
    assert sync_s > 0.2, sync_s
    t_plain = statistics.median(r["step_time_s"] for r in plain[1:K])
    t_healthy = statistics.median(r["step_time_s"] for r in slow[1:K])
    assert t_healthy - t_plain >= 0.5 * sync_s, (t_plain, t_healthy, sync_s)

    for r in slow[K:UNTIL]:
        first, second = r["scale_out_mb_s"]
        assert second["gpu"] == 5 and _near(second["min"], RATE / FACTOR), (r["step"], second)
        assert first["gpu"] == 1 and _near(first["min"], RATE / FACTOR), (r["step"], first)
        assert _near(first["max"], RATE) and _near(second["max"], RATE), (r["step"], r)
    t_fault = statistics.median(r["step_time_s"] for r in slow[K:UNTIL])
    assert t_fault - t_healthy >= 0.5 * (FACTOR - 1) * sync_s, (t_healthy, t_fault, sync_s)

    events = [json.loads(x) for x in (tmp_path / "slow" / "events.jsonl").read_text()
              .splitlines()]
    links = [e for e in events if e["event"] == "slow_link_fault"]
    assert [(e["gpu"], e["step"], e["factor"]) for e in links] == [(5, K, FACTOR)]
    assert not any(e["event"] == "fault" for e in events)
