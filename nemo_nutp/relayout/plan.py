"""Move plans: which survivor sends which units to which new rank when the layout changes.

Pure Python over ``layout`` (no torch, no process groups). Given the old plan, the new plan
(same model, same ``pp``, re-planned without the failed GPUs) and the map old rank -> new rank
of the survivors, ``plan_move`` says, per new rank and per (stage, unit space), where each unit
it now holds comes from:

1. its own old shard (a local copy, ``Piece.src`` is its own old rank, no bytes on the wire);
2. else a survivor of its own old replica at that stage (a TP peer: same scale-up domain);
3. else the same units in another replica (replicas are bitwise equal after every committed
   step), the ``max_sources`` replicas nearest by index first, least-loaded sender first, the
   missing range cut into up to ``max_sources`` blocks so that one healthy rank does not send
   everything.

Guarantees (property-tested, ``tests/relayout/test_plan.py``):
* every unit of every new rank's shard, in every space of its stage, is covered by exactly one
  piece, whose source is a survivor that held it in the old plan at the same stage;
* a new rank receives exactly the units it did not hold: ``received_bytes == lower_bound_bytes``
  (the lower bound), whatever the layouts;
* unit ranges are the model builder's (``units.space_bounds`` with the plan's
  ``unit_balance``), so they match ``nutp_units`` of the built parameters; element counts per
  unit come from ``units.unit_numel`` (the geometry ``checkpoint.sharding`` writes).
* ``possible`` is False (with a one-line ``reason``) when some unit is held by no survivor;
  the caller then falls back to the restart path.

Cost: one pass over the new ranks (O(W) cheap Python, to find the ranks whose holdings
changed) and O(affected ranks x max_sources) source choices; a replica that kept its GPUs and
degree moves nothing.

The space ``rep`` is a stage's replicated parameters (norms, row-parallel biases, a learned
position embedding), moved whole (one "unit", ``lo, hi = 0, 1``) to a new rank that did not
hold that stage.

MoE (``experts=MoveExperts(...)``): the ``expert`` space (``layout/experts.py``) is planned like
the dense spaces: unit ``e`` of a stage is routed expert ``e`` of every MoE layer of the stage
(all its tensors and their optimizer state), held by the rank ``expert_bounds`` gives it in
its replica. A new holder of an expert takes it whole from one survivor that held it (its own
old replica's holder first, else another replica's: replicas are bitwise equal), so each rank
receives exactly the experts it did not hold (the lower bound). Dense FFN units then count only
the layers that have them (dense layers; MoE layers with a shared expert), and ``rep`` adds
each MoE layer's router (``[num_experts, hidden]``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from ..layout.cost import stage_layers
from ..layout.experts import EXPERT_SPACE, ExpertShape, expert_bounds
from ..layout.plan import Plan, build_plan, plan_slices
from ..layout.specs import ModelDims
from ..layout.units import PARAM_KINDS, layer_kinds, space_bounds, unit_numel

REP = "rep"
MOVE_SPACES = ("qg", "ffn", "vocab", REP)
EXPERT = EXPERT_SPACE


@dataclass(frozen=True)
class MoveExperts:
    """What the move plan needs of a MoE model (pure): ``num_experts`` routed experts of
    ``expert_numel`` elements each (all one expert's tensors in one layer), ``moe_layers`` one
    flag per global layer (megatron's ``moe_layer_freq``), ``shared_ffn``: the MoE layers' shared
    expert is over the dense FFN's units."""

    num_experts: int
    expert_numel: int
    moe_layers: tuple[bool, ...]
    shared_ffn: bool = False

    def layers_in(self, first: int, last: int) -> int:
        """MoE layers among global layers [first, last)."""
        return sum(self.moe_layers[first:last])


def move_experts(dims: ModelDims, moe: Any) -> MoveExperts:
    """``MoveExperts`` of a model (``dims``) and its MoE settings (``model.moe.MoEDims`` or
    the MoE model's megatron ``TransformerConfig``, read by attribute: no model import
    here). ``ValueError`` naming the setting for what the move does not plan yet: MTP
    layers, the expert bias (a buffer, not moved), multi-latent attention."""
    mtp = getattr(moe, "mtp_num_layers", None)
    if mtp:
        raise ValueError(f"model.mtp_num_layers={mtp}: the live re-layout does not plan the "
                         "MTP layers' experts yet")
    if getattr(moe, "moe_router_enable_expert_bias", False):
        raise ValueError("model.moe_router_enable_expert_bias=True: the live re-layout does not "
                         "move the expert bias (a buffer) yet")
    kv = getattr(dims, "kv_lora_rank", None)
    if kv or getattr(moe, "multi_latent_attention", False):
        raise ValueError(f"model.kv_lora_rank={kv}: the live re-layout does not plan "
                         "multi-latent attention's replicated projections yet")
    size = getattr(moe, "moe_shared_expert_intermediate_size", None)
    if size is not None and int(size) != dims.ffn_hidden_size:
        raise ValueError(f"model.moe_shared_expert_intermediate_size={size}: the live re-layout "
                         "does not plan a shared expert of its own size (replicated in the "
                         f"replica, not over the {dims.ffn_hidden_size} FFN units) yet")
    e, f, h = (int(moe.num_moe_experts), int(moe.moe_ffn_hidden_size),
               dims.hidden_size)
    shape = ExpertShape(e, h, f, gated=dims.gated_linear_unit)
    bias = ((2 if dims.gated_linear_unit else 1) * f + h) if dims.add_bias_linear else 0
    if hasattr(moe, "moe_layers"):  # MoEDims
        layers = tuple(bool(x) for x in moe.moe_layers(dims.num_layers))
    else:  # megatron's TransformerConfig: moe_layer_freq, an int or a 0/1 list
        f = moe.moe_layer_freq
        layers = (tuple(i % f == 0 for i in range(dims.num_layers)) if isinstance(f, int)
                  else tuple(bool(x) for x in f))
    shared = getattr(moe, "moe_shared_expert_intermediate_size", None) is not None
    return MoveExperts(e, shape.unit_numel() + bias, layers, shared_ffn=shared)


def _spaces(experts: MoveExperts | None) -> tuple[str, ...]:
    return MOVE_SPACES if experts is None else ("qg", "ffn", EXPERT, "vocab", REP)


def _bounds(dims: ModelDims, space: str, degree: int, balance: str,
            experts: MoveExperts | None) -> np.ndarray:
    if space == EXPERT:
        assert experts is not None
        return expert_bounds(experts.num_experts, degree)
    return space_bounds(dims, space, degree, balance)


@dataclass(frozen=True)
class Piece:
    """Units ``[lo, hi)`` of ``space`` in ``stage`` that new rank ``dst`` takes from old rank
    ``src`` (its own old rank: a local copy). ``elems``: elements per moved field."""

    dst: int
    src: int
    stage: int
    space: str
    lo: int
    hi: int
    elems: int


@dataclass(frozen=True)
class MovePlan:
    possible: bool
    reason: str
    pieces: tuple[Piece, ...]
    rank_map: dict[int, int]  # old rank -> new rank
    bytes_per_elem: int
    lower_bound_bytes: dict[int, int] = field(default_factory=dict)  # new rank -> bytes
    received_bytes: dict[int, int] = field(default_factory=dict)  # new rank -> bytes
    sent_bytes: dict[int, int] = field(default_factory=dict)  # old rank -> bytes
    experts: MoveExperts | None = None  # MoE: the expert space is planned (None: no experts)

    def old_rank(self, new_rank: int) -> int:
        inv = self.__dict__.get("_inv")
        if inv is None:
            inv = {n: o for o, n in self.rank_map.items()}
            object.__setattr__(self, "_inv", inv)
        return int(inv[new_rank])

    def is_local(self, p: Piece) -> bool:
        return self.rank_map.get(p.src) == p.dst


def survivor_rank_map(old: Plan, new: Plan) -> dict[int, int]:
    """Old rank -> new rank of every old rank whose GPU the new plan uses (by GPU id)."""
    where = {g: n for n, g in enumerate(new.rank_to_gpu)}
    return {o: where[g] for o, g in enumerate(old.rank_to_gpu) if g in where}


def stable_replan(old: Plan, new: Plan) -> Plan | None:
    """``new`` with every replica stage kept on the TP slice it had in ``old``.

    The planner packs healthy replicas first and degraded ones last, so after one failure every
    replica behind it shifts by a slice and its GPUs change stage: their whole state would move
    (Llama-70B TP8 PP4 on 10K GPUs: ~60 % of the ranks, ~30 GB each). This re-plans with the
    planner's own per-slice degrees of ``new`` as explicit replicas (``nutp.replicas``: replica
    i, stage s on slice i * pp + s), so only the degraded replica's ranks receive anything.
    None when not expressible that way: ``old`` not in that slice order (e.g. it already holds a
    degraded replica packed last) or ``new`` dropping or adding a slice; use ``new`` then."""
    req = new.request
    starts = plan_slices(req)[0]
    pp = old.pp

    def slice_of(gpu: int) -> int:
        return int(np.searchsorted(starts, gpu, side="right") - 1)

    if any(slice_of(rep.gpus[s][0]) != i * pp + s
           for i, rep in enumerate(old.replicas) for s in range(pp)):
        return None
    degree = {slice_of(rep.gpus[s][0]): rep.tp[s] for rep in new.replicas for s in range(pp)}
    want = {i * pp + s for i in range(len(old.replicas)) for s in range(pp)}
    if set(degree) != want:
        return None
    layout = tuple(tuple(degree[i * pp + s] for s in range(pp)) for i in range(len(old.replicas)))
    try:
        return build_plan(dataclasses.replace(req, replicas=layout))
    except ValueError:
        return None


def unit_elems(plan: Plan, stage: int, space: str, experts: MoveExperts | None = None) -> int:
    """Elements per unit of ``space`` summed over the stage's parameters (``rep``: all the
    stage's replicated elements; ``expert``: one expert of every MoE layer of the stage)."""
    return _unit_elems(plan.request.model, plan.pp, stage, space, experts)


@lru_cache(maxsize=4096)
def _unit_elems(dims: ModelDims, pp: int, stage: int, space: str,
                experts: MoveExperts | None = None) -> int:
    first, last = stage_layers(dims.num_layers, pp)[stage]
    layers = last - first
    n_moe = 0 if experts is None else experts.layers_in(first, last)
    if space == EXPERT:
        return 0 if experts is None else n_moe * experts.expert_numel
    if space == "vocab":
        n = int(stage == 0) + int(stage == pp - 1 and not (pp == 1 and dims.tie_embeddings))
        return n * unit_numel("word_embedding", dims)
    if space == REP:
        h = dims.hidden_size
        ln = 2 if getattr(dims, "normalization", "RMSNorm") == "LayerNorm" else 1
        per_layer = 2 * ln * h + (2 * h if dims.add_bias_linear else 0) + (
            2 * ln * dims.kv if getattr(dims, "qk_layernorm", False) else 0) + (
            2 * ln * h if getattr(dims, "post_layernorm", False) else 0)
        out = layers * per_layer + (ln * h if stage == pp - 1 else 0)
        if experts is not None:  # each MoE layer's router; its experts carry no fc2 bias here
            out += n_moe * experts.num_experts * h
            if dims.add_bias_linear and not experts.shared_ffn:
                out -= n_moe * h
        if stage == 0 and getattr(dims, "position_embedding_type", "rope") == "learned_absolute":
            out += dims.seq_length * h
        return out
    if space == "ffn" and experts is not None and not experts.shared_ffn:
        layers -= n_moe  # a MoE layer's MLP is its experts
    return layers * sum(unit_numel(k, dims) for k in layer_kinds(dims)
                        if PARAM_KINDS[k].space == space)


def stage_spaces(plan: Plan, stage: int, experts: MoveExperts | None = None
                 ) -> tuple[str, ...]:
    return tuple(s for s in _spaces(experts) if unit_elems(plan, stage, s, experts) > 0)


def holding(plan: Plan, rank: int, space: str, experts: MoveExperts | None = None
            ) -> tuple[int, int, int, int]:
    """(replica, stage, lo, hi) of what ``rank`` holds of ``space`` in its stage."""
    i, s, j = plan.rank_index[rank]
    if space == REP:
        return i, s, 0, 1
    b = _bounds(plan.request.model, space, plan.replicas[i].tp[s],
                plan.request.parallel.unit_balance, experts)
    return i, s, int(b[j]), int(b[j + 1])


def _check(old: Plan, new: Plan, rank_map: Mapping[int, int], joiners: frozenset[int]
           ) -> None:
    if old.pp != new.pp:
        raise ValueError(f"parallel.pp={new.pp}: a live re-layout keeps the pipeline depth "
                         f"(old plan pp={old.pp})")
    if old.request.model != new.request.model:
        raise ValueError("model: the new plan is for another model than the old one")
    if old.request.parallel.unit_balance != new.request.parallel.unit_balance:
        raise ValueError(f"parallel.unit_balance={new.request.parallel.unit_balance!r}: differs "
                         f"from the old plan's {old.request.parallel.unit_balance!r}")
    bad = [o for o in rank_map if not 0 <= o < old.world_size]
    if bad:
        raise ValueError(f"rank_map: old ranks {bad[:4]} are not in the old plan")
    targets = sorted([*rank_map.values(), *joiners])
    if targets != list(range(new.world_size)):
        raise ValueError(f"rank_map: must map survivors one-to-one onto new ranks "
                         f"0..{new.world_size - 1} (with the joiners {sorted(joiners)[:8]}), "
                         f"got {targets[:8]}...")


class _Sources:
    """Old holders of a stage's units, and how much each survivor has been asked to send."""

    def __init__(self, old: Plan, alive: set[int], max_sources: int,
                 experts: MoveExperts | None = None) -> None:
        self.old, self.alive, self.k, self.experts = old, alive, max_sources, experts
        self.load: dict[int, int] = {}

    def _holder(self, rep: int, stage: int, space: str, lo: int, hi: int) -> int | None:
        """The alive rank of replica ``rep`` holding all of [lo, hi) at ``stage`` (or None)."""
        ranks = self.old.replicas[rep].ranks[stage]
        if space == REP:  # every rank of the stage holds it: the least-loaded survivor
            alive = [r for r in ranks if r in self.alive]
            return min(alive, key=lambda r: (self.load.get(r, 0), r)) if alive else None
        for r in ranks:
            _, _, a, b = holding(self.old, r, space, self.experts)
            if a <= lo and hi <= b:
                return r if r in self.alive else None
        return None

    def _cuts(self, rep: int, stage: int, space: str, lo: int, hi: int) -> list[int]:
        """Unit boundaries of replica ``rep`` strictly inside (lo, hi)."""
        out = []
        for r in self.old.replicas[rep].ranks[stage]:
            a = holding(self.old, r, space, self.experts)[2]
            if lo < a < hi:
                out.append(a)
        return sorted(out)

    def order(self, own_rep: int) -> list[int]:
        """Own replica first, then the others nearest by index."""
        n = len(self.old.replicas)
        rest = sorted((i for i in range(n) if i != own_rep), key=lambda i: (abs(i - own_rep), i))
        return [own_rep, *rest]

    def choose(self, own_rep: int, stage: int, space: str, lo: int, hi: int, elems: int
               ) -> list[tuple[int, int, int]] | None:
        """[(src, lo, hi)] covering [lo, hi), or None if some unit has no alive holder."""
        order = self.order(own_rep)
        peer = self._from_replica(own_rep, stage, space, lo, hi)
        out: list[tuple[int, int, int]] = []
        for a, b, src in peer:
            if src is not None:
                out.append((src, a, b))
                self.load[src] = self.load.get(src, 0) + (b - a) * elems
                continue
            got = self._spread(order[1:], stage, space, a, b, elems)
            if got is None:
                return None
            out += got
        return out

    def _from_replica(self, rep: int, stage: int, space: str, lo: int, hi: int
                      ) -> list[tuple[int, int, int | None]]:
        cuts = [lo, *self._cuts(rep, stage, space, lo, hi), hi]
        return [(a, b, self._holder(rep, stage, space, a, b)) for a, b in itertools.pairwise(cuts)]

    def _spread(self, reps: list[int], stage: int, space: str, lo: int, hi: int, elems: int
                ) -> list[tuple[int, int, int]] | None:
        """Cut [lo, hi) into up to k blocks, each from the least-loaded holder among the k
        nearest replicas (every replica if none of those holds it)."""
        n = hi - lo
        blocks = min(n, self.k)
        edges = [lo + (n * q) // blocks for q in range(blocks + 1)]
        out: list[tuple[int, int, int]] = []
        for a, b in itertools.pairwise(edges):
            got = self._block(reps[: self.k], stage, space, a, b, elems)
            if got is None:
                got = self._block(reps, stage, space, a, b, elems)
            if got is None:
                return None
            out += got
        return out

    def _block(self, reps: list[int], stage: int, space: str, lo: int, hi: int, elems: int
               ) -> list[tuple[int, int, int]] | None:
        best: tuple[int, int, int] | None = None
        for pos, rep in enumerate(reps):
            src = self._holder(rep, stage, space, lo, hi)
            if src is not None:
                key = (self.load.get(src, 0), pos, src)
                if best is None or key < best:
                    best = key
        if best is not None:
            self.load[best[2]] = best[0] + (hi - lo) * elems
            return [(best[2], lo, hi)]
        if hi - lo == 1 or not reps:
            return None
        cuts = self._cuts(reps[0], stage, space, lo, hi) or [(lo + hi) // 2]
        edges = [lo, *cuts, hi]
        out: list[tuple[int, int, int]] = []
        for a, b in itertools.pairwise(edges):
            got = self._block(reps, stage, space, a, b, elems)
            if got is None:
                return None
            out += got
        return out


def _missing(need: tuple[int, int], own: tuple[int, int] | None) -> list[tuple[int, int]]:
    lo, hi = need
    if own is None or own[1] <= lo or own[0] >= hi:
        return [(lo, hi)]
    return [(a, b) for a, b in ((lo, max(lo, own[0])), (min(hi, own[1]), hi)) if b > a]


def _unchanged(old: Plan, new: Plan) -> Callable[[int, int], bool]:
    """Whether old rank o and new rank n sit at the same (stage, degree, TP index)."""
    def where(plan: Plan, r: int) -> tuple[int, int, int]:
        i, s, j = plan.rank_index[r]
        return s, plan.replicas[i].tp[s], j

    return lambda o, n: where(old, o) == where(new, n)


def _ranges(plan: Plan, rank: int, experts: MoveExperts | None = None
            ) -> list[tuple[str, int, int, int]]:
    """(space, lo, hi, elements per unit) of everything ``rank`` holds."""
    i, s, j = plan.rank_index[rank]
    return _ranges_at(plan.request.model, plan.pp, plan.request.parallel.unit_balance, s,
                      plan.replicas[i].tp[s], j, experts)


@lru_cache(maxsize=65536)
def _ranges_at(dims: ModelDims, pp: int, balance: str, stage: int, degree: int, j: int,
               experts: MoveExperts | None = None) -> list[tuple[str, int, int, int]]:
    out = []
    for space in _spaces(experts):
        e = _unit_elems(dims, pp, stage, space, experts)
        if e == 0:
            continue
        if space == REP:
            out.append((space, 0, 1, e))
        else:
            b = _bounds(dims, space, degree, balance, experts)
            out.append((space, int(b[j]), int(b[j + 1]), e))
    return out


def plan_move(old: Plan, new: Plan, rank_map: Mapping[int, int], *, bytes_per_elem: int = 12,
              max_sources: int = 8, joiners: frozenset[int] = frozenset(),
              experts: MoveExperts | None = None) -> MovePlan:
    """The move plan from ``old`` to ``new`` (see the module docstring). ``bytes_per_elem``:
    bytes of all moved fields per parameter element (fp32 + Adam 12; bf16 + master + Adam 14),
    for the byte figures only. ``joiners``: new ranks without an old rank (a returning GPU's new
    process, grow back): they hold nothing, so everything they hold comes from survivors
    (their replica's old TP peers first). ``experts``: a MoE model's expert space is planned
    too (see the module docstring). Deterministic: every rank computes the same plan."""
    _check(old, new, rank_map, frozenset(joiners))
    if experts is not None:
        for t in sorted({t for rep in (*old.replicas, *new.replicas) for t in rep.tp}):
            expert_bounds(experts.num_experts, t)  # names model.num_moe_experts
    rmap = dict(rank_map)
    inv = {n: o for o, n in rmap.items()}
    src = _Sources(old, set(rmap), max_sources, experts)
    pieces: list[Piece] = []
    lower: dict[int, int] = {}
    same = _unchanged(old, new)
    for n in range(new.world_size):
        o = inv.get(n)
        lower[n] = 0
        s = new.rank_index[n][1]
        if o is not None and same(o, n):  # holds exactly what it held: local copies only
            pieces += [Piece(n, o, s, sp, lo, hi, (hi - lo) * e) for sp, lo, hi, e in
                       _ranges(new, n, experts)]
            continue
        for space in stage_spaces(new, s, experts):
            _, _, lo, hi = holding(new, n, space, experts)
            if o is None:  # a joiner: its new replica's old ranks are its nearest sources
                orep, own = min(new.rank_index[n][0], len(old.replicas) - 1), None
            else:
                orep, os_, olo, ohi = holding(old, o, space, experts)
                own = (olo, ohi) if os_ == s else None
            elems = unit_elems(new, s, space, experts)
            if o is not None and own is not None and min(hi, own[1]) > max(lo, own[0]):
                a, b = max(lo, own[0]), min(hi, own[1])
                pieces.append(Piece(n, o, s, space, a, b, (b - a) * elems))
            for a, b in _missing((lo, hi), own):
                lower[n] += (b - a) * elems * bytes_per_elem
                got = src.choose(orep, s, space, a, b, elems)
                if got is None:
                    return MovePlan(False, f"units [{a}, {b}) of {space} at stage {s} (new rank "
                                    f"{n}) are held by no survivor", (), rmap, bytes_per_elem,
                                    experts=experts)
                pieces += [Piece(n, r, s, space, x, y, (y - x) * elems) for r, x, y in got]
    return _finish(pieces, rmap, bytes_per_elem, lower, experts)


def _finish(pieces: Sequence[Piece], rmap: dict[int, int], bpe: int,
            lower: dict[int, int], experts: MoveExperts | None = None) -> MovePlan:
    merged: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.dst, p.stage, p.space, p.lo)):
        q = merged[-1] if merged else None
        if q is not None and (q.dst, q.src, q.stage, q.space, q.hi) == (
                p.dst, p.src, p.stage, p.space, p.lo):
            merged[-1] = Piece(q.dst, q.src, q.stage, q.space, q.lo, p.hi, q.elems + p.elems)
        else:
            merged.append(p)
    recv: dict[int, int] = {n: 0 for n in lower}
    sent: dict[int, int] = {}
    for p in merged:
        if rmap[p.src] != p.dst:
            recv[p.dst] += p.elems * bpe
            sent[p.src] = sent.get(p.src, 0) + p.elems * bpe
    return MovePlan(True, "", tuple(merged), rmap, bpe, lower, recv, sent, experts)


def split_stream(items: Sequence[tuple[object, int, int]], bucket_bytes: int
                 ) -> list[list[tuple[object, int, int]]]:
    """Cut a stream of ``(key, n_units, bytes_per_unit)`` into chunks of at most
    ``bucket_bytes`` (a single unit larger than that travels alone), splitting items at unit
    boundaries; returns per chunk ``[(key, first_unit, stop_unit)]`` (units relative to the
    item). Sender and receiver call it on the same stream and get the same chunks."""
    chunks: list[list[tuple[object, int, int]]] = []
    cur: list[tuple[object, int, int]] = []
    room = bucket_bytes
    for key, n, per in items:
        u = 0
        while u < n:
            fit = room // per if per else n - u
            if fit == 0:
                if cur:
                    chunks.append(cur)
                    cur, room = [], bucket_bytes
                    continue
                fit = 1  # one oversized unit alone
            take = min(fit, n - u)
            cur.append((key, u, u + take))
            room -= take * per
            u += take
            if room <= 0:
                chunks.append(cur)
                cur, room = [], bucket_bytes
    if cur:
        chunks.append(cur)
    return chunks
