"""Vectorised throughput of many failure states under each policy (planner semantics).

A *state* is a set of down GPUs (one trial at one time step, or one static draw). The input is
the list of *degraded slices* of all states: ``(state, slice, healthy GPUs)``, sorted by state.
For each policy this module reproduces what ``layout.plan.build_plan`` would do for that state,
without building plans:

* slices are ordered healthiest first (ties by slice index) and the first ``n_use * pp`` form
  the replicas, ``pp`` consecutive slices per replica, stage = position mod pp; so the worst
  slices become the unused ones (spares of ``drop+spares`` and ``nutp+spares``) and degraded
  stages share replicas;
* ``nutp``: each stage at ``best[healthy]``; a replica with a stage at degree 0 is dropped;
  ``nutp+spares`` is ``nutp`` on the cluster with the spare domains (a degraded slice runs only
  when no healthy slice is left over for it);
* ``drop``: any replica with a degraded stage is dropped;
* ``uniform-reduce``: every live degraded replica runs all stages at the smallest degree found
  among the degraded replicas of that state;
* ``nutp+boost``: ``nutp``, then a degraded replica's GPUs raise power until the compute part
  of its bottleneck stage keeps pace (speed 1) or the power cap is hit.

Contract: ``throughput`` is the planner's continuous ``capacity`` (sum of replica speeds /
``n_use``, no benching of slow replicas; with ``cost.mode='compute'`` it equals
``build_plan(...).capacity`` whenever the plan benches nobody). ``below_pace`` counts live
replicas slower than a healthy one plus dropped ones: the replicas a rigid job (fixed global
batch, uniform shares, fault-free step time) would have to replace by spares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import BoostConfig
from .cost import StageTables, boost_gain, boost_power

_EPS = 1e-9


@dataclass(frozen=True)
class PolicyCluster:
    """The slices a policy's cluster has and how many replicas it runs."""

    n_slices: int
    n_use: int
    pp: int
    tp_base: int


@dataclass(frozen=True)
class StateResult:
    throughput: np.ndarray  # (n_states,) vs the fault-free n_use replicas
    below_pace: np.ndarray  # (n_states,) replicas a rigid job would need to replace
    extra_power: np.ndarray  # (n_states,) boost power over TDP, fraction of the used GPUs' TDP


def slice_map(n_gpus: int, domain_size: int, tp_base: int) -> np.ndarray:
    """slice_of[g]: TP slice of GPU g (planner order), -1 for GPUs in no slice."""
    g = np.arange(n_gpus, dtype=np.int64)
    dom, off = g // domain_size, g % domain_size
    dom_len = np.minimum(domain_size, n_gpus - dom * domain_size)
    per_dom = domain_size // tp_base
    slices_before = dom * per_dom
    in_slice = off < (dom_len // tp_base) * tp_base
    return np.where(in_slice, slices_before + off // tp_base, -1)


def degraded_slices(state: np.ndarray, gpu: np.ndarray, slice_of: np.ndarray, tp_base: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(state, slice, healthy) of every slice with a down GPU; duplicates GPUs counted once."""
    n = len(slice_of)
    key = np.sort(state.astype(np.int64) * n + gpu)  # np.unique hashes first: slower here
    key = key[np.concatenate([[True], key[1:] != key[:-1]])] if len(key) else key
    st, sl = key // n, slice_of[key % n]
    keep = sl >= 0
    st, sl = st[keep], sl[keep]
    if len(st) == 0:
        return st, sl, sl.copy()
    n_sl = int(slice_of.max()) + 1
    key2 = st * n_sl + sl  # sorted: slice_of is non-decreasing on slice GPUs
    first = np.flatnonzero(np.concatenate([[True], key2[1:] != key2[:-1]]))
    counts = np.diff(np.concatenate([first, [len(key2)]]))
    return st[first], sl[first], tp_base - counts


def _order(st: np.ndarray, h: np.ndarray, n_states: int, c: PolicyCluster
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Used degraded entries: (state, healthy, stage, group start indices)."""
    m = np.bincount(st, minlength=n_states)
    cap = c.n_use * c.pp
    if c.pp == 1 and cap == c.n_slices:  # every slice is its own replica: no ordering needed
        return st, h, np.zeros(len(st), np.int64), np.arange(len(st))
    order = np.lexsort((c.tp_base - h, st))
    st, h = st[order], h[order]
    rank = np.arange(len(st)) - (np.cumsum(m) - m)[st]
    pos = (c.n_slices - m)[st] + rank
    used = pos < cap
    st, h, pos = st[used], h[used], pos[used]
    if len(st) == 0:
        return st, h, pos, pos
    gkey = st * c.n_use + pos // c.pp
    starts = np.flatnonzero(np.concatenate([[True], gkey[1:] != gkey[:-1]]))
    return st, h, pos % c.pp, starts


def _reduce(fn: np.ufunc, values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    if len(values) == 0:
        return values
    return fn.reduceat(values, starts)


def evaluate(policy: str, st: np.ndarray, sl: np.ndarray, h: np.ndarray, n_states: int,
             c: PolicyCluster, tab: StageTables, boost: BoostConfig) -> StateResult:
    """Per-state throughput, below-pace replicas and boost power for one capacity policy."""
    mask = sl < c.n_slices
    st, h, stage, starts = _order(st[mask], h[mask], n_states, c)
    deg = tab.best[h]
    time = tab.time[stage, deg]
    tb_time = tab.time[:, c.tp_base]
    pref = np.concatenate([[0.0], np.maximum.accumulate(tb_time)])  # healthy stages < s0
    s0 = stage[starts] if len(starts) else starts
    g_state = st[starts] if len(starts) else starts
    g_time = np.maximum(_reduce(np.maximum, time, starts), pref[s0])
    with np.errstate(divide="ignore"):
        speed = np.where(np.isfinite(g_time), 1.0 / g_time, 0.0)
    extra = np.zeros(n_states)
    if policy in ("drop", "drop+spares"):
        speed = np.zeros(len(starts))
    elif policy == "uniform-reduce":
        g_min = _reduce(np.minimum, deg, starts)
        d_state = np.full(n_states, c.tp_base)
        live = g_min > 0
        np.minimum.at(d_state, g_state[live], g_min[live])
        speed = np.where(live, tab.uniform_speed()[d_state[g_state]], 0.0)
    elif policy == "nutp+boost":
        speed, gain = _boost(tab, stage, deg, starts, s0, speed, boost)
        gpus = _reduce(np.add, deg, starts) + s0 * c.tp_base
        watts = gpus * (boost_power(gain, boost) - 1.0)
        extra = np.bincount(g_state, weights=watts, minlength=n_states) / (
            c.n_use * c.pp * c.tp_base)
    elif policy not in ("nutp", "nutp+spares"):
        raise ValueError(f"sim.policies: {policy!r} is not a capacity policy")
    n_groups = np.bincount(g_state, minlength=n_states)
    total = np.bincount(g_state, weights=speed, minlength=n_states)
    slow = np.bincount(g_state, weights=(speed < 1 - _EPS).astype(float), minlength=n_states)
    return StateResult(throughput=(c.n_use - n_groups + total) / c.n_use,
                       below_pace=slow.astype(np.int64), extra_power=extra)


def _boost(tab: StageTables, stage: np.ndarray, deg: np.ndarray, starts: np.ndarray,
           s0: np.ndarray, speed: np.ndarray, boost: BoostConfig
           ) -> tuple[np.ndarray, np.ndarray]:
    """Boosted speed and compute gain per degraded replica (dead replicas stay at 0)."""
    gmax = boost_gain(boost)
    cc, oo = tab.c[stage, deg], tab.o[stage, deg]
    tb = tab.c.shape[1] - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(oo < 1, cc / (1 - oo), np.inf)
        tb_need = tab.c[:, tb] / (1 - tab.o[:, tb])
    pref_need = np.concatenate([[0.0], np.maximum.accumulate(tb_need)])
    g_need = np.maximum(_reduce(np.maximum, need, starts), pref_need[s0])
    capped = cc / gmax + oo
    tb_capped = np.concatenate([[0.0], np.maximum.accumulate(tab.c[:, tb] / gmax + tab.o[:, tb])])
    g_capped = np.maximum(_reduce(np.maximum, capped, starts), tb_capped[s0])
    live = speed > 0
    reach = g_need <= gmax
    with np.errstate(divide="ignore", invalid="ignore"):
        new_speed = np.where(reach, 1.0, 1.0 / g_capped)
    gain = np.where(reach, np.maximum(g_need, 1.0), gmax)
    keep = speed >= 1 - _EPS
    new_speed = np.where(keep, speed, new_speed)
    gain = np.where(keep | ~live, 1.0, gain)
    return np.where(live, new_speed, 0.0), gain
