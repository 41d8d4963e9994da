"""Stragglers in the goodput simulator: a slow-GPU process and four policies (issue #15).

Process: straggler episodes arrive per GPU as a Poisson process (``sim.stragglers``), each on
one GPU of the job, with a relative speed uniform in ``[min_speed, max_speed]`` and a fixed or
exponential duration. The timeline (``sim.days``, ``sim.step_hours``, steady state as for
failures) is evaluated at step centres on an otherwise healthy cluster: the straggler loss is
reported on its own, next to the failure loss.

Per state, each used slice (replica stage; the fault-free plan's order: replica = slice // pp)
holding stragglers has ``k`` distinct slow GPUs with speeds ``v_1 <= ... <= v_k``. Kept, its
stage time is ``time[stage, tp_base] / v_1``; running at ``d = best[tp_base - j]`` on its
fastest ``d`` GPUs gives ``time[stage, d] / v_(tp_base - d + 1)`` (``v_i`` = 1 for ``i > k``;
inf when no degree is left), as the planner's choice (``layout/plan.py``) does. A replica's time
is the largest of its stages (healthy stages at ``time[:, tp_base]``). Speeds are relative to a
healthy replica. Throughput vs the healthy job, with continuous shares (as the planner's
``capacity``), ``n`` replicas:

* ``ignore``: equal shares; the synchronous step waits for the slowest replica: ``min speed``;
* ``rebalance``: shares follow speed: ``(n - a + sum kept speeds) / n`` over ``a`` affected;
* ``exclude``: per stage the fastest of keeping and excluding its ``j`` slowest GPUs (the
  planner's choice, ``build_plan(...).capacity`` under ``nutp``), rebalanced;
* ``drop``: replicas the stragglers make slower leave (a slow GPU on a stage that is not the
  replica's bottleneck can leave it at full speed).

Layout changes (``transitions.py``): ``exclude`` pays a planned restart (the runtime's path:
stop at the next checkpoint, re-plan, resume) when an episode starts on a slice where excluding
the GPU beats keeping it, and another when it ends; ``exclude-live`` pays planned live
re-layouts instead; ``drop`` pays planned restarts for episodes that slow their replica.
``ignore`` and ``rebalance`` keep the layout (shares change between steps at no cost). The
per-episode decision looks at the episode alone (overlapping episodes on one slice are rare).
Checkpoint saves are charged in the failure timeline, not here. Not modelled: the time to
detect a straggler (minutes of probes vs episodes of hours), the per-step noise rebalancing
smooths over.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import transitions as trn
from .config import StragglerConfig


def episodes(s: Any, trials: int, n_gpus: int, hours: float, lead: float,
             rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Poisson episodes of ``trials`` runs at ``s.rate_per_gpu_day`` per GPU, lasting
    ``s.duration_hours`` (fixed or exponential: ``s.duration_distribution``), each on one GPU:
    trial, start, end (hours), gpu. Stragglers and slow links (``links.py``) alike."""
    counts = rng.poisson(s.rate_per_gpu_day / 24.0 * n_gpus * (hours + lead), size=trials)
    n = int(counts.sum())
    trial = np.repeat(np.arange(trials, dtype=np.int64), counts)
    start = rng.uniform(-lead, hours, size=n)
    dur = (np.full(n, s.duration_hours) if s.duration_distribution == "fixed"
           else rng.exponential(s.duration_hours, size=n))
    gpu = rng.integers(0, n_gpus, size=n, dtype=np.int64)
    return {"trial": trial, "start": start, "end": start + dur, "gpu": gpu}


def straggler_events(s: StragglerConfig, trials: int, n_gpus: int, hours: float, lead: float,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Episodes of ``trials`` runs: trial, start, end (hours), gpu, speed."""
    ev = episodes(s, trials, n_gpus, hours, lead, rng)
    ev["speed"] = rng.uniform(s.min_speed, s.max_speed, size=len(ev["gpu"]))
    return ev


def active_at_steps(ev: dict[str, np.ndarray], n_steps: int, step_h: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(state, event index) of every episode active at a step centre;
    state = trial * n_steps + step."""
    k0 = np.clip(np.ceil(ev["start"] / step_h - 0.5), 0, n_steps).astype(np.int64)
    k1 = np.clip(np.ceil(ev["end"] / step_h - 0.5), 0, n_steps).astype(np.int64)
    n_k = (k1 - k0).clip(0)
    idx = np.repeat(np.arange(len(k0)), n_k)
    off = np.arange(len(idx)) - np.repeat(np.cumsum(n_k) - n_k, n_k)
    return ev["trial"][idx] * n_steps + k0[idx] + off, idx


def _group_starts(key: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]])) if len(key) else key


def evaluate_stragglers(state: np.ndarray, gpu: np.ndarray, speed: np.ndarray, n_states: int,
                        *, slice_of: np.ndarray, n_use: int, pp: int, tp_base: int,
                        time: np.ndarray, best: np.ndarray) -> dict[str, np.ndarray]:
    """Throughput per state under every straggler policy (module docstring)."""
    sl = slice_of[gpu]
    used = (sl >= 0) & (sl < n_use * pp)
    state, gpu, speed, sl = state[used], gpu[used], speed[used], sl[used]
    # one row per (state, gpu): the slowest of overlapping episodes
    order = np.lexsort((speed, gpu, state))
    state, gpu, speed, sl = state[order], gpu[order], speed[order], sl[order]
    first = _group_starts(state * len(slice_of) + gpu)
    state, speed, sl = state[first], speed[first], sl[first]
    # per (state, slice): rows by ascending speed; row j = "exclude the j slower ones"
    order = np.lexsort((speed, sl, state))
    state, speed, sl = state[order], speed[order], sl[order]
    g = _group_starts(state * (n_use * pp) + sl)
    k = np.diff(np.concatenate([g, [len(sl)]])) if len(g) else g
    st, stage, rep, v = state[g], sl[g] % pp, sl[g] // pp, speed[g]
    healthy = float(time[:, tp_base].max())
    t_keep = time[stage, tp_base] / v
    j = np.arange(len(sl)) - np.repeat(g, k)
    d_j = best[tp_base - j]
    e = tp_base - d_j  # GPUs left out: the e slowest
    v_used = np.where(e < np.repeat(k, k), speed[np.minimum(np.repeat(g, k) + e, len(sl) - 1)],
                      1.0)
    t_j = np.where(d_j > 0, time[sl % pp, d_j] / v_used, np.inf)
    d_all = best[np.maximum(tp_base - k, 0)]
    t_all = np.where(d_all > 0, time[stage, d_all], np.inf)
    t_best = np.minimum(np.minimum.reduceat(t_j, g), t_all) if len(g) else t_keep
    r = _group_starts(st * n_use + rep)
    r_state = st[r] if len(r) else st
    s_keep = healthy / np.maximum(np.maximum.reduceat(t_keep, r), healthy) if len(r) else v
    s_best = healthy / np.maximum(np.maximum.reduceat(t_best, r), healthy) if len(r) else v
    a = np.bincount(r_state, minlength=n_states).astype(np.float64)
    low = np.ones(n_states)
    np.minimum.at(low, r_state, s_keep)
    exclude = (n_use - a + np.bincount(r_state, s_best, minlength=n_states)) / n_use
    return {
        "ignore": low,
        "rebalance": (n_use - a + np.bincount(r_state, s_keep, minlength=n_states)) / n_use,
        "exclude": exclude, "exclude-live": exclude,
        "drop": (n_use - np.bincount(r_state, (s_keep < 1.0 - 1e-12).astype(np.float64),
                                      minlength=n_states)) / n_use,
    }


def straggler_transitions(policy: str, ev: dict[str, np.ndarray], *, slice_of: np.ndarray,
                          n_use: int, pp: int, tp_base: int, time: np.ndarray,
                          best: np.ndarray, costs: trn.Costs) -> trn.Transitions:
    """Planned transitions of ``policy``: at the start and the end of each episode that changes
    its layout (module docstring)."""
    if policy not in ("exclude", "exclude-live", "drop"):
        z = np.zeros(0)
        return trn.Transitions(z.astype(np.int64), z, z, z)
    sl = slice_of[ev["gpu"]]
    used = (sl >= 0) & (sl < n_use * pp)
    stage = np.where(used, sl % pp, 0)
    t_keep = time[stage, tp_base] / ev["speed"]
    slows = used & (t_keep > time[:, tp_base].max() * (1 + 1e-12))
    d1 = best[tp_base - 1]
    t_ex = time[stage, d1] if d1 > 0 else np.full(len(sl), np.inf)
    hit = slows & (t_ex < t_keep) if policy != "drop" else slows
    hold = (costs.planned_live_s if policy == "exclude-live" else costs.straggler_restart_s)
    n = int(hit.sum())
    return trn.Transitions(np.concatenate([ev["trial"][hit], ev["trial"][hit]]),
                           np.concatenate([ev["start"][hit], ev["end"][hit]]),
                           np.full(2 * n, hold / 3600.0), np.zeros(2 * n))


def run_stragglers(ctx: Any, rng: np.random.Generator) -> dict[str, Any]:
    """The straggler timeline of every ``sim.stragglers.policies`` entry (trial statistics of
    the time-averaged loss = throughput loss + transition loss, GPU-hours and $ lost)."""
    cfg, s = ctx.cfg, ctx.cfg.stragglers
    hours = cfg.days * 24.0
    n_steps = int(np.ceil(hours / cfg.step_hours))
    lead = s.duration_hours * (1.0 if s.duration_distribution == "fixed" else 5.0) \
        if cfg.steady_state else 0.0
    ev = straggler_events(s, cfg.trials, cfg.cluster.num_gpus, hours, lead, rng)
    state, idx = active_at_steps(ev, n_steps, cfg.step_hours)
    geometry = dict(slice_of=ctx.slice_of, n_use=ctx.clusters["nutp"].n_use, pp=cfg.parallel.pp,
                    tp_base=cfg.parallel.tp_base, time=ctx.tables.time, best=ctx.tables.best)
    thr = evaluate_stragglers(state, ev["gpu"][idx], ev["speed"][idx], cfg.trials * n_steps,
                              **geometry)  # type: ignore[arg-type]
    gpu_hours = cfg.cluster.num_gpus * hours
    out: dict[str, Any] = {}
    for p in s.policies:
        t = thr[p].reshape(cfg.trials, n_steps).mean(axis=1)
        tr = straggler_transitions(p, ev, costs=ctx.costs, **geometry)  # type: ignore[arg-type]
        still = trn.stall_fraction(tr, cfg.trials, hours, ctx.costs.recompute)
        loss = 1.0 - t * (1.0 - still)
        lost = float(loss.mean()) * gpu_hours
        out[p] = {"mean": float(loss.mean()), "p5": float(np.percentile(loss, 5)),
                  "p95": float(np.percentile(loss, 95)),
                  "stderr": float(loss.std(ddof=1) / np.sqrt(len(loss))) if len(loss) > 1
                  else 0.0, "throughput_loss": float((1.0 - t).mean()),
                  "transition_loss": float((t * still).mean()), "loss": float(loss.mean()),
                  **trn.event_stats(tr, cfg.trials, hours),
                  "gpu_hours_lost": lost, "usd_lost": lost * ctx.hw.usd_per_gpu_hour}
    slow = float(len(state)) / (cfg.trials * n_steps * cfg.cluster.num_gpus)
    return {"policies": out, "trials": cfg.trials, "events": len(ev["trial"]),
            "mean_slow_fraction": slow}
