"""The MLA part of the independent MoE reference (``moe_reference.py``): stock megatron-core
0.19.2 ``MLASelfAttention`` (multi-latent attention, DeepSeek-V2/V3) in megatron's own local
layer spec, ``get_gpt_layer_local_spec(multi_latent_attention=True, ...)``.

The only non-stock piece is :class:`MLACoreAttention`. megatron's ``MLASelfAttention`` builds its
core attention with ``k_channels``/``v_channels`` keyword arguments that only Transformer
Engine's attention takes; the local ``DotProductAttention`` does not, so the stock local MLA spec
does not build without TE (``TypeError: ... unexpected keyword argument 'k_channels'``). The
adapter drops the two arguments; ``DotProductAttention`` then sizes its output by
``kv_channels x heads``, which is MLA's ``v_head_dim x heads`` when ``kv_channels = v_head_dim``
(checked), and takes MLA's own ``softmax_scale`` (``1/sqrt(qk_head_dim + qk_pos_emb_head_dim)``,
times YaRN's mscale squared). Its math is megatron's unchanged.

Shape: DeepSeek-V3's attention in miniature (``DSV3_MLA`` + ``MLAShape``): query and KV
low-rank compression (``q_lora_rank``, ``kv_lora_rank``) with their latent RMSNorms
(``qk_layernorm``), ``qk_head_dim`` + a decoupled RoPE part ``qk_pos_emb_head_dim`` (RoPE on that
part only, one shared key RoPE head), ``v_head_dim``, YaRN (``rope_type='yarn'`` with its
factors; megatron's ``MLATransformerConfig`` fields, not the ``yarn_*`` attributes of dense
models).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention

DSV3_MLA: dict[str, Any] = dict(
    num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=8, kv_channels=8,
    ffn_hidden_size=64, vocab_size=96, seq_length=12, qk_layernorm=True,
    normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
    q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
"""The tiny DeepSeek-V3 shape's ``nemo_nutp.config.ModelConfig`` fields (with ``MLAShape``): MLA
has one KV "group" per head (``num_query_groups = num_attention_heads``: heads are the units),
``kv_channels = v_head_dim`` (the attention output width per head), and its shape fields
(the same as ``MLAShape``'s: what NUTP's layout reads)."""


@dataclass(frozen=True)
class MLAShape:
    """MLA settings (megatron ``MLATransformerConfig`` names); DeepSeek-V3's ratios, tiny."""

    q_lora_rank: int | None = 16
    kv_lora_rank: int = 12
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    rope_type: str = "yarn"
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def fields(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "multi_latent_attention": True}


def mla_config(base: Any, mla: MLAShape) -> Any:
    """megatron's ``MLATransformerConfig`` with ``base``'s (a ``TransformerConfig``) fields and
    the MLA ones."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig)
           if f.init}
    if own["kv_channels"] != mla.v_head_dim:
        raise ValueError(f"kv_channels={own['kv_channels']}: must be v_head_dim="
                         f"{mla.v_head_dim} (DotProductAttention's output width per head)")
    return MLATransformerConfig(**{**own, **mla.fields()})


class MLACoreAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` taking (and dropping) the ``k_channels`` /
    ``v_channels`` that ``MLASelfAttention`` passes (see the module doc)."""

    def __init__(self, *args: Any, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert v_channels is None or v_channels == self.config.kv_channels, (
            v_channels, self.config.kv_channels)


def mla_layer_spec(num_experts: int | None, *, qk_layernorm: bool, normalization: str) -> Any:
    """megatron's own local GPT layer spec with MLA (and MoE for ``num_experts``), the core
    attention replaced by :class:`MLACoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm, normalization=normalization,
                                    multi_latent_attention=True)
    spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return spec
