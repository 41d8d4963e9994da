"""The live re-layout tests' shared parts (``tests/live``, ``tests/launch/test_sbatch_live.py``):
the base overrides, one supervised job, the stock megatron-core reference of a job's config, and
the checks on its metrics and recovery events."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

from nemo_nutp.common.procs import kill_session
from nemo_nutp.config import load_config
from tests.helpers.launch import start_train
from tests.helpers.parity import Case, run_references

TOL = 1e-5
BASE = ("train.seed=7", "train.global_batch_size=12", "train.micro_batch_size=2",
        "train.clip_grad=0.5", "recovery.enabled=true", "recovery.mode=live")
JOB_TIMEOUT_S = 540


def run_job(out: Path, overrides: tuple[str, ...], env: dict[str, str]) -> tuple[int, str]:
    """One supervised ``nutp-train`` job to its exit (``JOB_TIMEOUT_S``: -1), every process of
    its session killed after; (exit code, its output ``<out>.log``)."""
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = start_train([f"output.dir={out}", *overrides], log=log, env=env)
    try:
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = -1
    finally:
        kill_session(proc.pid)
        proc.wait()
    return rc, log.read_text()


def stock_reference(overrides: tuple[str, ...], steps: int, tmp: Path) -> dict[str, Any]:
    import torch

    cfg = load_config(list(overrides))
    t = cfg.train
    case = Case(name="live", replicas=(1,), model=dataclasses.asdict(cfg.model),
                global_batch=t.global_batch_size // t.micro_batch_size,
                micro_batch_size=t.micro_batch_size, steps=steps, lr=t.lr,
                optimizer=t.optimizer, clip_grad=t.clip_grad, precision=t.precision,
                seed=t.seed, initial_loss_scale=t.initial_loss_scale,
                weight_decay=t.weight_decay, schedule=schedule_case(t))
    run_references([case], tmp)
    return dict(torch.load(tmp / "ref_live.pt"))


def schedule_case(t: Any) -> dict[str, Any]:
    """A ``train`` section's lr schedule as a parity ``Case.schedule`` ({}: constant)."""
    if t.lr_decay_style == "constant" and not t.lr_warmup_iters:
        return {}
    assert t.lr_decay_style != "WSD", "the reference takes no WSD settings"
    return {"lr_warmup_iters": t.lr_warmup_iters, "lr_warmup_init": t.lr_warmup_init,
            "lr_decay_style": t.lr_decay_style, "lr_decay_iters": t.lr_decay_iters or t.steps,
            "min_lr": t.min_lr}


def metric_rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))), "metrics rows have a gap"
    return rows


def read_events(out: Path) -> list[dict[str, Any]]:
    text = (out / "recovery" / "events.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


def check_steps(out: Path, ref: dict[str, Any], tol: float) -> list[dict[str, Any]]:
    rows = metric_rows(out)
    assert len(rows) == len(ref["losses"])
    for r, loss, norm, lr in zip(rows, ref["losses"], ref["grad_norms"], ref["lrs"],
                                 strict=True):
        assert abs(r["loss"] - loss) <= tol * abs(loss), (r["step"], r["loss"], loss)
        assert abs(r["grad_norm"] - norm) <= tol * abs(norm), (r["step"], r["grad_norm"], norm)
        assert r["lr"] == lr, (r["step"], r["lr"], lr)  # the schedule's, as megatron's sets it
    return rows


def replica_digests(ev: list[dict[str, Any]]) -> dict[int, dict[int, set[str]]]:
    """gen -> replica -> the digest of its assembled parameters right after the move."""
    found: dict[int, dict[int, set[str]]] = {}
    for e in ev:
        if e["event"] == "live_digest":
            found.setdefault(e["gen"], {}).setdefault(e["replica"], set()).add(e["digest"])
    return found


def check_live(ev: list[dict[str, Any]], *, relayouts: int) -> list[dict[str, Any]]:
    """Checks on the events of one world of processes (``ev``: up to a fallback, if any)."""
    assert [e["event"] for e in ev].count("start") == 1, "a live re-layout restarted"
    lives = [e for e in ev if e["event"] == "live_relayout"]
    assert len(lives) == relayouts, [e["event"] for e in ev]
    for e in lives:
        assert e["lost_steps"] == 0 and e["recomputed_steps"] <= 1, e
        assert e["resume_step"] == e["committed_step"] + 1, e
        assert e["checkpoint_bytes_read"] == 0 and e["processes_started"] == 0
    (first,) = [e for e in ev if e["event"] == "live_world"]
    for a, b in itertools.pairwise([first, *lives]):
        assert set(b["pids"]) < set(a["pids"]), "a survivor changed its process"
    digests = replica_digests(ev)
    assert sorted(digests) == [e["gen"] for e in lives], digests
    for gen, reps in digests.items():
        # replicas bitwise equal after the move: the same digest for every replica
        assert len(set().union(*reps.values())) == 1, (gen, reps)
    return lives
