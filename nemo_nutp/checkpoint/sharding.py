"""megatron-core's own sharded state dict of a GPT model, for NUTP's uneven shards.

``megatron_sharded_state_dict(model, dims, ...)`` describes this rank's parameters with *exactly*
the keys, global shapes and dtypes that megatron-core's ``GPTModel.sharded_state_dict()`` gives the
equivalent uniform model (so a stock megatron model at any TP loads it with plain
``dist_checkpointing.load(model.sharded_state_dict(), dir)``, and NUTP loads stock checkpoints):

* keys have no prefix (``embedding.word_embeddings.weight``, ``output_layer.weight``,
  ``decoder.final_layernorm.weight``);
* transformer layers share one key per parameter with a leading layer axis:
  ``decoder.layers.<name>`` of global shape ``(num_layers, *shape)``, layer ``i`` at offset ``i``
  (megatron's ``prepend_axis_num=1``);
* the layer spec's ``sharded_state_dict_keys_map`` renames keys (megatron's local spec:
  ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` ->
  ``mlp.linear_fc1.layer_norm_``; the TE spec's names are already fused);
* every ``_extra_state`` is a ``ShardedObject`` of shape ``(num_layers,)`` (layers) or ``(1,)``,
  except ``output_layer._extra_state``, which megatron's ``GPTModel`` drops;
* gated fc1 keeps megatron's global ``(2F, H)`` = ``[gate rows; up rows]``: a rank holding FFN
  units ``[lo, hi)`` writes two chunks, gate rows ``[lo, hi)`` and up rows ``[F + lo, F + hi)``
  (megatron's ``apply_swiglu_sharded_factory`` with uneven offsets).

* MoE experts (``model.moe``: whole experts per rank, tagged ``nutp_expert``) are written as
  megatron's ``SequentialMLP`` writes them: ``decoder.layers.mlp.experts.experts.<name>`` of
  global shape ``(num_layers, num_experts, *shape)``, each at its *global* expert index
  (``expert_pieces``); the optimizer side is ``checkpoint/experts.py``.

Uneven chunks get ``axis_fragmentations=None`` (megatron-core's uneven sharding: torch DCP
validates coverage and reshards on load). Who writes: replica 0 (``replica_id`` all zero) writes
sharded parameters; replicated ones (norms, row-parallel biases, extra state) are written by
replica 0's TP rank 0. Replicas hold identical data (contract 1), so nothing is lost.

The dict keys are this rank's parameter names (``decoder.layers.3.input_layernorm.weight``), as
in megatron, so a loaded dict maps back to parameters by name; ``.data`` of every entry is the
parameter object itself (megatron's optimizer finds its states by ``id(data)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from ..layout import PARAM_KINDS
from ..layout.specs import ModelDims
from ..layout.units import unit_geometry
from ..model.build import global_name

LOCAL_SPEC_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""megatron's ``get_gpt_layer_local_spec`` ``sharded_state_dict_keys_map`` (used when a model's
layers do not carry their spec)."""

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_DROPPED = ("output_layer._extra_state",)


@dataclass(frozen=True)
class Piece:
    """One chunk of a global tensor held by this rank: local rows ``rows`` (None: all) sit at
    ``global_offset`` of ``global_shape`` (layer axis included)."""

    key: str
    rows: tuple[int, int] | None
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def keys_map(model: torch.nn.Module) -> dict[str, str]:
    """The layer spec's ``sharded_state_dict_keys_map`` (megatron applies it per layer)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    sub = getattr(layers[0], "submodules_config", None) if layers else None
    found = getattr(sub, "sharded_state_dict_keys_map", None)
    return dict(found) if found is not None else dict(LOCAL_SPEC_KEYS_MAP)


def megatron_key(name: str, kmap: dict[str, str]) -> tuple[str, int | None]:
    """(megatron checkpoint key, layer number or None) of a parameter/state name."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    rest = m.group(2)
    for old, new in kmap.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"decoder.layers.{rest}", int(m.group(1))


def pieces(name: str, kind: str | None, dims: ModelDims, units: tuple[int, int] | None,
           local_shape: tuple[int, ...], kmap: dict[str, str]) -> list[Piece]:
    """The chunks of megatron's global tensor(s) that a local parameter describes.

    A layer's chunk carries the layer axis as a leading local dimension of size 1 (megatron
    writes ``prepend_axis_num=1`` chunks exactly so; its uneven-sharding writer does not take
    ``prepend_axis_num``, so the axis is explicit here)."""
    key, layer = megatron_key(name, kmap)
    lead: tuple[int, ...] = () if layer is None else (dims.num_layers,)
    lead_off: tuple[int, ...] = () if layer is None else (layer,)
    one: tuple[int, ...] = () if layer is None else (1,)
    if kind is None:
        return [Piece(key, None, one + local_shape, lead + local_shape,
                      lead_off + (0,) * len(local_shape))]
    assert units is not None, name
    shape, per_unit, half = unit_geometry(kind, dims)
    axis = PARAM_KINDS[kind].axis
    lo, hi = units
    if half:  # gated fc1: [gate rows lo..hi; up rows F+lo..F+hi] of the global (2F, ...)
        n = (hi - lo) * per_unit
        loc = (*one, n, *local_shape[1:])
        rest = (0,) * (len(shape) - 1)
        return [Piece(key, (0, n), loc, lead + shape, (*lead_off, lo * per_unit, *rest)),
                Piece(key, (n, 2 * n), loc, lead + shape,
                      (*lead_off, half + lo * per_unit, *rest))]
    off = [0] * len(shape)
    off[axis] = lo * per_unit
    return [Piece(key, None, one + local_shape, lead + shape, lead_off + tuple(off))]


def _tensor(piece: Piece, key: str, data: torch.Tensor, replica_id: Any) -> ShardedTensor:
    view = data if piece.rows is None else data[piece.rows[0]:piece.rows[1]]
    if tuple(view.shape) != piece.local_shape:
        view = view.view(piece.local_shape)
    return ShardedTensor(key=key, data=view, dtype=data.dtype,
                         local_shape=piece.local_shape, global_shape=piece.global_shape,
                         global_offset=piece.global_offset, axis_fragmentations=None,
                         replica_id=replica_id)


def _factory(param: torch.Tensor, parts: list[Piece], replica_id: Any) -> ShardedTensorFactory:
    """One local tensor -> its chunks (views). A factory, so that ``.data`` stays the parameter
    itself (megatron's optimizer matches its states to params by ``id(data)``); for gated fc1 it
    is megatron's swiglu factory with uneven offsets."""

    def build(k: str, t: torch.Tensor, rid: Any, flattened_range: Any = None
              ) -> list[ShardedTensor]:
        del flattened_range
        return [_tensor(p, k, t.detach(), rid) for p in parts]

    def merge(ts: list[torch.Tensor]) -> torch.Tensor:
        flat = [t.reshape(-1, *param.shape[1:]) if param.dim() else t.reshape(()) for t in ts]
        return torch.cat(flat, 0) if len(flat) > 1 else flat[0]

    return ShardedTensorFactory(parts[0].key, param, build, merge, replica_id)


def _extra_object(name: str, obj: Any, dims: ModelDims, kmap: dict[str, str],
                  replica_id: Any) -> ShardedObject:
    key, layer = megatron_key(name, kmap)
    if layer is None:
        return ShardedObject(key, obj, (1,), (0,), replica_id=replica_id)
    return ShardedObject(key, obj, (dims.num_layers,), (layer,), replica_id=replica_id)


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of the model's first transformer layer (its pipeline stage's offset)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return int(layers[0].layer_number) - 1 if layers else 0


_WRAPPER = re.compile(r"^(chunks\.\d+\.)?module\.")


def state_key(name: str) -> str:
    """The key ``megatron_sharded_state_dict`` gives a parameter of the rank's model named
    ``name``: without the half-precision wrapper's ``module.``, which sits at the top or, with
    virtual pipeline stages, inside each chunk (``chunks.<c>.module.``)."""
    return _WRAPPER.sub(r"\1", name, count=1)


def _chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A ``model.ModelChunks``'s chunks (virtual pipeline stages), each NUTP GPT itself: a
    half-precision run wraps every chunk in megatron's ``Float16Module``, whose ``decoder`` is
    its ``module``'s (without unwrapping, every chunk's layers would be keyed from layer 0)."""
    from megatron.core.transformer.module import Float16Module

    chunks: Any = model.chunks
    return [c.module if isinstance(c, Float16Module) else c for c in chunks]


_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def expert_indices(model: torch.nn.Module) -> dict[str, int]:
    """``{"decoder.layers.<i>.mlp.experts.local_experts.<l>": global expert index}`` of the
    model's local experts (``model.moe.NUTPMoELayer`` tags each expert module ``nutp_expert``);
    empty for a dense model."""
    return {name.removeprefix("module."): int(m.nutp_expert) for name, m in model.named_modules()
            if getattr(m, "nutp_expert", None) is not None}


def expert_pieces(name: str, experts: dict[str, int], dims: ModelDims, num_experts: int,
                  local_shape: tuple[int, ...], kmap: dict[str, str]) -> list[Piece] | None:
    """megatron's ``SequentialMLP`` chunks of a local expert's tensor (None: not an expert's):
    key ``decoder.layers.mlp.experts.experts.<rest>``, global shape ``(L, E, *shape)``, this
    expert at ``(layer, global index)``; gated fc1 as megatron's swiglu factory writes it, the
    gate and up halves as two chunks. The expert is whole on its rank (expert TP 1)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    layer, local, rest = int(m[1]), int(m[2]), m[3]
    e = experts[f"decoder.layers.{layer}.mlp.experts.local_experts.{local}"]
    key, _ = megatron_key(f"decoder.layers.{layer}.mlp.experts.experts.{rest}", kmap)
    lead, off = (dims.num_layers, num_experts), (layer, e)
    rest0 = (0,) * len(local_shape)
    if rest == "linear_fc1.weight" and getattr(dims, "gated_linear_unit", False):
        n = local_shape[0] // 2
        loc = (1, 1, n, *local_shape[1:])
        return [Piece(key, (0, n), loc, lead + local_shape, off + rest0),
                Piece(key, (n, 2 * n), loc, lead + local_shape,
                      (*off, n, *rest0[1:]))]
    return [Piece(key, None, (1, 1, *local_shape), lead + local_shape, off + rest0)]


def _expert_object(name: str, obj: Any, dims: ModelDims, experts: dict[str, int],
                   num_experts: int, kmap: dict[str, str], replica: int) -> ShardedObject | None:
    m = _EXPERT.match(name)
    if m is None:
        return None
    layer, e = int(m[1]), experts[f"decoder.layers.{m[1]}.mlp.experts.local_experts.{m[2]}"]
    key, _ = megatron_key(f"decoder.layers.{layer}.mlp.experts.experts.{m[3]}", kmap)
    return ShardedObject(key, obj, (dims.num_layers, num_experts), (layer, e),
                         replica_id=(0, 0, replica))


def _num_experts(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "num_moe_experts", None) or 0)


def megatron_sharded_state_dict(model: torch.nn.Module, dims: ModelDims, *, replica: int,
                                tp_rank: int) -> dict[str, Any]:
    """``{name: ShardedTensor | ShardedTensorFactory | ShardedObject}`` of this rank's model in
    megatron-core's GPT format (see the module docstring). ``model``: the unwrapped NUTP GPT
    whose parameters carry ``nutp_kind``/``nutp_units``.

    Pipeline stages: layers get their global index (the stage's offset added); the last
    stage's copy of a tied embedding is megatron's: a non-main replica of
    ``embedding.word_embeddings.weight`` (never written; loaded from the first stage's).
    Virtual pipeline stages (``model.ModelChunks``): every chunk's, its names prefixed
    ``chunks.<c>.`` as the rank's parameter names, each chunk's layers at their global index."""
    if hasattr(model, "chunks"):
        return {f"chunks.{c}.{k}": v for c, chunk in enumerate(_chunks(model))
                for k, v in megatron_sharded_state_dict(chunk, dims, replica=replica,
                                                        tp_rank=tp_rank).items()}
    kmap = keys_map(model)
    offset = layer_offset(model)
    experts, num_experts = expert_indices(model), _num_experts(model)
    out: dict[str, Any] = {}
    for raw, value in model.state_dict(keep_vars=True).items():
        name = raw.removeprefix("module.")
        gname = global_name(name, layer_offset=offset)
        if name.endswith(_DROPPED):
            continue
        if experts and _EXPERT.match(name):  # megatron's SequentialMLP keys (one pipeline stage)
            if name.endswith("_extra_state"):
                out[name] = _expert_object(name, value, dims, experts, num_experts, kmap,
                                           replica)
                continue
            parts = expert_pieces(name, experts, dims, num_experts, tuple(value.shape), kmap)
            assert parts is not None
            out[name] = _factory(value, parts, (0, 0, replica))
            continue
        if name.endswith("_extra_state"):
            out[name] = _extra_object(gname, value, dims, kmap, (0, tp_rank, replica))
            continue
        kind = getattr(value, "nutp_kind", None)
        rid: tuple[int, ...] = (0, 0, replica) if kind is not None else (0, tp_rank, replica)
        if getattr(value, "nutp_tied_copy", False):
            gname, kind, rid = "embedding.word_embeddings.weight", "word_embedding", (1, 0, 0)
        parts = pieces(gname, kind, dims, getattr(value, "nutp_units", None),
                       tuple(value.shape), kmap)
        if len(parts) == 1 and parts[0].local_shape == tuple(value.shape):
            out[name] = _tensor(parts[0], parts[0].key, value, rid)
        else:
            out[name] = _factory(value, parts, rid)
    return out


def expected_global_shapes(model: torch.nn.Module, dims: ModelDims) -> dict[str, list[int]]:
    """Global shape of every megatron checkpoint key of the model's parameters."""
    if hasattr(model, "chunks"):  # virtual pipeline stages: every chunk's
        return {k: v for chunk in _chunks(model)
                for k, v in expected_global_shapes(chunk, dims).items()}
    kmap = keys_map(model)
    offset = layer_offset(model)
    experts, num_experts = expert_indices(model), _num_experts(model)
    out: dict[str, list[int]] = {}
    for raw, p in model.named_parameters():
        name = global_name(raw, layer_offset=offset)
        found = expert_pieces(name, experts, dims, num_experts, tuple(p.shape), kmap) \
            if experts else None
        if found is not None:
            out.update({piece.key: list(piece.global_shape) for piece in found})
            continue
        kind = getattr(p, "nutp_kind", None)
        if getattr(p, "nutp_tied_copy", False):
            name, kind = "embedding.word_embeddings.weight", "word_embedding"
        for piece in pieces(name, kind, dims,
                            getattr(p, "nutp_units", None), tuple(p.shape), kmap):
            out[piece.key] = list(piece.global_shape)
    return out
