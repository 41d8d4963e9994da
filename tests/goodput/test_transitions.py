"""Issue 21: every layout change costs time. Property tests of the one transition mechanism
(``goodput/transitions.py``) against independent formulas written here: zero-cost transitions
reproduce the throughput-only simulator, ``stop-wait`` with the former ``sim.stop_wait`` values
(and ``recompute=half_interval``) is the former pause formula on every draw, transition loss
grows with cost per event on every draw and with the event rate (per draw where the model
allows it: thinned draws, ``stop-wait``; in the mean otherwise, with the counterexamples that
show why), planned events never recompute, and ``loss = throughput_loss + transition_loss``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
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
from nemo_nutp.goodput.report import transitions_line
from nemo_nutp.goodput.simulate import eval_states, timeline_events
from nemo_nutp.layout import ClusterSpec, ModelDims, ParallelSpec

TIMELINE = ("drop", "drop-live", "drop+spares", "uniform-reduce", "nutp-restart", "nutp-live",
            "nutp-live+spares", "nutp+boost", "stop-wait")
ZERO = TransitionConfig(detect_s=0.0, restart_points=[RestartPoint(1, 0.0)],
                        restart_exponent=0.0, checkpoint_interval_hours=0.0, save_s=0.0,
                        live_base_s=0.0, live_group_s=0.0, live_lost_steps=0.0, weight_bytes=0,
                        optimizer_bytes=0, max_wait_hours=0.0, repair_batch_hours=[0.0])
TODAY_STOP_WAIT = {"max_wait_hours": 0.25, "restart_hours": 0.25,
                   "checkpoint_interval_hours": 0.5}
"""The former ``sim.stop_wait`` defaults of configs/sim/paper_32k.yaml."""
FORMER = ["sim.transitions.recompute=half_interval", "sim.transitions.detect_s=0",
          "sim.transitions.restart_points=[{gpus:1,seconds:900}]",
          "sim.transitions.restart_exponent=0", "sim.transitions.checkpoint_interval_hours=0.5",
          "sim.transitions.max_wait_hours=0.25", "sim.transitions.save_s=0"]
"""The same values as overrides of ``nutp simulate`` (README): the former stop-wait."""


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
    base = dict(name="t", cluster=ClusterSpec(num_gpus=256, domain_size=8, gpus_per_node=4,
                                              hardware="b200_nvl32"),
                parallel=ParallelSpec(tp_base=8), trials=40,
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
    cfg = _small(seed=seed, parallel=ParallelSpec(tp_base=tp, pp=pp), transitions=ZERO,
                 failures=fail)
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
                      else cfg.max_wait_hours * 3600, fit=(0, 0), source="test",
                      recompute=cfg.recompute)
    load = trn.slice_load(ev.trial, ev.lo, ev.size, ev.start, ev.end, np.zeros(1, np.int64))
    tr = trn.failure_transitions("stop-wait", ev, load, n_used_slices=1, num_gpus=1, tp=1,
                                 best=np.arange(2), costs=costs)
    return trn.stall_fraction(tr, trials, hours, cfg.recompute)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stop_wait_is_the_former_formula_through_the_transition_code(data: st.DataObject
                                                                      ) -> None:
    """With the former values and ``recompute=half_interval``: the former formula on every
    draw. The default ``capped``: equal whenever the job ran at least half a checkpoint
    interval between pauses (and no pause began before the horizon); otherwise lower (it
    loses at most the work since the previous resume), never higher."""
    trials, hours = 3, 48.0
    ev = _stop_wait_events(data, trials, hours)
    sw = TODAY_STOP_WAIT
    lost = sw["checkpoint_interval_hours"] / 2
    old = _old_pause_fraction(ev, trials, hours, sw["max_wait_hours"], sw["restart_hours"], lost)
    former = _stop_wait_stall(ev, _today(recompute="half_interval"), trials, hours)
    np.testing.assert_allclose(former, old, rtol=0, atol=1e-12)
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
    """paper_32k with the former stop-wait values given as overrides (``FORMER``): the
    transition code's stop-wait is the former formula on the same failure draws (39 %, as the
    former README said); the default ``capped`` recompute is lower by the half intervals the
    job had not run since its previous restart."""
    cfg = load_sim_config(["sim.trials=40", "sim.policies=[stop-wait]",
                           "sim.transitions.repair_batch_hours=[0]",
                           "sim.stragglers.rate_per_gpu_day=0", *FORMER])
    sw = TODAY_STOP_WAIT
    c = make_context(cfg).costs
    assert (c.detect_s, c.restart_s, c.max_wait_s, c.interval_s, c.save_s) == pytest.approx((
        0.0, sw["restart_hours"] * 3600, sw["max_wait_hours"] * 3600,
        sw["checkpoint_interval_hours"] * 3600, 0.0), rel=1e-12)  # exp(log(900)): rounding
    ev, trials = timeline_events(make_context(cfg), np.random.default_rng(cfg.seed).spawn(2)[1])
    hours = cfg.days * 24
    old = _old_pause_fraction(ev.select(ev.lo < cfg.cluster.num_gpus), trials, hours,
                              sw["max_wait_hours"], sw["restart_hours"],
                              sw["checkpoint_interval_hours"] / 2)
    former = simulate(cfg, sweep=False)["timeline"]["policies"]["stop-wait"]
    capped = simulate(dataclasses.replace(cfg, transitions=dataclasses.replace(
        cfg.transitions, recompute="capped")), sweep=False)["timeline"]["policies"]["stop-wait"]
    print(f"stop-wait at the former values: former formula {old.mean():.4f}, transition code "
          f"half_interval {former['mean']:.4f}, capped {capped['mean']:.4f}")
    assert former["throughput_loss"] == 0.0 and former["loss"] == pytest.approx(former["mean"])
    for k, ref in (("mean", old.mean()), ("p5", np.percentile(old, 5)),
                   ("p95", np.percentile(old, 95))):
        assert former[k] == pytest.approx(ref, abs=1e-12), k
    assert old.mean() - 0.02 < capped["mean"] <= old.mean() + 1e-12
    assert 0.385 <= old.mean() < 0.395


def _transitions(data: st.DataObject, trials: int, hours: float, *, t_lo: float,
                 lost: tuple[float, float], n_max: int = 10) -> trn.Transitions:
    n = data.draw(st.integers(1, n_max))
    return trn.Transitions(
        np.array([data.draw(st.integers(0, trials - 1)) for _ in range(n)], np.int64),
        np.array([data.draw(st.floats(t_lo, hours + 1, allow_nan=False)) for _ in range(n)]),
        np.array([data.draw(st.floats(0.0, 3.0, allow_nan=False)) for _ in range(n)]),
        np.array([data.draw(st.floats(*lost, allow_nan=False)) for _ in range(n)]))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stall_is_monotone_in_costs(data: st.DataObject) -> None:
    """Raising any transition's hold or lost time never lowers the stall of any trial."""
    trials, hours = 2, 24.0
    tr = _transitions(data, trials, hours, t_lo=0.0, lost=(0.0, 2.0))
    n = len(tr.t)
    base = trn.stall_fraction(tr, trials, hours)
    grow = np.array([data.draw(st.floats(1.0, 3.0)) for _ in range(n)])
    more = trn.Transitions(tr.trial, tr.t, tr.hold * grow, tr.lost * grow[::-1])
    assert np.all(trn.stall_fraction(more, trials, hours) >= base - 1e-12)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stall_grows_when_transitions_are_added(data: st.DataObject) -> None:
    """``capped``: adding transitions inside the horizon whose lost is at least every other
    transition's never lowers the stall of any trial (the base may begin before the
    horizon)."""
    trials, hours, lost = 2, 24.0, 1.0
    base = _transitions(data, trials, hours, t_lo=-5.0, lost=(0.0, lost))
    extra = _transitions(data, trials, hours, t_lo=0.0, lost=(lost, 2 * lost), n_max=6)
    both = trn.Transitions.concat([base, extra])
    assert np.all(trn.stall_fraction(both, trials, hours)
                  >= trn.stall_fraction(base, trials, hours) - 1e-12)


def _one(*rows: tuple[float, float, float]) -> trn.Transitions:
    """Transitions of trial 0 from (t, hold, lost) rows, hours."""
    t, hold, lost = (np.array(c, float) for c in zip(*rows, strict=True))
    return trn.Transitions(np.zeros(len(t), np.int64), t, hold, lost)


def test_where_more_events_can_cost_less() -> None:
    """Why the event-rate property holds in the mean only, not per draw (the model, not a
    bug): (a) a planned restart waits for a save, so a failure soon after it redoes less;
    (b) a failure bridging two down periods of a ``drop`` replica keeps it dropped
    throughout: two transitions instead of four; (c) the former ``half_interval`` charge is
    not even monotone in cost: a longer stall that merges two drops the second's half
    interval."""
    hours = 24.0

    def stall(tr: trn.Transitions, mode: str = "capped") -> float:
        return float(trn.stall_fraction(tr, 1, hours, mode)[0] * hours)

    f = (10.0, 0.1, 0.25)  # a failure after a long run: hold 0.1 h, redoes 0.25 h
    assert stall(_one(f)) == pytest.approx(0.35)
    assert stall(_one(f, (9.8, 0.05, 0.0))) == pytest.approx(0.05 + 0.1 + 0.15)  # (a)
    z = np.zeros(3, np.int64)
    ev = Events(z, np.array([0.0, 6.0, 4.0]), np.array([5.0, 10.0, 7.0]), np.array([0, 1, 2]),
                z + 1, np.ones(3, bool))
    costs = trn.Costs(detect_s=30, restart_s=300, planned_restart_s=300,
                      straggler_restart_s=300, live_s=0, planned_live_s=0, live_lost_s=0,
                      interval_s=1800, save_s=0, max_wait_s=None, fit=(0, 0), source="test")
    counts = []
    for sel in (np.array([True, True, False]), np.ones(3, bool)):  # (b)
        e = ev.select(sel)
        load = trn.slice_load(e.trial, e.lo, e.size, e.start, e.end, np.zeros(8, np.int64))
        tr = trn.failure_transitions("drop", e, load, n_used_slices=1, num_gpus=8, tp=8,
                                     best=np.arange(9), costs=costs)
        counts.append((len(tr.t), stall(tr)))
    assert counts[0][0] == 4 and counts[1][0] == 2 and counts[1][1] < counts[0][1]
    a, b = (5.0, 0.5, 0.25), (5.6, 0.5, 0.25)  # (c) stop-wait-like stalls 0.1 h apart
    assert stall(_one(a, b), "half_interval") == pytest.approx(1.5)
    assert stall(_one((5.0, 0.65, 0.25), b), "half_interval") == pytest.approx(1.35)
    assert stall(_one((5.0, 0.65, 0.25), b)) >= stall(_one(a, b))  # capped: monotone


def _per_trial(ctx: object, ev: Events, costs: trn.Costs | None = None
               ) -> dict[str, dict[str, np.ndarray]]:
    """Per policy and trial: throughput and time standing still (simulate's own rows)."""
    from nemo_nutp.goodput.config import CAPACITY_OF
    from nemo_nutp.goodput.simulate import _capacity, _loss_rows

    cfg = ctx.cfg  # type: ignore[attr-defined]
    hours, n = cfg.days * 24, int(np.ceil(cfg.days * 24 / cfg.step_hours))
    acc = _capacity(ctx, ev, cfg.trials, n, None, "test")  # type: ignore[arg-type]
    rows = _loss_rows(ctx, ev, cfg.trials, hours, acc,  # type: ignore[arg-type]
                      costs or ctx.costs, list(cfg.policies))  # type: ignore[attr-defined]
    out = {}
    for p, r in rows.items():
        thr = acc[CAPACITY_OF[p]]["thr"] if p in CAPACITY_OF else np.ones(cfg.trials)
        out[p] = {"transition": thr * r["_still"], "still": r["_still"],
                  "mean_event_s": np.array(r["mean_event_s"])}
    return out


def _ctx(cfg: SimConfig) -> object:
    from nemo_nutp.goodput.config import HardwareSpec

    return make_context(cfg, dims=_dims(), hw=HardwareSpec())


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1.5, 20.0))
def test_transition_loss_monotone_in_cost_per_event(seed: int, scale: float) -> None:
    """Same failure draws (inside the horizon), every cost x ``scale``: no policy's
    transition loss goes down in any trial, its throughput loss stays."""
    lo = TransitionConfig(detect_s=5.0, restart_points=[RestartPoint(1, 60.0)],
                          restart_exponent=0.0, checkpoint_interval_hours=0.2, save_s=2.0,
                          live_base_s=0.5, live_group_s=0.05, repair_batch_hours=[0.0])
    hi = dataclasses.replace(lo, detect_s=5.0 * scale,
                             restart_points=[RestartPoint(1, 60.0 * scale)],
                             checkpoint_interval_hours=0.2 * scale, save_s=2.0 * scale,
                             live_base_s=0.5 * scale, live_group_s=0.05 * scale,
                             live_lost_steps=scale)
    cfg = _small(seed=seed, transitions=lo, steady_state=False)
    ctx = _ctx(cfg)
    ev, _ = timeline_events(ctx, np.random.default_rng(seed))  # type: ignore[arg-type]
    a = _per_trial(ctx, ev)
    b = _per_trial(ctx, ev, _ctx(dataclasses.replace(cfg, transitions=hi)).costs)  # type: ignore[attr-defined]
    for p in TIMELINE:
        assert np.all(b[p]["transition"] >= a[p]["transition"] - 1e-12), p
        assert b[p]["mean_event_s"] >= a[p]["mean_event_s"] - 1e-9
        assert a[p]["transition"].max() > 0, p


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), q=st.floats(0.1, 0.7))
def test_transition_loss_monotone_in_the_failure_rate_on_thinned_draws(seed: int, q: float
                                                                      ) -> None:
    """Coupled draws: the failures at rates q/2 x, q x and 1 x a base rate are nested subsets
    of one draw (thinning: each event kept iff its uniform mark is below the rate's share).
    ``stop-wait`` (every failure a transition of the same cost): transition loss never goes
    down in any trial. Every policy: its mean rises (the per-draw counterexamples are in
    test_where_more_events_can_cost_less), at a rate where a replica's down periods seldom
    overlap (~0.27 GPUs of an 8-GPU slice down on average; paper_32k: ~0.06 of a 32-GPU one):
    ``drop``'s transitions saturate when replicas stay dropped (at 0.1/GPU-day here
    ``drop-live`` already loses less at the full rate than at 0.69 of it)."""
    tc = TransitionConfig(detect_s=30.0, restart_points=[RestartPoint(1, 300.0)],
                          restart_exponent=0.0, checkpoint_interval_hours=0.5, save_s=10.0,
                          repair_batch_hours=[0.0])
    cfg = _small(seed=seed, transitions=tc, steady_state=False,
                 failures=FailureConfig(rate_per_gpu_day=0.05, hardware_repair_hours=20.0))
    ctx = _ctx(cfg)
    rng = np.random.default_rng(seed)
    ev, _ = timeline_events(ctx, rng)  # type: ignore[arg-type]
    mark = rng.random(len(ev))
    rows = [_per_trial(ctx, ev.select(mark < share)) for share in (q / 2, q, 1.0)]
    for lo, hi in itertools.pairwise(rows):
        sw_lo, sw_hi = lo["stop-wait"]["transition"], hi["stop-wait"]["transition"]
        assert np.all(sw_hi >= sw_lo - 1e-12)
        for p in TIMELINE:
            assert hi[p]["transition"].mean() > lo[p]["transition"].mean(), p


def test_transition_loss_grows_with_the_failure_rate() -> None:
    """``sim.failures.multiplier`` 0.5 -> 1 -> 2 (independent draws): every policy's mean
    transition loss and its events per day rise."""
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
                                   pp=cfg.parallel.pp, tp_base=cfg.parallel.tp_base,
                                   time=ctx.tables.time, best=ctx.tables.best, costs=ctx.costs)
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
    live = {**entry, "transition_s": 0.25, "lost_steps": 0, "recomputed_steps": 1}  # in flight
    js.write_text(json.dumps({"paths": {"restart": {"kill": entry, "gpu_back": {
        **entry, "transition_s": 1.0}}, "live": {"kill": live}}}))
    m = make_context(dataclasses.replace(cfg, transitions=dataclasses.replace(
        cfg.transitions, measured=str(js))))
    read, live_bytes, _ = trn._state_bytes(cfg, m.dims, m.clusters["nutp"].n_use)
    load = read / (cfg.transitions.storage_gbps * 1e9)
    n = cfg.cluster.num_gpus
    assert m.costs.detect_s == 0.5
    assert m.costs.restart_s == pytest.approx(2.0 * (n / 4) ** k + load)
    assert m.costs.planned_restart_s == pytest.approx(1.0 * (n / 4) ** k + load)
    assert m.costs.live_s == pytest.approx(0.25 + live_bytes / (m.hw.network_gbps * 1e9))
    assert m.costs.live_lost_s == pytest.approx(m.tables.parts_s["step_s"])
    assert "measured" in m.costs.source and m.costs.fit == pytest.approx((a, k))
    assert "recompute capped" in transitions_line(simulate(dataclasses.replace(
        m.cfg, trials=2, days=1.0, stragglers=dataclasses.replace(
            m.cfg.stragglers, rate_per_gpu_day=0.0)), sweep=False))  # the printed line
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


def test_simulator_reads_what_transition_cost_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """``data/transitions_measured.json`` is the unedited output of one
    ``benchmarks/transition_cost.py --quick`` run (every path and event): it has every key the
    benchmark promises (its ``FIELDS``), and the simulator turns it into the scenario's costs
    by the stated model (restart scaled by the fit's k plus the checkpoint read; live: its
    re-layout plus the new shard, and the in-flight steps it redid)."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("transition_cost",
                                                  root / "benchmarks" / "transition_cost.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look themselves up
    spec.loader.exec_module(bench)
    path = Path(__file__).parent / "data" / "transitions_measured.json"
    data = json.loads(path.read_text())
    assert data["schema"] == "nemo_nutp.bench.transitions/1"
    assert {"restart", "live"} <= set(data["paths"]) <= set(bench.PATHS)
    for entries in data["paths"].values():
        for e in entries.values():
            assert set(bench.FIELDS) <= set(e)
    cfg = load_sim_config(["sim.trials=2", f"sim.transitions.measured={path}"])
    ctx = make_context(cfg)
    c, (r, lv) = ctx.costs, (data["paths"]["restart"], data["paths"]["live"])
    _, k = trn.restart_fit(cfg.transitions.restart_points, None)
    read, live_bytes, _ = trn._state_bytes(cfg, ctx.dims, ctx.clusters["nutp"].n_use)
    load, bw = read / (cfg.transitions.storage_gbps * 1e9), ctx.hw.network_gbps * 1e9
    n = cfg.cluster.num_gpus
    for got, e in ((c.restart_s, r["kill"]), (c.planned_restart_s, r["gpu_back"]),
                   (c.straggler_restart_s, r["straggler"])):
        assert got == pytest.approx(e["transition_s"] * (n / e["processes_started"]) ** k
                                    + load)
    assert c.detect_s == r["kill"]["detect_s"]
    assert c.live_s == pytest.approx(lv["kill"]["transition_s"] + live_bytes / bw)
    assert c.planned_live_s == pytest.approx(lv["gpu_back"]["transition_s"] + live_bytes / bw)
    redo = lv["kill"]["lost_steps"] + lv["kill"]["recomputed_steps"]
    assert redo >= 1 and c.live_lost_s == pytest.approx(redo * ctx.tables.parts_s["step_s"])


def test_measured_live_spare_path_prices_the_spare_swap(tmp_path: Path) -> None:
    """When ``benchmarks/transition_cost.py`` ran its ``live_spare`` path, the simulator's spare
    swap is that measured transition plus the scenario's spare bytes (else the live kill's)."""
    path = Path(__file__).parent / "data" / "transitions_measured.json"
    data = json.loads(path.read_text())
    data["paths"]["live_spare"] = {"kill": {**data["paths"]["live"]["kill"],
                                            "transition_s": 1.234}}
    mine = tmp_path / "measured.json"
    mine.write_text(json.dumps(data))
    base = make_context(load_sim_config(["sim.trials=2", f"sim.transitions.measured={path}"]))
    cfg = load_sim_config(["sim.trials=2", f"sim.transitions.measured={mine}"])
    ctx = make_context(cfg)
    _, _, spare_bytes = trn._state_bytes(cfg, ctx.dims, ctx.clusters["nutp"].n_use)
    bw = ctx.hw.network_gbps * 1e9
    assert ctx.costs.live_spare_s == pytest.approx(1.234 + spare_bytes / bw)
    assert base.costs.live_spare_s == pytest.approx(
        data["paths"]["live"]["kill"]["transition_s"] + spare_bytes / bw)
