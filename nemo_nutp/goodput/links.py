"""Link fail-slow events in the goodput simulator: a slow scale-out NIC and five policies
(issue #36, item 5).

Process (``sim.links``): episodes arrive per GPU as a Poisson process, each slowing one GPU's
scale-out NIC by a bandwidth divisor ``s`` uniform in ``[min_slowdown, max_slowdown]`` for a
fixed or exponential duration; ``detect_s`` after its start the link is localised, and only then
does a policy act (before that every policy runs as ``ignore``). Calibration, with sources:
``configs/sim/paper_32k.yaml`` and docs/simulator.md. The loss is reported on its own, next to
the failure and straggler losses, on an otherwise healthy cluster.

Step time (``cost.py``, times relative to the fault-free step): stage ``k``'s fault-free time
``time[k, tp_base]`` holds the exposed part ``(1 - dp_overlap) x sync[k]`` of its ring
all-reduce ``sync[k]`` over the scale-out network. A NIC ``s`` times slower stretches that
ring (a ring runs at its slowest link) to ``s x sync[k]``, and every replica waits for it at
the reduction: the whole job's step becomes ``max(1, time[k, tp_base] + (s - 1) x sync[k])``
(the backward window that hid ``dp_overlap`` of the sync does not grow: the extra is exposed).

* ``ignore``: that step for the whole episode.
* ``rebalance`` (micro-batch re-split): shares follow replica speed, which fixes a slow
  replica's compute or pipeline part; it cannot fix this one: every replica holds the same
  gradient bytes and waits at the same reduction, so it loses what ``ignore`` loses (a slow
  pipeline send/recv over the NIC is not in the cost model).
* ``sync-relayout`` (NIC-aware ownership): the slow GPU's cross-replica units move to its
  ``tp_base - 1`` TP peers over NVLink; the math stays the same. Their NICs carry
  ``tp/(tp-1)`` of their bytes; the NVLink hop (the slow GPU's gradient shard out, the reduced
  shard back: ``reshard[k]``) is pipelined with the ring, bucket by bucket. Step:
  ``time[k, tp_base] + max(tp/(tp-1) x sync[k], reshard[k]) - sync[k]``. Applied when it beats
  keeping the link, with a planned live re-layout when the episode is localised and another
  when it ends (the full ``planned_live_s``: an upper bound, only ownership moves).
* ``exclude``: the replica runs stage ``k`` without the GPU at ``best[tp_base - 1]`` (a degraded
  replica, as for stragglers; shares rebalanced). Its ``tp - 1`` NICs carry the same
  ``tp/(tp-1)`` of the (uniform-layout) sync as ``sync-relayout``'s, which every replica waits
  for; the replica's own time ``T_r`` (its slowest stage, stage ``k``'s sync growth at the
  lower degree taken out: it is in the job-wide term; at least the healthy step) costs its
  share: throughput
  ``1 / T_rl x (n - 1 + 1 / T_r) / n``. When it beats keeping the link, a planned live
  re-layout out and one back.
* ``restart``: a planned checkpoint-restart (``straggler_restart_s``) when the episode is
  localised, after which the job runs on healthy links (the restart leaves the bad link).

Loss per trial: every episode's slow time inside the horizon weighted by its throughput loss,
summed (episodes that overlap in time are charged as if apart: an upper bound, small at rates
where they rarely meet); transitions stand still as for stragglers (``transitions.py``):
``loss = 1 - (1 - throughput loss) x (1 - stall fraction)``. ``cost.mode=compute`` has no DP
sync, so no link loss. Not modelled: a slow NVLink, partial moves (the slow NIC keeping part of
its units), the wait for the next save before a planned restart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import transitions as trn
from .config import LinkConfig
from .cost import CostModel
from .stragglers import episodes


def link_events(s: LinkConfig, trials: int, n_gpus: int, hours: float, lead: float,
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Episodes of ``trials`` runs: trial, start, end (hours), gpu, slowdown."""
    ev = episodes(s, trials, n_gpus, hours, lead, rng)
    ev["slowdown"] = rng.uniform(s.min_slowdown, s.max_slowdown, size=len(ev["gpu"]))
    return ev


def link_step_times(ev: dict[str, np.ndarray], *, slice_of: np.ndarray, n_use: int, pp: int,
                    tp_base: int, time: np.ndarray, best: np.ndarray, sync: np.ndarray,
                    reshard: np.ndarray, sync_d1: np.ndarray, dp_overlap: float
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per episode, the job's relative throughput under each policy once it is localised
    (``ignore``'s is every policy's before), and whether the policy changes the layout for it
    (module docstring). Per stage, relative to the fault-free step: ``sync`` the DP ring
    all-reduce at ``tp_base``, ``sync_d1`` at ``best[tp_base - 1]``, ``reshard`` the NVLink move
    of one rank's gradient shard (out and back)."""
    sl = slice_of[ev["gpu"]]
    used = (sl >= 0) & (sl < n_use * pp)
    k = np.where(used, sl % pp, 0)
    healthy = float(time[:, tp_base].max())
    base = time[k, tp_base]
    t_ign = np.where(used, np.maximum(healthy, base + (ev["slowdown"] - 1.0) * sync[k]), healthy)
    if tp_base > 1:  # the tp - 1 peers' NICs carry tp/(tp-1); the NVLink hop pipelined with it
        t_rl = np.maximum(healthy, base + np.maximum(sync[k] * tp_base / (tp_base - 1),
                                                     reshard[k]) - sync[k])
    else:
        t_rl = np.full(len(k), np.inf)
    relayout = used & (t_rl < t_ign)
    d1 = int(best[tp_base - 1])
    others = np.array([time[np.arange(pp) != j, tp_base].max(initial=0.0) for j in range(pp)])
    if d1 > 0:  # the replica's own sync at d1 is the job-wide one above (t_rl), not its own
        t_rep = np.maximum(np.maximum(healthy, others[k]),  # never faster than the others
                           time[k, d1] - (1 - dp_overlap) * (sync_d1[k] - sync[k]))
        thr_ex = healthy / t_rl * (n_use - 1 + healthy / t_rep) / n_use
    else:
        thr_ex = np.full(len(k), (n_use - 1) / n_use)
    thr_ign = healthy / t_ign
    exclude = used & (thr_ex > thr_ign)
    thr = {"ignore": thr_ign, "rebalance": thr_ign,
           "sync-relayout": np.where(relayout, healthy / t_rl, thr_ign),
           "exclude": np.where(exclude, thr_ex, thr_ign), "restart": np.ones(len(k))}
    keep = np.zeros(len(k), bool)
    changes = {"ignore": keep, "rebalance": keep, "sync-relayout": relayout, "exclude": exclude,
               "restart": used & (t_ign > healthy * (1 + 1e-12))}
    return thr, changes


def link_loss(policy: str, ev: dict[str, np.ndarray], thr: dict[str, np.ndarray],
              changes: dict[str, np.ndarray], *, detect_h: float, trials: int, hours: float,
              costs: trn.Costs) -> tuple[np.ndarray, trn.Transitions]:
    """Per trial throughput loss of ``policy`` (slow time x loss, summed over episodes) and
    its planned transitions (module docstring)."""
    t_det = np.minimum(ev["start"] + detect_h, ev["end"])

    def inside(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (np.clip(b, 0, hours) - np.clip(a, 0, hours)).clip(0)

    lost = (inside(ev["start"], t_det) * (1.0 - thr["ignore"])
            + inside(t_det, ev["end"]) * (1.0 - thr[policy]))
    per_trial = np.bincount(ev["trial"], lost, minlength=trials) / hours
    hit = changes[policy] & (ev["end"] > t_det)  # localised before it ended
    if policy == "restart":
        t, hold = t_det[hit], np.full(int(hit.sum()), costs.straggler_restart_s / 3600.0)
        trial = ev["trial"][hit]
    else:
        t = np.concatenate([t_det[hit], ev["end"][hit]])
        hold = np.full(len(t), costs.planned_live_s / 3600.0)
        trial = np.concatenate([ev["trial"][hit], ev["trial"][hit]])
    return np.minimum(per_trial, 1.0), trn.Transitions(trial, t, hold, np.zeros(len(t)))


def sync_tables(ctx: Any) -> dict[str, np.ndarray]:
    """Per stage, relative to the fault-free step: ``sync`` (the DP ring all-reduce at
    ``tp_base``), ``sync_d1`` (at ``best[tp_base - 1]``), ``reshard`` (one rank's gradient shard
    over NVLink, out and back)."""
    cfg = ctx.cfg
    step = ctx.tables.parts_s["step_s"]
    z = np.zeros(cfg.parallel.pp)
    if cfg.cost.mode == "compute":
        return {"sync": z, "sync_d1": z, "reshard": z}
    model = CostModel(cfg, ctx.dims, ctx.hw)
    parts = [model.sync(k, cfg.parallel.tp_base) for k in range(cfg.parallel.pp)]
    d1 = int(ctx.tables.best[cfg.parallel.tp_base - 1])
    return {"sync": np.array([p[0] for p in parts]) / step,
            "sync_d1": (np.array([model.sync(k, d1)[0] for k in range(cfg.parallel.pp)]) / step
                        if d1 > 0 else z),
            "reshard": np.array([2.0 * p[1] / (ctx.hw.nvlink_gbps * 1e9) for p in parts]) / step}


def run_links(ctx: Any, rng: np.random.Generator) -> dict[str, Any]:
    """The link fail-slow timeline of every ``sim.links.policies`` entry (trial statistics of
    the time-averaged loss = throughput loss + transition loss, GPU-hours and $ lost)."""
    cfg, s = ctx.cfg, ctx.cfg.links
    hours = cfg.days * 24.0
    lead = s.duration_hours * (1.0 if s.duration_distribution == "fixed" else 5.0) \
        if cfg.steady_state else 0.0
    ev = link_events(s, cfg.trials, cfg.cluster.num_gpus, hours, lead, rng)
    sync = sync_tables(ctx)
    thr, changes = link_step_times(ev, slice_of=ctx.slice_of, n_use=ctx.clusters["nutp"].n_use,
                                   pp=cfg.parallel.pp, tp_base=cfg.parallel.tp_base,
                                   time=ctx.tables.time, best=ctx.tables.best,
                                   dp_overlap=cfg.cost.dp_overlap, **sync)
    gpu_hours = cfg.cluster.num_gpus * hours
    out: dict[str, Any] = {}
    for p in s.policies:
        thr_loss, tr = link_loss(p, ev, thr, changes, detect_h=s.detect_s / 3600.0,
                                 trials=cfg.trials, hours=hours, costs=ctx.costs)
        t = 1.0 - thr_loss
        still = trn.stall_fraction(tr, cfg.trials, hours, ctx.costs.recompute)
        loss = 1.0 - t * (1.0 - still)
        lost = float(loss.mean()) * gpu_hours
        out[p] = {"mean": float(loss.mean()), "p5": float(np.percentile(loss, 5)),
                  "p95": float(np.percentile(loss, 95)),
                  "stderr": float(loss.std(ddof=1) / np.sqrt(len(loss))) if len(loss) > 1
                  else 0.0, "throughput_loss": float(thr_loss.mean()),
                  "transition_loss": float((t * still).mean()), "loss": float(loss.mean()),
                  **trn.event_stats(tr, cfg.trials, hours),
                  "gpu_hours_lost": lost, "usd_lost": lost * ctx.hw.usd_per_gpu_hour}
    slow_h = (np.minimum(ev["end"], hours) - np.maximum(ev["start"], 0.0)).clip(0).sum()
    return {"policies": out, "trials": cfg.trials, "events": len(ev["trial"]),
            "mean_slow_links": float(slow_h / (cfg.trials * hours)),
            "sync_s": float(sync["sync"].max() * ctx.tables.parts_s["step_s"])}
