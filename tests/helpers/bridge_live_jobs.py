"""One supervised ``nutp-bridge`` job beside the uninterrupted run of the same recipe, and the
checks every such test makes (``tests/integrations/test_bridge_live.py``,
``test_bridge_stragglers.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TOL = 1e-5
END = 7  # train_iters


def schedule(end: int) -> list[str]:
    """fp32 (the tiny recipe's parity settings), warmup then cosine over ``end`` steps: every
    step has its own lr; evaluation every 2 steps."""
    return ["scheduler.lr_warmup_iters=1", "scheduler.lr_decay_style=cosine",
            f"scheduler.lr_decay_iters={end}", "optimizer.lr=0.01", "optimizer.min_lr=0.001",
            f"train.train_iters={end}", "validation.eval_interval=2", "validation.eval_iters=1",
            "dataset.data_sharding=false"]


SCHEDULE = schedule(END)
JOB_TIMEOUT_S = 480
LIVE = ["recovery.enabled=true", "recovery.mode=live"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def job_args(tmp_path: Path, overrides: list[str], end: int = END) -> list[str]:
    """``nutp-bridge``'s arguments for the shrunk recipe's job (``overrides``: e.g. ``LIVE``;
    ``end``: its steps): output in ``tmp_path/run``, checkpoints (at the end only) in
    ``tmp_path/ckpt``."""
    from tests.helpers.bridge_jobs import PARITY, RECIPE, TINY

    return ["--recipe", RECIPE, "--config-file", str(TINY), "--output-dir",
            str(tmp_path / "run"), *PARITY, *schedule(end), *overrides,
            f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=1000"]


def reference(tmp_path: Path, end: int = END) -> Path:
    """The uninterrupted run of the same recipe (one process, megatron's own optimizer), in
    ``tmp_path/ref``: run it beside the job."""
    from tests.helpers.bridge_jobs import run_worker
    from tests.helpers.dist import spawn

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    spawn(run_worker, 1, ([*schedule(end), "model.tensor_model_parallel_size=1",
                           "nutp.replicas=[1]"],), ref_dir)
    return ref_dir


def check_job(tmp_path: Path, end: int = END
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """The job of ``job_args(tmp_path, ...)`` against ``reference(tmp_path)``: every step's lr
    (1e-12), loss and grad norm (``TOL``) and every validation loss equal to the uninterrupted
    run's; under the supervisor one ``start``, no failure, restart or checkpoint read, nothing
    lost. (The job's metrics rows, its events, its output dir.)"""
    from tests.helpers.live import metric_rows, read_events

    out, ckpt, ref_dir = tmp_path / "run", tmp_path / "ckpt", tmp_path / "ref"
    want = json.loads((ref_dir / "run_result.json").read_text())
    assert len({row["lr"] for row in want}) == end  # a schedule that moves every step
    rows = metric_rows(out)  # every step, no gap
    assert len(rows) == end
    for r, w in zip(rows, want, strict=True):
        assert rel(r["lr"], w["lr"]) <= 1e-12, (r, w)
        assert rel(r["loss"], w["loss"]) <= TOL, (r, w)
        assert rel(r["grad_norm"], w["grad_norm"]) <= TOL, (r, w)
    ref_evals = json.loads((ref_dir / "bridge_rank0.json").read_text())["evals"]
    assert [e["step"] for e in ref_evals] == list(range(2, end + 1, 2)), ref_evals
    got_evals = {r["step"] + 1: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(got_evals) == [e["step"] for e in ref_evals], got_evals
    for e in ref_evals:
        assert rel(got_evals[e["step"]], e["val_loss"]) <= TOL, (got_evals, e)
    live = (out / "recovery" / "events.jsonl").exists()
    ev = read_events(out) if live else [
        json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in ev]
    assert "resumed" not in names and "failure" not in names and "live_fallback" not in names
    assert names.count("start") == int(live), "a live re-layout restarted"
    lives = [e for e in ev if e["event"] == "live_relayout"]
    for e in lives:  # nothing lost, nothing read back
        assert e["lost_steps"] == 0 and e["recomputed_steps"] <= 1, e
        assert e["resume_step"] == e["committed_step"] + 1, e
        assert e["checkpoint_bytes_read"] == 0, e
    assert not list(ckpt.glob("iter_*")) or all(  # no save before the end: nothing to read
        int(p.name[5:]) == end for p in ckpt.glob("iter_*"))
    assert (out / "goodput.json").is_file() and (out / "training.png").is_file()
    return rows, ev, out


def bridge_job(tmp_path: Path, overrides: list[str], env: dict[str, str], *,
               grow: bool = False, end: int = END
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """One ``nutp-bridge`` job on this machine (``overrides``: e.g. ``LIVE``; ``env``: faults;
    ``grow``: GPU 3 reported back as it starts; ``end``: its steps) and the uninterrupted run
    of the same recipe (one process) beside it: ``check_job``'s (the job's metrics rows, its
    events, its output dir)."""
    from nemo_nutp.common.procs import kill_session

    out = tmp_path / "run"
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "nemo_nutp.launch.bridge_cli",
           *job_args(tmp_path, overrides, end)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, **env})
    try:
        if grow:
            report_back(out, proc, log)
        reference(tmp_path, end)  # beside the live job
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        kill_session(proc.pid)
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    return check_job(tmp_path, end)


def report_back(out: Path, proc: subprocess.Popen[str], log: Path) -> None:
    """Once the first world is up (its ranks still building): GPU 3 is healthy again."""
    events = out / "recovery" / "events.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "live_world" not in (events.read_text() if events.exists() else ""):
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, "no world within the job timeout"
        time.sleep(0.05)
    health = out / "recovery" / "health.json"
    assert json.loads(health.read_text())["failed_gpus"] == [3]
    tmp = health.with_suffix(".test-tmp")
    tmp.write_text(json.dumps({"failed_gpus": []}))
    os.replace(tmp, health)


