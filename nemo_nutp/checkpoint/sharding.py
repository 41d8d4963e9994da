"""Layout-free sharded state dicts: every local shard is one chunk of a *global* tensor.

megatron's own ``GPTModel.sharded_state_dict`` assumes uniform TP (equal chunks at
``tp_rank * size``), which is wrong for NUTP's uneven shards. Here the description comes from the
NUTP tags instead (``p.nutp_kind``, ``p.nutp_units``): a rank holding units ``[lo, hi)`` of a
parameter holds exactly one regular chunk of the global (TP1) tensor,

* row-split kinds (qkv, fc1, embeddings): rows ``[lo * r, hi * r)`` of the global matrix;
* column-split kinds (attention proj, fc2): columns ``[lo * c, hi * c)``;
* gated fc1 (megatron keeps ``[gate rows; up rows]`` of the local units): a chunk of the
  ``(2, F, H)`` view of the global ``(2F, H)`` weight, offset ``(0, lo, 0)``.

Chunks are uneven, so the ``ShardedTensor`` has ``axis_fragmentations=None`` (megatron-core's
"uneven sharding": torch DCP validates coverage and reshards on load). Any layout that describes
the same global tensors can therefore load any other layout's checkpoint.

Who writes: replica 0 (``replica_id`` all zero) writes sharded params; replicated params
(norms, row-parallel biases) are written by replica 0, TP rank 0 only. Replicas hold identical
data (contract 1), so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from ..layout import PARAM_KINDS
from ..layout.specs import ModelDims
from ..layout.units import _geometry


@dataclass(frozen=True)
class Chunk:
    """Where a local tensor sits in its global tensor (in the chunk's own view shape)."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def chunk_of(kind: str | None, dims: ModelDims, units: tuple[int, int] | None,
             local_shape: tuple[int, ...]) -> Chunk:
    """The chunk a local parameter of ``kind`` holding ``units`` describes."""
    if kind is None:
        return Chunk(tuple(local_shape), tuple(local_shape), (0,) * len(local_shape))
    assert units is not None, kind
    shape, per_unit, half = _geometry(kind, dims)
    axis = PARAM_KINDS[kind].axis
    lo, hi = units
    glob, loc = list(shape), list(shape)
    off = [0] * len(shape)
    if half:  # gated fc1: view (2F, ...) as (2, F, ...); the split axis moves to 1
        assert axis == 0, kind
        glob = [2, shape[0] // 2, *shape[1:]]
        loc = list(glob)
        off = [0] * len(glob)
        axis = 1
    loc[axis] = (hi - lo) * per_unit
    off[axis] = lo * per_unit
    return Chunk(tuple(glob), tuple(loc), tuple(off))


def _replica_id(kind: str | None, replica: int, tp_rank: int) -> tuple[int, int]:
    return (replica, 0 if kind is not None else tp_rank)


def _factory(key: str, param: torch.Tensor, chunk: Chunk, replica_id: tuple[int, int]
             ) -> ShardedTensorFactory:
    """A factory, not a plain ShardedTensor, so that ``.data`` stays the parameter object itself
    (megatron's optimizer matches its states to model params by ``id(data)``) while the saved
    chunk is a reshaped view (gated fc1)."""

    def build(k: str, t: torch.Tensor, rid: Any, flattened_range: Any = None) -> ShardedTensor:
        view = t.detach().view(chunk.local_shape)
        return ShardedTensor(key=k, data=view, dtype=t.dtype, local_shape=chunk.local_shape,
                             global_shape=chunk.global_shape, global_offset=chunk.global_offset,
                             axis_fragmentations=None, replica_id=rid)

    merge: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.reshape(param.shape)  # noqa: E731
    return ShardedTensorFactory(key, param, build, merge, replica_id)


def model_sharded_state_dict(model: torch.nn.Module, dims: ModelDims, *, replica: int,
                             tp_rank: int, prefix: str = "model.") -> dict[str, Any]:
    """``{param name: ShardedTensorFactory}`` for every parameter of this rank's model.

    Keys are the megatron parameter names (``module.`` stripped), i.e. the same global tensor
    has the same key in every layout.
    """
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        kind = getattr(p, "nutp_kind", None)
        units = getattr(p, "nutp_units", None)
        chunk = chunk_of(kind, dims, units, tuple(p.shape))
        out[name] = _factory(prefix + name, p, chunk, _replica_id(kind, replica, tp_rank))
    return out


def global_shapes(model: torch.nn.Module, dims: ModelDims) -> dict[str, list[int]]:
    """Global shape of every parameter (recorded in a checkpoint's marker)."""
    out = {}
    for name, p in model.named_parameters():
        kind = getattr(p, "nutp_kind", None)
        ch = chunk_of(kind, dims, getattr(p, "nutp_units", None), tuple(p.shape))
        out[name.removeprefix("module.")] = list(ch.global_shape)
    return out
