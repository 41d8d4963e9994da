"""Run a Bridge recipe with NUTP through Bridge's own ``train()`` (one rank of a gloo/NCCL world).

``train_rank(job, plan, out_dir)`` builds, on this rank: the NUTP groups, the recipe's model as
the NUTP GPT (``model_config_of``: every field that changes the math is honoured or rejected by
name), the NUTP DDP, Bridge's optimizer and scheduler (``setup_optimizer``) with the exact NUTP
grad norm (with ``optimizer.use_distributed_optimizer``: NUTP's ZeRO-1, ``bridge_zero``),
megatron's micro-batch calculator at this replica's share, the finalize / grad-scale functions
Bridge's ``setup()`` would set (here: NUTP's gradient finalisation), the recipe's dataset
through Bridge's data pipeline with this replica's share of every global batch
(``bridge_data.train_iterator``; for evaluation during training ``valid_iterator`` and
``bridge_eval``'s callbacks), and then calls ``megatron.bridge.training.train.train``.
With ``pp > 1`` the stages run at their plan's degrees: Bridge's ``train()`` and
``evaluate()`` get NUTP's stage communicator through ``bridge_pipeline``'s one substitution
point, and the step's finalisation covers every stage. Virtual pipeline stages: Bridge gets
``bridge_pipeline.chunk_views`` of the one NUTP DDP over the rank's chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def model_config_of(provider: Any, *, vocab_size: int) -> Any:
    """NUTP's ``ModelConfig`` of a Bridge ``GPTModelProvider``; one-line ``ValueError`` naming
    every ``model.<field>`` the NUTP model cannot honour (``bridge_fields.REFUSED``: the table
    of every provider field)."""
    from ..config.schema import ModelConfig
    from .bridge_fields import check_model

    check_model(provider)
    moe_of(provider)
    mla = mla_of(provider)
    gated = bool(provider.gated_linear_unit)
    act = _activation_name(provider.activation_func)
    pos = provider.position_embedding_type
    from ..config.schema import POSITION_EMBEDDINGS

    if pos not in POSITION_EMBEDDINGS:
        raise ValueError(f"model.position_embedding_type={pos}: not supported by the NUTP "
                         f"model (one of {POSITION_EMBEDDINGS})")
    # cross_entropy_fusion_impl=te: megatron's native fused kernel (bridge_fields.SUBSTITUTED)
    fused_ce = bool(getattr(provider, "cross_entropy_loss_fusion", False))
    heads = provider.num_attention_heads
    # MLA: its shape fields (the layout's units); kv_channels is not read by megatron's MLA
    # (TE's attention takes the k/v head widths; NUTP's local core attention sizes its output
    # by it, so it is v_head_dim there: model.mla.MLADims.check)
    kv = provider.kv_channels if mla is None else mla.v_head_dim
    shape = {} if mla is None else {k: getattr(mla, k) for k in MLA_SHAPE}
    return ModelConfig(
        num_layers=provider.num_layers, hidden_size=provider.hidden_size,
        num_attention_heads=heads, num_query_groups=provider.num_query_groups or heads,
        ffn_hidden_size=provider.ffn_hidden_size, vocab_size=vocab_size,
        seq_length=provider.seq_length, gated_linear_unit=gated, activation_func=act,
        tie_embeddings=bool(provider.share_embeddings_and_output_weights),
        add_bias_linear=bool(provider.add_bias_linear), add_qkv_bias=bool(provider.add_qkv_bias),
        kv_channels=kv, qk_layernorm=bool(provider.qk_layernorm), **shape,
        **_window_of(provider), **_gemma_of(provider),
        normalization=provider.normalization, position_embedding_type=pos,
        layernorm_epsilon=float(provider.layernorm_epsilon),
        layernorm_zero_centered_gamma=bool(provider.layernorm_zero_centered_gamma),
        init_std=float(provider.init_method_std),
        hidden_dropout=float(provider.hidden_dropout),
        attention_dropout=float(provider.attention_dropout), cross_entropy_loss_fusion=fused_ce,
        **_rope_of(provider))


def moe_of(provider: Any) -> Any:
    """NUTP's MoE layer settings (``model.moe.MoEDims``) of a provider with
    ``num_moe_experts``, else None. What they carry is honoured as megatron reads it
    (``bridge_fields.HONOURED``); the dispatcher is always NUTP's all-to-all one inside each
    replica (``model.moe_token_dispatcher_type``: ``bridge_fields.SUBSTITUTED``); every other
    MoE setting is refused away from megatron's default by ``check_model``. Multi-token
    prediction (``model.mtp_num_layers``, ``model.mtp_loss_scaling_factor``: ``model/mtp.py``)
    is carried with MoE only. One-line ``ValueError`` naming the field for a value NUTP's MoE
    layer does not build."""
    experts = getattr(provider, "num_moe_experts", None)
    raw = getattr(provider, "mtp_num_layers", None)
    mtp = int(raw) if raw else None  # (0: off, as megatron reads it)
    if not experts:
        if mtp is not None:
            raise ValueError(f"model.mtp_num_layers={mtp}: NUTP builds multi-token prediction "
                             "on its MoE model only (model.num_moe_experts) so far")
        return None
    from ..model.moe import MoEDims
    from ..model.mtp import check_mtp

    coeff = provider.moe_aux_loss_coeff
    if isinstance(coeff, (list, tuple)):  # megatron: one coefficient per load-balancing type
        raise ValueError(f"model.moe_aux_loss_coeff={list(coeff)}: NUTP MoE takes one "
                         "coefficient (one load-balancing type)")
    moe = MoEDims(num_moe_experts=int(experts), moe_router_topk=int(provider.moe_router_topk),
                  moe_ffn_hidden_size=int(provider.moe_ffn_hidden_size or
                                          provider.ffn_hidden_size),
                  moe_aux_loss_coeff=float(coeff or 0.0),
                  moe_router_load_balancing_type=str(provider.moe_router_load_balancing_type),
                  moe_router_dtype=provider.moe_router_dtype, mtp_num_layers=mtp,
                  mtp_loss_scaling_factor=float(provider.mtp_loss_scaling_factor),
                  **_deepseek_routing_of(provider))
    moe.check(1)
    check_mtp(moe, pp=1)  # (pipeline stages with MoE: check_moe)
    return moe


MLA_SHAPE = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""The MLA shape fields of ``ModelConfig`` (what the layout's units read)."""
MLA_ROPE = ("rope_type", "rotary_base", "rotary_scaling_factor",
            "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim")
"""MLA's RoPE (and YaRN) settings, megatron's ``MLATransformerConfig`` names."""


def mla_of(provider: Any) -> Any:
    """NUTP's multi-latent attention settings (``model.mla.MLADims``) of a provider with
    ``multi_latent_attention``, else None: the shape (``MLA_SHAPE``) and MLA's own RoPE with
    YaRN (``MLA_ROPE``) as megatron's ``MultiLatentAttention`` reads them (the softmax scale
    from ``rotary_scaling_factor`` and ``mscale_all_dim`` at either ``rope_type``). Built on
    NUTP's MoE model at one stage (``model/mla.py``); one-line ``ValueError`` naming the field
    for what MLA does not read or NUTP's MLA does not build: the dense model's RoPE scalings
    and YaRN (``rope_scaling``, ``seq_len_interpolation_factor``, ``yarn_*``), ``rotary_percent``
    other than 1, ``softmax_scale``, windows, logit softcapping and the Gemma families (NUTP's
    own core attention, not MLA's)."""
    if not getattr(provider, "multi_latent_attention", False):
        return None
    from ..model.mla import MLADims

    on = "model.multi_latent_attention=True"
    if not all(hasattr(provider, k) for k in (*MLA_SHAPE, *MLA_ROPE)):
        raise ValueError(f"{on}: {type(provider).__name__} has no MLA fields (Bridge's "
                         "MLAModelProvider, megatron's MLATransformerConfig)")
    if not getattr(provider, "num_moe_experts", None):
        raise ValueError(f"{on}: NUTP builds multi-latent attention on its MoE model only "
                         "(model.num_moe_experts) so far")
    pp = int(getattr(provider, "pipeline_model_parallel_size", 1) or 1)
    if pp > 1:
        raise ValueError(f"model.pipeline_model_parallel_size={pp}: not with {on} yet "
                         "(NUTP's MLA is tested at one stage)")
    off = {"rope_scaling": False, "seq_len_interpolation_factor": None, "softmax_scale": None,
           "window_size": None, "attn_logit_softcapping": None,
           **{name: None for name in YARN_FIELDS}}
    for name, default in off.items():
        value = getattr(provider, name, default)
        if value != default and value is not None and value is not False:
            raise ValueError(f"model.{name}={value}: not with {on} (megatron's MLA does not "
                             "read it: its RoPE is model.rope_type's)")
    if float(provider.rotary_percent) != 1.0:
        raise ValueError(f"model.rotary_percent={provider.rotary_percent}: not with {on} "
                         "(NUTP's MLA rotates the whole RoPE part, qk_pos_emb_head_dim)")
    if isinstance(provider.rotary_base, (tuple, list)) or _family(provider) is not None:
        raise ValueError(f"model.rotary_base={provider.rotary_base}: not with {on} (per-layer "
                         "RoPE bases and the Gemma families are NUTP's GQA attention only)")
    q = provider.q_lora_rank
    mla = MLADims(q_lora_rank=None if not q else int(q),
                  **{k: int(getattr(provider, k)) for k in MLA_SHAPE if k != "q_lora_rank"},
                  rope_type=str(provider.rope_type), rotary_base=float(provider.rotary_base),
                  rotary_scaling_factor=float(provider.rotary_scaling_factor),
                  original_max_position_embeddings=int(
                      provider.original_max_position_embeddings),
                  beta_fast=float(provider.beta_fast), beta_slow=float(provider.beta_slow),
                  mscale=float(provider.mscale), mscale_all_dim=float(provider.mscale_all_dim))
    heads = int(provider.num_attention_heads)
    groups = provider.num_query_groups or heads
    if groups != heads:
        raise ValueError(f"model.num_query_groups={groups}: MLA has one per head (heads are "
                         f"its units): must be model.num_attention_heads={heads}")
    from types import SimpleNamespace

    mla.check(SimpleNamespace(  # the model's MLA as NUTP builds it (model_config_of's fields)
        **{k: getattr(mla, k) for k in MLA_SHAPE}, num_query_groups=heads,
        num_attention_heads=heads, kv=mla.v_head_dim, kv_channels=mla.v_head_dim,
        qk_layernorm=bool(provider.qk_layernorm),
        position_embedding_type=provider.position_embedding_type,
        add_bias_linear=bool(provider.add_bias_linear), add_qkv_bias=bool(provider.add_qkv_bias)))
    return mla


def moe_spec_of(provider: Any) -> Any:
    """The planner's view of a provider's experts (``layout.specs.MoESpec``: experts, top-k,
    expert width, shared expert width, ``moe_layer_freq``), or None without
    ``num_moe_experts``. Read as megatron reads them (a shared expert of its own size is
    counted whole on every rank: ``layout.experts.shared_expert_columns``); what NUTP's MoE
    layers do not build is refused by ``check_moe``/``check_container``, not here."""
    experts = getattr(provider, "num_moe_experts", None)
    if not experts:
        return None
    from ..layout.specs import MoESpec

    shared = getattr(provider, "moe_shared_expert_intermediate_size", None)
    freq = getattr(provider, "moe_layer_freq", 1)
    return MoESpec(num_moe_experts=int(experts), moe_router_topk=int(provider.moe_router_topk),
                   moe_ffn_hidden_size=int(provider.moe_ffn_hidden_size or
                                           provider.ffn_hidden_size),
                   moe_shared_expert_intermediate_size=int(shared) if shared else None,
                   moe_layer_freq=freq if isinstance(freq, int) else tuple(freq))


def _deepseek_routing_of(provider: Any) -> dict[str, Any]:
    """The DeepSeek-V3 routing fields of ``MoEDims`` (issue #34) as megatron reads them: sigmoid
    scores, the aux-loss-free expert bias and its update rate, group-limited top-k, top-k
    scaling, one shared expert (of any size), the MoE layer frequency, the z-loss and
    pre-softmax."""
    freq = provider.moe_layer_freq
    shared = provider.moe_shared_expert_intermediate_size
    return dict(
        moe_router_score_function=str(provider.moe_router_score_function),
        moe_router_enable_expert_bias=bool(provider.moe_router_enable_expert_bias),
        moe_router_bias_update_rate=float(provider.moe_router_bias_update_rate),
        moe_router_num_groups=provider.moe_router_num_groups or None,
        moe_router_group_topk=provider.moe_router_group_topk or None,
        moe_router_topk_scaling_factor=provider.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=None if not shared else int(shared),
        moe_layer_freq=freq if isinstance(freq, int) else tuple(int(x) for x in freq),
        moe_z_loss_coeff=provider.moe_z_loss_coeff or None,
        moe_router_pre_softmax=bool(getattr(provider, "moe_router_pre_softmax", False)))


def check_moe(cfg: Any, plan: Any = None) -> None:
    """What NUTP's MoE layers do not run yet, one line naming the field (nothing without
    ``model.num_moe_experts``): bf16/fp16, virtual pipeline stages, the distributed optimizer
    over pipeline stages, checkpoints with the distributed optimizer or over stages (recovery:
    ``check_moe_recovery``); with ``plan``: each replica's degree at every stage (experts over
    its ranks, ``model.num_moe_experts``) and sequence parallelism at a degree above 1
    (megatron's ``MoELayer`` needs it). Pipeline stages run (per-stage degrees; Bridge's
    logged MoE metrics reduced NUTP's way, ``bridge_moe_metrics``)."""
    m = cfg.model
    moe = moe_of(m)
    if moe is None:
        return
    check_mla(cfg)
    on = f"NUTP MoE ({moe.num_moe_experts} experts)"
    moe.moe_layers(int(m.num_layers))  # names a bad model.moe_layer_freq
    for half in ("bf16", "fp16"):
        if getattr(m, half, False):
            raise ValueError(f"model.{half}=True: {on} trains fp32 so far "
                             "(mixed_precision=null, model.bf16=false, model.fp16=false)")
    vp = m.virtual_pipeline_model_parallel_size
    if vp is not None and int(vp) > 1:
        raise ValueError(f"model.virtual_pipeline_model_parallel_size={vp}: {on} builds no "
                         "virtual pipeline stages yet: set null")
    if int(m.pipeline_model_parallel_size) > 1:
        from .bridge_zero import wants_zero

        if moe.moe_router_enable_expert_bias:
            raise ValueError("model.moe_router_enable_expert_bias=True: not with "
                             f"model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}"
                             f" and {on} yet (tested at one stage)")

        if wants_zero(cfg):
            raise ValueError("ddp.use_distributed_optimizer=True: not with "
                             f"model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}"
                             f" and {on} yet (the experts' ZeRO-1 over stages is not built): "
                             "set ddp.use_distributed_optimizer=false "
                             "optimizer.use_distributed_optimizer=false")
        for name in ("save", "load"):
            path = getattr(cfg.checkpoint, name, None)
            if path:
                raise ValueError(f"checkpoint.{name}={path}: not with {on} over "
                                 f"{m.pipeline_model_parallel_size} pipeline stages yet "
                                 "(megatron's MoE keys are tested at one stage)")
    # checkpoint.save / load: NUTP's store writes megatron's MoE keys (checkpoint/sharding.py),
    # not yet the distributed optimizer's expert slices (sync/zero.py refuses them at save time)
    if cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer:
        for name in ("save", "load"):
            path = getattr(cfg.checkpoint, name, None)
            if path:
                raise ValueError(f"checkpoint.{name}={path}: not with {on} and "
                                 "optimizer.use_distributed_optimizer=true yet (the experts' "
                                 "optimizer slices are not in the checkpoint format)")
    if plan is None:
        return
    for degree in sorted({d for rep in plan.replicas for d in rep.tp}):
        moe.check(degree)
        if degree > 1 and not m.sequence_parallel:
            raise ValueError(f"model.sequence_parallel=False: {on} needs it at a replica of "
                             f"degree {degree} (megatron's MoE layer refuses TP > 1 without "
                             "it; its experts are spread over the replica's TP group)")


def check_mla(cfg: Any) -> None:
    """What NUTP's multi-latent attention does not run yet under ``nutp-bridge``, one line
    naming the field (nothing without ``model.multi_latent_attention``): checkpoints and the
    distributed optimizer with MLA (neither tested: the up-projections' head units in the
    checkpoint format and in ZeRO's slices)."""
    if mla_of(cfg.model) is None:
        return
    on = "model.multi_latent_attention=True"
    for name in ("save", "load"):
        path = getattr(cfg.checkpoint, name, None)
        if path:
            raise ValueError(f"checkpoint.{name}={path}: not with {on} yet (NUTP's checkpoints "
                             "of MLA's head units are not tested)")
    if cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer:
        raise ValueError(f"optimizer.use_distributed_optimizer=True: not with {on} yet (NUTP's "
                         "ZeRO-1 over MLA's head units is not tested): set "
                         "optimizer.use_distributed_optimizer=false ddp.use_distributed_optimizer"
                         "=false")


def check_moe_recovery(cfg: Any, recovery: Any) -> None:
    """``recovery.enabled=true`` with MoE: ``recovery.mode=live`` runs (the survivors move the
    experts whole in memory, ``live/link.move``; ``tests/integrations/test_bridge_moe_live.py``);
    one line naming what is not built or not tested with it yet: the restart path, the
    distributed optimizer (the experts' optimizer slices are not moved), pipeline stages, the
    expert bias (a buffer, not moved), MTP layers, multi-latent attention, a shared expert of
    its own size (replicated in the replica, not moved), hot spares. Reads the fields as set,
    not through ``moe_of``: the model's own fields are checked after it, all refused ones
    named together (``model_config_of``), not the first MoE value ``moe_of`` meets."""
    m = cfg.model
    experts = getattr(m, "num_moe_experts", None)
    if not experts or not recovery.enabled:
        return
    on = f"NUTP MoE ({experts} experts) through nutp-bridge"
    if recovery.mode != "live":
        raise ValueError(f"recovery.mode={recovery.mode}: not with {on} yet (the restart path "
                         "is untested with MoE): set recovery.mode=live")
    zero = cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer
    bias = bool(getattr(m, "moe_router_enable_expert_bias", False))
    mtp = getattr(m, "mtp_num_layers", None)
    shared = getattr(m, "moe_shared_expert_intermediate_size", None)
    mla = bool(getattr(m, "multi_latent_attention", False))
    refused = [  # (field, value, refused, why)
        ("optimizer.use_distributed_optimizer", bool(zero), bool(zero),
         "the experts' optimizer slices are not moved live yet: set "
         "optimizer.use_distributed_optimizer=false ddp.use_distributed_optimizer=false"),
        ("model.pipeline_model_parallel_size", m.pipeline_model_parallel_size,
         int(m.pipeline_model_parallel_size) > 1,
         "the live re-layout of MoE pipeline stages is not tested yet"),
        ("model.moe_router_enable_expert_bias", bias, bias,
         "the expert bias (a buffer) is not moved live yet"),
        ("model.mtp_num_layers", mtp, bool(mtp), "the MTP layers' experts are not moved live yet"),
        ("model.moe_shared_expert_intermediate_size", shared,
         shared is not None and int(shared) != int(m.ffn_hidden_size),
         "a shared expert of its own size is replicated in the replica and not moved live yet"),
        ("model.multi_latent_attention", mla, mla,
         "multi-latent attention's replicated projections are not moved live yet"),
        ("recovery.spares", recovery.spares, int(recovery.spares) > 0,
         "a hot spare joining a MoE world is not tested yet"),
    ]
    for field, value, bad, why in refused:
        if bad:
            raise ValueError(f"{field}={value}: not with {on} and recovery.mode=live yet ({why})")


def _activation_name(func: Any) -> str:
    """``model.activation_func``'s name for a provider's callable (the same functions the NUTP
    model builds from the name); anything else is refused by name."""
    from megatron.core import activations
    from megatron.core.fusions import fused_bias_geglu

    from ..config.schema import ACTIVATIONS

    # (megatron's fused GEGLU module has its own quick_gelu, the same math: gpt-oss's bridge)
    known = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu",
             activations.squared_relu: "squared_relu", activations.quick_gelu: "quick_gelu",
             fused_bias_geglu.quick_gelu: "quick_gelu", activations.fast_gelu: "fast_gelu"}
    if func not in known:
        raise ValueError(f"model.activation_func={getattr(func, '__name__', func)}: not "
                         f"supported by the NUTP model (one of {ACTIVATIONS})")
    return known[func]


def _family(provider: Any) -> str | None:
    """'gemma', 'gemma2' or 'gemma3' for Bridge's Gemma providers (and their subclasses),
    whose ``provide`` and layer specs add what no ``TransformerConfig`` field says: embedding
    scaling, post norms, the per-layer window and RoPE patterns; else None."""
    names = {c.__name__ for c in type(provider).__mro__}
    for name in ("Gemma3ModelProvider", "Gemma2ModelProvider", "GemmaModelProvider"):
        if name in names:
            return name.removesuffix("ModelProvider").lower()
    return None


def _window_of(provider: Any) -> dict[str, Any]:
    """Sliding-window attention (megatron ``window_size``, ``window_attn_skip_freq`` as an
    int); a per-layer list pattern is refused by name. Gemma 2 slides on the odd layers
    (frequency 2); Gemma 3 on all but every ``sum(interleaved_attn_pattern)``-th layer, with
    an int window ``w`` meaning ``(w - 1, 0)`` (Bridge's ``Gemma3TEDotProductAttention``)."""
    w = getattr(provider, "window_size", None)
    freq = getattr(provider, "window_attn_skip_freq", None)
    if freq is not None and not isinstance(freq, int):
        raise ValueError(f"model.window_attn_skip_freq={freq}: not supported by the NUTP model "
                         "(an int or null)")
    family = _family(provider)
    if family in ("gemma2", "gemma3") and freq is not None:
        raise ValueError(f"model.window_attn_skip_freq={freq}: not read by {family}'s "
                         "attention (its own layer pattern decides): leave it null")
    if family == "gemma2" and w is not None:
        freq = 2  # Gemma2DotProductAttention: the window on odd layer numbers
    if family == "gemma3":
        if getattr(provider, "is_vision_language", False):
            raise ValueError("model.is_vision_language=True: not supported by the NUTP model "
                             "(Gemma 3's text model only)")
        pattern = getattr(provider, "interleaved_attn_pattern", (5, 1))
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"model.window_size={w}: not supported by the NUTP model for "
                             "Gemma 3 (an int >= 1: its window of (w - 1, 0))")
        return {"window_size": (w - 1, 0), "window_attn_skip_freq": int(sum(pattern))}
    if w is not None and not isinstance(w, (tuple, list)):
        raise ValueError(f"model.window_size={w}: not supported by the NUTP model (a [left, "
                         "right] pair; an int is Gemma 3's own scheme)")
    return {"window_size": None if w is None else (int(w[0]), int(w[1])),
            "window_attn_skip_freq": freq}


def _gemma_of(provider: Any) -> dict[str, Any]:
    """Gemma's settings as ``ModelConfig`` fields: ``softmax_scale`` (Gemma 2: from
    ``query_pre_attn_scalar`` q as 1/sqrt(q), which its attention uses instead), logit
    softcapping (0 or null: off, as Bridge's ``logit_softcapping``), embedding scaling (Gemma,
    Gemma 2: the factor in the embeddings' dtype; Gemma 3: unrounded) and post norms (Gemma 2
    and 3's layer specs)."""
    family = _family(provider)
    scale = getattr(provider, "softmax_scale", None)
    q = getattr(provider, "query_pre_attn_scalar", None)
    if q is not None and family == "gemma2":
        if scale is not None and scale != 1.0 / math.sqrt(q):
            raise ValueError(f"model.softmax_scale={scale}: Gemma 2's attention uses "
                             f"model.query_pre_attn_scalar={q} (1/sqrt) instead: leave it null")
        scale = 1.0 / math.sqrt(q)  # Gemma2DotProductAttention: alpha = 1 / sqrt(q)
    elif q is not None:
        raise ValueError(f"model.query_pre_attn_scalar={q}: not supported by the NUTP model "
                         "outside Gemma 2 (set model.softmax_scale)")
    caps = {name: (float(v) if v else None) for name in
            ("attn_logit_softcapping", "final_logit_softcapping")
            for v in [getattr(provider, name, None)]}
    return {"softmax_scale": None if scale is None else float(scale), **caps,
            "apply_embedding_scaling": family is not None,
            "embedding_scale_rounded": family != "gemma3",
            "post_layernorm": family in ("gemma2", "gemma3")}


def _rope_of(provider: Any) -> dict[str, Any]:
    """The provider's RoPE settings as ``ModelConfig`` fields (megatron's names), as they are:
    without RoPE, ``ModelConfig`` accepts only their defaults (a RoPE setting that would be
    ignored is refused by name); YaRN's ``yarn_*`` likewise. Bridge's provider default
    ``rope_scaling_factor=1.0`` is read only with ``rope_scaling``."""
    base = provider.rotary_base
    if isinstance(base, (tuple, list)):
        return _gemma3_rope_of(provider)
    out: dict[str, Any] = {"rotary_base": int(base),
                           "rotary_percent": float(provider.rotary_percent),
                           "rope_scaling": bool(getattr(provider, "rope_scaling", False)),
                           "seq_len_interpolation_factor":
                               getattr(provider, "seq_len_interpolation_factor", None)}
    if out["rope_scaling"]:
        out["rope_scaling_factor"] = float(provider.rope_scaling_factor)
    for name in YARN_FIELDS:  # as set: ModelConfig refuses them without yarn, by name
        out[name] = getattr(provider, name, None)
    return out


YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
               "yarn_correction_range_round_to_int")
"""Bridge's ``GPTModelProvider`` YaRN fields (``ModelConfig``'s, by the same names)."""


def _gemma3_rope_of(provider: Any) -> dict[str, Any]:
    """Gemma 3's ``rotary_base`` (local, global): the sliding-window layers at the local
    base, the others at the global one with ``rope_scaling_factor`` as linear scaling
    (Bridge's ``Gemma3RotaryEmbedding``, which builds both unscaled by llama3 and at
    ``rotary_percent`` 1: other values of those are refused by name)."""
    local, base = provider.rotary_base
    if _family(provider) != "gemma3":
        raise ValueError(f"model.rotary_base={tuple(provider.rotary_base)}: per-layer RoPE "
                         "bases only as Gemma 3's provider builds them")
    if getattr(provider, "rope_scaling", False):
        raise ValueError("model.rope_scaling=True: Gemma 3 scales its global layers linearly "
                         "(model.rope_scaling_factor): set false")
    if float(provider.rotary_percent) != 1.0:
        raise ValueError(f"model.rotary_percent={provider.rotary_percent}: Gemma 3's RoPE "
                         "rotates every channel: set 1.0")
    return {"rotary_base": int(base), "rotary_base_local": int(local),
            "rope_scaling_factor_global": float(provider.rope_scaling_factor),
            "seq_len_interpolation_factor": getattr(provider, "seq_len_interpolation_factor",
                                                    None)}


def precision_of(cfg: Any) -> str:
    m = cfg.model
    return "bf16" if m.bf16 else "fp16" if m.fp16 else "fp32"


def recording(optimizer: Any, reduce: Any, *, report_share: float = 1.0,
              eval_parts: list[tuple[float, float]] | None = None,
              hooks: StepHooks | None = None) -> tuple[list[dict[str, float]], Any]:
    """(the per-step record, Bridge's ``forward_step`` recording each micro-batch's loss).
    ``optimizer.step`` is wrapped: after it, ``reduce(this rank's mean micro-batch loss)`` is
    the step's global-batch loss, recorded with the grad norm megatron's step returned.
    ``report_share``: the factor on each micro-batch's reported ``(loss sum, tokens)`` (what
    Bridge's ``train_step`` all-reduces over ``pg_collection.dp_cp`` for its printed loss):
    ``1/degree`` under NUTP, whose ``dp_cp`` holds every TP rank of every replica, so that the
    sum counts every sample once (Bridge's ``evaluate`` reduces the same values over the same
    group). Micro-batches of an evaluation (the model in eval mode) are not in the step's loss;
    their ``(loss sum, tokens)`` before the factor go to ``eval_parts``. ``hooks``: called
    around megatron's step with the step's loss (before) and outcome (after)."""
    from megatron.bridge.training.gpt_step import forward_step

    record: list[dict[str, float]] = []
    losses: list[float] = []
    step = optimizer.step

    def recorded_step(*args: Any, **kwargs: Any) -> Any:
        lr = float(optimizer.param_groups[0]["lr"])  # what this step applies
        # (a pipeline's other stages see no loss: ``reduce`` gets it from the last stage)
        loss = reduce(sum(losses) / len(losses) if losses else float("nan"))
        losses.clear()
        if hooks is not None:
            hooks.before(loss)
        out = step(*args, **kwargs)
        norm = float(out[1]) if out[1] is not None else float("nan")
        record.append({"loss": loss, "grad_norm": norm, "lr": lr})
        if hooks is not None:
            hooks.after(bool(out[0]), None if out[1] is None else float(out[1]))
        return out

    def recorded_forward(state: Any, data_iterator: Any, model: Any,
                         return_schedule_plan: bool = False) -> Any:
        output, loss_fn = forward_step(state, data_iterator, model, return_schedule_plan)
        training = model.training  # Bridge's evaluate() puts the model in eval mode

        def loss_func(*args: Any, **kwargs: Any) -> Any:
            out = loss_fn(*args, **kwargs)
            if training:
                losses.append(float(out[0].detach().sum()) / float(out[1]))
            elif eval_parts is not None:
                eval_parts.append((float(out[0].detach().sum()), float(out[1])))
            if report_share != 1.0:
                out = (out[0], out[1], {k: v * report_share for k, v in out[2].items()})
            return out
        return output, loss_func

    optimizer.step = recorded_step
    return record, recorded_forward


def global_samples(optimizer: Any, scheduler: Any, state: Any, global_batch: int, *,
                   counted: int) -> None:
    """Bridge counts a step as ``micro-batches x micro_batch_size x data_parallel_size``
    samples: for the scheduler's increment (``cfg.data_parallel_size``, here the world) and
    ``train_state.consumed_train_samples`` (``pg_collection.dp.size()``, here the stage group).
    Under NUTP a rank runs its replica's share, so both would differ per replica (the lr and
    weight-decay schedules drifting apart between replicas). The scheduler steps by the global
    batch; the consumed-sample counter is corrected by ``global_batch - counted`` at every
    optimizer step (which Bridge's ``train_step`` runs right before it adds ``counted``)."""
    opt_step, sched_step = optimizer.step, scheduler.step

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        state.train_state.consumed_train_samples += global_batch - counted
        return opt_step(*args, **kwargs)

    def scheduler_step(increment: int) -> Any:
        return sched_step(increment=global_batch)

    optimizer.step = optimizer_step
    scheduler.step = scheduler_step


def load_weights(model: Any, plan: Any, groups: Any, optimizer: Any, path: str | Path) -> None:
    """Weights only (collective), checked against this model's global shapes first."""
    from ..checkpoint.store import load_checkpoint
    from .bridge_ckpt import session_of

    load_checkpoint(session_of(model, plan, groups, optimizer), path, load_optimizer=False)


def validate_as_uniform(cfg: Any, plan: Any | None) -> None:
    """Bridge's ``ConfigContainer.validate()`` (derived scheduler steps, mixed precision,
    pipeline settings, ...). A uniform layout passes it as it is. For a non-uniform one
    (replicas [2,1], or [[2,1],[2,2]] with stages) Bridge's data-parallel size (the world over
    TP x PP x CP) does not exist: the check runs with the replicas as its data-parallel size,
    preset where ``validate()`` would derive it (the layout itself was validated by the NUTP
    planner). ``plan=None``: one process reading the recipe's data (a reference), data-parallel
    size 1."""
    m = cfg.model
    # optimizer.use_precision_aware_optimizer (bridge_fields.SUBSTITUTED): NUTP's distributed
    # optimizer at the recipe's fp32 dtypes, not TE's fused Adam, which validate() would import
    cfg.optimizer.use_precision_aware_optimizer = False
    if plan is None:
        cfg.data_parallel_size = 1
    elif len({tuple(r.tp) for r in plan.replicas}) != 1 or \
            plan.replicas[0].tp[0] != m.tensor_model_parallel_size:
        cfg.data_parallel_size = len(plan.replicas)
    cfg.validate()


def preflight(job: Any, plan: Any) -> None:
    """Bridge's own sequence-length check, run once by the launching process before any process
    group, so the error is one line naming the field and not a failure of every rank (which a
    recovery supervisor would blame on the GPUs): ``dataset.seq_length`` against
    ``model.seq_length``. (Bridge's whole ``validate()`` cannot run here: it reads the world size
    from ``torch.distributed``, which the launcher has not started; each rank runs it.)"""
    cfg = job.bridge
    m, d = cfg.model, cfg.dataset
    data_seq = getattr(d, "seq_length", None) if d is not None else None
    if data_seq is not None and int(data_seq) != int(m.seq_length):
        raise ValueError(f"dataset.seq_length={data_seq}: differs from model.seq_length="
                         f"{m.seq_length} (Bridge trains only when they are equal)")


@dataclass
class BridgeWorld:
    """One world's Bridge objects on this rank, before training state exists (``build_world``):
    the groups, the NUTP model in Bridge's chunk list, Bridge's optimizer and scheduler (not yet
    stepped), the model config's callbacks and megatron's micro-batch calculator set. A live
    re-layout builds one per world (``bridge_live``) and moves the state into it."""

    job: Any
    plan: Any
    groups: Any
    cfg: Any  # this world's ConfigContainer
    model: list[Any]  # what Bridge's train() gets (virtual stages: bridge_pipeline.ChunkView)
    ddp: Any  # the NUTP DDP (every chunk of this rank)
    optimizer: Any
    scheduler: Any
    raw_step: Any  # the optimizer's step before any wrapper (a live re-layout's completion)
    finish: Any  # the model config's finalize_model_grads_func before any wrapper
    datasets: Any = None  # the recipe's (train, valid, test) datasets, built by the first run


@dataclass
class BridgeRun:
    """What Bridge's ``train()`` is called with, from a ``BridgeWorld`` (``start_world``)."""

    world: BridgeWorld
    state: Any
    checkpoints: Any
    callbacks: Any
    data: Any
    valid: Any
    forward: Any
    record: list[dict[str, float]]
    evals: list[dict[str, float]]
    eval_parts: list[tuple[float, float]]
    outputs: Any
    first_step: int
    balance: Any  # train.rebalance.LiveBalance
    eval_pending: bool = False  # the evaluation owed at first_step (ResumeAt.eval_pending)
    links: tuple[Any, ...] = ()  # slow_link faults keyed by GPU (parallel.comm.LinkFault)

    def next_step(self) -> int:
        """The step after the one whose end left ``train()`` (Bridge counts it after)."""
        return int(self.state.train_state.step) + 1


@dataclass
class StepHooks:
    """Around the optimizer step (``recovery.mode=live``: the manager's vote and result):
    ``before(loss)`` after the global-batch loss is known and before any optimizer state
    changes (it may raise to stop the step); ``after(ok, grad_norm)`` right after the update."""

    before: Callable[[float], None]
    after: Callable[[bool, float | None], None]


def build_world(job: Any, plan: Any, *, seed: int) -> BridgeWorld:
    """Collective over the world: groups, model, DDP, optimizer and scheduler of this rank
    (module docstring), from ``job.bridge`` (validated and adjusted for this plan here)."""
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.core import parallel_state, tensor_parallel

    from ..compat.bridge_cpu import apply_bridge_cpu_patches
    from ..parallel import build_groups
    from .bridge import exact_grad_norm, moe_groups, nutp_ddp, nutp_provider
    from .bridge_pipeline import PipelineFinish, chunk_views
    from .bridge_zero import overlap_param_gather, setup_zero_optimizer, wants_zero

    apply_bridge_cpu_patches()
    cfg = job.bridge
    check_moe(cfg, plan)
    moe = moe_of(cfg.model)
    validate_as_uniform(cfg, plan)
    cfg.dist.use_decentralized_pg = True  # explicit process groups (NUTP's), never mpu globals
    if not torch.cuda.is_available():  # megatron's local attention needs the explicit mask
        cfg.dataset.skip_getting_attention_mask_from_dataset = False
    groups = build_groups(plan)
    ctx = groups.ctx
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=ctx.tp_rank, ep_rank=0,
                                                    etp_rank=0)
    zero = wants_zero(cfg)
    overlap = False
    if zero:  # NUTP's ZeRO-1 over the usual NUTP DDP, never megatron's buffers (bridge_zero)
        cfg.ddp.use_distributed_optimizer = False
        overlap = overlap_param_gather(cfg, job.nutp.recovery)
        # NUTP's own forward pre-hooks complete the gather (bridge_zero): off on the config,
        # so that Bridge's loop does not toggle megatron's
        cfg.ddp.overlap_param_gather = cfg.optimizer.overlap_param_gather = False
    provider = nutp_provider(cfg.model, plan, groups, seed=seed, moe=moe,
                             mla=mla_of(cfg.model))
    chunks = provider.provide_distributed_model(
        ddp_config=cfg.ddp, wrap_with_ddp=False, pg_collection=groups.pgs,
        use_cpu_initialization=True)  # bf16/fp16: Bridge's default Float16Module wrapper
    cfg.ddp.overlap_grad_reduce = True
    (ddp,) = nutp_ddp(chunks, cfg.ddp, plan, groups, moe=moe)
    model = chunk_views(ddp) if plan.vp > 1 else [ddp]
    if zero:
        optimizer, scheduler = setup_zero_optimizer(
            cfg, [ddp], redundancy=job.nutp.recovery.live_redundancy, overlap=overlap)
    else:
        optimizer, scheduler = setup_optimizer(
            optimizer_config=cfg.optimizer, scheduler_config=cfg.scheduler, model=[ddp],
            use_gloo_process_groups=False,
            pg_collection=groups.pgs if moe is None else moe_groups(groups))
        exact_grad_norm(optimizer, ddp)
    mc = ddp.config
    mc.no_sync_func = ddp.no_sync
    mc.finalize_model_grads_func = finish = PipelineFinish(plan, groups, ddp)
    mc.grad_scale_func = optimizer.scale_loss
    return BridgeWorld(job, plan, groups, cfg, model, ddp, optimizer, scheduler, optimizer.step,
                       finish)


def start_world(world: BridgeWorld, out_dir: str | Path, *,
                init_from: str | Path | None = None, resume: ResumeAt | None = None,
                ledger: Any = None, hooks: StepHooks | None = None, balance: Any = None,
                callbacks_extra: Callable[[Any, Any], None] | None = None,
                links: tuple[Any, ...] | None = None, watch: Any = None) -> BridgeRun:
    """Collective over the world: the training state, data, callbacks and outputs of a world.
    ``resume=None``: the run's first world (``init_from`` weights, else Bridge's
    ``checkpoint.load``); else a live re-layout's next world, whose state was moved in and
    which starts at ``resume`` (the schedule's clock, the data position). ``ledger``: the goodput
    ledger to continue; ``hooks``: around the optimizer step; ``balance``: the
    world's ``train.rebalance.LiveBalance`` to keep (a re-entry of the same world after its
    shares changed; None: a new one: ``nutp.rebalance``, the straggler probe, the injected
    slowdown); ``callbacks_extra(callbacks, state)``: more of Bridge's callbacks, registered
    last; ``links``: the ``slow_link`` faults (keyed by GPU) of the run before (None: this
    world's first run takes them from the injected faults); ``watch``: rank 0's slow-link watch
    to continue (``train/links.py``). Wrappers of an earlier run of the same world are dropped
    first."""
    from megatron.bridge.training.checkpointing import CheckpointLoadContext
    from megatron.bridge.training.state import GlobalState
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from ..common.faults import Faults
    from ..train.loop import link_faults
    from ..train.rebalance import LiveBalance
    from ..train.step import reduce_replica_loss
    from .bridge_ckpt import NUTPBridgeCheckpointManager
    from .bridge_data import datasets, train_iterator, valid_iterator
    from .bridge_eval import eval_callbacks
    from .bridge_outputs import BridgeOutputs
    from .bridge_recovery import recovery_callbacks

    job, plan, groups, cfg = world.job, world.plan, world.groups, world.cfg
    model, optimizer, scheduler = world.model, world.optimizer, world.scheduler
    first = resume is None or resume.same_world  # the world's first run, or its re-entry
    fault = Faults.from_env_or_config(job.nutp) if first else None
    if balance is None:  # the shares (nutp.rebalance), the straggler probe, a slowdown
        balance = LiveBalance(job.nutp, balance_view(world), fault=fault, rank=groups.ctx.rank)
    ctx = groups.ctx  # (after a rebalance: this replica's new share)
    for obj in (optimizer, scheduler):  # an earlier run's wrappers (a re-entry)
        vars(obj).pop("step", None)
    mc = world.ddp.config
    mc.finalize_model_grads_func = world.finish
    mbs = cfg.train.micro_batch_size
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(ctx.rank, None, ctx.microbatches * mbs, mbs, 1)
    state = GlobalState()
    state.cfg = cfg
    cfg.model.timers = state.timers
    cfg.optimizer.timers = state.timers
    if init_from is not None:
        load_weights(world.ddp, plan, groups, optimizer, init_from)
    checkpoints = NUTPBridgeCheckpointManager(cfg.checkpoint, plan=plan, groups=groups)
    if resume is None:
        # checkpoint.load: before the scheduler and optimizer wrappers below (the scheduler's
        # load_state_dict steps it by the saved count) and the data iterator (it starts at the
        # consumed samples)
        checkpoints.load(CheckpointLoadContext(state=state, model=model, optimizer=optimizer,
                                               opt_param_scheduler=scheduler,
                                               pg_collection=groups.pgs))
    else:
        resume.apply(state, scheduler, cfg)
        # megatron's rerun state machine (a process global, created implicitly with its
        # defaults by the first train_step) is left mid-step by a stopped world: a new one
        from megatron.core.rerun_state_machine import (
            destroy_rerun_state_machine,
            initialize_rerun_state_machine,
        )

        destroy_rerun_state_machine()
        initialize_rerun_state_machine()
    first_step = int(state.train_state.step)

    def from_last_stage(value: float) -> float:
        """The last stage's value on every rank of the replica (collective over it)."""
        if plan.pp == 1:
            return value
        box = torch.zeros(1, dtype=torch.float64)
        if ctx.stage == plan.pp - 1 and ctx.tp_rank == 0:
            box[0] = value
        torch.distributed.all_reduce(box, group=groups.replica)
        return float(box[0])

    def reduce(replica: float) -> float:
        return reduce_replica_loss(from_last_stage(replica), weight=ctx.weight,
                                   degree=ctx.degree, stage_group=groups.stage)

    eval_parts: list[tuple[float, float]] = []
    record, recorded_forward = recording(optimizer, reduce, report_share=1.0 / ctx.degree,
                                         eval_parts=eval_parts, hooks=hooks)
    global_samples(optimizer, scheduler, state, cfg.train.global_batch_size,
                   counted=groups.pgs.dp.size() * mbs * ctx.microbatches)
    share = {"num_microbatches": plan.request.global_batch, "offset": ctx.microbatch_offset,
             "count": ctx.microbatches}
    if world.datasets is None:  # (a re-entry of the same world reuses them)
        world.datasets = datasets(cfg, groups.pgs)
    train_ds, valid_ds, _ = world.datasets
    data = train_iterator(cfg, state.train_state, groups.pgs, dataset=train_ds, **share)
    valid = valid_iterator(cfg, state.train_state, valid_ds, **share)
    evals: list[dict[str, float]] = []
    callbacks = eval_callbacks(cfg, state, share=ctx.microbatches,
                               dp_size=groups.pgs.dp.size(), record=evals,
                               shared=from_last_stage if plan.pp > 1 else None)
    # heartbeats, the injected fault (the run's first world only), resumed
    recovery_callbacks(callbacks, job.nutp, plan, checkpoints, fault=first)
    if links is None:  # slow links (keyed by GPU) apply in every world of the process
        links = link_faults(fault, plan)
    if groups.comm is not None:
        groups.comm.faults = links
    outputs = BridgeOutputs(job.nutp, plan, groups, world.ddp, out_dir, record=record,
                            evals=evals, start_step=first_step, ledger=ledger,
                            inside=balance.inside_speeds, live=hooks is not None, watch=watch)
    outputs.attach(callbacks, optimizer, checkpoints, mc)
    if getattr(mc, "mtp_num_layers", None) and not cfg.logger.skip_train_metrics_log:
        mtp_log_callbacks(callbacks, groups)  # (before a Reshare can leave the step)
    balance_callbacks(callbacks, balance, outputs, mc, iters=int(cfg.train.train_iters))
    if callbacks_extra is not None:
        callbacks_extra(callbacks, state)
    return BridgeRun(world, state, checkpoints, callbacks, data, valid, recorded_forward,
                     record, evals, eval_parts, outputs, first_step, balance,
                     resume is not None and resume.eval_pending, links)


def reshared(run: BridgeRun, out_dir: str | Path) -> BridgeRun:
    """The same world re-entered after its shares changed (``Reshare``), from the next step:
    rank 0's metrics continued, the goodput ledger and the balance kept, the evaluation Bridge
    would have run after the step owed. Collective."""
    run.outputs.suspend()
    nxt = run.next_step()
    resume = ResumeAt(nxt, same_world=True,
                      eval_pending=ResumeAt.evaluates_at(run.world.cfg, nxt))
    return start_world(run.world, out_dir, resume=resume, ledger=run.outputs.ledger,
                       balance=run.balance, links=run.links, watch=run.outputs.link_watch())


class Reshare(Exception):
    """The replicas' shares changed after this step (``nutp.rebalance``): leave ``train()``;
    the same world re-enters it at the next step with them."""


def balance_view(world: BridgeWorld) -> Any:
    """What ``train.rebalance`` reads of a ``nutp-train`` session, for a Bridge world."""
    from types import SimpleNamespace

    from megatron.core.transformer.module import Float16Module

    from ..train.step import StepOptions

    gpt = world.ddp.module
    return SimpleNamespace(plan=world.plan, groups=world.groups, model=world.ddp,
                           gpt=gpt.module if isinstance(gpt, Float16Module) else gpt,
                           opts=StepOptions())


def mtp_log_callbacks(callbacks: Any, groups: Any) -> None:
    """The MTP losses Bridge's ``training_log`` reports (megatron's ``track_mtp_metrics``: the
    tracker times ``1 / micro-batches``, after averaging over megatron's global data-parallel
    group, which NUTP does not create: ``model/mtp.py``) as one process has them over the
    global batch. Every TP rank of a replica holds its replica's sum over its ``m_r``
    micro-batches; at each step's end (before ``training_log``) the tracker becomes
    ``m_r x sum over replicas (w_r x replica mean)`` (``w_r = m_r / M``, each TP rank counted
    ``1 / degree``), so that Bridge's ``1 / m_r`` logs the global mean on every rank. The
    acceptance counts become the global sums likewise (exact only at even vocabulary shards:
    megatron's argmax over vocab shards assumes them, ``model/mtp.py``). Collective over the
    stage group."""

    def reduce(_ctx: Any) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        c = groups.ctx  # (after a rebalance: this replica's new share)
        for key, factor, back in (
                ("loss_values", c.weight / (c.microbatches * c.degree), c.microbatches),
                ("correct_values", 1.0 / c.degree, 1),
                ("total_values", 1.0 / c.degree, 1)):
            values = tracker.get(key)
            if values is None:
                continue
            t = values.double() * factor
            torch.distributed.all_reduce(t, group=groups.stage)
            values.copy_(t * back)

    callbacks.register("on_train_step_end", reduce)


def balance_callbacks(callbacks: Any, balance: Any, outputs: Any, mc: Any, *,
                      iters: int) -> None:
    """Around each of Bridge's steps, what ``nutp-train``'s loop does around its own
    (``train.rebalance.LiveBalance``): the injected slowdown (``common/faults.py`` kind slow: this
    rank's compute x factor, slept before the gradient finalisation, outside the sync's timing,
    so that it is compute), the straggler probe and the shares from the step's per-replica
    compute times (``outputs.last_reps``); changed shares leave ``train()`` (``Reshare``) after
    the step's row (rank 0's row records the shares the step ran with)."""
    import time

    t0 = [0.0]
    finish = mc.finalize_model_grads_func

    def slowed_finish(*args: Any, **kwargs: Any) -> Any:
        f = balance.session.opts.slow_factor
        if f > 1.0:
            time.sleep((f - 1.0) * (time.perf_counter() - t0[0]))
        return finish(*args, **kwargs)

    mc.finalize_model_grads_func = slowed_finish

    def start(ctx: Any) -> None:
        balance.before_step(int(ctx.state.train_state.step))
        t0[0] = time.perf_counter()

    def end(ctx: Any) -> None:
        step = int(ctx.state.train_state.step)
        used = balance.after_step(step, outputs.last_reps)
        if outputs.pending is not None:
            outputs.pending["microbatches"] = used
        if balance.shares != used and step + 1 < iters:
            raise Reshare

    callbacks.register("on_train_step_start", start)
    callbacks.register("on_train_step_end", end)


def train_world(run: BridgeRun) -> None:
    """Bridge's own ``train()`` from ``run``'s step to ``train.train_iters`` (collective),
    after the evaluation the run owes, if any."""
    from megatron.bridge.training import train as bridge_train

    from .bridge_moe_metrics import nutp_moe_tracker
    from .bridge_pipeline import stage_communicator

    w = run.world
    if getattr(w.cfg.model, "num_moe_experts", None):  # Bridge's logged MoE metrics: NUTP's sums
        nutp_moe_tracker(w.groups, w.plan.request.global_batch)
    with stage_communicator(w.plan, w.groups):
        if run.eval_pending:
            owed_evaluation(run)
        bridge_train.train(run.forward, w.model, w.optimizer, w.scheduler, run.data, run.valid,
                           run.state, run.checkpoints, w.groups.pgs,
                           callback_manager=run.callbacks)
    settle = getattr(w.optimizer, "settle", None)
    if settle is not None:  # the last step's deferred parameter gather (bridge_zero)
        settle("end")


def owed_evaluation(run: BridgeRun) -> None:
    """The evaluation Bridge's ``train()`` runs right after step ``first_step - 1``, which the
    run that stopped there did not reach (it left ``train()`` at the step's end, or its world
    stopped): Bridge's own ``evaluate_and_print_results`` with this run's callbacks; rank 0
    adds its loss to that step's row. Collective."""
    from megatron.bridge.training.eval import evaluate_and_print_results

    run.eval_pending = False
    w = run.world
    evaluate_and_print_results(run.state, f"iteration {run.first_step}", run.forward, run.valid,
                               w.model, w.ddp.config, verbose=False, write_to_tensorboard=False,
                               callback_manager=run.callbacks)
    out = run.outputs.out
    if out is not None and run.evals and run.evals[-1]["step"] == run.first_step and \
            out.rows and out.rows[-1]["step"] == run.first_step - 1:
        out.amend_last({"val_loss": run.evals[-1]["val_loss"]})


def rank_record(runs: list[BridgeRun], out_dir: str | Path) -> dict[str, Any]:
    """This rank's per-step record (each run's numbered from its first step) and evaluations
    over ``runs`` (one world: its runs between share changes), written to
    ``bridge_rank<r>.json`` (atomic)."""
    from ..layout.serialize import write_json_atomic

    ctx = runs[-1].world.groups.ctx
    steps, evals, parts = [], [], []
    for run in runs:
        for i, row in enumerate(run.record):
            row["step"] = run.first_step + i
        steps += run.record
        evals += run.evals
        parts += run.eval_parts
    out = {"rank": ctx.rank, "replica": ctx.replica, "steps": steps, "evals": evals,
           "eval_parts": parts}
    write_json_atomic(out, Path(out_dir, f"bridge_rank{ctx.rank}.json"))
    return out


@dataclass(frozen=True)
class ResumeAt:
    """Where a live re-layout's next world starts: ``step`` (the last committed + 1) with
    ``skips`` of the steps before it skipped (fp16's loss scaler)."""

    step: int
    skips: int = 0
    same_world: bool = False  # a re-entry of the world that stopped (its shares changed)
    eval_pending: bool = False  # the evaluation due at ``step`` did not complete: run it
    # before training (the validation data then starts where it would have)

    @staticmethod
    def evaluates_at(cfg: Any, counter: int) -> bool:
        """Whether Bridge's ``train()`` evaluates when its step counter reaches ``counter``
        (right after the step ``counter - 1``)."""
        v = cfg.validation
        first = getattr(v, "start_eval_at_iter", None) or 1
        return bool(v.eval_interval and v.eval_iters and counter >= first and
                    counter % v.eval_interval == 0)

    def apply(self, state: Any, scheduler: Any, cfg: Any) -> None:
        """Bridge's train state and scheduler as an uninterrupted run has them at ``step``:
        every step consumed the global batch; the scheduler stepped by it on each update
        (megatron skips it on a skipped one); each evaluation so far (Bridge evaluates when its
        counter, after the step, is a multiple of ``validation.eval_interval``, from
        ``start_eval_at_iter``) consumed
        ``eval_iters`` validation global batches."""
        ts = state.train_state
        gbs = int(cfg.train.global_batch_size)
        ts.step = self.step
        ts.consumed_train_samples = self.step * gbs
        v = cfg.validation
        last = self.step - int(self.eval_pending)
        evals = sum(1 for s in range(1, last + 1) if self.evaluates_at(cfg, s))
        ts.consumed_valid_samples = evals * int(v.eval_iters) * int(v.eval_global_batch_size
                                                                    or gbs)
        if not self.same_world:  # (a re-entry's scheduler is already there)
            scheduler.step(increment=(self.step - self.skips) * gbs)


def train_rank(job: Any, plan: Any, out_dir: str, *, seed: int,
               init_from: str | Path | None = None) -> dict[str, Any]:
    """Collective over the world: build and train this rank; returns the per-step record.
    ``out_dir``: the run directory (``nutp-bridge`` passes ``output.dir``): every rank's
    ``bridge_rank<r>.json``, and rank 0's ``metrics.jsonl``, ``goodput.json`` and
    ``training.png`` (``bridge_outputs``).
    ``init_from``: start from the weights of this megatron-core checkpoint (NUTP's, Bridge's or
    stock megatron's ``iter_N``; any layout) instead of NUTP's own initialisation."""
    world = build_world(job, plan, seed=seed)
    run = start_world(world, out_dir, init_from=init_from)
    runs = [run]
    while True:
        try:
            train_world(run)
            break
        except Reshare:  # the same world at its new shares, from the next step
            run = reshared(run, out_dir)
            runs.append(run)
    run.outputs.finish()
    out = rank_record(runs, out_dir)
    return {**out, "model": world.ddp, "groups": world.groups, "state": run.state,
            "optimizer": world.optimizer, "saved": run.checkpoints.saved,
            "loaded": run.checkpoints.loaded}
