"""The planner: cluster + health + configuration + policy -> a frozen, serialisable ``Plan``.

Guarantees (property-tested in ``tests/layout``):
* every live replica stage runs at a valid degree (<= its healthy GPUs, <= the units of every
  sharded parameter, >= ``parallel.min_tp``, dividing ``seq_length`` under sequence parallel);
* ranks ``0..world_size-1`` map one-to-one onto used GPUs; a TP group never leaves its domain;
  rank order is stage-major, then replicas (healthy first, degraded ones contiguous), then TP;
* explicit ``replicas`` (per replica an int or ``pp`` per-stage degrees) run exactly those
  degrees, replica i's stage s on slice ``i * pp + s``;
* a replica's speed comes from the stage cost model (``layout.cost``: the slowest rank's compute
  from the unit assignment, TP communication, stage-boundary traffic; compute only without
  ``PlanRequest.cost``): a replica runs at its slowest stage; under ``nutp`` a stage that lost
  GPUs runs at the valid degree <= its healthy GPUs with the smallest predicted time (ties:
  more GPUs; compute only, that is the largest valid degree); ``Replica.stage_times`` are the
  predicted per-stage times relative to a healthy replica's slowest stage;
* micro-batch shares are positive integers summing to ``parallel.global_batch`` and minimise the
  step makespan ``max(share / speed)``; weights are ``share / global_batch``;
* per-GPU speed (``health.slow_gpus``): a replica stage runs at its slowest used GPU, so its time
  is its largest rank work / that speed; a stage uses its fastest healthy GPUs, and under ``nutp``
  each stage holding a straggler either keeps it (more GPUs, a slower replica: fewer
  micro-batches) or excludes it (a lower degree), whichever the cost model predicts faster;
  ``Replica.straggler`` records the choice and ``speed_keep`` / ``speed_exclude`` both predictions;
* policies: ``nutp`` keeps every replica at the degree its healthy GPUs allow; ``drop`` drops any
  replica with a failed GPU; ``uniform-reduce`` pads every degraded replica down to one common
  degree (the public reference's behaviour).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .cost import StageTime, stage_time, sync_seconds
from .experts import check_expert_degree
from .memory import fits_every_stage, stage_memory, why_not
from .specs import (
    ClusterSpec,
    ModelDims,
    ParallelSpec,
    PlanRequest,
    bad_value,
    interleave_error,
)
from .sync import SyncLayout, make_sync_layout, nic_aware, reshard_plan
from .units import (
    PARAM_KINDS,
    SPACES,
    layer_kinds,
    max_degree,
    num_units,
    space_bounds,
    unit_numel,
)

POLICIES = ("nutp", "drop", "uniform-reduce")


@dataclass(frozen=True)
class Replica:
    """One data-parallel copy of the model."""

    index: int
    tp: tuple[int, ...]  # degree per pipeline stage
    gpus: tuple[tuple[int, ...], ...]  # GPUs used, per stage, in TP-rank order
    ranks: tuple[tuple[int, ...], ...]  # global ranks, per stage, in TP-rank order
    healthy: tuple[int, ...]  # healthy GPUs in each stage's slice
    speed: float  # relative to a healthy replica (compute model)
    microbatches: int
    weight: float  # share of the global batch: microbatches / global_batch
    straggler: str = ""  # slow GPU in its slices: "keep" it or "exclude" it ("" if none)
    speed_keep: float = 0.0  # predicted speed keeping every slow GPU (when straggler != "")
    speed_exclude: float = 0.0  # ... excluding every slow GPU (0: the stage could not run)
    stage_times: tuple[float, ...] = ()  # predicted time per micro-batch of each stage, relative
    # to a healthy replica's slowest stage (Plan.unit_time_s: seconds of 1.0 with a cost spec)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    replicas: tuple[Replica, ...]
    world_size: int
    rank_to_gpu: tuple[int, ...]
    full_replicas: int  # replicas a fault-free cluster would run
    predicted_throughput: float  # vs fault-free, with integer micro-batch shares
    capacity: float  # sum of replica speeds / full_replicas (continuous bound)
    dropped_replicas: int
    idle_healthy_gpus: int  # healthy GPUs in slices that the plan does not use
    sync: dict[tuple[int, str], SyncLayout] = field(repr=False)
    unit_time_s: float | None = None  # seconds per micro-batch of a healthy replica's slowest
    # stage (the cost model's); None without a cost spec (compute-only, relative units)

    @property
    def pp(self) -> int:
        return self.request.parallel.pp

    @property
    def vp(self) -> int:
        """Model chunks per rank (megatron's virtual pipeline size; 1: no interleaving)."""
        return self.request.parallel.vp

    @cached_property
    def rank_index(self) -> dict[int, tuple[int, int, int]]:
        """rank -> (replica position, stage, TP-local index)."""
        out = {}
        for i, rep in enumerate(self.replicas):
            for s, ranks in enumerate(rep.ranks):
                for j, r in enumerate(ranks):
                    out[r] = (i, s, j)
        return out

    def tp_groups(self) -> list[list[int]]:
        return [list(rep.ranks[s]) for s in range(self.pp) for rep in self.replicas]

    def pp_groups(self) -> list[list[int]]:
        """Per replica and TP position j: rank j of each stage (j mod degree on smaller ones)."""
        return [[rep.ranks[s][j % rep.tp[s]] for s in range(self.pp)]
                for rep in self.replicas for j in range(max(rep.tp))]

    def embedding_groups(self) -> list[list[int]]:
        """First/last-stage rank pairs that exchange tied-embedding gradient rows: within a
        replica, rank j of the first stage and rank k of the last whose vocab units overlap
        (pairing by unit, as ``pipeline.finalize`` does; by rank position would pair rows of
        different tokens when the two stages' degrees differ). Empty when pp == 1."""
        if self.pp == 1:
            return []
        out = []
        for rep in self.replicas:
            b0 = self.unit_bounds(0, "vocab", rep.tp[0])
            bl = self.unit_bounds(self.pp - 1, "vocab", rep.tp[-1])
            out += [[rep.ranks[0][j], rep.ranks[-1][k]] for j in range(rep.tp[0])
                    for k in range(rep.tp[-1])
                    if min(b0[j + 1], bl[k + 1]) > max(b0[j], bl[k])]
        return out

    def stage_groups(self) -> list[list[int]]:
        """All ranks of a stage over replicas: the DP group of replicated parameters."""
        return [[r for rep in self.replicas for r in rep.ranks[s]] for s in range(self.pp)]

    def unit_bounds(self, stage: int, space: str, degree: int) -> np.ndarray:
        """Unit assignment (boundaries, length degree+1) of a degree in a stage."""
        return self.sync[(stage, space)].bounds[degree]

    def sync_owner_ranks(self, stage: int, space: str) -> np.ndarray:
        """(replicas, shards) global rank owning each shard in each replica."""
        lay = self.sync[(stage, space)]
        rows = [np.asarray(rep.ranks[stage])[lay.owners_of(rep.tp[stage], i)]
                for i, rep in enumerate(self.replicas)]
        return np.stack(rows)

    def sync_groups(self, stage: int, space: str) -> list[list[int]]:
        """Distinct DP groups (owners of a shard across replicas) for a stage and unit space."""
        own = self.sync_owner_ranks(stage, space)
        return [list(map(int, c)) for c in np.unique(own.T, axis=0)]

    def sync_traffic(self, bytes_per_elem: int = 4) -> list[tuple[tuple[int, ...], int]]:
        """(member GPUs, bytes) of every cross-replica reduction of a step: one per shard of
        every stage and unit space (replicated parameters, a few norms, are left out)."""
        out = []
        for (stage, space), lay in self.sync.items():
            elems = unit_elems(self.request.model, self.pp, stage)[space]
            own = self.sync_owner_ranks(stage, space)
            size = np.diff(lay.shards)
            for k in range(lay.num_shards):
                gpus = tuple(self.rank_to_gpu[int(r)] for r in own[:, k])
                out.append((gpus, int(size[k]) * elems * bytes_per_elem))
        return out

    def sync_seconds(self, rate_mb_s: float, link_rate: dict[int, float] | None = None,
                     bytes_per_elem: int = 4) -> float:
        """Predicted seconds of a step's cross-replica sync at scale-out ``rate_mb_s``, each
        GPU's NIC at ``link_rate`` of it (``cost.sync_seconds``: the slowest NIC's total)."""
        per = sync_seconds(self.sync_traffic(bytes_per_elem), rate_mb_s, link_rate or {},
                           self.request.cluster.domain_size)
        return max(per.values(), default=0.0)

    def reshard_bytes(self, bytes_per_elem: int = 4) -> int:
        """Bytes all ranks send per step for resharding gradients there and back."""
        return sum(self.reshard_bytes_by_rank(bytes_per_elem).values())

    def reshard_bytes_by_rank(self, bytes_per_elem: int = 4) -> dict[int, int]:
        """Bytes each rank sends per step: units to their owner, reduced units back."""
        out: dict[int, int] = {}
        for (stage, space), lay in self.sync.items():
            elems = unit_elems(self.request.model, self.pp, stage)[space]
            for i, rep in enumerate(self.replicas):
                for src, dst, lo, hi in reshard_plan(lay, rep.tp[stage], i).transfers:
                    b = (hi - lo) * elems * bytes_per_elem
                    for r in (rep.ranks[stage][src], rep.ranks[stage][dst]):
                        out[r] = out.get(r, 0) + b
        return out


# --------------------------------------------------------------------------------------------
def unit_elems(dims: ModelDims, pp: int, stage: int) -> dict[str, int]:
    """Gradient elements of one unit of each unit space in a stage (all its layers; the vocab
    space: the embedding rows the stage holds, the tied copy's included)."""
    layers = dims.num_layers // pp
    out = {s: 0 for s in SPACES}
    for kind in layer_kinds(dims):
        out[PARAM_KINDS[kind].space] += layers * unit_numel(kind, dims)
    first, last = stage == 0, stage == pp - 1
    n = int(first or (last and dims.tie_embeddings)) + int(last and not dims.tie_embeddings)
    out["vocab"] = n * unit_numel("word_embedding", dims)
    return out


def nic_aware_sync(req: PlanRequest, replicas: tuple[Replica, ...],
                   sync: dict[tuple[int, str], SyncLayout]) -> dict[tuple[int, str], SyncLayout]:
    """The sync layouts with NIC-aware owners (``layout.sync.nic_aware``) for every replica
    stage holding a GPU of ``health.slow_links``; unchanged without one."""
    links = dict(req.health.slow_links)
    if not links:
        return sync
    out = dict(sync)
    for i, rep in enumerate(replicas):
        for s in range(len(rep.tp)):
            rates = {j: links[g] for j, g in enumerate(rep.gpus[s]) if g in links}
            if not rates:
                continue
            load: dict[int, float] = {}
            elems = unit_elems(req.model, len(rep.tp), s)
            for space in sorted(SPACES, key=lambda sp: -elems[sp]):  # big units first
                if elems[space] == 0:  # no gradient of this space in this stage
                    continue
                out[(s, space)] = nic_aware(out[(s, space)], i, rep.tp[s], rates, load,
                                            unit_bytes=float(elems[space]))
    return out


def _valid_degrees(req: PlanRequest, *, memory: bool = True) -> np.ndarray:
    """valid[t] for t in 0..tp_base: a stage may run at degree t (``memory``: and t fits in
    GPU memory on every stage; explicit per-stage degrees are checked per stage instead)."""
    p, m = req.parallel, req.model
    t = np.arange(p.tp_base + 1)
    ok = (t >= p.min_tp) & (t <= max_degree(m))
    if req.moe is not None:  # every rank of a replica holds at least one expert
        ok &= t <= req.moe.num_moe_experts
    if p.sequence_parallel:
        ok &= (m.seq_length % np.maximum(t, 1)) == 0
    ok[0] = False
    if memory and req.memory is not None:  # a degree that does not fit some stage is never planned
        for d in np.nonzero(ok)[0]:
            ok[d] = fits_every_stage(m, int(d), req.memory, pp=p.pp, balance=p.unit_balance,
                                     moe=req.moe)
    return ok


def best_degree_table(valid: np.ndarray) -> np.ndarray:
    """best[h]: largest valid degree <= h (0 if none)."""
    idx = np.where(valid, np.arange(len(valid)), 0)
    return np.maximum.accumulate(idx)


def check_interleaving(req: PlanRequest, shares: list[int]) -> None:
    """With virtual pipeline stages every replica's share of micro-batches must satisfy
    megatron's interleaved schedule (``specs.interleave_error``): checked per replica, since each
    runs the schedule on its own share."""
    p = req.parallel
    if p.vp <= 1:
        return
    for k, m in enumerate(shares):
        why = interleave_error(m, p.pp)
        if why is not None:
            raise bad_value("parallel.virtual_pipeline_model_parallel_size", p.vp,
                            f"replica {k}'s share is {m} of the {req.global_batch} micro-batches "
                            f"of a step (train.global_batch_size / train.micro_batch_size; "
                            f"shares {shares}): {why}")


def _validate(req: PlanRequest) -> None:
    p, m, c = req.parallel, req.model, req.cluster
    if req.policy not in POLICIES:
        raise bad_value("nutp.policy", req.policy, f"must be one of {POLICIES}")
    if m.num_layers % p.pp:
        raise bad_value("parallel.pp", p.pp, f"must divide model.num_layers={m.num_layers}")
    if m.num_layers % (p.pp * p.vp):
        raise bad_value("parallel.virtual_pipeline_model_parallel_size", p.vp,
                        f"parallel.pp={p.pp} times it must divide model.num_layers="
                        f"{m.num_layers}")
    if p.tp_base > c.domain_size:
        raise bad_value("parallel.tp_base", p.tp_base,
                        f"a TP group must fit in one domain (cluster.domain_size={c.domain_size})")
    for space in SPACES:
        if p.tp_base > num_units(m, space):
            field_name = {"qg": "num_query_groups", "ffn": "ffn_hidden_size",
                          "vocab": "vocab_size"}[space]
            raise bad_value("parallel.tp_base", p.tp_base,
                            f"exceeds model.{field_name}={num_units(m, space)} units")
    if req.moe is not None:
        check_expert_degree(req.moe.num_moe_experts, p.tp_base)
        if req.moe.moe_shared_expert_intermediate_size is not None and \
                p.tp_base > req.moe.moe_shared_expert_intermediate_size:
            raise bad_value("parallel.tp_base", p.tp_base, "exceeds model.moe_shared_expert_"
                            f"intermediate_size={req.moe.moe_shared_expert_intermediate_size}")
    if p.sequence_parallel and m.seq_length % p.tp_base:
        raise bad_value("model.seq_length", m.seq_length,
                        f"must be divisible by parallel.tp_base={p.tp_base} with sequence parallel")
    req.health.check_against(c)
    _check_memory(req)
    if req.replicas is not None:
        valid = _valid_degrees(req, memory=False)
        shown = [list(r) for r in req.replicas]
        for k, degs in enumerate(req.replicas):
            for s, t in enumerate(degs):
                if not (0 < t <= p.tp_base and valid[t]):
                    raise bad_value("nutp.replicas", shown,
                                    f"replica {k} stage {s}: degree {t} is not valid (1..tp_base="
                                    f"{p.tp_base}, <= the model's units, >= parallel.min_tp="
                                    f"{p.min_tp}, divides model.seq_length under sequence "
                                    "parallel)")


def _check_memory(req: PlanRequest) -> None:
    """The healthy degree, and every explicit replica stage, must fit in GPU memory."""
    if req.memory is None:
        return
    p, m, mem = req.parallel, req.model, req.memory
    why = why_not(m, p.tp_base, mem, pp=p.pp, balance=p.unit_balance, moe=req.moe)
    if why:
        raise bad_value("parallel.tp_base", p.tp_base, why)
    for k, degs in enumerate(req.replicas or ()):
        for s, t in enumerate(degs):
            if 0 < t <= p.tp_base and not stage_memory(m, t, mem, stage=s, pp=p.pp,
                                                       balance=p.unit_balance,
                                                       moe=req.moe).fits:
                raise bad_value("nutp.replicas", [list(r) for r in req.replicas or ()],
                                f"replica {k}: " + why_not(m, t, mem, pp=p.pp, stage=s,
                                                      balance=p.unit_balance, moe=req.moe))


def plan_slices(req: PlanRequest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start GPU of every TP slice (tp_base consecutive GPUs inside one domain), healthy count."""
    c, tb = req.cluster, req.parallel.tp_base
    full = c.num_gpus // c.domain_size
    per = c.domain_size // tb
    starts = (np.arange(full)[:, None] * c.domain_size + np.arange(per)[None, :] * tb).ravel()
    rem = c.num_gpus - full * c.domain_size
    starts = np.concatenate([starts, full * c.domain_size + np.arange(rem // tb) * tb])
    failed = np.zeros(c.num_gpus, dtype=bool)  # unusable: failed, or held back as spares
    failed[list(req.health.failed_gpus)] = True
    failed[list(req.health.reserved_gpus)] = True
    healthy = tb - failed[starts[:, None] + np.arange(tb)[None, :]].sum(axis=1)
    return starts.astype(np.int64), healthy.astype(np.int64), failed


def spare_slices(cluster: ClusterSpec, tp_base: int, spares: int) -> list[tuple[int, ...]]:
    """The GPUs of the last ``spares`` TP slices of the cluster (hot spares: whole slices, as a
    TP group stays inside one scale-up domain)."""
    if spares <= 0:
        return []
    req = PlanRequest(cluster=cluster, parallel=ParallelSpec(tp_base=tp_base))
    starts = plan_slices(req)[0]
    if spares >= len(starts):
        raise bad_value("recovery.spares", spares, f"the cluster holds {len(starts)} TP slices "
                        f"of parallel.tp_base={tp_base}: at least one must train")
    return [tuple(range(int(s), int(s) + tp_base)) for s in starts[-spares:]]


def apportion(speeds: np.ndarray, total: int, field_name: str = "global_batch"
              ) -> np.ndarray:
    """Integer shares (>= 1 where speed > 0) summing to ``total`` minimising max(share/speed)."""
    speeds = np.asarray(speeds, dtype=np.float64)
    live = speeds > 0
    n = int(live.sum())
    if n == 0:
        raise bad_value("health.failed_gpus", "...",
                        "no replica can run: every replica lost too much")
    if total < n:
        raise bad_value(field_name, total, f"fewer micro-batches than live replicas ({n}); "
                        "raise train.global_batch_size or lower train.micro_batch_size")
    shares = np.zeros(len(speeds), dtype=np.int64)
    shares[live] = np.maximum(1, np.floor(total * speeds[live] / speeds[live].sum()))
    excess = int(shares.sum()) - total
    if excess > 0:  # only when the floor of 1 over-allocates: take from the most loaded
        heap = [(-shares[i] / speeds[i], i) for i in np.nonzero(live & (shares > 1))[0]]
        heapq.heapify(heap)
        for _ in range(excess):
            _, i = heapq.heappop(heap)
            shares[i] -= 1
            if shares[i] > 1:
                heapq.heappush(heap, (-shares[i] / speeds[i], i))
    heap = [((shares[i] + 1) / speeds[i], i) for i in np.nonzero(live)[0]]
    heapq.heapify(heap)
    for _ in range(total - int(shares.sum())):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / speeds[i], i))
    return shares


def _bench_slow(speeds: np.ndarray, total: int) -> np.ndarray:
    """Mask of replicas to keep: every replica must take >= 1 micro-batch, so a replica slower
    than the makespan of the others would slow the whole step; keep the speed threshold (over
    the few distinct speeds) with the smallest makespan, preferring more replicas on ties."""
    best_t, best_level = np.inf, 0.0
    for level in np.unique(speeds):  # ascending: ties keep the lower threshold
        sub = speeds[speeds >= level]
        if len(sub) > total:
            continue
        t = float((apportion(sub, total) / sub).max())
        if t < best_t - 1e-12:
            best_t, best_level = t, level
    return speeds >= best_level


class _Speed:
    """Replica speed relative to a healthy one from the stage cost model (``layout.cost``):
    per stage the slowest rank's compute (slowed by its slowest GPU), TP communication and
    stage-boundary traffic; a replica runs at its slowest stage (cached per degrees)."""

    def __init__(self, req: PlanRequest) -> None:
        self.req, self.pp, self.tb = req, req.parallel.pp, req.parallel.tp_base
        self.tokens = req.micro_batch_size * req.model.seq_length
        self._cache: dict[tuple[int, int, int | None, int | None], StageTime] = {}
        self.full = max(self.stage_times((self.tb,) * self.pp))

    def stage(self, s: int, t: int, t_prev: int | None, t_next: int | None) -> StageTime:
        key = (s, t, t_prev, t_next)
        if key not in self._cache:
            r = self.req
            self._cache[key] = stage_time(
                r.model, r.cost, t=t, stage=s, pp=self.pp, tokens=self.tokens, t_prev=t_prev,
                t_next=t_next, sequence_parallel=r.parallel.sequence_parallel,
                balance=r.parallel.unit_balance, vp=r.parallel.vp, moe=r.moe)
        return self._cache[key]

    def _nbrs(self, s: int, degrees: tuple[int, ...] | None) -> tuple[int | None, int | None]:
        d = degrees or (self.tb,) * self.pp
        if self.req.parallel.vp > 1:  # virtual stages: a ring (last stage -> stage 0)
            return d[(s - 1) % self.pp], d[(s + 1) % self.pp]
        return (d[s - 1] if s > 0 else None), (d[s + 1] if s < self.pp - 1 else None)

    def time(self, stage: int, t: int, gpu_speed: float = 1.0,
             degrees: tuple[int, ...] | None = None) -> float:
        """Stage time at degree ``t``; neighbours at ``degrees`` (default: healthy)."""
        st = self.stage(stage, t, *self._nbrs(stage, degrees))
        return st.compute / gpu_speed + st.tp + st.boundary

    def stage_times(self, degrees: tuple[int, ...], gpu_speed: tuple[float, ...] | None = None
                    ) -> list[float]:
        v = gpu_speed or (1.0,) * len(degrees)
        return [self.time(s, t, v[s], degrees) for s, t in enumerate(degrees)]

    def __call__(self, degrees: tuple[int, ...], gpu_speed: tuple[float, ...] | None = None
                 ) -> float:
        """Replica speed; ``gpu_speed``: per stage, the slowest used GPU's relative speed."""
        if min(degrees) <= 0:
            return 0.0
        return self.full / max(self.stage_times(degrees, gpu_speed))

    def choice_table(self, valid: np.ndarray) -> np.ndarray:
        """(pp, tb+1): per stage and healthy GPUs h, the valid degree <= h with the smallest
        predicted stage time (neighbours healthy; ties within 1e-9: more GPUs); 0 if none."""
        out = np.zeros((self.pp, self.tb + 1), dtype=np.int64)
        for s in range(self.pp):
            best, best_t = 0, np.inf
            for h in range(1, self.tb + 1):
                if valid[h]:
                    t = self.time(s, h)
                    if t <= best_t * (1 + 1e-9):
                        best, best_t = h, min(t, best_t)
                out[s, h] = best
        return out


def _fastest(failed: np.ndarray, gspeed: np.ndarray, start: int, tb: int, d: int) -> np.ndarray:
    """The ``d`` fastest healthy GPUs of a slice (ties: lower id), in id order."""
    ids = np.nonzero(~failed[start:start + tb])[0] + start
    order = sorted(ids.tolist(), key=lambda g: (-gspeed[g], g))
    return np.asarray(sorted(order[:d]), dtype=np.int64)


def _straggler_degrees(req: PlanRequest, speed: _Speed, starts: np.ndarray, failed: np.ndarray,
                       gspeed: np.ndarray, sl: np.ndarray, deg: np.ndarray
                       ) -> dict[int, tuple[str, float, float]]:
    """Under ``nutp``, per stage with a slow healthy GPU: the degree (on its fastest GPUs) with
    the smallest predicted stage time (ties: more GPUs); updates ``deg`` in place. Returns per
    replica row (choice, speed keeping every slow GPU, speed excluding every slow GPU)."""
    tb = req.parallel.tp_base
    best = best_degree_table(_valid_degrees(req))
    out: dict[int, tuple[str, float, float]] = {}
    for i in range(deg.shape[0]):
        if (deg[i] == 0).any():
            continue
        keep_t, excl_t, touched, excluded = [], [], False, False
        for s in range(deg.shape[1]):
            start = int(starts[sl[i, s]])
            v = np.sort(gspeed[start:start + tb][~failed[start:start + tb]])[::-1]
            h, n_slow = len(v), int((v < 1.0).sum())
            t0 = speed.time(s, int(deg[i, s]), v[int(deg[i, s]) - 1])
            if n_slow == 0:
                keep_t.append(t0)
                excl_t.append(t0)
                continue
            touched = True
            d_ex = int(best[h - n_slow])
            keep_t.append(speed.time(s, int(best[h]), v[int(best[h]) - 1]))
            excl_t.append(speed.time(s, d_ex) if d_ex else np.inf)
            cands = {int(best[h - k]) for k in range(n_slow + 1)} - {0}
            d = min(cands, key=lambda x: (speed.time(s, x, v[x - 1]), -x))
            excluded |= d < h
            deg[i, s] = d
        if touched:
            out[i] = ("exclude" if excluded else "keep", speed.full / max(keep_t),
                      speed.full / max(excl_t))
    return out


def _degrees(req: PlanRequest, healthy: np.ndarray, speed: _Speed) -> np.ndarray:
    """(replicas, pp) degree per stage under the policy; 0 marks a dropped replica. ``nutp``
    gives each stage that lost GPUs the valid degree (<= its healthy GPUs) the cost model
    predicts fastest."""
    tb = req.parallel.tp_base
    valid = _valid_degrees(req)
    best = best_degree_table(valid)
    if req.policy == "drop":
        ok = (healthy == tb).all(axis=1)
        return np.where(ok[:, None], tb, 0) * np.ones_like(healthy)
    if req.policy == "nutp":  # healthy stages keep the configured degree (memory is sized
        table = speed.choice_table(valid)  # for it); degraded ones take the cost model's
        deg = np.where(healthy == tb, best[healthy],
                       table[np.arange(req.parallel.pp)[None, :], healthy])
    else:
        deg = best[healthy]
    dead = (deg == 0).any(axis=1)
    deg[dead] = 0
    if req.policy == "uniform-reduce":
        degraded = ~dead & (healthy < tb).any(axis=1)
        if degraded.any():
            deg[degraded] = int(deg[degraded].min())
    return deg


def slices_of(cluster: ClusterSpec, tp_base: int) -> int:
    """TP slices (``tp_base`` consecutive GPUs inside one domain) the cluster holds."""
    full, rem = divmod(cluster.num_gpus, cluster.domain_size)
    return full * (cluster.domain_size // tp_base) + rem // tp_base


def fit_cluster(cluster: ClusterSpec, tp_base: int, slices: int) -> ClusterSpec:
    """The cluster with the fewest GPUs (a multiple of ``gpus_per_node``, same domains) that
    holds ``slices`` TP slices; the cluster itself if it already does."""
    if slices_of(cluster, tp_base) >= slices:
        return cluster
    if tp_base > cluster.domain_size:
        raise bad_value("parallel.tp_base", tp_base,
                        "a TP group must fit in one domain "
                        f"(cluster.domain_size={cluster.domain_size})")
    n = cluster.gpus_per_node
    while slices_of(dataclasses.replace(cluster, num_gpus=n), tp_base) < slices:
        n += cluster.gpus_per_node
    return dataclasses.replace(cluster, num_gpus=n)


def _explicit(req: PlanRequest, healthy: np.ndarray, n_slices: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Slices (replica i, stage s -> slice i * pp + s) and degrees of explicit replicas."""
    p, c = req.parallel, req.cluster
    assert req.replicas is not None
    shown = [list(r) for r in req.replicas]
    n = len(req.replicas)
    if n * p.pp > n_slices:
        fit = fit_cluster(c, p.tp_base, n * p.pp)
        raise bad_value("nutp.replicas", shown,
                        f"{n} replicas x parallel.pp={p.pp} stages need {n * p.pp} slices of "
                        f"parallel.tp_base={p.tp_base} GPUs; the cluster has {n_slices}: set "
                        f"cluster.num_gpus={fit.num_gpus} (with cluster.domain_size="
                        f"{c.domain_size}, cluster.gpus_per_node={c.gpus_per_node}) or lower "
                        "parallel.tp_base")
    if p.dp is not None and p.dp != n:
        raise bad_value("parallel.dp", p.dp, f"disagrees with nutp.replicas={shown}")
    sl = np.arange(n * p.pp).reshape(n, p.pp)
    deg = np.asarray(req.replicas, dtype=np.int64).reshape(n, p.pp)
    over = np.argwhere(deg > healthy[sl])
    if len(over):
        i, s = (int(x) for x in over[0])
        raise bad_value("nutp.replicas", shown,
                        f"replica {i} stage {s}: degree {deg[i, s]} exceeds "
                        f"its {healthy[sl[i, s]]} healthy GPUs")
    return sl, deg


def build_plan(req: PlanRequest) -> Plan:
    """Make the plan; raises ``ValueError`` naming the field for every impossible request."""
    _validate(req)
    p = req.parallel
    starts, healthy, failed = plan_slices(req)
    reserved = set(req.health.reserved_gpus) - set(req.health.failed_gpus)
    held = {int(s) for s in starts if reserved & set(range(int(s), int(s) + p.tp_base))}
    n_full = (len(starts) - len(held)) // p.pp  # spare slices are not the job's
    speed = _Speed(req)
    if req.replicas is not None:
        sl, deg = _explicit(req, healthy, len(starts))
        n_full = len(req.replicas)
    else:
        if n_full == 0:
            raise bad_value("cluster.num_gpus", req.cluster.num_gpus, f"holds no replica of "
                            f"parallel.pp={p.pp} stages x parallel.tp_base={p.tp_base}")
        order = np.lexsort((starts, -healthy))  # healthiest slices first: degraded stages share
        n_use = n_full if p.dp is None else p.dp  # replicas, so fewer replicas slow down
        if n_use > n_full:
            raise bad_value("parallel.dp", p.dp, f"cluster holds only {n_full} replicas")
        n_full = n_use
        sl = order[: n_use * p.pp].reshape(n_use, p.pp)
        deg = _degrees(req, healthy[sl], speed)
    gspeed = np.asarray(req.health.gpu_speed(req.cluster.num_gpus), dtype=np.float64)
    choice = (_straggler_degrees(req, speed, starts, failed, gspeed, sl, deg)
              if req.policy == "nutp" and req.replicas is None and req.health.slow_gpus else {})
    return _assemble(req, starts, healthy, failed, sl, deg, n_full, gspeed, choice, speed)


def _assemble(req: PlanRequest, starts: np.ndarray, healthy: np.ndarray, failed: np.ndarray,
              sl: np.ndarray, deg: np.ndarray, n_full: int, gspeed: np.ndarray,
              choice: dict[int, tuple[str, float, float]], speed: _Speed) -> Plan:
    p = req.parallel
    live = np.nonzero((deg > 0).all(axis=1))[0]
    if len(live) == 0:
        raise bad_value("health.failed_gpus", list(req.health.failed_gpus)[:8],
                        "no replica can run at parallel.min_tp or above")
    # Healthy replicas first, then degraded ones grouped by degree (contiguous ranks).
    live = live[np.lexsort((live, *[-deg[live, s] for s in reversed(range(p.pp))]))]
    gpus: dict[tuple[int, int], tuple[int, ...]] = {}
    for i in live:
        for s in range(p.pp):
            ok = _fastest(failed, gspeed, int(starts[sl[i, s]]), p.tp_base, int(deg[i, s]))
            gpus[(int(i), s)] = tuple(int(g) for g in ok)
    gv = {int(i): tuple(float(gspeed[list(gpus[(int(i), s)])].min()) for s in range(p.pp))
          for i in live}
    speeds = np.array([speed(tuple(int(x) for x in deg[i]), gv[int(i)]) for i in live])
    keep = _bench_slow(speeds, req.global_batch)
    deg[live[~keep]] = 0
    live, speeds = live[keep], speeds[keep]
    if p.vp > 1 and req.global_batch % p.pp == 0 and req.global_batch >= p.pp * len(speeds):
        # the interleaved schedule runs multiples of pp per replica: apportion in groups of pp
        shares = p.pp * apportion(speeds, req.global_batch // p.pp)
    else:
        shares = apportion(speeds, req.global_batch)
    ranks: dict[tuple[int, int], tuple[int, ...]] = {}
    rank_to_gpu: list[int] = []
    for s in range(p.pp):
        for i in live:
            g = gpus[(int(i), s)]
            ranks[(int(i), s)] = tuple(range(len(rank_to_gpu), len(rank_to_gpu) + len(g)))
            rank_to_gpu.extend(g)
    world = len(rank_to_gpu)
    if req.world_size is not None and req.world_size != world:
        raise bad_value("world_size", req.world_size, f"the launcher's world size differs from the "
                        f"plan's {world} GPUs")
    replicas = tuple(
        Replica(index=k, tp=tuple(int(x) for x in deg[i]),
                gpus=tuple(gpus[(int(i), s)] for s in range(p.pp)),
                ranks=tuple(ranks[(int(i), s)] for s in range(p.pp)),
                healthy=tuple(int(healthy[sl[i, s]]) for s in range(p.pp)),
                speed=float(speeds[k]), microbatches=int(shares[k]),
                weight=float(shares[k]) / req.global_batch,
                straggler=choice.get(int(i), ("", 0.0, 0.0))[0],
                speed_keep=float(choice.get(int(i), ("", 0.0, 0.0))[1]),
                speed_exclude=float(choice.get(int(i), ("", 0.0, 0.0))[2]),
                stage_times=tuple(t / speed.full for t in speed.stage_times(
                    tuple(int(x) for x in deg[i]), gv[int(i)])))
        for k, i in enumerate(live))
    check_interleaving(req, [int(x) for x in shares])
    sync = {(s, space): make_sync_layout(
        num_units(req.model, space), sorted({r.tp[s] for r in replicas}), p.sync_layout,
        bounds=functools.partial(space_bounds, req.model, space, balance=p.unit_balance))
        for s in range(p.pp) for space in SPACES}
    sync = nic_aware_sync(req, replicas, sync)
    t_full = apportion(np.ones(n_full), req.global_batch).max()
    t_plan = float((shares / speeds).max())
    used = {g for g in rank_to_gpu}
    in_slices = {int(starts[x]) + j for x in sl.ravel() for j in range(p.tp_base)}
    reserved = set(req.health.reserved_gpus) - set(req.health.failed_gpus)  # spares: idle
    idle = sum(1 for g in in_slices if not failed[g] and g not in used) + len(reserved)
    return Plan(request=req, replicas=replicas, world_size=world, rank_to_gpu=tuple(rank_to_gpu),
                full_replicas=n_full, predicted_throughput=float(t_full / t_plan),
                capacity=float(speeds.sum() / n_full), dropped_replicas=n_full - len(live),
                idle_healthy_gpus=idle, sync=sync,
                unit_time_s=speed.full if req.cost is not None else None)
