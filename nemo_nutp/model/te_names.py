"""Checkpoint names shared by the local and the Transformer-Engine layers (pure).

Both implementations write the same checkpoint: TE fuses the pre-attention and pre-MLP norms
into ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``, ``layer_norm_bias``), and megatron's
local spec already renames its separate norms to those keys (its
``sharded_state_dict_keys_map``, applied by ``checkpoint.sharding``), so every parameter key is
the same. What differs is ``_extra_state``: TE modules (linears and ``core_attention``) carry
fp8 scaling metadata, megatron's local linears carry None and its ``DotProductAttention`` none
at all. NUTP runs no fp8, so extra state is never read back on load (``read_back_on_load``): a
checkpoint of either implementation loads into the other.
"""

from __future__ import annotations

TE_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""Local layer parameter prefix -> TE's fused name (megatron's local-spec keys map)."""


def te_name(local: str) -> str:
    """The TE layer's name of a local layer parameter (``decoder.layers.<i>.`` kept)."""
    head, sep, rest = local.partition("decoder.layers.")
    if not sep:
        return local
    num, dot, tail = rest.partition(".")
    for old, new in TE_FUSED_NORMS.items():
        if tail.startswith(old):
            return f"{head}decoder.layers.{num}{dot}{new}{tail[len(old):]}"
    return local


def local_name(te: str) -> str:
    """Inverse of ``te_name``."""
    for old, new in TE_FUSED_NORMS.items():
        if new in te:
            return te.replace(new, old, 1)
    return te


def read_back_on_load(key: str) -> bool:
    """Whether a loader requests this state key: not ``_extra_state`` (TE's fp8 metadata, the
    local layers' None), which one implementation has where the other has none."""
    return not key.endswith("_extra_state")
