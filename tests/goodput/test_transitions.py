"""Issue 21: every layout change costs time. Property tests of the one transition mechanism
(``goodput/transitions.py``) against independent formulas written here: zero-cost transitions
reproduce the throughput-only simulator, ``stop-wait`` with the former ``sim.stop_wait`` values
reproduces the former pause formula, transition loss grows with cost and with the event rate,
planned events never recompute, and ``loss = throughput_loss + transition_loss``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.goodput import load_sim_config, make_context, simulate
from nemo_nutp.goodput import transitions as trn
from nemo_nutp.goodput.config import (
    CostConfig,
    FailureConfig,
    RestartPoint,
    SimConfig,
    TransitionConfig,
)
from nemo_nutp.goodput.failures import Events, down_at_steps
from nemo_nutp.goodput.simulate import eval_states, timeline_events
from nemo_nutp.layout import ModelDims

TIMELINE = ("drop", "drop-live", "drop+spares", "uniform-reduce", "nutp-restart", "nutp-live",
            "nutp+boost", "stop-wait")
ZERO = TransitionConfig(detect_s=0.0, restart_points=[RestartPoint(1, 0.0)],
                        restart_exponent=0.0, checkpoint_interval_hours=0.0, save_s=0.0,
                        live_base_s=0.0, live_group_s=0.0, live_lost_steps=0.0, weight_bytes=0,
                        max_wait_hours=0.0, repair_batch_hours=[0.0])
TODAY_STOP_WAIT = {"max_wait_hours": 0.25, "restart_hours": 0.25,
                   "checkpoint_interval_hours": 0.5}
"""The former ``sim.stop_wait`` defaults of configs/sim/paper_32k.yaml."""


def _today(**kw: object) -> TransitionConfig:
    """The former stop-wait values as one configuration of the transition mechanism."""
    sw = TODAY_STOP_WAIT
    base = dict(detect_s=0.0, restart_points=[RestartPoint(1, sw["restart_hours"] * 3600)],
                restart_exponent=0.0, checkpoint_interval_hours=sw["checkpoint_interval_hours"],
                save_s=0.0, max_wait_hours=sw["max_wait_hours"], repair_batch_hours=[0.0])
    base.update(kw)
    return TransitionConfig(**base)  # type: ignore[arg-type]


def _dims() -> ModelDims:
    """The small model of test_simulator (8 query groups: TP up to 8)."""
    return ModelDims(num_layers=4, hidden_size=48, num_attention_heads=16, num_query_groups=8,
                     ffn_hidden_size=40, vocab_size=101, seq_length=16)


def _small(**kw: object) -> SimConfig:
    base = dict(name="t", num_gpus=256, domain_size=8, gpus_per_node=4, tp_base=8, trials=40,
                fractions=[1e-3], days=2.0, cost=CostConfig(mode="compute"),
                policies=list(TIMELINE), spare_domains=2,
                failures=FailureConfig(rate_per_gpu_day=0.05, hardware_repair_hours=20.0))
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def _old_pause_fraction(ev: Events, trials: int, hours: float, max_wait: float | None,
                        restart: float, lost_per_failure: float) -> np.ndarray:
    """The former stop-wait formula, written out per trial: every failure stops the job until
    its GPUs are back (at most ``max_wait``) plus ``restart``; overlapping pauses merge; each
    pause that stops a running job also loses ``lost_per_failure`` of work."""
    out = np.zeros(trials)
    for tr in range(trials):
        m = ev.trial == tr
        spans = []
        for s0, e0 in zip(ev.start[m], ev.end[m], strict=True):
            wait = e0 - s0 if max_wait is None else min(e0 - s0, max_wait)
            s, e = min(max(s0, 0.0), hours), min(max(s0 + wait + restart, 0.0), hours)
            if e > s:
                spans.append((s, e))
        spans.sort()
        total, end, blocks = 0.0, -1.0, 0
        for s, e in spans:
            if s > end:
                blocks += 1
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
        out[tr] = min((total + blocks * lost_per_failure) / hours, 1.0)
    return out


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tp=st.sampled_from([4, 8]), pp=st.sampled_from([1, 2]),
       node=st.sampled_from([0.0, 0.3]))
def test_zero_cost_reproduces_the_throughput_only_mean(seed: int, tp: int, pp: int,
                                                       node: float) -> None:
    from nemo_nutp.goodput.config import CAPACITY_OF, BlastConfig
    fail = FailureConfig(rate_per_gpu_day=0.05, hardware_repair_hours=20.0,
                         blast=BlastConfig(gpu=1.0 - node, node=node))
    cfg = _small(seed=seed, tp_base=tp, pp=pp, transitions=ZERO, failures=fail)
    ref = _throughput_only_dims(cfg, _dims())
    tl = simulate_dims(cfg, _dims())["timeline"]["policies"]
    for p in TIMELINE[:-1]:
        r = tl[p]
        assert r["mean"] == ref[CAPACITY_OF[p]], (p, r["mean"], ref)  # exactly
        assert r["transition_loss"] == 0.0 and r["throughput_loss"] == pytest.approx(r["mean"])
    assert tl["stop-wait"]["mean"] == 0.0


def _throughput_only_dims(cfg: SimConfig, dims: object) -> dict[str, float]:
    from nemo_nutp.goodput.config import HardwareSpec

    ctx = make_context(cfg, dims=dims, hw=HardwareSpec())  # type: ignore[arg-type]
    ev, trials = timeline_events(ctx, np.random.default_rng(cfg.seed).spawn(2)[1])
    n_steps = int(np.ceil(cfg.days * 24 / cfg.step_hours))
    state, gpu = down_at_steps(ev, 0, trials, n_steps, cfg.step_hours)
    res = eval_states(ctx, state, gpu, trials * n_steps)
    return {p: float((1 - r.throughput.reshape(trials, n_steps).mean(axis=1)).mean())
            for p, r in res.items()}


def simulate_dims(cfg: SimConfig, dims: object) -> dict:
    """``simulate`` on given model dims (the small test model) instead of a model file."""
    from nemo_nutp.goodput.config import HardwareSpec
    from nemo_nutp.goodput.simulate import run_timeline

    ctx = make_context(cfg, dims=dims, hw=HardwareSpec())  # type: ignore[arg-type]
    rng = np.random.default_rng(cfg.seed)
    _, timeline_rng = rng.spawn(2)
    return {"timeline": run_timeline(ctx, timeline_rng)}


def _stop_wait_events(data: st.DataObject, trials: int, hours: float) -> Events:
    n = data.draw(st.integers(0, 12))
    f = st.floats(-5.0, hours + 2.0, allow_nan=False)
    start = np.array([data.draw(f) for _ in range(n)])
    dur = np.array([data.draw(st.floats(0.0, 30.0, allow_nan=False)) for _ in range(n)])
    trial = np.array([data.draw(st.integers(0, trials - 1)) for _ in range(n)], np.int64)
    z = np.zeros(n, np.int64)
    return Events(trial, start, start + dur, z, z + 1, np.ones(n, bool))


def _stop_wait_stall(ev: Events, cfg: TransitionConfig, trials: int, hours: float
                     ) -> np.ndarray:
    costs = trn.Costs(detect_s=cfg.detect_s, restart_s=cfg.restart_points[0].seconds,
                      planned_restart_s=0, straggler_restart_s=0, live_s=0, planned_live_s=0,
                      live_lost_s=0, interval_s=cfg.checkpoint_interval_hours * 3600,
                      save_s=0, max_wait_s=None if cfg.max_wait_hours is None
                      else cfg.max_wait_hours * 3600, fit=(0, 0), source="test")
    load = trn.slice_load(ev.trial, ev.lo, ev.size, ev.start, ev.end, np.zeros(1, np.int64))
    tr = trn.failure_transitions("stop-wait", ev, load, n_used_slices=1, num_gpus=1, tp=1,
                                 best=np.arange(2), costs=costs)
    return trn.stall_fraction(tr, trials, hours)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stop_wait_is_the_former_formula_through_the_transition_code(data: st.DataObject
                                                                      ) -> None:
    """With the former values: equal to the former formula whenever the job ran at least half
    a checkpoint interval between pauses (and no pause began before the horizon); otherwise
    lower (it loses at most the work since the previous resume), never higher."""
    trials, hours = 3, 48.0
    ev = _stop_wait_events(data, trials, hours)
    sw = TODAY_STOP_WAIT
    lost = sw["checkpoint_interval_hours"] / 2
    old = _old_pause_fraction(ev, trials, hours, sw["max_wait_hours"], sw["restart_hours"], lost)
    new = _stop_wait_stall(ev, _today(), trials, hours)
    assert np.all(new <= old + 1e-12)
    for tr in range(trials):
        m = ev.trial == tr
        s = np.clip(ev.start[m], 0, hours)
        e = np.clip(ev.start[m] + np.minimum(ev.end[m] - ev.start[m], sw["max_wait_hours"])
                    + sw["restart_hours"], 0, hours)
        keep = e > s
        s, e = np.sort(s[keep]), e[keep][np.argsort(s[keep])]
        ends = np.maximum.accumulate(e)
        gaps = s[1:] - ends[:-1]
        if np.all(ev.start[m] >= 0) and np.all((gaps >= lost) | (gaps <= 0)):
            assert new[tr] == pytest.approx(old[tr], abs=1e-12)


def test_stop_wait_paper_scenario_today() -> None:
    """paper_32k at the former values: the transition code's stop-wait next to the former
    formula on the same failure draws (the former README said 39 %)."""
    cfg = load_sim_config(["sim.trials=40", "sim.policies=[stop-wait]",
                           "sim.transitions.repair_batch_hours=[0]"])
    cfg = dataclasses.replace(cfg, transitions=_today())
    ctx = make_context(cfg)
    ev, trials = timeline_events(ctx, np.random.default_rng(cfg.seed).spawn(2)[1])
    hours = cfg.days * 24
    sw = TODAY_STOP_WAIT
    old = _old_pause_fraction(ev.select(ev.lo < cfg.num_gpus), trials, hours,
                              sw["max_wait_hours"], sw["restart_hours"],
                              sw["checkpoint_interval_hours"] / 2).mean()
    new = simulate(cfg, sweep=False)["timeline"]["policies"]["stop-wait"]
    print(f"stop-wait at the former values: transition code {new['mean']:.4f}, former formula "
          f"{old:.4f}")
    assert new["throughput_loss"] == 0.0 and new["loss"] == pytest.approx(new["mean"])
    # lower only by half-intervals the job had not run since its previous restart
    assert old - 0.02 < new["mean"] <= old + 1e-12
    assert 0.385 <= old < 0.395


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stall_is_monotone_in_costs(data: st.DataObject) -> None:
    """Raising any transition's hold or lost time never lowers the stall of any trial."""
    trials, hours = 2, 24.0
    n = data.draw(st.integers(1, 10))
    tr = trn.Transitions(
        np.array([data.draw(st.integers(0, trials - 1)) for _ in range(n)], np.int64),
        np.array([data.draw(st.floats(0.0, hours + 1, allow_nan=False)) for _ in range(n)]),
        np.array([data.draw(st.floats(0.0, 3.0, allow_nan=False)) for _ in range(n)]),
        np.array([data.draw(st.floats(0.0, 2.0, allow_nan=False)) for _ in range(n)]))
    base = trn.stall_fraction(tr, trials, hours)
    grow = np.array([data.draw(st.floats(1.0, 3.0)) for _ in range(n)])
    more = trn.Transitions(tr.trial, tr.t, tr.hold * grow, tr.lost * grow[::-1])
    assert np.all(trn.stall_fraction(more, trials, hours) >= base - 1e-12)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1.5, 20.0))
def test_transition_loss_monotone_in_cost_per_event(seed: int, scale: float) -> None:
    """Same failure draws, every cost x ``scale``: no policy's transition time goes down."""
    lo = TransitionConfig(detect_s=5.0, restart_points=[RestartPoint(1, 60.0)],
                          restart_exponent=0.0, checkpoint_interval_hours=0.2, save_s=2.0,
                          live_base_s=0.5, live_group_s=0.05, repair_batch_hours=[0.0])
    hi = dataclasses.replace(lo, detect_s=5.0 * scale,
                             restart_points=[RestartPoint(1, 60.0 * scale)],
                             checkpoint_interval_hours=0.2 * scale, save_s=2.0 * scale,
                             live_base_s=0.5 * scale, live_group_s=0.05 * scale,
                             live_lost_steps=scale)
    a = simulate_dims(_small(seed=seed, transitions=lo), _dims())["timeline"]["policies"]
    b = simulate_dims(_small(seed=seed, transitions=hi), _dims())["timeline"]["policies"]
    for p in TIMELINE:
        assert b[p]["transition_loss"] >= a[p]["transition_loss"] - 1e-12, p
        assert b[p]["throughput_loss"] == a[p]["throughput_loss"]
        assert b[p]["mean_event_s"] >= a[p]["mean_event_s"] - 1e-9


def test_transition_loss_grows_with_the_failure_rate() -> None:
    """Failure multiplier 0.5 -> 1 -> 2 (other draws alike): every policy's mean transition
    loss rises, by many standard errors of the trial mean."""
    rows = []
    for mult in (0.5, 1.0, 2.0):
        f = FailureConfig(rate_per_gpu_day=0.05, hardware_repair_hours=20.0, multiplier=mult)
        cfg = _small(failures=f, trials=60, transitions=_today(save_s=0.0))
        rows.append(simulate_dims(cfg, _dims())["timeline"]["policies"])
    for p in TIMELINE:
        t = [r[p]["transition_loss"] for r in rows]
        assert t[0] < t[1] < t[2], (p, t)
        assert rows[0][p]["events_per_day"] < rows[1][p]["events_per_day"] \
            < rows[2][p]["events_per_day"]


def test_planned_events_never_recompute(tmp_path: Path) -> None:
    """A trace whose only failure happened before the horizon: the one event inside is its
    repair (GPU back), a planned transition: restart and live policies pay exactly its hold,
    nothing recomputed; straggler transitions are planned too."""
    from nemo_nutp.goodput.stragglers import straggler_transitions

    trace = tmp_path / "t.csv"
    trace.write_text("time_h,gpu,duration_h\n-1.0,3,5.0\n")
    tc = TransitionConfig(detect_s=50.0, restart_points=[RestartPoint(1, 100.0)],
                          restart_exponent=0.0, checkpoint_interval_hours=2.0, save_s=0.0,
                          repair_batch_hours=[0.0])
    cfg = _small(transitions=tc, failures=FailureConfig(trace=str(trace)),
                 policies=["drop", "nutp-restart", "nutp-live"], spare_domains=0)
    res = simulate(cfg, sweep=False, directory=None)
    ctx = make_context(cfg)
    hours = cfg.days * 24
    for p, hold in (("drop", ctx.costs.planned_restart_s), ("nutp-restart",
                    ctx.costs.planned_restart_s), ("nutp-live", ctx.costs.planned_live_s)):
        r = res["timeline"]["policies"][p]
        assert r["events_per_day"] == pytest.approx(1 / cfg.days)
        assert r["mean_event_s"] == pytest.approx(hold)  # no detection, nothing lost
        thr = 1 - r["throughput_loss"]
        assert r["transition_loss"] == pytest.approx(thr * hold / 3600 / hours, rel=1e-12)
    ev = {"trial": np.zeros(3, np.int64), "start": np.array([1.0, 2.0, 3.0]),
          "end": np.array([5.0, 6.0, 7.0]), "gpu": np.array([0, 9, 17]),
          "speed": np.array([0.3, 0.5, 0.4])}
    for p in ("exclude", "exclude-live", "drop"):
        tr = straggler_transitions(p, ev, slice_of=ctx.slice_of, n_use=ctx.clusters["nutp"].n_use,
                                   pp=cfg.pp, tp_base=cfg.tp_base, time=ctx.tables.time,
                                   best=ctx.tables.best, costs=ctx.costs)
        assert len(tr.t) == 6 and np.all(tr.lost == 0), p


def test_paper_rows_add_up_and_name_their_mode() -> None:
    """Acceptance: nutp-restart and nutp-live rows, every row's fields, loss = sum."""
    cfg = load_sim_config(["sim.trials=12", "sim.days=4",
                           "sim.transitions.repair_batch_hours=[0,24]"])
    res = simulate(cfg, sweep=False)
    tl = res["timeline"]["policies"]
    assert {"nutp-restart", "nutp-live", "nutp-restart@daly"} <= set(tl)
    for p, r in tl.items():
        for k in ("throughput_loss", "transition_loss", "loss", "events_per_day",
                  "mean_event_s", "mean", "p5", "p95", "mode"):
            assert k in r, (p, k)
        assert r["loss"] == pytest.approx(r["throughput_loss"] + r["transition_loss"],
                                          rel=1e-12, abs=1e-15)
        assert r["mean"] == r["loss"]
    assert tl["nutp-restart"]["mode"] == "restart" and tl["nutp-live"]["mode"] == "live"
    # the same layouts, only the way of changing them differs
    assert tl["nutp-restart"]["throughput_loss"] == tl["nutp-live"]["throughput_loss"]
    assert tl["nutp-live"]["transition_loss"] < tl["nutp-restart"]["transition_loss"]
    # Young/Daly: the best interval never loses to the configured one (same draws)
    assert tl["nutp-restart@daly"]["transition_loss"] <= tl["nutp-restart"]["transition_loss"]
    d = res["timeline"]["daly"]
    assert d["interval_h"] == pytest.approx(np.sqrt(2 * cfg.transitions.save_s * d["mttf_h"]
                                                    * 3600) / 3600)
    b = res["timeline"]["repair_batching"]
    assert b["hours"] == [0, 24] and set(b["best_hours"]) == set(cfg.policies)
    for p in cfg.policies:
        assert b["loss"][p][0] == pytest.approx(tl[p]["loss"], rel=1e-12)  # all 12 trials
    for r in res["stragglers"]["policies"].values():
        assert r["loss"] == pytest.approx(r["throughput_loss"] + r["transition_loss"],
                                          rel=1e-12, abs=1e-15)


def test_restart_model_fit_and_measured_json(tmp_path: Path) -> None:
    """The default restart model passes through its two published points; a measured JSON
    (written here, the shape benchmarks/transition_cost.py writes) replaces the costs, scaled
    by the stated model; bad input names the key."""
    cfg = load_sim_config(["sim.trials=2"])
    a, k = trn.restart_fit(cfg.transitions.restart_points, None)
    for pt in cfg.transitions.restart_points:
        assert a * pt.gpus ** k == pytest.approx(pt.seconds, rel=1e-9)
    entry = {"detect_s": 0.5, "transition_s": 2.0, "lost_steps": 1, "step_s": 0.3,
             "checkpoint_bytes_read": 10**6, "processes_started": 4,
             "bytes_received_rank_max": 0}
    js = tmp_path / "transitions.json"
    js.write_text(json.dumps({"paths": {"restart": {"kill": entry, "gpu_back": {
        **entry, "transition_s": 1.0}}, "live": {"kill": {**entry, "transition_s": 0.25}}}}))
    m = make_context(dataclasses.replace(cfg, transitions=dataclasses.replace(
        cfg.transitions, measured=str(js))))
    read, live_bytes = trn._state_bytes(cfg, m.dims, m.clusters["nutp"].n_use)
    load = read / (cfg.transitions.storage_gbps * 1e9)
    n = cfg.num_gpus
    assert m.costs.detect_s == 0.5
    assert m.costs.restart_s == pytest.approx(2.0 * (n / 4) ** k + load)
    assert m.costs.planned_restart_s == pytest.approx(1.0 * (n / 4) ** k + load)
    assert m.costs.live_s == pytest.approx(0.25 + live_bytes / (m.hw.network_gbps * 1e9))
    assert m.costs.live_lost_s == pytest.approx(m.tables.parts_s["step_s"])
    assert "measured" in m.costs.source
    with pytest.raises(ValueError, match=r"sim\.transitions\.measured"):
        make_context(dataclasses.replace(cfg, transitions=dataclasses.replace(
            cfg.transitions, measured=str(tmp_path / "missing.json"))))
    warm = make_context(dataclasses.replace(cfg, transitions=dataclasses.replace(
        cfg.transitions, calibration="warm_standby")))
    assert warm.costs.restart_s < make_context(cfg).costs.restart_s
    for override, key in (("sim.transitions.save_s=-1", "save_s"),
                          ("sim.transitions.calibration=magic", "calibration"),
                          ("+sim.transitions.bogus=1", "bogus"),
                          ("sim.transitions.repair_batch_hours=[]", "repair_batch_hours")):
        with pytest.raises(ValueError, match=key):
            load_sim_config([override])
