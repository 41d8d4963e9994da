"""Live micro-batch rebalancing (``nutp.rebalance``) and the ``slow`` fault (issue #15).

The end-to-end test trains with ``nutp-train`` while one rank is slowed by fault injection and
the shares change mid-run, and compares every step's loss and grad norm with *stock*
single-process megatron-core (``tests/helpers/reference.py``) on the same global batches.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.common.faults import Fault, Faults, parse
from nemo_nutp.layout.plan import apportion
from nemo_nutp.train.rebalance import ShareController, makespan, propose
from tests.helpers.launch import run_train

SPEEDS = st.lists(st.floats(0.05, 1.0), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(SPEEDS, st.integers(0, 40), st.integers(1, 5))
def test_propose_keeps_a_partition_and_never_slows(speeds: list[float], extra: int,
                                                    shift: int) -> None:
    m = len(speeds) + extra
    per_mb = [1.0 / s for s in speeds]
    shares = [int(x) for x in apportion(np.ones(len(speeds)), m)]
    out = propose(shares, per_mb, shift)
    assert sum(out) == m and min(out) >= 1
    assert sum(abs(a - b) for a, b in zip(out, shares, strict=True)) <= 2 * shift
    assert makespan(out, per_mb) <= makespan(shares, per_mb)


@settings(max_examples=200, deadline=None)
@given(SPEEDS, st.integers(0, 40))
def test_controller_reaches_the_planner_optimum(speeds: list[float], extra: int) -> None:
    """Constant measured speeds, no hysteresis: the controller ends at the makespan of the
    planner's optimal apportionment (computed here by ``layout.plan.apportion``)."""
    m = len(speeds) + extra
    per_mb = [1.0 / s for s in speeds]
    c = ShareController([int(x) for x in apportion(np.ones(len(speeds)), m)], smoothing=1.0,
                        hysteresis=0.0, max_shift=m, warmup=0)
    for _ in range(3):
        c.observe([s * t for s, t in zip(c.shares, per_mb, strict=True)])
    best = apportion(np.asarray(speeds), m)
    assert makespan(c.shares, per_mb) == pytest.approx(makespan(best, per_mb), rel=1e-12)


def test_controller_smoothing_hysteresis_and_bound() -> None:
    c = ShareController([8, 8], smoothing=0.5, hysteresis=0.2, max_shift=2, warmup=1)
    assert c.observe([1.0, 3.0]) is None  # warm-up step: ignored
    assert c.observe([1.0, 1.1]) is None  # 10% apart: below the hysteresis
    new = c.observe([1.0, 3.0])  # averaged per micro-batch: [0.125, 0.25625]; 2 moves
    assert new == [10, 6]
    assert c.per_mb == pytest.approx([0.125, 0.5 * 3.0 / 8 + 0.5 * 1.1 / 8])
    assert c.observe([10 * 0.125, 6 * 10.0]) == [12, 4]  # far slower: still 2 per step
    for bad in (dict(smoothing=0.0), dict(hysteresis=1.0), dict(max_shift=0)):
        with pytest.raises(ValueError, match=r"nutp\.rebalance_"):
            ShareController([4, 4], **bad)  # type: ignore[arg-type]


def test_slow_fault_spec() -> None:
    (f,) = parse("slow:rank=3:factor=2.5")
    assert (f.kind, f.rank, f.step, f.factor) == ("slow", 3, 0, 2.5)
    assert f.slow_factor(3, 0) == 2.5 and f.slow_factor(2, 0) == 1.0
    g = Faults(parse("slow:rank=1:factor=3:step=4"))
    assert g.slow_factor(1, 3) == 1.0 and g.slow_factor(1, 4) == 3.0
    assert parse("kill:rank=1:step=5") == [Fault("kill", 1, 5)]
    for bad in ("slow:rank=1:factor=0.5", "slow:rank=x:factor=3", "kill:rank=1:step=2.5",
                "melt:rank=1:step=2"):
        with pytest.raises(ValueError, match="NUTP_FAULT"):
            parse(bad)


def test_config_fields_validated() -> None:
    from nemo_nutp.config import load_config

    cfg = load_config(["nutp.rebalance=true", "recovery.fault.kind=slow",
                       "recovery.fault.factor=2"])
    assert cfg.nutp.rebalance and cfg.recovery.fault.factor == 2.0
    for override, key in (("nutp.rebalance_smoothing=0", "nutp.rebalance_smoothing"),
                          ("nutp.rebalance_hysteresis=1.5", "nutp.rebalance_hysteresis"),
                          ("nutp.rebalance_max_shift=0", "nutp.rebalance_max_shift"),
                          ("recovery.fault.factor=0.5", "recovery.fault.factor"),
                          ("nutp.straggler_threshold=1", "nutp.straggler_threshold"),
                          ("nutp.straggler_window=0", "nutp.straggler_window"),
                          ("nutp.straggler_probe_interval=-1", "nutp.straggler_probe_interval"),
                          ("nutp.exclude_stragglers=true", "nutp.exclude_stragglers")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config([override])
    with pytest.raises(ValueError, match=r"checkpoint\.interval"):
        load_config(["nutp.exclude_stragglers=true", "nutp.straggler_probe_interval=1"])


def _train(out: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_train([f"output.dir={out}", *overrides], env=env, timeout=600)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_rebalanced_run_matches_stock_megatron(tmp_path: Path) -> None:
    """TP2 + TP1 replicas, TP rank 0 of the TP2 replica slowed 4x: the shares move mid-run
    (the TP1 replica takes more micro-batches), every step's loss and grad norm stay within
    1e-5 of stock single-process megatron-core on the same global batches."""
    import torch

    from nemo_nutp.config import load_config
    from tests.helpers.parity import Case, run_references

    overrides = ["nutp.replicas=[2,1]", "train.steps=6", "train.seed=11",
                 "train.global_batch_size=16", "train.micro_batch_size=2", "train.lr=1e-3",
                 "train.clip_grad=0.05", "nutp.rebalance=true", "nutp.rebalance_smoothing=1.0",
                 "nutp.rebalance_hysteresis=0.0", "nutp.rebalance_max_shift=2"]
    out = tmp_path / "run"
    r = _train(out, {"NUTP_FAULT": "slow:rank=0:factor=4"}, *overrides)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shares = [x["microbatches"] for x in rows]
    assert all(sum(s) == 8 and min(s) >= 1 for s in shares)
    changed = [i for i in range(1, len(shares)) if shares[i] != shares[i - 1]]
    assert changed and changed[0] < len(shares) - 1, shares  # changed mid-run
    assert shares[-1][1] > shares[0][1], shares  # towards the unslowed replica
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rebalance"] == changed

    cfg = load_config(overrides)
    case = Case("rebalance", (2, 1), model=dataclasses.asdict(cfg.model), global_batch=8,
                micro_batch_size=2, steps=6, lr=1e-3, clip_grad=0.05, seed=11)
    run_references([case], tmp_path)
    ref = torch.load(tmp_path / "ref_rebalance.pt")
    for x, loss, norm in zip(rows, ref["losses"], ref["grad_norms"], strict=True):
        assert abs(x["loss"] - loss) <= 1e-5 * abs(loss), (x["step"], x["loss"], loss)
        assert abs(x["grad_norm"] - norm) <= 1e-5 * norm, (x["step"], x["grad_norm"], norm)
        assert norm > 0.05  # clipping active on every step


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_straggler_detected_excluded_and_resumed(tmp_path: Path) -> None:
    """Rank 1 (GPU 1) slowed 4x in a TP2 + TP2 job under the recovery supervisor: the probe names
    GPU 1, the world stops after the next checkpoint (nutp.exclude_stragglers), the supervisor
    re-plans without GPU 1 (TP2 + TP1, the path of a failed GPU) and resumes; every step's loss
    over both attempts is within 1e-5 of stock single-process megatron-core. The written health
    report plans the same layout for a manual relaunch (health.report)."""
    import torch

    from nemo_nutp.config import load_config
    from nemo_nutp.config.derived import plan_request
    from nemo_nutp.layout import build_plan
    from tests.helpers.parity import Case, run_references

    out = tmp_path / "run"
    overrides = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
                 "parallel.tp_base=2", "health.failed_gpus=[]", "train.steps=8",
                 "train.global_batch_size=16", "train.seed=5", "checkpoint.interval=2",
                 "nutp.straggler_probe_interval=1", "nutp.straggler_window=3",
                 # 2.5x: the 4x slowed GPU is found; probe noise of 2 shared cores is not (at
                 # the default 1.5x a clean-clone run once flagged GPU 3)
                 "nutp.straggler_threshold=2.5", "nutp.exclude_stragglers=true"]
    r = _train(out, {"NUTP_FAULT": "slow:rank=1:factor=4"}, *overrides, "recovery.enabled=true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "stragglers.json").read_text())
    assert list(report["slow_gpus"]) == ["1"] and report["slow_gpus"]["1"] < 0.5
    events = [json.loads(x) for x in (out / "recovery" / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names.count("straggler") == 1 and names.count("relayout") == 1, names
    (relayout,) = [e for e in events if e["event"] == "relayout"]
    assert relayout["gpus"] == [1] and relayout["resume_step"] == 4, relayout
    again = [*overrides, f"health.report={out / 'stragglers.json'}"]
    plan = build_plan(plan_request(load_config(again)))
    assert 1 not in plan.rank_to_gpu and sorted(r.tp[0] for r in plan.replicas) == [1, 2]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(8))
    assert rows[3]["replica_tp"] == [[2], [2]]  # stopped after the checkpoint of step 4
    assert rows[-1]["replica_tp"] == [list(rep.tp) for rep in plan.replicas]
    good = json.loads((out / "goodput.json").read_text())  # issue #15 item 6: slack split
    assert good["straggler_gpu_s"] > 0 and good["slack_gpu_s"] >= 0, good
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [(x["cause"], x["gpus"], x["resume_step"]) for x in summary] == [("straggler", [1], 4)]

    cfg = load_config(overrides)
    case = Case("excluded", (2, 2), model=dataclasses.asdict(cfg.model), global_batch=8,
                micro_batch_size=2, steps=8, lr=cfg.train.lr, seed=5)
    run_references([case], tmp_path)
    ref = torch.load(tmp_path / "ref_excluded.pt")
    for x, loss in zip(rows, ref["losses"], strict=True):
        assert abs(x["loss"] - loss) <= 1e-5 * abs(loss), (x["step"], x["loss"], loss)
