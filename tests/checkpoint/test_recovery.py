"""Issue 6 acceptance: automatic recovery at reduced TP, crash during a save.

* Kill test: the default 7-rank TP4+TP3 job, checkpoints every 2 steps, rank 1 SIGKILLed at step
  5; the supervisor marks GPU 1 failed, re-plans (TP3+TP3), resumes from step 4 and finishes.
  Every step's loss equals an uninterrupted single-process TP1 run on the same global batches.
* Crash during save: rank 1 of a TP2+TP1 job dies inside the save of step 4; the restart loads
  step 2 (the partial directory is ignored) and finishes with the reference losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOL = 1e-5
COMMON = ("train.steps=6", "train.seed=7", "train.global_batch_size=12",
          "train.micro_batch_size=2")


def _train(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nemo_nutp.train", f"output.dir={out}", *COMMON, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    r = _train(out, "nutp.replicas=[1]", "failures=none")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return _losses(out)


def _check(out: Path, ref: list[float]) -> list[dict]:
    losses = _losses(out)
    assert len(losses) == len(ref)
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) <= TOL * abs(b), (losses, ref)
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    good = json.loads((out / "goodput.json").read_text())
    assert good["restart_gpu_s"] > 0 and good["checkpoint_gpu_s"] > 0
    return summary


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_kill_rank_recovers_at_reduced_tp(tmp_path: Path, reference: list[float]) -> None:
    out = tmp_path / "kill"
    r = _train(out, "checkpoint.interval=2", "recovery.enabled=true",
               "recovery.fault.kind=kill", "recovery.fault.rank=1", "recovery.fault.step=5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (s,) = _check(out, reference)
    assert s["gpus"] == [1] and "signal 9" in s["reason"]
    assert s["resume_step"] == 4 and s["replica_tp"] == [[3], [3]]
    assert s["lost_steps"] <= 2  # at most the checkpoint interval is recomputed
    print(f"kill test: detect {s['detect_s']:.2f} s, restart {s['restart_s']:.2f} s, "
          f"lost steps {s['lost_steps']}")
    health = json.loads((out / "recovery" / "health.json").read_text())
    assert health["failed_gpus"] == [1, 7]
    assert "Recovery" in r.stdout


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_crash_during_save_resumes_previous_checkpoint(tmp_path: Path,
                                                      reference: list[float]) -> None:
    out = tmp_path / "savecrash"
    r = _train(out, "nutp.replicas=[2,1]", "checkpoint.interval=2", "recovery.enabled=true",
               "recovery.fault.kind=save_crash", "recovery.fault.rank=1",
               "recovery.fault.step=4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (s,) = _check(out, reference)
    assert s["resume_step"] == 2
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert any(".tmp-" in n and n.startswith("step_00000004") for n in ckpts), ckpts
    assert "step_00000006" in ckpts
