"""Units of TP-sharded parameters, their assignment to ranks, and element index maps.

A *unit* is the smallest slice of a sharded parameter that can move between ranks without
changing the math (see NUTP.md). Every parameter kind lives in one *unit space*:

=============  ===================  ==========================================================
space          units                parameter kinds
=============  ===================  ==========================================================
``qg``         query groups          fused QKV weight/bias (rows), attention proj (columns)
``ffn``        FFN columns           fc1 weight/bias (rows; gate+up together), fc2 (columns)
``vocab``      vocabulary rows       word embedding, untied output layer
=============  ===================  ==========================================================

Contract:
* ``assignment(U, t)`` gives rank ``j`` the contiguous units ``[b[j], b[j+1])`` with counts
  differing by at most one; ``t`` need not divide ``U``. ``space_bounds`` is what plans use:
  the same for query groups and vocab rows, and by default *work-balanced* FFN ranges.
* ``global_index(kind, dims, units)`` returns, for each unit, the flat indices of its elements in
  the *global* (TP1 megatron) tensor in **canonical order** (ascending global flat index). Pairing
  by (unit, canonical element) is what makes cross-replica reduction correct for row-parallel,
  gated and GQA layouts alike; pairing by local flat offset is not.
* ``local_layout(kind, dims, units)`` returns, for each element of the rank's *local* tensor in
  megatron's memory order, its global flat index (gated fc1: all gate rows, then all up rows).
* ``unit_view_shape(kind, dims, n_local)`` is the O(1) form of both: the local tensor viewed as
  ``(H, n_local, W)`` and transposed to ``(n_local, H, W)`` holds unit ``u``'s elements at
  ``[u]`` in canonical order (row blocks, column blocks and gate/up halves alike), so moving
  units ``[lo, hi)`` is a strided view, never an index array.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .specs import ModelDims

SPACES = ("qg", "ffn", "vocab")


@dataclass(frozen=True)
class ParamKind:
    """A TP-sharded parameter kind of a GPT model."""

    name: str
    space: str
    axis: int  # dimension of the global tensor the units split (0 rows, 1 columns)


PARAM_KINDS: dict[str, ParamKind] = {
    k.name: k
    for k in (
        ParamKind("qkv_weight", "qg", 0),
        ParamKind("qkv_bias", "qg", 0),
        ParamKind("proj_weight", "qg", 1),
        ParamKind("fc1_weight", "ffn", 0),
        ParamKind("fc1_bias", "ffn", 0),
        ParamKind("fc2_weight", "ffn", 1),
        ParamKind("word_embedding", "vocab", 0),
        ParamKind("output_layer", "vocab", 0),
        ParamKind("mla_q_weight", "qg", 0),
        ParamKind("mla_kv_up_weight", "qg", 0),
    )
}


def kinds_of(dims: ModelDims) -> list[str]:
    """The kinds a model of ``dims`` can have: MLA's (``mla_*``) with MLA
    (``model.kv_lora_rank``), the fused QKV ones without."""
    mla = getattr(dims, "kv_lora_rank", None) is not None
    return [k for k in PARAM_KINDS
            if (k.startswith("mla_") if mla else not k.startswith("mla_"))
            and not (mla and k.startswith("qkv_"))]


def num_units(dims: ModelDims, space: str) -> int:
    return {"qg": dims.num_query_groups, "ffn": dims.ffn_hidden_size,
            "vocab": dims.vocab_size}[space]


def layer_kinds(dims: ModelDims) -> list[str]:
    """Sharded kinds present in one transformer layer."""
    if getattr(dims, "kv_lora_rank", None) is not None:
        return ["mla_q_weight", "mla_kv_up_weight", "proj_weight", "fc1_weight", "fc2_weight"]
    kinds = ["qkv_weight", "proj_weight", "fc1_weight", "fc2_weight"]
    if dims.qkv_bias:
        kinds.append("qkv_bias")
    if dims.add_bias_linear:
        kinds.append("fc1_bias")
    return kinds


def replicated_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Replicated (not TP-sharded) parameters of one layer: norms and row-parallel biases."""
    h = dims.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm": (h,), "pre_mlp_layernorm": (h,)}
    if getattr(dims, "kv_lora_rank", None) is not None:
        r, pos = int(dims.kv_lora_rank or 0), int(dims.qk_pos_emb_head_dim or 0)
        if dims.q_lora_rank is not None:
            shapes.update(q_down_proj=(dims.q_lora_rank, h))
        shapes.update(kv_down_proj=(r + pos, h))
        if dims.qk_layernorm:
            if dims.q_lora_rank is not None:
                shapes.update(q_latent_layernorm=(dims.q_lora_rank,))
            shapes.update(kv_latent_layernorm=(r,))
        return shapes
    if dims.qk_layernorm:
        shapes.update(q_layernorm=(dims.kv,), k_layernorm=(dims.kv,))
    if getattr(dims, "post_layernorm", False):
        shapes.update(proj_post_layernorm=(h,), fc2_post_layernorm=(h,))
    if dims.add_bias_linear:
        shapes.update(proj_bias=(h,), fc2_bias=(h,))
    return shapes


@lru_cache(maxsize=4096)
def _assignment(n: int, t: int) -> np.ndarray:
    b = (np.arange(t + 1, dtype=np.int64) * n) // t
    b.setflags(write=False)
    return b


def assignment(n: int, t: int) -> np.ndarray:
    """Boundaries ``b`` (length t+1): rank j holds units [b[j], b[j+1])."""
    if t < 1 or t > n:
        raise ValueError(f"degree={t}: must be in [1, {n}] for {n} units")
    return _assignment(n, t)


def unit_geometry(kind: str, d: ModelDims) -> tuple[tuple[int, ...], int, int]:
    """(global shape, rows-or-cols per unit along the split axis, rows per half for gated)."""
    h, g, kv, hpg = d.hidden_size, d.num_query_groups, d.kv, d.heads_per_group
    f, v = d.ffn_hidden_size, d.vocab_size
    per_group = (hpg + 2) * kv
    halves = 2 if d.gated_linear_unit else 1
    table: dict[str, tuple[tuple[int, ...], int, int]] = {
        "qkv_weight": ((g * per_group, h), per_group, 0),
        "qkv_bias": ((g * per_group,), per_group, 0),
        "proj_weight": ((h, g * hpg * kv), hpg * kv, 0),
        "fc1_weight": ((halves * f, h), 1, f if d.gated_linear_unit else 0),
        "fc1_bias": ((halves * f,), 1, f if d.gated_linear_unit else 0),
        "fc2_weight": ((h, f), 1, 0),
        "word_embedding": ((v, h), 1, 0),
        "output_layer": ((v, h), 1, 0),
    }
    if kind.startswith("mla_"):
        return _mla_geometry(kind, d)
    return table[kind]


def _mla_geometry(kind: str, d: ModelDims) -> tuple[tuple[int, ...], int, int]:
    """MLA's head-sharded up-projections (rows; a head's rows are a unit): ``mla_q_weight``
    ``[heads x (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank or hidden]``,
    ``mla_kv_up_weight`` ``[heads x (qk_head_dim + v_head_dim), kv_lora_rank]``. Empty
    (``[0, 0]``) without MLA. ``linear_proj`` is the ``proj_weight`` kind (one group per head,
    ``kv = v_head_dim``)."""
    n = d.num_attention_heads
    if getattr(d, "kv_lora_rank", None) is None:
        return (n, 0), 1, 0
    qk, pos, v = int(d.qk_head_dim or 0), int(d.qk_pos_emb_head_dim or 0), int(d.v_head_dim or 0)
    if kind == "mla_q_weight":
        cols = d.hidden_size if d.q_lora_rank is None else d.q_lora_rank
        return (n * (qk + pos), cols), qk + pos, 0
    return (n * (qk + v), int(d.kv_lora_rank or 0)), qk + v, 0


def global_shape(kind: str, dims: ModelDims) -> tuple[int, ...]:
    return unit_geometry(kind, dims)[0]


def unit_numel(kind: str, dims: ModelDims) -> int:
    shape, per_unit, half = unit_geometry(kind, dims)
    rest = int(np.prod(shape)) // shape[PARAM_KINDS[kind].axis]
    return per_unit * rest * (2 if half else 1)


def local_shape(kind: str, dims: ModelDims, n_local: int) -> tuple[int, ...]:
    shape, per_unit, half = unit_geometry(kind, dims)
    axis = PARAM_KINDS[kind].axis
    out = list(shape)
    out[axis] = n_local * per_unit * (2 if half else 1)
    return tuple(out)


def unit_view_shape(kind: str, dims: ModelDims, n_local: int) -> tuple[int, int, int]:
    """``(H, n_local, W)``: viewing a rank's local tensor (``n_local`` consecutive units) with
    this shape, ``view.transpose(0, 1)[u]`` is local unit ``u`` with its ``H * W`` elements in
    canonical order. Row splits: ``H`` = 1, or 2 for the gate/up halves of gated fc1; column
    splits: ``H`` = rows, ``W`` = the unit's columns."""
    shape, per_unit, half = unit_geometry(kind, dims)
    cols = shape[1] if len(shape) == 2 else 1
    if PARAM_KINDS[kind].axis == 0:
        return (2 if half else 1), n_local, per_unit * cols
    return shape[0], n_local, per_unit


def global_index(kind: str, dims: ModelDims, units: np.ndarray) -> np.ndarray:
    """(len(units), unit_numel) global flat indices of each unit's elements, canonical order."""
    shape, per_unit, half = unit_geometry(kind, dims)
    units = np.asarray(units, dtype=np.int64)
    axis = PARAM_KINDS[kind].axis
    offs = np.arange(per_unit, dtype=np.int64)
    # Split-axis coordinates of each unit: (n, k) with k = per_unit (x2 for gated halves).
    coords = units[:, None] * per_unit + offs[None, :]
    if half:
        coords = np.concatenate([coords, coords + half], axis=1)
    if len(shape) == 1:
        return coords
    rows, cols = shape
    if axis == 0:
        return (coords[:, :, None] * cols + np.arange(cols)[None, None, :]).reshape(len(units), -1)
    # Split along columns: canonical order is row-major over (row, unit column).
    return (np.arange(rows)[None, :, None] * cols + coords[:, None, :]).reshape(len(units), -1)


def local_layout(kind: str, dims: ModelDims, units: np.ndarray) -> np.ndarray:
    """Global flat index of every element of the local tensor, in local memory order."""
    shape, per_unit, half = unit_geometry(kind, dims)
    units = np.asarray(units, dtype=np.int64)
    coords = (units[:, None] * per_unit + np.arange(per_unit)[None, :]).reshape(-1)
    if half:  # megatron keeps [gate_local; up_local] in two halves
        coords = np.concatenate([coords, coords + half])
    if len(shape) == 1:
        return coords
    rows, cols = shape
    if PARAM_KINDS[kind].axis == 0:
        return (coords[:, None] * cols + np.arange(cols)[None, :]).reshape(-1)
    return (np.arange(rows)[:, None] * cols + coords[None, :]).reshape(-1)


def local_unit_positions(kind: str, dims: ModelDims, n_local: int) -> np.ndarray:
    """(n_local, unit_numel): position in the local flat tensor of each local unit's canonical
    elements, for a rank holding ``n_local`` consecutive units. Independent of which units."""
    units = np.arange(n_local, dtype=np.int64)
    lay = local_layout(kind, dims, units)
    canon = global_index(kind, dims, units)
    order = np.argsort(lay, kind="stable")
    pos = order[np.searchsorted(lay, canon, sorter=order)]
    return pos


BALANCES = ("work", "units")


def _unit_costs(dims: ModelDims) -> tuple[float, float]:
    """Forward multiply-adds per token of one query group and of one FFN column."""
    h, kv, hpg, s = dims.hidden_size, dims.kv, dims.heads_per_group, dims.seq_length
    per_group = (hpg + 2) * kv * h + 2 * hpg * s * kv + hpg * kv * h
    per_ffn = (2 if dims.gated_linear_unit else 1) * h + h
    return float(per_group), float(per_ffn)


@lru_cache(maxsize=1024)
def _work_balanced_ffn(dims: ModelDims, t: int) -> np.ndarray:
    """FFN boundaries that even out per-rank layer work given the query-group split: a rank
    holding an extra query group takes fewer FFN columns (each rank keeps >= 1 column)."""
    f = dims.ffn_hidden_size
    per_group, per_ffn = _unit_costs(dims)
    qg = np.diff(assignment(dims.num_query_groups, t)).astype(np.float64)
    target = (qg.sum() * per_group + f * per_ffn) / t
    ideal = np.clip((target - qg * per_group) / per_ffn, 1.0, None)
    ideal *= f / ideal.sum()
    counts = np.maximum(1, np.floor(ideal)).astype(np.int64)
    while counts.sum() > f:  # only when the floor of 1 over-allocates
        counts[np.argmax(np.where(counts > 1, counts - ideal, -np.inf))] -= 1
    for i in np.argsort(-(ideal - counts), kind="stable")[: f - int(counts.sum())]:
        counts[i] += 1
    b = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    b.setflags(write=False)
    return b


def space_bounds(dims: ModelDims, space: str, t: int, balance: str = "work") -> np.ndarray:
    """Boundaries (length t+1) of the units of ``space`` over ``t`` ranks.

    ``units``: every space split into counts differing by at most one. ``work`` (default): query
    groups and vocab rows as ``units``; FFN columns sized so that every rank's layer work is as
    even as the query-group granularity allows (a rank with an extra group gets fewer columns).
    """
    n = num_units(dims, space)
    if balance == "units" or space != "ffn" or t == 1:
        return assignment(n, t)
    if balance != "work":
        raise ValueError(f"parallel.unit_balance={balance!r}: must be one of {BALANCES}")
    if t > n:
        raise ValueError(f"degree={t}: must be in [1, {n}] for {n} units")
    return _work_balanced_ffn(dims, t)


def rank_work(dims: ModelDims, t: int, layers: int, with_vocab: bool,
              balance: str = "work") -> np.ndarray:
    """Relative forward FLOPs per token of each of ``t`` ranks for a stage (compute model).

    Uses the real unit assignment, so query-group granularity and uneven shards show up as a
    slowest rank. Units: multiply-adds; constant factors cancel in ratios.
    """
    per_group, per_ffn = _unit_costs(dims)
    qg = np.diff(space_bounds(dims, "qg", t, balance)).astype(np.float64)
    ff = np.diff(space_bounds(dims, "ffn", t, balance)).astype(np.float64)
    work = layers * (qg * per_group + ff * per_ffn)
    if with_vocab:
        work = work + np.diff(space_bounds(dims, "vocab", t, balance)) * float(dims.hidden_size)
    return work


def max_degree(dims: ModelDims) -> int:
    """Largest TP degree every sharded parameter can take (one unit per rank at least)."""
    return min(num_units(dims, s) for s in SPACES)
