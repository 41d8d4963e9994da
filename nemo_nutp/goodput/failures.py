"""Failure processes: static failed-GPU sets (sweeps) and Poisson timelines (with repair).

Contract:
* GPUs are numbered ``0..n_gpus-1`` in consecutive nodes and scale-up domains (as the planner's
  ``ClusterSpec``). A failure hits one GPU, its node or its domain (``sim.failures.blast``).
* ``static_down`` draws, per trial, every blast unit of kind k independently with probability
  ``q_k = p * share_k * size_k / mean_size``, so the expected failed-GPU fraction is ``p`` and,
  for ``blast.gpu == 1``, each GPU is down independently with probability exactly ``p`` (the
  closed form ``1-(1-p)^n`` of ``drop`` holds exactly).
* ``poisson_events`` draws per-GPU Poisson arrivals at ``failures.rate`` over the horizon (plus a
  lead-in of the longest repair when ``steady_state``), a cause (hardware/software) and a blast
  kind per event; an event keeps its GPUs down for ``[start, end)`` hours.
* Everything is seeded by the ``numpy.random.Generator`` passed in; no global state.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import BLAST_KINDS, FailureConfig


@dataclass(frozen=True)
class Events:
    """Failure events of many trials (all arrays of equal length)."""

    trial: np.ndarray  # int64
    start: np.ndarray  # hours (may be negative: lead-in)
    end: np.ndarray  # hours
    lo: np.ndarray  # first GPU down
    size: np.ndarray  # GPUs down (blast radius)
    hardware: np.ndarray  # bool: hardware cause

    def __len__(self) -> int:
        return len(self.trial)

    def select(self, mask: np.ndarray) -> Events:
        return Events(self.trial[mask], self.start[mask], self.end[mask], self.lo[mask],
                      self.size[mask], self.hardware[mask])


def blast_sizes(domain_size: int, gpus_per_node: int) -> dict[str, int]:
    return {"gpu": 1, "node": gpus_per_node, "domain": domain_size}


def _unit_range(kind_idx: np.ndarray, gpu: np.ndarray, n_gpus: int, sizes: dict[str, int]
                ) -> tuple[np.ndarray, np.ndarray]:
    size_of = np.array([sizes[k] for k in BLAST_KINDS], dtype=np.int64)[kind_idx]
    lo = gpu - gpu % size_of
    return lo, np.minimum(size_of, n_gpus - lo)


def static_down(p: float, trials: int, n_gpus: int, shares: dict[str, float],
                sizes: dict[str, int], rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """(trial, gpu) of every down GPU (may repeat a GPU when blast units overlap)."""
    mean_size = sum(shares[k] * sizes[k] for k in BLAST_KINDS)
    trial_ids: list[np.ndarray] = []
    gpu_ids: list[np.ndarray] = []
    for k in BLAST_KINDS:
        if shares[k] <= 0 or p <= 0:
            continue
        size = sizes[k]
        n_units = n_gpus // size
        q = min(1.0, p * shares[k] * size / mean_size)
        counts = rng.binomial(n_units, q, size=trials)
        for t in np.nonzero(counts)[0]:
            units = rng.choice(n_units, size=int(counts[t]), replace=False)
            g = (units[:, None] * size + np.arange(size)[None, :]).ravel()
            gpu_ids.append(g)
            trial_ids.append(np.full(len(g), t, dtype=np.int64))
    if not gpu_ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(trial_ids), np.concatenate(gpu_ids).astype(np.int64)


def poisson_events(f: FailureConfig, trials: int, n_gpus: int, hours: float,
                   sizes: dict[str, int], rng: np.random.Generator, *, steady_state: bool
                   ) -> Events:
    """Random failure events of ``trials`` independent runs of ``hours`` each."""
    lead = 0.0
    if steady_state:
        longest = max(f.hardware_repair_hours, f.software_recovery_hours)
        lead = longest * (1.0 if f.repair_distribution == "fixed" else 5.0)
    counts = rng.poisson(f.rate * n_gpus * (hours + lead), size=trials)
    n = int(counts.sum())
    trial = np.repeat(np.arange(trials, dtype=np.int64), counts)
    start = rng.uniform(-lead, hours, size=n)
    hw = rng.random(n) < f.hardware_fraction
    mean = np.where(hw, f.hardware_repair_hours, f.software_recovery_hours)
    dur = mean if f.repair_distribution == "fixed" else rng.exponential(mean)
    gpu = rng.integers(0, n_gpus, size=n, dtype=np.int64)
    p = np.array([f.blast.shares()[k] for k in BLAST_KINDS])
    kind = rng.choice(len(BLAST_KINDS), size=n, p=p / p.sum())
    lo, size = _unit_range(kind, gpu, n_gpus, sizes)
    return Events(trial, start, start + dur, lo, size, hw)


def load_trace(path: str | Path, n_gpus: int, sizes: dict[str, int]) -> Events:
    """Events of one run from a CSV (header ``time_h,gpu,duration_h[,blast][,cause]``) or a
    JSON list of objects with those keys. ``blast`` defaults to ``gpu``, ``cause`` to
    ``hardware``. Raises ``ValueError`` naming the row and field of bad input."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"sim.failures.trace={str(path)!r}: file not found")
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"sim.failures.trace={str(path)!r}: JSON must be a list of events")
    else:
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    t, g, d, kind, hw = [], [], [], [], []
    for i, r in enumerate(rows):
        try:
            t.append(float(r["time_h"]))
            g.append(int(r["gpu"]))
            d.append(float(r["duration_h"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"sim.failures.trace row {i}: needs time_h, gpu, duration_h "
                             f"({e!r})") from None
        b = str(r.get("blast") or "gpu")
        if b not in BLAST_KINDS:
            raise ValueError(f"sim.failures.trace row {i}: blast={b!r} not in {BLAST_KINDS}")
        if not 0 <= g[-1] < n_gpus or d[-1] < 0:
            raise ValueError(f"sim.failures.trace row {i}: gpu={g[-1]} / duration_h={d[-1]} "
                             f"out of range (0..{n_gpus - 1}, >= 0)")
        kind.append(BLAST_KINDS.index(b))
        hw.append(str(r.get("cause") or "hardware") == "hardware")
    start = np.asarray(t, dtype=np.float64)
    lo, size = _unit_range(np.asarray(kind, dtype=np.int64), np.asarray(g, dtype=np.int64),
                           n_gpus, sizes)
    return Events(np.zeros(len(t), np.int64), start, start + np.asarray(d), lo, size,
                  np.asarray(hw, dtype=bool))


def down_at_steps(ev: Events, trial_lo: int, trial_hi: int, n_steps: int, step_h: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(state, gpu) pairs down at step centres, states ``(trial - trial_lo) * n_steps + k``."""
    sel = ev.select((ev.trial >= trial_lo) & (ev.trial < trial_hi))
    k0 = np.clip(np.ceil(sel.start / step_h - 0.5), 0, n_steps).astype(np.int64)
    k1 = np.clip(np.ceil(sel.end / step_h - 0.5), 0, n_steps).astype(np.int64)
    n_k = k1 - k0
    live = n_k > 0
    k0, n_k, lo, size = k0[live], n_k[live], sel.lo[live], sel.size[live]
    base = (sel.trial[live] - trial_lo) * n_steps + k0
    # expand each event to its steps, then each step to the event's GPUs
    idx = np.repeat(np.arange(len(k0)), n_k)
    off = np.arange(len(idx)) - np.repeat(np.cumsum(n_k) - n_k, n_k)
    state = base[idx] + off
    reps = size[idx]
    gidx = np.repeat(np.arange(len(idx)), reps)
    goff = np.arange(len(gidx)) - np.repeat(np.cumsum(reps) - reps, reps)
    return state[gidx], lo[idx][gidx] + goff
