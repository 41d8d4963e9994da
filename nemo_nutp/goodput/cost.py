"""Step-time cost model of one replica stage at TP degree ``t``, and the power-boost law.

Contract:
* ``CostModel.tables()`` returns per (stage, degree) the step time of a full fault-free share,
  split into a compute part ``c`` (speeds up with power boost) and the rest ``o`` (TP comm, DP
  sync), both **relative to the fault-free replica's step time** (so a healthy replica's
  bottleneck stage has ``c + o == 1``). Degree 0 (and invalid degrees) carry ``inf``.
* Compute is the *slowest rank's* work from the planner's unit assignment
  (``layout.units.rank_work``): uneven shards and query-group granularity show up exactly. The
  compute and TP-communication formulas are the planner's stage cost model (``layout.cost``);
  this module adds the DP sync, 1F1B fill/drain and power boost the simulator needs.
  ``cost.shard_balance='balanced'`` instead lets fine-grained FFN/vocab units fill in around the
  query-group remainder: ``max(attention of the fullest rank, total / t)`` (a bound within one
  unit of an achievable co-balanced assignment).
* ``cost.mode='compute'`` keeps only compute: the replica speed then equals the planner's
  ``Replica.speed`` (``plan._Speed``) for the same degrees; the simulator's consistency test relies
  on this.
* A replica's time is the max over its stages of ``c + o`` (pipeline bottleneck); the share of
  the DP sync is fixed per step, so the linearisation holds at the fault-free share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout.cost import FLOPS_PER_MAC, FWD_BWD, tp_bytes
from ..layout.plan import best_degree_table
from ..layout.specs import ModelDims
from ..layout.units import max_degree, rank_work, space_bounds
from .config import BoostConfig, HardwareSpec, SimConfig


@dataclass(frozen=True)
class StageTables:
    """Per (stage, degree) relative compute ``c`` and other ``o`` time; ``best[h]`` degree."""

    c: np.ndarray  # (pp, tb+1)
    o: np.ndarray  # (pp, tb+1)
    best: np.ndarray  # (tb+1,) largest valid degree <= healthy GPUs (0: none)
    parts_s: dict[str, float]  # absolute seconds of the fault-free step, for the report

    @property
    def time(self) -> np.ndarray:
        return self.c + self.o

    def uniform_speed(self) -> np.ndarray:
        """speed[d]: replica speed with every stage at degree d (uniform-reduce)."""
        with np.errstate(divide="ignore"):
            return np.where(np.isfinite(self.time.max(axis=0)), 1.0 / self.time.max(axis=0), 0.0)


def valid_degrees(dims: ModelDims, tp_base: int, min_tp: int) -> np.ndarray:
    """valid[t], t in 0..tp_base, with the planner's rule (sequence parallel off)."""
    t = np.arange(tp_base + 1)
    ok = (t >= min_tp) & (t <= max_degree(dims))
    ok[0] = False
    return ok


def max_rank_params(dims: ModelDims, t: int, layers: int, with_vocab: bool) -> float:
    h, kv, hpg = dims.hidden_size, dims.kv, dims.heads_per_group
    qg = np.diff(space_bounds(dims, "qg", t)).astype(np.float64)
    ff = np.diff(space_bounds(dims, "ffn", t)).astype(np.float64)
    halves = 2 if dims.gated_linear_unit else 1
    per = layers * (qg * (2 * hpg + 2) * kv * h + ff * (halves + 1) * h)
    if with_vocab:
        per = per + np.diff(space_bounds(dims, "vocab", t)) * float(h)
    return float(per.max())


def _balanced_work(dims: ModelDims, t: int, layers: int, with_vocab: bool) -> float:
    """Slowest rank when FFN/vocab units fill in around the query groups (continuous bound)."""
    planner = rank_work(dims, t, layers, with_vocab)
    h, kv, hpg, s = dims.hidden_size, dims.kv, dims.heads_per_group, dims.seq_length
    per_group = (hpg + 2) * kv * h + 2 * hpg * s * kv + hpg * kv * h
    attn_max = layers * per_group * float(np.diff(space_bounds(dims, "qg", t)).max())
    return float(min(planner.max(), max(attn_max, planner.sum() / t)))


class CostModel:
    """Cost of one replica stage; see the module docstring for what is modelled."""

    def __init__(self, cfg: SimConfig, dims: ModelDims, hw: HardwareSpec) -> None:
        par = cfg.parallel
        if dims.num_layers % par.pp:
            raise ValueError(f"sim.parallel.pp={par.pp}: must divide "
                             f"model.num_layers={dims.num_layers}")
        if par.tp_base > max_degree(dims):
            raise ValueError(f"sim.parallel.tp_base={par.tp_base}: exceeds the model's smallest "
                             f"unit count {max_degree(dims)}")
        self.cfg, self.dims, self.hw, self.cc = cfg, dims, hw, cfg.cost
        self.layers = dims.num_layers // cfg.parallel.pp

    def work(self, stage: int, t: int) -> float:
        """Slowest rank's forward multiply-adds per token."""
        vocab = stage == self.cfg.parallel.pp - 1
        if self.cc.shard_balance == "balanced":
            return _balanced_work(self.dims, t, self.layers, vocab)
        return float(rank_work(self.dims, t, self.layers, vocab).max())

    def parts(self, stage: int, t: int) -> tuple[float, float]:
        """(compute, other) seconds of one fault-free step share at degree t."""
        cfg, hw, cc, d = self.cfg, self.hw, self.cc, self.dims
        tokens = cfg.micro_batch_tokens
        mb = cfg.micro_batches_per_replica + cfg.parallel.pp - 1  # 1F1B: fill + drain
        flops = FWD_BWD * FLOPS_PER_MAC * self.work(stage, t) * tokens
        comp = mb * flops / (hw.peak_tflops * 1e12 * cc.mfu)
        if cc.mode == "compute":
            return comp, 0.0
        tp = mb * tp_bytes(d, t, self.layers, tokens=tokens, act_bytes=2) / (hw.nvlink_gbps * 1e9)
        dp, _ = self.sync(stage, t)
        return comp, tp * (1 - cc.tp_overlap) + dp * (1 - cc.dp_overlap)

    def sync(self, stage: int, t: int) -> tuple[float, float]:
        """(seconds of the DP ring all-reduce before overlap, gradient bytes) of the slowest
        rank of a stage at degree t (the scale-out NIC carries them; ``goodput/links.py``)."""
        cfg = self.cfg
        dp_n = max(2, cfg.cluster.num_gpus // (cfg.parallel.tp_base * cfg.parallel.pp))
        grads = self.cc.grad_bytes * max_rank_params(self.dims, t, self.layers,
                                                     stage == cfg.parallel.pp - 1)
        return 2 * (dp_n - 1) / dp_n * grads / (self.hw.network_gbps * 1e9), grads

    def tables(self) -> StageTables:
        tb, pp = self.cfg.parallel.tp_base, self.cfg.parallel.pp
        valid = valid_degrees(self.dims, tb, self.cfg.parallel.min_tp)
        c = np.full((pp, tb + 1), np.inf)
        o = np.full((pp, tb + 1), np.inf)
        for s in range(pp):
            for t in np.nonzero(valid)[0]:
                c[s, t], o[s, t] = self.parts(s, int(t))
        full = float((c[:, tb] + o[:, tb]).max())
        s_b = int(np.argmax(c[:, tb] + o[:, tb]))
        parts = {"step_s": full, "compute_s": float(c[s_b, tb]), "other_s": float(o[s_b, tb])}
        return StageTables(c=c / full, o=o / full, best=best_degree_table(valid), parts_s=parts)


def boost_gain(boost: BoostConfig) -> float:
    """Largest compute speed-up the power cap allows: (1 + max_power) ** alpha."""
    return float((1.0 + boost.max_power) ** boost.alpha)


def boost_power(gain: np.ndarray, boost: BoostConfig) -> np.ndarray:
    """Power (x TDP) a GPU needs for a compute speed-up ``gain`` (inverse of the law)."""
    return np.asarray(gain, dtype=np.float64) ** (1.0 / boost.alpha)
