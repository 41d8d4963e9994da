"""Monte Carlo goodput simulation: static failure-fraction sweeps and failure timelines.

``simulate(cfg)`` returns a JSON-ready dict (schema ``nemo_nutp.sim/2``, see docs/simulator.md) with
* ``sweep``: per failed-GPU fraction and policy, mean/p5/p95 throughput loss over trials,
  spare domains a rigid job needs (p95), boost power; plus the closed form of ``drop``;
* ``blast``: the same at ``sim.blast_fraction`` for failures of one GPU / node / domain;
* ``timeline``: per policy over ``sim.days`` with the Poisson failure process (or a trace):
  ``throughput_loss`` (the degraded layouts' capacity), ``transition_loss`` (time standing
  still or recomputing to change layouts and to save checkpoints, ``transitions.py``), ``loss``
  (their sum; ``mean/p5/p95`` describe it), ``events_per_day``, ``mean_event_s``, rigid paused
  time, spare domains for zero pause, GPU-hours and $ lost; ``nutp-restart@daly``: the restart
  policy at its Young/Daly checkpoint interval; ``repair_batching``: the loss of every policy
  when repaired GPUs are taken back at once or in batches; ``transitions``: the costs used;
* ``stragglers`` (with the timeline, when ``sim.stragglers.rate_per_gpu_day`` > 0): per
  straggler policy the same statistics of the loss to slow GPUs alone (``stragglers.py``);
* ``links`` (with the timeline, when ``sim.links.rate_per_gpu_day`` > 0): the same per link
  policy for slow scale-out NICs alone (``links.py``).
All randomness comes from ``numpy.random.default_rng(sim.seed)`` in a fixed order, so equal
configs give equal results. Losses are ``1 - throughput``, throughput vs the fault-free job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..layout.specs import ModelDims
from . import transitions as trn
from .config import (
    CAPACITY_OF,
    CAPACITY_POLICIES,
    MODE_OF,
    SPARE_LAYOUTS,
    HardwareSpec,
    SimConfig,
    load_hardware,
    load_model,
)
from .cost import CostModel, StageTables
from .failures import (
    Events,
    blast_sizes,
    down_at_steps,
    load_trace,
    poisson_events,
    static_down,
)
from .policies import PolicyCluster, StateResult, degraded_slices, evaluate, slice_map

Progress = Callable[[str, float], None]
"""progress(label, fraction_done) callback."""


@dataclass(frozen=True)
class Context:
    """Everything derived once from a config."""

    cfg: SimConfig
    dims: ModelDims
    hw: HardwareSpec
    tables: StageTables
    n_gpus: int  # including spare domains
    slice_of: np.ndarray
    clusters: dict[str, PolicyCluster]
    sizes: dict[str, int]
    costs: trn.Costs

    @property
    def capacities(self) -> list[str]:
        """Capacity layouts of the configured policies, in order (the sweep's rows)."""
        out = [CAPACITY_OF[p] for p in self.cfg.policies if p in CAPACITY_OF]
        return list(dict.fromkeys(out))

    @property
    def slices_per_domain(self) -> int:
        return self.cfg.cluster.domain_size // self.cfg.parallel.tp_base


def make_context(cfg: SimConfig, *, directory: Path | None = None,
                 dims: ModelDims | None = None, hw: HardwareSpec | None = None) -> Context:
    dims = dims or load_model(cfg, directory)
    hw = hw or load_hardware(cfg, directory)
    tables = CostModel(cfg, dims, hw).tables()
    holders = [p for p in cfg.policies if CAPACITY_OF.get(p) in SPARE_LAYOUTS]
    spares = cfg.spare_domains if holders else 0
    cl, par = cfg.cluster, cfg.parallel
    if spares and cl.num_gpus % cl.domain_size:
        raise ValueError(f"sim.cluster.num_gpus={cl.num_gpus}: must be a multiple of "
                         f"sim.cluster.domain_size={cl.domain_size} when {holders[0]} adds spare "
                         "domains")
    n_gpus = cl.num_gpus + spares * cl.domain_size
    slice_of = slice_map(n_gpus, cl.domain_size, par.tp_base)
    base_slices = int(slice_of[: cl.num_gpus].max()) + 1
    n_use = base_slices // par.pp
    if n_use == 0:
        raise ValueError(f"sim.cluster.num_gpus={cl.num_gpus}: holds no replica of "
                         f"sim.parallel.pp={par.pp} x sim.parallel.tp_base={par.tp_base}")
    base = PolicyCluster(base_slices, n_use, par.pp, par.tp_base)
    clusters = {p: base for p in CAPACITY_POLICIES}
    for p in SPARE_LAYOUTS:  # the same slices; the planner's order leaves the worst out
        clusters[p] = replace(base, n_slices=int(slice_of.max()) + 1)
    costs = trn.scenario_costs(cfg, dims, hw, tables.parts_s["step_s"], n_use)
    return Context(cfg, dims, hw, tables, n_gpus, slice_of, clusters,
                   blast_sizes(cfg.cluster.domain_size, cfg.cluster.gpus_per_node), costs)


def eval_states(ctx: Context, state: np.ndarray, gpu: np.ndarray, n_states: int
                ) -> dict[str, StateResult]:
    """Every capacity policy of the config on the states given as (state, down GPU) pairs."""
    st, sl, h = degraded_slices(state, gpu, ctx.slice_of, ctx.cfg.parallel.tp_base)
    return {p: evaluate(p, st, sl, h, n_states, ctx.clusters[p], ctx.tables, ctx.cfg.boost)
            for p in ctx.capacities if p in CAPACITY_POLICIES}


def _stats(loss: np.ndarray) -> dict[str, float]:
    return {"mean": float(loss.mean()), "p5": float(np.percentile(loss, 5)),
            "p95": float(np.percentile(loss, 95)),
            "stderr": float(loss.std(ddof=1) / np.sqrt(len(loss))) if len(loss) > 1 else 0.0}


def _domains(ctx: Context, replicas: np.ndarray) -> np.ndarray:
    return -(-replicas * ctx.cfg.parallel.pp // ctx.slices_per_domain)


def static_point(ctx: Context, p: float, shares: dict[str, float], rng: np.random.Generator
                 ) -> dict[str, dict[str, Any]]:
    """One sweep point: ``trials`` independent failure states at failed fraction ``p``."""
    trials = ctx.cfg.trials
    tr, gpu = static_down(p, trials, ctx.n_gpus, shares, ctx.sizes, rng)
    out: dict[str, dict[str, Any]] = {}
    for pol, r in eval_states(ctx, tr, gpu, trials).items():
        spares = _domains(ctx, r.below_pace)
        out[pol] = {**_stats(1.0 - r.throughput),
                    "spare_domains_p95": float(np.percentile(spares, 95)),
                    "spare_domains_mean": float(spares.mean()),
                    "boost_power": float(r.extra_power.mean())}
    return out


def run_sweep(ctx: Context, rng: np.random.Generator, progress: Progress | None = None
              ) -> dict[str, Any]:
    """Failed-fraction sweep (Fig. 6/7 analogues) and blast-radius sensitivity (Fig. 10)."""
    cfg = ctx.cfg
    n = cfg.parallel.tp_base * cfg.parallel.pp
    points = []
    steps = len(cfg.fractions) + 3
    for i, p in enumerate(cfg.fractions):
        res = static_point(ctx, p, cfg.failures.blast.shares(), rng)
        points.append({"fraction": p, "drop_closed_form": 1 - (1 - p) ** n, "policies": res})
        if progress:
            progress("sweep", (i + 1) / steps)
    blast = []
    for j, kind in enumerate(("gpu", "node", "domain")):
        shares = {"gpu": 0.0, "node": 0.0, "domain": 0.0, kind: 1.0}
        blast.append({"kind": kind, "gpus": ctx.sizes[kind], "fraction": cfg.blast_fraction,
                      "policies": static_point(ctx, cfg.blast_fraction, shares, rng)})
        if progress:
            progress("sweep", (len(cfg.fractions) + j + 1) / steps)
    return {"points": points, "blast": blast, "replica_gpus": n}


def timeline_events(ctx: Context, rng: np.random.Generator) -> tuple[Events, int]:
    """Events of every trial (a trace is one deterministic trial)."""
    cfg = ctx.cfg
    hours = cfg.days * 24.0
    if cfg.failures.trace:
        return load_trace(cfg.failures.trace, ctx.n_gpus, ctx.sizes), 1
    ev = poisson_events(cfg.failures, cfg.trials, ctx.n_gpus, hours, ctx.sizes, rng,
                        steady_state=cfg.steady_state)
    return ev, cfg.trials


def _chunk(ev: Events, trials: int, n_steps: int, step_h: float) -> int:
    if len(ev) == 0:
        return trials
    pairs = float(np.sum(np.minimum(ev.end - np.maximum(ev.start, 0), n_steps * step_h)
                         .clip(0) / step_h * ev.size))
    per_trial = max(pairs / trials, 1.0)
    return int(max(1, min(trials, 3e6 // per_trial)))


def _capacity(ctx: Context, ev: Events, trials: int, n_steps: int,
              progress: Progress | None, label: str) -> dict[str, dict[str, np.ndarray]]:
    """Per capacity layout and trial: mean throughput, paused share, peak spares, boost."""
    cfg = ctx.cfg
    acc = {p: {k: np.zeros(trials) for k in ("thr", "paused", "peak", "power")}
           for p in ctx.capacities}
    chunk = _chunk(ev, trials, n_steps, cfg.step_hours)
    for lo in range(0, trials, chunk):
        hi = min(trials, lo + chunk)
        state, gpu = down_at_steps(ev, lo, hi, n_steps, cfg.step_hours)
        for p, r in eval_states(ctx, state, gpu, (hi - lo) * n_steps).items():
            shape = (hi - lo, n_steps)
            acc[p]["thr"][lo:hi] = r.throughput.reshape(shape).mean(axis=1)
            acc[p]["paused"][lo:hi] = (r.below_pace.reshape(shape) > 0).mean(axis=1)
            acc[p]["peak"][lo:hi] = _domains(ctx, r.below_pace.reshape(shape).max(axis=1))
            acc[p]["power"][lo:hi] = r.extra_power.reshape(shape).mean(axis=1)
        if progress:
            progress(label, hi / trials)
    return acc


def batched(ev: Events, hours: float) -> Events:
    """Repairs taken back every ``hours`` (0: at once): each down interval ends at the next
    multiple of ``hours``."""
    if hours <= 0:
        return ev
    return Events(ev.trial, ev.start, np.ceil(ev.end / hours) * hours, ev.lo, ev.size,
                  ev.hardware)


def _loss_rows(ctx: Context, ev: Events, trials: int, hours: float,
               acc: dict[str, dict[str, np.ndarray]], costs: trn.Costs,
               policies: list[str], lost_h: float | None = None) -> dict[str, dict[str, Any]]:
    """throughput_loss, transition_loss, loss, events of every policy (module docstring)."""
    cfg = ctx.cfg
    load = trn.slice_load(ev.trial, ev.lo, ev.size, ev.start, ev.end, ctx.slice_of)
    save = costs.save_fraction if lost_h is None else costs.save_s / (2 * lost_h * 3600.0)
    out: dict[str, dict[str, Any]] = {}
    for p in policies:
        tr = trn.failure_transitions(
            p, ev, load, n_used_slices=ctx.clusters["nutp"].n_use * cfg.parallel.pp,
            num_gpus=cfg.cluster.num_gpus, tp=cfg.parallel.tp_base, best=ctx.tables.best,
            costs=costs, lost_h=lost_h, n_slices=ctx.clusters["nutp+spares"].n_slices)
        thr = np.ones(trials) if p not in CAPACITY_OF else acc[CAPACITY_OF[p]]["thr"]
        stall = trn.stall_fraction(tr, trials, hours, costs.recompute)
        still = np.minimum(1.0, stall + save)
        loss = 1.0 - thr * (1.0 - still)
        out[p] = {**_stats(loss), "mode": MODE_OF[p],
                  "throughput_loss": float((1.0 - thr).mean()),
                  "transition_loss": float((thr * still).mean()),
                  "loss": float(loss.mean()), **trn.event_stats(tr, trials, hours),
                  "_loss": loss, "_still": still}
    return out


def run_timeline(ctx: Context, rng: np.random.Generator, progress: Progress | None = None
                 ) -> dict[str, Any]:
    """Time-stepped simulation of every policy over ``sim.days``, layout changes included."""
    cfg = ctx.cfg
    hours = cfg.days * 24.0
    n_steps = int(np.ceil(hours / cfg.step_hours))
    ev, trials = timeline_events(ctx, rng)
    batches = cfg.transitions.repair_batch_hours
    main_ev = batched(ev, batches[0])
    acc = _capacity(ctx, main_ev, trials, n_steps, progress, "timeline")
    rows = _loss_rows(ctx, main_ev, trials, hours, acc, ctx.costs, list(cfg.policies))
    gpu_hours = cfg.cluster.num_gpus * hours
    out: dict[str, Any] = {}
    per_trial: dict[str, np.ndarray] = {}
    for p, row in rows.items():
        loss, still = row.pop("_loss"), row.pop("_still")
        per_trial[p] = loss
        if p == "stop-wait":
            row.update(rigid_paused=float(still.mean()), spare_domains_zero_pause=None,
                       boost_power=0.0)
        else:
            a = acc[CAPACITY_OF[p]]
            row.update(rigid_paused=float(a["paused"].mean()),
                       spare_domains_zero_pause=float(np.percentile(a["peak"], 95)),
                       boost_power=float(a["power"].mean()))
        idle = (cfg.spare_domains * cfg.cluster.domain_size * hours
                if CAPACITY_OF.get(p) in SPARE_LAYOUTS else 0.0)
        lost = float(loss.mean()) * gpu_hours + idle
        row["gpu_hours_lost"], row["usd_lost"] = lost, lost * ctx.hw.usd_per_gpu_hour
        out[p] = row
    mttf_h = 1.0 / max(cfg.failures.rate * cfg.cluster.num_gpus, 1e-300)
    daly: dict[str, Any] = {"mttf_h": mttf_h, "save_s": ctx.costs.save_s}
    if "nutp-restart" in cfg.policies and ctx.costs.save_s > 0:
        tau = trn.young_daly_interval_s(ctx.costs.save_s, mttf_h * 3600.0)
        d = _loss_rows(ctx, main_ev, trials, hours, acc, ctx.costs, ["nutp-restart"],
                       lost_h=tau / 2 / 3600.0)["nutp-restart"]
        d.pop("_loss"), d.pop("_still")
        daly["interval_h"] = tau / 3600.0
        base = out["nutp-restart"]
        lost = d["loss"] * gpu_hours
        out["nutp-restart@daly"] = {
            **d, **{k: base[k] for k in ("rigid_paused", "spare_domains_zero_pause",
                                         "boost_power")},
            "gpu_hours_lost": lost, "usd_lost": lost * ctx.hw.usd_per_gpu_hour,
            "checkpoint_interval_h": tau / 3600.0}
    res = {"policies": out, "trials": trials, "hours": hours, "steps": n_steps,
           "events": len(ev),
           "mean_failed_fraction": _mean_failed_fraction(ev, trials, cfg.cluster.num_gpus, hours),
           "transitions": ctx.costs.as_dict(), "daly": daly}
    res["repair_batching"] = _batching(ctx, ev, trials, hours, n_steps, per_trial, progress)
    return res


def _batching(ctx: Context, ev: Events, trials: int, hours: float, n_steps: int,
              main: dict[str, np.ndarray], progress: Progress | None) -> dict[str, Any]:
    """Mean loss of every policy for each ``transitions.repair_batch_hours`` entry on the same
    draws: the first ``transitions.repair_batch_trials`` trials (the first entry is the main
    timeline's, restricted to them); the best entry per policy."""
    cfg = ctx.cfg
    batches = list(cfg.transitions.repair_batch_hours)
    n = min(trials, cfg.transitions.repair_batch_trials)
    loss = {p: [float(main[p][:n].mean())] for p in cfg.policies}
    sub = ev.select(ev.trial < n)
    for h in batches[1:]:
        bev = batched(sub, h)
        acc = _capacity(ctx, bev, n, n_steps, progress, f"repairs every {h:g} h")
        for p, r in _loss_rows(ctx, bev, n, hours, acc, ctx.costs, list(cfg.policies)).items():
            loss[p].append(r["loss"])
    best = {p: batches[int(np.argmin(v))] for p, v in loss.items()}
    return {"hours": batches, "trials": n, "loss": loss, "best_hours": best}


def _mean_failed_fraction(ev: Events, trials: int, n_gpus: int, hours: float) -> float:
    """Time-averaged fraction of down GPUs (overlaps counted twice: an upper bound)."""
    m = ev.lo < n_gpus
    down = (np.minimum(ev.end[m], hours) - np.maximum(ev.start[m], 0)).clip(0) * ev.size[m]
    return float(down.sum() / (trials * hours * n_gpus))


def simulate(cfg: SimConfig, *, progress: Progress | None = None, sweep: bool = True,
             timeline: bool = True, directory: Path | None = None) -> dict[str, Any]:
    """Run the scenario; see the module docstring for the result layout."""
    ctx = make_context(cfg, directory=directory)
    rng, tb = np.random.default_rng(cfg.seed), cfg.parallel.tp_base
    out: dict[str, Any] = {
        "schema": "nemo_nutp.sim/2", "config": asdict(cfg), "hardware": asdict(ctx.hw),
        "model": asdict(ctx.dims), "replicas": ctx.clusters["nutp"].n_use,
        "transitions": ctx.costs.as_dict(),
        "step_time": ctx.tables.parts_s,
        "degraded_speed": {str(t): float(1 / ctx.tables.time[:, t].max())
                           for t in range(max(1, tb - 4), tb + 1)},
    }
    sweep_rng, timeline_rng = rng.spawn(2)  # independent streams: either part reproduces alone
    if sweep:
        out["sweep"] = run_sweep(ctx, sweep_rng, progress)
    if timeline:
        out["timeline"] = run_timeline(ctx, timeline_rng, progress)
    (straggler_rng,) = rng.spawn(1)  # a third stream: the two above are unchanged
    if timeline and cfg.stragglers.rate_per_gpu_day > 0:
        from .stragglers import run_stragglers

        out["stragglers"] = run_stragglers(ctx, straggler_rng)
    (link_rng,) = rng.spawn(1)  # a fourth stream: the three above are unchanged
    if timeline and cfg.links.rate_per_gpu_day > 0:
        from .links import run_links

        out["links"] = run_links(ctx, link_rng)
    return out
