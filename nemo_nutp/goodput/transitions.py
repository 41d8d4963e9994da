"""What changing the layout costs: one mechanism for every timeline and straggler policy.

Contract:
* An *event* changes a policy's layout or not (``changes``): failures (start of a down
  interval, unplanned) and repairs (its end, planned) in the timeline; straggler exclusions and
  returns (planned) in the straggler table. The rule looks at the slice the event hits and how
  many GPUs of that slice other events hold down at that moment: ``nutp``-like layouts change
  when the slice's best degree changes; ``drop`` layouts when the slice turns degraded or whole
  again (a failure inside an already dropped replica changes nothing). Not modelled: failures
  in unused slices (spare domains of ``drop+spares``) and blasts spanning several slices (the
  first slice counts). ``live_spare`` (``nutp-live+spares``) follows its spare pool through
  each trial instead (``spare_transitions``).
* Each change becomes a *transition* ``(trial, t, hold, lost)`` (hours): the job stands still
  for ``hold`` from ``t`` and redoes ``lost`` of work (``Costs``):

  ==============  =================================  ==========================================
  mode            unplanned (failure)                planned (GPU back, straggler)
  ==============  =================================  ==========================================
  ``restart``     detect + restart(N); lost: half a  restart(N) at a save; lost 0
                  checkpoint interval
  ``live``        detect + live; lost: the           live; lost 0
                  in-flight step
  ``stop-wait``   detect + min(down, max_wait) +     (none: the job ran on a hot-swapped GPU)
                  restart(N); lost: half an interval
  ``live_spare``  a spare free: detect + live_spare;  refills the pool (none), or a refilled
                  lost: the in-flight step; else as   spare replaces a degraded slice:
                  ``live``                            live_spare; lost 0
  ==============  =================================  ==========================================

  ``restart(N) = a * N ** k`` fitted in log space to published checkpoint-restart times
  (``transitions.restart_points``); ``live = live_base_s + (pp + tp_base) * live_group_s +
  bytes / live_gbps`` with ``bytes`` a rank's whole new shard of weights (an upper bound on what
  it must receive). ``live_spare = live_base_s + (pp + tp_base) * live_group_s + spare bytes /
  live_gbps`` is a *model*, not a measurement (the standby processes do not exist yet): it
  assumes the spare slice's processes are already started with the model built (warm
  standbys: no process start, no checkpoint read), that joining costs what re-forming the
  communicators of a live re-layout costs (the same groups: the stage's TP group, the
  replica's pipeline groups, the cross-replica sync groups), and that each spare rank
  receives its whole weight shard at ``tp_base`` from the same rank of a peer replica plus
  its optimizer slices (``_state_bytes``) over its own NIC at ``live_gbps``, one NIC the
  bottleneck; ``spare_transitions`` replays the pool per trial. With ``transitions.measured``
  the measured tiny-job numbers replace them, scaled: restart ``transition_s * (N /
  processes_started) ** k`` plus the scenario's checkpoint read at ``storage_gbps``; live
  ``transition_s`` plus the scenario's bytes (live_spare: its own measured kill when the
  benchmark ran the ``live_spare`` path, else the live kill's ``transition_s``
  plus the spare's bytes); detection as measured (does not grow with N); live: (lost +
  recomputed in-flight) steps x the scenario's step time.
* ``stall_fraction``: per trial the union of ``[t, t + hold)`` clipped to the horizon, plus per
  merged block reaching into the horizon the ``lost`` of the transition that opened it (the
  job redoes it after it resumes); ``sim.transitions.recompute='capped'`` (default): at most
  the time the job ran since the previous block (work done since the last resume is all there
  is to lose; a failure during a stall loses nothing more); ``'half_interval'``: always the
  whole ``lost``, the former ``sim.stop_wait`` formula exactly (it charges work the job never
  ran when stalls come closer than half an interval). The save stall ``save_s`` every
  interval comes on top; ``transition_loss = throughput x min(1, stall + save)`` (the time
  standing still is worth what the job would have done then), so ``loss = throughput_loss +
  transition_loss``.
* Monotonicity (tests/goodput/test_transitions.py), 'capped': per draw, raising any
  transition's hold or lost never lowers the stall, and adding transitions whose lost is at
  least every other one's never lowers it (``min(lost, run)`` is subadditive), so
  ``stop-wait`` (every failure a transition, all with the same lost) is monotone in the
  failure rate on coupled (thinned) draws. Not per draw, by the model itself: a planned
  restart saves a checkpoint a later failure would have needed (an extra failure's repair
  can lower the total), and a failure bridging two down periods of a ``drop`` replica
  removes two transitions; these hold for the mean. 'half_interval' is monotone per draw in
  lost only: a longer or an added stall that merges two stalls drops the second one's half
  interval while the union grows by less.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import MODE_OF, SimConfig
from .cost import max_rank_params
from .failures import Events

H = 3600.0


@dataclass(frozen=True)
class Costs:
    """Seconds per transition of each kind in one scenario (module docstring)."""

    detect_s: float
    restart_s: float  # unplanned: detected -> training again
    planned_restart_s: float  # GPU back: stopped at a save -> training again
    straggler_restart_s: float  # straggler exclusion / return
    live_s: float
    planned_live_s: float
    live_lost_s: float  # unplanned live: the in-flight step
    interval_s: float
    save_s: float
    max_wait_s: float | None
    fit: tuple[float, float]  # restart model a, k
    source: str
    recompute: str = "capped"  # sim.transitions.recompute (stall_fraction)
    live_spare_s: float = 0.0  # a spare slice's standby processes take a failed slice's place
    planned_live_spare_s: float = 0.0  # a refilled spare replaces a degraded slice

    @property
    def save_fraction(self) -> float:
        return self.save_s / self.interval_s if self.interval_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"detect_s": self.detect_s, "restart_s": self.restart_s,
                "planned_restart_s": self.planned_restart_s,
                "straggler_restart_s": self.straggler_restart_s, "live_s": self.live_s,
                "planned_live_s": self.planned_live_s, "live_lost_s": self.live_lost_s,
                "checkpoint_interval_s": self.interval_s, "save_s": self.save_s,
                "max_wait_s": self.max_wait_s, "restart_fit": {"a": self.fit[0],
                                                               "k": self.fit[1]},
                "recompute": self.recompute, "live_spare_s": self.live_spare_s,
                "planned_live_spare_s": self.planned_live_spare_s, "source": self.source}


def restart_fit(points: list[Any], exponent: float | None) -> tuple[float, float]:
    """(a, k) of ``seconds = a * gpus ** k``: least squares in log space (k fixed if given)."""
    x = np.log([float(p.gpus) for p in points])
    y = np.log([max(float(p.seconds), 1e-12) for p in points])
    if exponent is None:
        k = float(np.polyfit(x, y, 1)[0])
    else:
        k = float(exponent)
    a = float(np.exp(np.mean(y - k * x)))
    if all(float(p.seconds) == 0 for p in points):
        a = 0.0
    return a, k


def _state_bytes(cfg: SimConfig, dims: Any, n_replicas: int) -> tuple[float, float, float]:
    """(checkpoint bytes the whole job reads in a restart, weight bytes a rank of a shrinking
    stage receives at most in a live re-layout, bytes a spare rank receives to take a failed
    rank's place: its whole weight shard at ``tp_base`` from the same rank of a peer replica,
    plus its distributed-optimizer slices, 1/``n_replicas`` of the shard, twice: the dead
    rank's primary from the neighbour holding its copy and the copy it keeps in turn,
    ``recovery.live_redundancy``, docs/live.md)."""
    t, layers = cfg.transitions, dims.num_layers // cfg.parallel.pp
    tb, pp = cfg.parallel.tp_base, cfg.parallel.pp
    stage_params = [max_rank_params(dims, tb, layers, s == pp - 1) * tb for s in range(pp)]
    total = float(sum(stage_params))
    read = t.weight_bytes * total * n_replicas + t.optimizer_bytes * total
    new = max(1, tb - 1)
    live = max(t.weight_bytes * max_rank_params(dims, new, layers, s == pp - 1)
               for s in range(pp))
    per_param = t.weight_bytes + 2.0 * t.optimizer_bytes / max(1, n_replicas)
    spare = max(per_param * max_rank_params(dims, tb, layers, s == pp - 1) for s in range(pp))
    return read, float(live), float(spare)


def scenario_costs(cfg: SimConfig, dims: Any, hw: Any, step_s: float, n_replicas: int
                   ) -> Costs:
    """The transition costs of a scenario (published calibration or measured, scaled)."""
    t = cfg.transitions
    a, k = restart_fit(t.restart_points, t.restart_exponent)
    if t.calibration == "warm_standby":
        a, _ = restart_fit(t.warm_standby_points, k)
    n = float(cfg.cluster.num_gpus)
    restart = a * n ** k
    read_bytes, live_bytes, spare_bytes = _state_bytes(cfg, dims, n_replicas)
    bw = (t.live_gbps or hw.network_gbps) * 1e9
    groups = cfg.parallel.pp + cfg.parallel.tp_base
    live = t.live_base_s + groups * t.live_group_s + live_bytes / bw
    relayout = t.live_base_s + groups * t.live_group_s  # the live path less its bytes
    live_lost = t.live_lost_steps * step_s
    det, planned, strag, planned_live = t.detect_s, restart, restart, live
    source = f"published fit ({t.calibration})"
    if t.measured:
        r, lv = (_read_measured(t.measured).get(x, {}) for x in ("restart", "live"))
        load = read_bytes / (t.storage_gbps * 1e9)

        def scaled(e: dict[str, Any]) -> float:
            procs = max(1, int(e["processes_started"]))
            return float(e["transition_s"]) * (n / procs) ** k + load

        if "kill" in r:
            det, restart = float(r["kill"]["detect_s"]), scaled(r["kill"])
        planned = scaled(r["gpu_back"]) if "gpu_back" in r else restart
        strag = scaled(r["straggler"]) if "straggler" in r else planned
        if "kill" in lv:
            relayout = float(lv["kill"]["transition_s"])
            live = relayout + live_bytes / bw
            lk = lv["kill"]  # measured, not the setting: committed steps lost (0 on the live
            # path) + the in-flight steps it discarded and redid (recomputed_steps)
            live_lost = (float(lk["lost_steps"]) + float(lk.get("recomputed_steps", 0))) * step_s
            det = det if "kill" in r else float(lv["kill"]["detect_s"])
        planned_live = (float(lv["gpu_back"]["transition_s"]) + live_bytes / bw
                        if "gpu_back" in lv else live)
        source = f"measured {t.measured} (scaled)"
    spare = relayout + spare_bytes / bw  # the spare's ranks receive a whole shard
    if t.measured:  # benchmarks/transition_cost.py's live_spare path, when it ran
        sp = _read_measured(t.measured).get("live_spare", {})
        if "kill" in sp:
            spare = float(sp["kill"]["transition_s"]) + spare_bytes / bw
    return Costs(detect_s=det, restart_s=restart, planned_restart_s=planned,
                 straggler_restart_s=strag, live_s=live, planned_live_s=planned_live,
                 live_lost_s=live_lost, interval_s=t.checkpoint_interval_hours * H,
                 save_s=t.save_s,
                 max_wait_s=None if t.max_wait_hours is None else t.max_wait_hours * H,
                 fit=(a, k), source=source, recompute=t.recompute, live_spare_s=spare,
                 planned_live_spare_s=spare)


def _read_measured(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sim.transitions.measured={path!r}: file not found")
    try:
        data = json.loads(p.read_text())
        paths = data["paths"]
        for evs in paths.values():
            for entry in evs.values():
                for key in ("detect_s", "transition_s", "lost_steps", "processes_started"):
                    float(entry[key])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"sim.transitions.measured={path!r}: not a transitions.json of "
                         f"benchmarks/transition_cost.py ({e!r})") from None
    return dict(paths)


# ------------------------------------------------------------------ which events change layouts

@dataclass(frozen=True)
class SliceLoad:
    """Per event: its slice (-1: none) and the GPUs other events hold down in that slice at
    its start and at its end."""

    slice: np.ndarray
    at_start: np.ndarray
    at_end: np.ndarray


def slice_load(trial: np.ndarray, lo: np.ndarray, size: np.ndarray, start: np.ndarray,
               end: np.ndarray, slice_of: np.ndarray) -> SliceLoad:
    sl = slice_of[lo]
    n = len(sl)
    d0, d1 = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if n == 0:
        return SliceLoad(sl, d0, d1)
    n_sl = int(slice_of.max()) + 2
    key = trial * n_sl + (sl + 1)
    order = np.argsort(key, kind="stable")
    k = key[order]
    first = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
    cnt = np.diff(np.concatenate([first, [n]]))
    group = np.repeat(np.arange(len(first)), cnt)
    multi = cnt[group] > 1
    pos = np.flatnonzero(multi)  # positions (in sorted order) sharing a slice with others
    if len(pos):
        c = cnt[group[pos]]
        i = np.repeat(pos, c)
        j = np.repeat(first[group[pos]], c) + (np.arange(len(i)) - np.repeat(np.cumsum(c) - c, c))
        other = i != j
        i, j = order[i[other]], order[j[other]]
        act0 = (start[j] <= start[i]) & (start[i] < end[j])
        act1 = (start[j] <= end[i]) & (end[i] < end[j])
        np.add.at(d0, i, size[j] * act0)
        np.add.at(d1, i, size[j] * act1)
    return SliceLoad(sl, d0, d1)


def changes(capacity: str, before: np.ndarray, after: np.ndarray, best: np.ndarray, tp: int
            ) -> np.ndarray:
    """Does going from ``before`` to ``after`` healthy GPUs in a slice change the layout?"""
    before, after = np.clip(before, 0, tp), np.clip(after, 0, tp)
    if capacity in ("drop", "drop+spares"):
        return (before == tp) != (after == tp)
    return np.asarray(best[before] != best[after])


@dataclass(frozen=True)
class Transitions:
    trial: np.ndarray
    t: np.ndarray  # hours
    hold: np.ndarray  # hours standing still
    lost: np.ndarray  # hours recomputed

    @staticmethod
    def concat(parts: list[Transitions]) -> Transitions:
        return Transitions(*(np.concatenate([getattr(p, f) for p in parts])
                             for f in ("trial", "t", "hold", "lost")))


def failure_transitions(policy: str, ev: Events, load: SliceLoad, *, n_used_slices: int,
                        num_gpus: int, tp: int, best: np.ndarray, costs: Costs,
                        lost_h: float | None = None, n_slices: int | None = None
                        ) -> Transitions:
    """The transitions of ``policy`` for the failure timeline (failures and repairs).
    ``n_slices``: every slice, spare domains included (``live_spare``; default: the used)."""
    mode = MODE_OF[policy]
    if mode == "live_spare":
        return spare_transitions(ev, load.slice, n_used_slices=n_used_slices,
                                 n_slices=n_used_slices if n_slices is None else n_slices,
                                 tp=tp, best=best, costs=costs)
    lost_unplanned = costs.interval_s / 2 / H if lost_h is None else lost_h
    if mode == "stop-wait":
        m = ev.lo < num_gpus
        down = ev.end[m] - ev.start[m]
        wait = down if costs.max_wait_s is None else np.minimum(down, costs.max_wait_s / H)
        hold = (costs.detect_s + costs.restart_s) / H + wait
        return Transitions(ev.trial[m], ev.start[m], hold, np.full(m.sum(), lost_unplanned))
    from .config import CAPACITY_OF

    cap = CAPACITY_OF[policy]
    used = (load.slice >= 0) & (load.slice < n_used_slices)
    fail = used & changes(cap, tp - load.at_start, tp - load.at_start - ev.size, best, tp)
    back = used & changes(cap, tp - load.at_end - ev.size, tp - load.at_end, best, tp)
    if mode == "restart":
        f_hold, f_lost, b_hold = costs.detect_s + costs.restart_s, lost_unplanned * H, \
            costs.planned_restart_s
    else:
        f_hold, f_lost, b_hold = costs.detect_s + costs.live_s, costs.live_lost_s, \
            costs.planned_live_s
    nf, nb = int(fail.sum()), int(back.sum())
    return Transitions(np.concatenate([ev.trial[fail], ev.trial[back]]),
                       np.concatenate([ev.start[fail], ev.end[back]]),
                       np.concatenate([np.full(nf, f_hold / H), np.full(nb, b_hold / H)]),
                       np.concatenate([np.full(nf, f_lost / H), np.zeros(nb)]))


def _swap(spare: int, worn: int, pool: set[int], free: set[int], degraded: set[int]) -> None:
    """Whole spare slice ``spare`` goes into service; running slice ``worn`` goes to the pool."""
    free.discard(spare)
    pool.discard(spare)
    pool.add(worn)
    degraded.discard(worn)


def spare_transitions(ev: Events, slices: np.ndarray, *, n_used_slices: int, n_slices: int,
                      tp: int, best: np.ndarray, costs: Costs) -> Transitions:
    """``live_spare`` (``nutp-live+spares``): the pool is every slice the job does not run
    (the spare domains, ``[n_used_slices, n_slices)`` at the start); a trial's events are
    replayed in time order (a repair before a failure at the same instant):

    * a failure in a pool slice: no transition (it only leaves the pool while down);
    * a failure in a running slice while a pool slice is whole: that slice's standby
      processes take the failed slice's place, live (unplanned ``live_spare_s``: detection +
      ``live_spare_s``, the in-flight step redone); the failed slice goes to the pool; the
      replica is back at full TP;
    * no whole pool slice: ``nutp-live`` (a live transition when the slice's best degree
      changes; the slice runs degraded);
    * a repair in a pool slice that makes it whole refills the pool: no transition, unless a
      running slice is degraded: then the refilled slice replaces the worst of them at once
      (planned ``planned_live_spare_s``, nothing redone);
    * a repair in a running (degraded) slice: planned live when its best degree changes.

    The swap unit is a TP slice (``tp_base`` GPUs in one scale-up domain: a TP group never
    leaves its NVLink domain), so a spare domain gives ``domain_size // tp_base`` swaps; with
    ``tp_base == domain_size`` (every shipped scenario) a failed stage takes a whole spare
    domain. As in ``failure_transitions``, a blast spanning several slices counts for its first
    slice. The capacity (``nutp+spares``) is the planner's healthiest-first choice; it equals
    this replay's slice choice except when a pool slice partly repaired is healthier than a
    degraded running one (no swap modelled: only whole slices are swapped in)."""
    ok = slices >= 0
    trial = np.concatenate([ev.trial[ok], ev.trial[ok]])
    t = np.concatenate([ev.start[ok], ev.end[ok]])
    kind = np.concatenate([np.ones(int(ok.sum()), np.int64), np.zeros(int(ok.sum()), np.int64)])
    sl = np.concatenate([slices[ok], slices[ok]])
    size = np.concatenate([ev.size[ok], ev.size[ok]])
    order = np.lexsort((kind, t, trial))  # per trial in time; repairs (kind 0) first
    out: list[tuple[int, float, int]] = []  # (trial, t, kind): 0 failure live, 1 failure
    # with a spare, 2 repair live, 3 repair refilling a spare into a degraded slice
    best_l = [int(b) for b in best]
    prev = -1
    down: dict[int, int] = {}
    pool: set[int] = set()
    free: set[int] = set()
    degraded: set[int] = set()  # running slices with a GPU down
    for tr, when, fails, s, k in zip(trial[order].tolist(), t[order].tolist(),
                                     kind[order].tolist(), sl[order].tolist(),
                                     size[order].tolist(), strict=True):
        if tr != prev:
            prev, down, degraded = tr, {}, set()
            pool = set(range(n_used_slices, n_slices))
            free = set(pool)
        before = down.get(s, 0)
        after = before + k if fails else before - k
        down[s] = after
        h0, h1 = max(0, tp - before), max(0, tp - after)
        if s in pool:
            if fails:
                free.discard(s)
            elif after == 0:
                free.add(s)
                if degraded:  # the refilled spare replaces the worst degraded slice
                    _swap(s, max(degraded, key=lambda x: (down[x], -x)), pool, free, degraded)
                    out.append((tr, when, 3))
            continue
        if fails and free:  # a running slice fails while a spare is whole: swap it in
            _swap(min(free), s, pool, free, degraded)
            out.append((tr, when, 1))
            continue
        if after > 0:
            degraded.add(s)
        else:
            degraded.discard(s)
        if best_l[h0] != best_l[h1]:
            out.append((tr, when, 0 if fails else 2))
    rows = np.array(out, dtype=np.float64).reshape(-1, 3)
    kinds = rows[:, 2].astype(np.int64)
    hold = np.array([costs.detect_s + costs.live_s, costs.detect_s + costs.live_spare_s,
                     costs.planned_live_s, costs.planned_live_spare_s]) / H
    lost = np.array([costs.live_lost_s, costs.live_lost_s, 0.0, 0.0]) / H
    return Transitions(rows[:, 0].astype(np.int64), rows[:, 1], hold[kinds], lost[kinds])


def stall_fraction(tr: Transitions, trials: int, hours: float, recompute: str = "capped"
                   ) -> np.ndarray:
    """Per trial: fraction of the horizon standing still or recomputing (module docstring).
    Transitions before the horizon merge like any other (they end the previous run of the
    job) but only their part inside it counts. A merged block recomputes the ``lost`` of the
    transition that opened it when the block reaches into the horizon (the job redoes that
    work after it resumes); ``recompute='capped'``: at most the time the job ran since the
    previous block, ``'half_interval'``: the whole ``lost`` (the former stop-wait formula)."""
    keep = tr.t < hours
    trial, s, lost = tr.trial[keep], tr.t[keep], tr.lost[keep]
    e = s + tr.hold[keep]
    if len(trial) == 0:
        return np.zeros(trials)
    order = np.lexsort((s, trial))
    trial, s, e, lost = trial[order], s[order], e[order], lost[order]
    lo = float(min(s.min(), 0.0))
    off = trial * (4.0 * (float(e.max()) - lo + 1.0)) - lo  # trials apart, same rounding
    run_end = np.maximum.accumulate(e + off)  # on both sides: touching spans stay merged
    new_trial = np.concatenate([[True], trial[1:] != trial[:-1]])
    new_block = new_trial | (s + off > np.concatenate([[-np.inf], run_end[:-1]]))
    block_id = np.cumsum(new_block) - 1
    b_end = np.full(int(block_id[-1]) + 1, -np.inf)
    np.maximum.at(b_end, block_id, e)  # exact (the offsets round)
    b_trial, b_start = trial[new_block], s[new_block]
    b_prev = np.where(new_trial[new_block], -np.inf, np.concatenate([[-np.inf], b_end[:-1]]))
    inside = np.clip(b_end, 0, hours) - np.clip(b_start, 0, hours)
    redo = lost[new_block]
    if recompute == "capped":
        redo = np.minimum(redo, b_start - b_prev)
    elif recompute != "half_interval":
        raise ValueError(f"sim.transitions.recompute={recompute!r}: must be 'capped' or "
                         "'half_interval'")
    reaches = (b_start >= 0) | (b_end > 0)  # into the horizon (a zero hold inside counts)
    paused = np.bincount(b_trial, weights=inside + np.where(reaches, redo, 0.0),
                         minlength=trials)
    return np.minimum(paused / hours, 1.0)


def event_stats(tr: Transitions, trials: int, hours: float) -> dict[str, float]:
    """Transitions per day inside the horizon and their mean cost (hold + lost, seconds)."""
    inside = (tr.t >= 0) & (tr.t < hours)
    n = int(inside.sum())
    return {"events_per_day": n / trials / (hours / 24.0),
            "mean_event_s": float((tr.hold[inside] + tr.lost[inside]).mean() * H) if n else 0.0}


def young_daly_interval_s(save_s: float, mttf_s: float) -> float:
    """Young's first-order optimal checkpoint interval sqrt(2 * save * MTTF)."""
    return float(np.sqrt(2.0 * save_s * mttf_s))
