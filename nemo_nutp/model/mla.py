"""NUTP multi-latent attention (MLA, DeepSeek-V2/V3): heads as units (megatron-core 0.19).

megatron's ``MLASelfAttention`` projects the hidden state down to a query latent
(``linear_q_down_proj``, ``[q_lora_rank, h]``) and a KV latent plus one shared RoPE key
(``linear_kv_down_proj``, ``[kv_lora_rank + qk_pos_emb_head_dim, h]``), normalises the latents
(``q_layernorm``, ``kv_layernorm``), projects them up per head (``linear_q_up_proj``,
``[heads x (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]``; ``linear_q_proj`` from the
hidden state without a query latent; ``linear_kv_up_proj``,
``[heads x (qk_head_dim + v_head_dim), kv_lora_rank]``), applies RoPE (YaRN: ``rope_type``) to
the positional part only, and ends with ``linear_proj`` (``[h, heads x v_head_dim]``).

Under NUTP the units are the heads (the ``qg`` unit space with one query group per head: its
balanced assignment, 8 heads over 3 ranks are 2/3/3):

* the up-projections are sharded by head (their rows), ``linear_proj`` by head (its columns,
  megatron's row-parallel layer): the rank-local config view of ``layers.local_config``;
* the down-projections and the latent norms are replicated in the replica. Under sequence
  parallelism each rank applies them to its own sequence shard, so its gradient is a partial
  sum: they are marked ``sequence_parallel`` and the gradient sync sums them over the TP group,
  as it sums the norms. megatron shards the down-projections' outputs over TP instead (its
  ``ColumnParallelLinear``, which needs ``degree | q_lora_rank``); its TE spec replicates them
  (``TELinear``, ``parallel_mode='duplicated'``), which is what NUTP does with a
  ``ColumnParallelLinear`` over the rank alone (no collective). The forward then takes
  megatron's own replicated-latent path (gather the RoPE key over the sequence, the up
  projections gather the latents).

``NUTPMLASelfAttention`` subclasses megatron's ``MLASelfAttention``: it runs
``MultiLatentAttention.__init__`` (rotary embedding, core attention, ``linear_proj``) and builds
the four projections and two norms as ``MLASelfAttention.__init__`` does, but with the
down-projections over the rank alone (megatron's constructor accepts only its own linear
classes there, checked by identity). The forward is megatron's.

Layout: the model's shape fields (``model.kv_lora_rank`` etc., ``layout.specs.ModelDims``) give
the up-projections their unit kinds (``layout.units``: ``mla_q_weight``, ``mla_kv_up_weight``,
rows, in the ``qg`` space), so initialisation, the cross-replica gradient sync and assembly
treat them as they treat the fused QKV weight; the down-projections and latent norms are in
``replicated_shapes``.

Through ``nutp-bridge``: ``integrations.bridge_run.mla_of`` reads these settings from a Bridge
provider. Not built yet: MLA in ``nutp-train`` (refused by name), the TE spec, fused RoPE,
``cache_mla_latents``, DSA; the layout's cost model still prices a head as a GQA query group.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MultiLatentAttention,
)
from megatron.core.transformer.spec_utils import build_module

ROPE_TYPES = ("rope", "yarn")


@dataclass(frozen=True)
class MLADims:
    """The MLA settings this module builds (megatron ``MLATransformerConfig`` names)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str = "yarn"
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def check(self, model_cfg: Any) -> None:
        """``ValueError`` naming the field for what this module does not build, or where the
        model's MLA shape (what the layout reads) differs from these settings."""
        for name in ("kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                     "v_head_dim"):
            if getattr(model_cfg, name, None) != getattr(self, name):
                raise ValueError(f"model.{name}={getattr(model_cfg, name, None)!r}: must be the "
                                 f"MLA setting {getattr(self, name)!r}")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{name}={v!r}: must be a positive integer")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"model.q_lora_rank={self.q_lora_rank}: must be positive or None")
        if self.q_lora_rank is None and getattr(model_cfg, "qk_layernorm", False):
            raise ValueError("model.q_lora_rank=None: with model.qk_layernorm megatron's local "
                             "MLA wants a fused norm+linear query projection (TE): not built")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r}: must be one of {ROPE_TYPES}")
        if model_cfg.num_query_groups != model_cfg.num_attention_heads:
            raise ValueError(f"model.num_query_groups={model_cfg.num_query_groups}: MLA has one "
                             "per head (heads are its units): must be model.num_attention_heads="
                             f"{model_cfg.num_attention_heads}")
        if model_cfg.kv != self.v_head_dim:
            raise ValueError(f"model.kv_channels={model_cfg.kv_channels}: MLA's attention output "
                             f"per head is model.v_head_dim={self.v_head_dim}: must be equal")
        if getattr(model_cfg, "position_embedding_type", "rope") != "rope":
            raise ValueError("model.position_embedding_type="
                             f"{model_cfg.position_embedding_type!r}: MLA applies its own RoPE "
                             "(model.rope_type); the model's must be 'rope'")
        if getattr(model_cfg, "add_bias_linear", False) or getattr(model_cfg, "add_qkv_bias",
                                                                    False):
            raise ValueError("model.add_bias_linear=True: MLA's projections have no bias")

    def config_fields(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "multi_latent_attention": True}


def mla_transformer_config(base: Any, mla: MLADims) -> Any:
    """megatron's ``MLATransformerConfig`` with ``base``'s fields (a ``TransformerConfig``,
    validated at TP1: the caller sets the degree after) and the MLA ones; non-field attributes
    of ``base`` (Gemma / ``yarn_*``) carried over."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    after = {k: own.pop(k) for k in _SET_AFTER}
    config = MLATransformerConfig(**{**own, **mla.config_fields()})
    for k, v in vars(base).items():
        if k not in names:
            setattr(config, k, v)
    for k, v in after.items():
        setattr(config, k, v)
    return config


_SET_AFTER = ("tensor_model_parallel_size", "sequence_parallel", "expert_model_parallel_size",
              "expert_tensor_parallel_size")
"""What NUTP sets after megatron's validation at TP1 (uneven degrees need not divide)."""


class MLADotProductAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` as MLA's core attention: ``MLASelfAttention``
    passes ``k_channels``/``v_channels`` (TE's attention takes them, the local one does not);
    the local one sizes its output by ``kv_channels`` (checked equal to ``v_head_dim``:
    ``MLADims.check``) and takes MLA's ``softmax_scale``."""

    def __init__(self, *args: Any, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"model.kv_channels={self.config.kv_channels}: must be "
                             f"model.v_head_dim={v_channels} with MLA")


def nutp_mla_attention_spec(*, local_heads: int, single: Any, latent_norms: bool = True,
                            q_latent: bool = True) -> Any:
    """The ``self_attention`` entry of a local layer spec for ``NUTPMLASelfAttention`` over
    ``local_heads`` heads (megatron's local MLA submodules, NUTP's norms and core attention);
    ``latent_norms``: ``model.qk_layernorm`` (the latent norms), ``q_latent``: a query latent
    (``q_lora_rank`` set; its norm only then)."""
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .layers import NUTPNorm

    return ModuleSpec(
        module=NUTPMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "nutp_local_heads": local_heads,
                "nutp_single": single},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_up_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear, core_attention=MLADotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=NUTPNorm if latent_norms and q_latent else IdentityOp,
            kv_layernorm=NUTPNorm if latent_norms else IdentityOp))


def _replicated_linear(rows: int, config: Any, single: Any, name: str | None) -> Any:
    """``ColumnParallelLinear`` over this rank alone: the whole ``[rows, h]`` weight, no
    collective (megatron turns its sequence parallelism off at size 1); the weight is marked
    replicated and partial under sequence parallelism (see the module doc)."""
    lin = ColumnParallelLinear(config.hidden_size, rows, config=config,
                               init_method=config.init_method, gather_output=False, bias=False,
                               skip_bias_add=False, is_expert=False, tp_group=single, name=name)
    lin.weight.tensor_model_parallel = False  # type: ignore[attr-defined]
    lin.weight.partition_dim = -1  # type: ignore[attr-defined]
    lin.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
    return lin


class NUTPMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` over this rank's heads (see the module doc):
    ``nutp_local_heads`` heads, ``nutp_single`` the process group of this rank alone."""

    def __init__(self, config: Any, submodules: Any, layer_number: int, attn_mask_type: Any,
                 *, nutp_local_heads: int, nutp_single: Any, **kwargs: Any) -> None:
        pgs = kwargs["pg_collection"]
        degree = pgs.tp.size()
        cfg = copy.copy(config)
        cfg.num_attention_heads = cfg.num_query_groups = nutp_local_heads * degree
        MultiLatentAttention.__init__(self, config=cfg, submodules=submodules,
                                      layer_number=layer_number, attn_mask_type=attn_mask_type,
                                      attention_type="self", **kwargs)
        name = kwargs.get("name")

        def sub(s: str) -> str | None:
            return None if name is None else f"{name}.{s}"

        c = self.config
        layer = self._resolve_qk_norm_config(submodules)
        up = dict(config=c, init_method=c.init_method, gather_output=False, bias=False,
                  skip_bias_add=False, is_expert=False, tp_group=pgs.tp)
        if c.q_lora_rank is None:
            self.linear_q_proj = build_module(layer["linear_q_proj"], c.hidden_size,
                                              c.num_attention_heads * self.q_head_dim,
                                              tp_comm_buffer_name="q_proj",
                                              name=sub("linear_q_proj"), **up)
        else:
            self.linear_q_down_proj = _replicated_linear(c.q_lora_rank, c, nutp_single,
                                                         sub("linear_q_down_proj"))
            self.linear_q_up_proj = build_module(layer["linear_q_up_proj"], c.q_lora_rank,
                                                 c.num_attention_heads * self.q_head_dim,
                                                 tp_comm_buffer_name="q_up_proj",
                                                 name=sub("linear_q_up_proj"), **up)
        self.linear_kv_down_proj = _replicated_linear(c.kv_lora_rank + c.qk_pos_emb_head_dim,
                                                      c, nutp_single, sub("linear_kv_down_proj"))
        self.linear_kv_up_proj = build_module(
            layer["linear_kv_up_proj"], c.kv_lora_rank,
            c.num_attention_heads * (c.qk_head_dim + c.v_head_dim),
            tp_comm_buffer_name="kv_up_proj", name=sub("linear_kv_up_proj"), **up)
        if c.q_lora_rank is not None:
            self.q_layernorm = layer["q_layernorm"](hidden_size=c.q_lora_rank, config=c,
                                                    eps=c.layernorm_epsilon)
        self.kv_layernorm = layer["kv_layernorm"](hidden_size=c.kv_lora_rank, config=c,
                                                  eps=c.layernorm_epsilon)
