"""NUTP GPT specs and builder, and global-weight-consistent initialisation.

* ``nutp_layer_spec(dims, degree, tp_rank)`` derives megatron-core's *local* GPT layer spec and
  swaps in the NUTP attention/MLP/norm subclasses with this rank's unit counts; pass it (or the
  block spec from ``nutp_block_spec``) as ``transformer_layer_spec`` to a megatron GPT model.
* ``build_gpt_model(plan, rank, model_cfg, pgs, seed=...)`` builds this rank's model and loads
  its units of the *global* weights, which are a deterministic function of (seed, parameter name)
  — so every replica starts from the same model whatever its degree and unit assignment.
* Every parameter gets ``nutp_kind`` (a ``layout.units`` kind, or None when replicated) and
  ``nutp_units = (lo, hi)``, which the gradient sync and checkpointing read.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..compat.megatron import nutp_mlp_linear_fc2, nutp_mlp_submodule
from ..layout import PARAM_KINDS, Plan, chunk_layers
from ..layout.specs import ModelDims
from ..layout.units import space_bounds
from .init import init_param_
from .layers import (
    NUTPMLP,
    NUTPGPTModel,
    NUTPHeadNorm,
    NUTPNorm,
    NUTPSelfAttention,
    PostNormRowParallelLinear,
    SoftcapDotProductAttention,
)

_KIND_OF = (
    (r"embedding\.word_embeddings\.weight$", "word_embedding"),
    (r"output_layer\.weight$", "output_layer"),
    (r"self_attention\.linear_qkv\.weight$", "qkv_weight"),
    (r"self_attention\.linear_qkv\.bias$", "qkv_bias"),
    (r"self_attention\.linear_proj\.weight$", "proj_weight"),
    (r"mlp\.linear_fc1\.weight$", "fc1_weight"),
    (r"mlp\.linear_fc1\.bias$", "fc1_bias"),
    (r"mlp\.linear_fc2\.weight$", "fc2_weight"),
    # a MoE layer's shared expert: its FFN columns are the dense FFN's units (model/moe.py)
    (r"mlp\.shared_experts\.linear_fc1\.weight$", "fc1_weight"),
    (r"mlp\.shared_experts\.linear_fc2\.weight$", "fc2_weight"),
    (r"self_attention\.linear_q_(up_)?proj\.weight$", "mla_q_weight"),
    (r"self_attention\.linear_kv_up_proj\.weight$", "mla_kv_up_weight"),
)


def param_kind(name: str) -> str | None:
    """Layout kind of a GPT parameter name; None for replicated parameters (norms, row biases)."""
    name = name.removeprefix("module.")
    for pattern, kind in _KIND_OF:
        if re.search(pattern, name):
            return kind
    return None


def unit_range(dims: ModelDims, kind: str, degree: int, tp_rank: int, balance: str = "work"
               ) -> tuple[int, int]:
    """Units [lo, hi) of a parameter kind held by ``tp_rank`` (the plan's assignment)."""
    b = space_bounds(dims, PARAM_KINDS[kind].space, degree, balance)
    return int(b[tp_rank]), int(b[tp_rank + 1])


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _has_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def resolve_impl(model: Any, *, cuda: bool | None = None) -> tuple[str, str]:
    """(layer implementation, core attention) this process builds for ``model.transformer_impl``
    / ``model.core_attention``: ``auto`` means Transformer Engine when CUDA and
    ``transformer_engine`` are present, else megatron's local layers with SDPA core attention
    on CUDA and megatron's ``DotProductAttention`` on CPU. TE layers bring their own attention
    ('te')."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    impl = getattr(model, "transformer_impl", "local")
    if impl == "auto":
        impl = "transformer_engine" if cuda and _has_te() else "local"
    if impl == "transformer_engine":
        return impl, "te"
    core = getattr(model, "core_attention", "megatron")
    if core == "auto":  # SDPA cannot softcap the scores
        softcap = getattr(model, "attn_logit_softcapping", None)
        core = "sdpa" if cuda and not softcap else "megatron"
    return impl, core


def needs_attention_mask(model: Any, *, cuda: bool | None = None) -> bool:
    """Only megatron's local ``DotProductAttention`` reads an explicit mask; SDPA and TE mask
    causally themselves (``attention_mask=None``)."""
    return resolve_impl(model, cuda=cuda)[1] == "megatron"


def fusions(*, cuda: bool, te: bool) -> dict[str, bool]:
    """megatron's fusion switches: off on CPU (portable math); on CUDA the pure-torch (jit)
    fusions, and with Transformer Engine also those that need its kernels (softmax, RoPE,
    weight-gradient accumulation into ``main_grad``). Never on: ``persist_layer_norm`` (apex)
    and ``cross_entropy_loss_fusion`` (NUTP computes the vocab-range loss itself; with
    ``model.cross_entropy_loss_fusion`` it rounds the logits gradient as megatron's fused one)."""
    return dict(bias_activation_fusion=cuda, bias_dropout_fusion=cuda,
                masked_softmax_fusion=cuda and te, apply_rope_fusion=cuda and te,
                gradient_accumulation_fusion=cuda and te, persist_layer_norm=False,
                cross_entropy_loss_fusion=False)


def enable_cuda_math(precision: str) -> None:
    """TF32 tensor cores for fp32 runs on CUDA (matmuls and cuDNN), as megatron's training
    does; bf16/fp16 runs are unaffected."""
    if precision == "fp32" and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def transformer_config(model: Any, *, degree: int, sequence_parallel: bool = False,
                       precision: str = "fp32", pp: int = 1, vp: int = 1,
                       cuda: bool | None = None) -> TransformerConfig:
    """megatron ``TransformerConfig`` of the *global* model (fusions only on CUDA: ``fusions``).

    Built at TP1 (megatron validates head counts against ``tensor_model_parallel_size``, which
    uneven NUTP degrees need not divide); the degree and sequence parallelism are set after.
    ``precision`` 'bf16'/'fp16' sets megatron's ``bf16``/``fp16`` and the params dtype (the
    model is then wrapped in megatron's ``Float16Module``). ``pp`` sets megatron's pipeline
    size (the stage's layer count and offset come from the rank's pipeline group) and the
    dtype of the activations sent between stages; ``vp`` > 1 megatron's
    ``virtual_pipeline_model_parallel_size`` (model chunks per rank, the interleaved schedule;
    a chunk's layers follow from its ``vp_stage``). ``model.recompute_*`` pass through to
    megatron's activation recompute. ``cuda``: default ``torch.cuda.is_available()``.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    impl, _ = resolve_impl(model, cuda=cuda)
    recompute = {k: getattr(model, k, None) for k in
                 ("recompute_granularity", "recompute_method", "recompute_num_layers")}
    config = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size, kv_channels=model.kv,
        gated_linear_unit=model.gated_linear_unit, activation_func=activation(model),
        normalization=getattr(model, "normalization", "RMSNorm"),
        layernorm_epsilon=float(getattr(model, "layernorm_epsilon", 1e-5)),
        qk_layernorm=bool(getattr(model, "qk_layernorm", False)),
        layernorm_zero_centered_gamma=bool(getattr(model, "layernorm_zero_centered_gamma",
                                                   False)),
        softmax_scale=getattr(model, "softmax_scale", None),
        window_size=getattr(model, "window_size", None),
        window_attn_skip_freq=getattr(model, "window_attn_skip_freq", None),
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_bias_linear or getattr(model, "add_qkv_bias", False),
        hidden_dropout=float(getattr(model, "hidden_dropout", 0.0)),
        attention_dropout=float(getattr(model, "attention_dropout", 0.0)),
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=DTYPES[precision], bf16=precision == "bf16", fp16=precision == "fp16",
        **fusions(cuda=cuda, te=impl == "transformer_engine"), **recompute,
        pipeline_model_parallel_size=pp, pipeline_dtype=DTYPES[precision],
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
    )
    config.tensor_model_parallel_size = degree
    config.sequence_parallel = sequence_parallel and degree > 1
    for name, value in yarn_attributes(model).items():
        setattr(config, name, value)
    for name, default in GEMMA_ATTRS.items():  # not megatron fields: Bridge's provider names
        setattr(config, name, getattr(model, name, default))
    return config


def yarn_attributes(model: Any) -> dict[str, Any]:
    """The ``yarn_*`` attributes megatron's ``GPTModel`` and attention read from the config with
    ``position_embedding_type='yarn'`` (``TransformerConfig`` has no such fields: Bridge's
    providers and MLA's config add them). Empty otherwise: megatron's attention scales q and k
    by YaRN's concentration factor whenever the config *has* ``yarn_rotary_scaling_factor``."""
    if getattr(model, "position_embedding_type", "rope") != "yarn":
        return {}
    return {f"yarn_{k}": getattr(model, f"yarn_{k}") for k in (
        "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
        "mscale", "mscale_all_dim", "correction_range_round_to_int")}


GEMMA_ATTRS: dict[str, Any] = {
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "apply_embedding_scaling": False, "embedding_scale_rounded": True,
    "rotary_base_local": None,
    "rope_scaling_factor_global": 1.0}
"""``model.*`` settings that are not megatron ``TransformerConfig`` fields: set on the config
as attributes (as Bridge's Gemma providers, ``TransformerConfig`` subclasses, carry them) for
the NUTP layers to read (``model/layers.py``)."""


def nutp_layer_spec(dims: ModelDims, *, degree: int, tp_rank: int,
                    tp_group: Any = None, balance: str = "work",
                    core_attention: str = "megatron") -> ModuleSpec:
    """megatron's local GPT layer spec with NUTP attention/MLP/norms for this rank's units.

    ``tp_group`` is this rank's TP group: megatron's ``TransformerLayer`` passes a TP group only
    to the exact ``MLP`` class, so the spec carries it for ``NUTPMLP``. ``core_attention``
    'sdpa' substitutes ``SDPAttention`` (torch SDPA, causal, no ``[s, s]`` scores) for
    megatron's ``DotProductAttention``.
    """
    spec = _with_nutp_modules(get_gpt_layer_local_spec(), dims, degree, tp_rank, tp_group,
                              balance)
    spec.submodules.input_layernorm = NUTPNorm
    spec.submodules.pre_mlp_layernorm = NUTPNorm
    attn = spec.submodules.self_attention.submodules
    if getattr(dims, "qk_layernorm", False):
        attn.q_layernorm = attn.k_layernorm = NUTPHeadNorm
    if getattr(dims, "post_layernorm", False):
        attn.linear_proj = PostNormRowParallelLinear
        nutp_mlp_linear_fc2(spec.submodules.mlp, PostNormRowParallelLinear)
    softcap = getattr(dims, "attn_logit_softcapping", None)
    if core_attention == "sdpa":
        if softcap:
            raise ValueError(f"model.attn_logit_softcapping={softcap}: not with SDPA core "
                             "attention (model.core_attention=megatron)")
        from .attention import SDPAttention

        attn.core_attention = SDPAttention
    elif core_attention != "megatron":
        raise ValueError(f"core_attention={core_attention!r}: must be sdpa or megatron")
    elif softcap:
        attn.core_attention = SoftcapDotProductAttention
    return spec


def _with_nutp_modules(base: ModuleSpec, dims: ModelDims, degree: int, tp_rank: int,
                       tp_group: Any, balance: str) -> ModuleSpec:
    """Copy of a megatron GPT layer spec with NUTP attention/MLP holding this rank's units."""
    spec = copy.deepcopy(base)
    sub = spec.submodules
    g0, g1 = unit_range(dims, "qkv_weight", degree, tp_rank, balance)
    f0, f1 = unit_range(dims, "fc1_weight", degree, tp_rank, balance)
    sub.self_attention.module = NUTPSelfAttention
    sub.self_attention.params = {**sub.self_attention.params, "nutp_local_groups": g1 - g0}
    sub.mlp = nutp_mlp_submodule(sub.mlp, cls=NUTPMLP, local_ffn=f1 - f0, tp_group=tp_group)
    return spec


def nutp_block_spec(dims: ModelDims, *, degree: int, tp_rank: int,
                    tp_group: Any = None, balance: str = "work",
                    num_layers: int | None = None, impl: str = "local",
                    core_attention: str = "megatron") -> TransformerBlockSubmodules:
    """Block spec of ``num_layers`` NUTP layers (default: all; a pipeline stage: its own);
    ``impl`` 'local' or 'transformer_engine' (``resolve_impl``)."""
    if impl == "transformer_engine":
        layer = nutp_te_layer_spec(dims, degree=degree, tp_rank=tp_rank, tp_group=tp_group,
                                   balance=balance)
    else:
        layer = nutp_layer_spec(dims, degree=degree, tp_rank=tp_rank, tp_group=tp_group,
                                balance=balance, core_attention=core_attention)
    n = dims.num_layers if num_layers is None else num_layers
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=NUTPNorm)


def nutp_te_layer_spec(dims: ModelDims, *, degree: int, tp_rank: int,
                       tp_group: Any = None, balance: str = "work") -> ModuleSpec:
    """Transformer-Engine variant: megatron's TE GPT layer spec with the NUTP attention/MLP.

    TE's fused layernorm-linear modules size their shard from the same rank-local config view,
    so the substitution is the same as for the local spec; the norms stay fused into
    ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``), and TE's attention masks causally
    with ``attention_mask=None``. Checkpoint names map to the local spec's
    (``model.te_names``). Needs ``transformer_engine``; it is not installed in CI, so this path
    has no CPU test (``tests/gpu`` has one, skipped without TE).
    """
    if getattr(dims, "qk_layernorm", False):
        raise ValueError("model.qk_layernorm=True: built with megatron's local layers only "
                         "(model.transformer_impl=local); the TE spec's fused QK norm is not "
                         "built yet")
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
    except ImportError as e:
        raise ImportError("nutp_te_layer_spec needs transformer_engine (pip install "
                          "transformer-engine, or use the NGC container)") from e
    return _with_nutp_modules(get_gpt_layer_with_transformer_engine_spec(), dims, degree,
                              tp_rank, tp_group, balance)


LAYER_SPECS = {"nutp_local": nutp_layer_spec, "nutp_te": nutp_te_layer_spec}
"""Registry of NUTP layer-spec builders by name; pass the result as a megatron-core GPT
``transformer_layer_spec`` (with ``NUTPGPTModel`` for uneven vocab shards)."""


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


def global_name(name: str, *, layer_offset: int = 0) -> str:
    """A stage-local parameter name as in the whole (TP1, PP1) model: ``module.`` wrappers
    dropped and the stage's layer offset added to ``decoder.layers.<i>``."""
    from .init import normalize_name

    name = normalize_name(name)
    m = _LAYER.match(name)
    return name if m is None else f"{m[1]}{int(m[2]) + layer_offset}{m[3]}"


def load_global_init(model: torch.nn.Module, dims: ModelDims, *, degree: int, tp_rank: int,
                     seed: int, std: float = 0.02, balance: str = "work",
                     layer_offset: int = 0) -> None:
    """Tag every parameter with its units and fill in its units of the global init.

    The init is megatron's (``model/init.py``: N(0, std), output projections scaled by
    1/sqrt(2L), zero biases, unit norms), generated per unit block, so a rank's time and memory
    scale with its shard. Sharded parameters also get megatron's TP attributes
    (``tensor_model_parallel``, ``partition_dim``), which megatron sets only inside its own
    init routines. ``p.nutp_name`` is the parameter's name in the whole model (pipeline
    stages: layers renumbered by ``layer_offset``); the last stage's copy of a tied embedding
    (``output_layer.weight`` with ``pp > 1``) is initialised as the word embedding and tagged
    ``nutp_tied_copy``."""
    for name, p in model.named_parameters():
        # nutp_replicated: whole on every rank whatever its name (a MoE layer's shared expert
        # of its own size, model/moe.py)
        kind = None if getattr(p, "nutp_replicated", False) else param_kind(name)
        gname = global_name(name, layer_offset=layer_offset)
        tied_copy = bool(getattr(p, "shared_embedding", False)) and kind == "output_layer"
        p.nutp_kind = kind  # type: ignore[attr-defined]
        p.nutp_name = gname  # type: ignore[attr-defined]
        p.nutp_tied_copy = tied_copy  # type: ignore[attr-defined]
        units = None if kind is None else unit_range(dims, kind, degree, tp_rank, balance)
        p.nutp_units = units  # type: ignore[attr-defined]
        if kind is not None:
            p.tensor_model_parallel = True  # type: ignore[attr-defined]
            p.partition_dim = PARAM_KINDS[kind].axis  # type: ignore[attr-defined]
            p.partition_stride = 1  # type: ignore[attr-defined]
        init_name, init_kind = (("embedding.word_embeddings.weight", "word_embedding")
                                if tied_copy else (gname, kind))
        init_param_(p, name=init_name, kind=init_kind, units=units, dims=dims, seed=seed,
                    std=std)


def activation(model_cfg: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation function from ``model.activation_func`` (a name, elementwise: no
    unit changes); null: silu for a gated MLP, gelu otherwise."""
    from megatron.core import activations

    name = getattr(model_cfg, "activation_func", None)
    if name is None:
        name = "silu" if model_cfg.gated_linear_unit else "gelu"
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
        "squared_relu": activations.squared_relu, "quick_gelu": activations.quick_gelu,
        "fast_gelu": activations.fast_gelu}
    return table[name]


def rope_kwargs(model_cfg: Any) -> dict[str, Any]:
    """megatron ``GPTModel``'s RoPE arguments from a model config (defaults where a shape-only
    ``ModelDims`` has none): base, partial RoPE, Llama 3.1 scaling, position interpolation
    (YaRN's own settings travel on the config: ``yarn_attributes``). Elementwise per head: no
    unit changes."""
    return {"rotary_base": getattr(model_cfg, "rotary_base", 10000),
            "rotary_percent": getattr(model_cfg, "rotary_percent", 1.0),
            "rope_scaling": getattr(model_cfg, "rope_scaling", False),
            "rope_scaling_factor": getattr(model_cfg, "rope_scaling_factor", 8.0),
            "seq_len_interpolation_factor": getattr(model_cfg, "seq_len_interpolation_factor",
                                                    None)}


class ModelChunks(torch.nn.Module):
    """A rank's model chunks under virtual pipeline stages, as one module for the NUTP DDP
    (one grad buffer, one sync engine over every chunk's parameters: all of them belong to the
    rank's stage and sync at its degree); megatron's interleaved schedule runs ``chunks``."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = getattr(chunks[0], "config", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("model chunks run through megatron's interleaved pipeline schedule "
                           "(pipeline.PipelineRunner), one chunk at a time")


def build_gpt_chunks(plan: Plan, rank: int, model_cfg: Any, pgs: ProcessGroupCollection, *,
                     seed: int = 1234, precision: str = "fp32") -> list[NUTPGPTModel]:
    """This rank's model chunks: ``plan.vp`` of them (megatron's virtual pipeline stages;
    chunk ``c`` of stage ``s`` holds layer block ``c * pp + s``), one without interleaving."""
    if plan.vp == 1:
        return [build_gpt_model(plan, rank, model_cfg, pgs, seed=seed, precision=precision)]
    return [build_gpt_model(plan, rank, model_cfg, pgs, seed=seed, precision=precision,
                            vp_stage=c) for c in range(plan.vp)]


def build_gpt_model(plan: Plan, rank: int, model_cfg: Any, pgs: ProcessGroupCollection, *,
                    seed: int = 1234, precision: str = "fp32",
                    vp_stage: int | None = None) -> NUTPGPTModel:
    """This rank's NUTP GPT model: its pipeline stage's layers (embedding on the first stage,
    final norm and output layer on the last) at the stage's degree, initialised from the
    global weights; layers and core attention per ``resolve_impl``. With virtual pipeline
    stages (``plan.vp > 1``) one chunk, ``vp_stage``: its layer block ``vp_stage * pp +
    stage``, the embedding only on chunk 0 of stage 0, the output layer only on the last chunk
    of the last stage (``build_gpt_chunks`` builds them all)."""
    if (plan.vp > 1) != (vp_stage is not None) or not 0 <= (vp_stage or 0) < plan.vp:
        raise ValueError(f"vp_stage={vp_stage}: must be a chunk index in [0, "
                         f"{plan.vp}) with virtual pipeline stages, None without")
    i, stage, j = plan.rank_index[rank]
    degree = plan.replicas[i].tp[stage]
    if pgs.tp.size() != degree:
        raise ValueError(f"tp group size {pgs.tp.size()} != planned degree {degree}")
    if plan.pp > 1 and (pgs.pp is None or pgs.pp.size() != plan.pp or pgs.pp.rank() != stage):
        raise ValueError(f"rank {rank}: its pipeline group must hold one rank per stage with "
                         f"this rank at position {stage}")
    if getattr(model_cfg, "kv_lora_rank", None) is not None:
        raise ValueError(f"model.kv_lora_rank={model_cfg.kv_lora_rank}: multi-latent attention "
                         "is built with MoE only so far (model.moe.build_moe_gpt_model, mla=)")
    sp = plan.request.parallel.sequence_parallel
    config = transformer_config(model_cfg, degree=degree, sequence_parallel=sp,
                                precision=precision, pp=plan.pp, vp=plan.vp)
    balance = plan.request.parallel.unit_balance
    first, last = chunk_layers(model_cfg.num_layers, plan.pp, plan.vp)[stage][vp_stage or 0]
    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    first_chunk, last_chunk = (vp_stage or 0) == 0, (vp_stage or 0) == plan.vp - 1
    v0, v1 = unit_range(model_cfg, "word_embedding", degree, j, balance)
    impl, core = resolve_impl(model_cfg)
    model = NUTPGPTModel(
        config, nutp_block_spec(model_cfg, degree=degree, tp_rank=j, tp_group=pgs.tp,
                                balance=balance, num_layers=last - first, impl=impl,
                                core_attention=core),
        vocab_range=(v0, v1),
        bf16_loss_grad=(plan.replicas[i].weight
                        if getattr(model_cfg, "cross_entropy_loss_fusion", False) else None),
        max_sequence_length=model_cfg.seq_length,
        position_embedding_type=getattr(model_cfg, "position_embedding_type", "rope"),
        **rope_kwargs(model_cfg),
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        parallel_output=True, pg_collection=pgs,
        pre_process=stage == 0 and first_chunk,
        post_process=stage == plan.pp - 1 and last_chunk, **chunk,
    )
    load_global_init(model, model_cfg, degree=degree, tp_rank=j, seed=seed,
                     std=getattr(model_cfg, "init_std", 0.02), balance=balance,
                     layer_offset=first)
    return model
