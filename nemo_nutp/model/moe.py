"""NUTP MoE layers: experts as units, expert parallelism inside each replica (megatron-core 0.19).

A replica of degree ``t`` runs megatron's own ``MoELayer`` with expert parallelism over its own
TP group and expert TP 1: TP rank ``j`` holds experts ``layout.experts.local_experts(E, t, j)``
(uneven where ``t`` does not divide ``E``: 8 over 3 ranks are 2/3/3), every expert once per
replica. Sequence parallel is on whenever ``t > 1`` (megatron's ``MoELayer`` refuses TP > 1
without it in training), so each rank routes only its own sequence shard and the all-to-all
dispatcher moves tokens between the replica's ranks.

What is NUTP's here, and why (megatron's classes, subclassed, never edited):
* ``NUTPMoELayer`` (``MoELayer``): megatron asserts ``E % ep_size == 0`` and sizes every rank
  ``E / ep_size`` experts (``BaseMoELayer.__init__``); the layer takes its expert range from
  the NUTP layout instead (``_UnevenExperts``, placed after ``MoELayer`` in the MRO), and uses
  ``NUTPAlltoAllTokenDispatcher``.
* ``NUTPAlltoAllTokenDispatcher`` (``MoEAlltoAllTokenDispatcher``): megatron's split sizes and
  chunk sort orders reshape ``[E]`` as ``[ep_size, E / ep_size]``; here the per-rank split is the
  sum over each rank's own expert range (``layout.experts.rank_token_counts``, in torch) and
  the chunk orders are built for ``ep_size x local experts`` chunks. Dropless only.
* ``moe_pg_collection``: megatron's MoE reads ``ep``, ``tp_ep``, ``expt_tp``, ``tp_cp`` and
  ``tp_dp_cp`` from the collection; NUTP sets ``ep = tp_ep = tp_cp =`` the replica's TP group,
  ``expt_tp =`` this rank alone, ``tp_dp_cp =`` the stage (only logging averages over it).

The router is megatron's ``TopKRouter``, replicated (``[E, h]``, fp32 routing with
``moe_router_dtype='fp32'``). Under sequence parallelism its gradient on each rank is the part of
its own tokens (megatron marks it ``sequence_parallel``), so the replica's gradient is the sum
over its TP group, as for norms. The load-balancing aux loss is megatron's: each rank's loss uses
its own tokens' probabilities with the replica's token counts (summed over ``tp_cp``) and the
replica's token total, so summed over the replica every token counts once, not once per TP rank.
Its gradient scale is the main loss's (``MoEAuxLossAutoScaler.set_loss_scale``, per micro-batch).

Pipeline stages (``plan.pp > 1``, no virtual stages): each stage's MoE layers use that stage's
TP group of the replica as expert parallelism (its own expert ranges, e.g. 2/3/3 on a degree-3
stage and 4/4 on a degree-2 one); megatron's schedule sets the aux-loss gradient scale on every
stage after each forward (loss scale / the replica's micro-batches); megatron's tracker on each
rank holds only its stage's layers (``tests/helpers/moe_pipeline_jobs.py`` sums it over the
stages).

DeepSeek-V3 routing (megatron's router, unchanged): sigmoid scores, group-limited top-k, top-k
scaling, the sequence aux loss and the z-loss are per token or reduced over ``tp_cp`` as above.
The aux-loss-free expert bias is a replicated buffer; its update (``update_expert_bias``, run by
``train_step`` after the gradient sync, as megatron's ``finalize_model_grads``) sums the token
counts over the stage of *all* replicas (NUTP's data parallelism is not megatron's), so every
rank applies the same update as one process. A shared expert (``NUTPSharedExpertMLP``) of
the dense FFN's size is a dense MLP over this rank's dense FFN units, tagged and synchronised
like a dense MLP. A shared expert of its own size (``moe_shared_expert_intermediate_size !=
ffn_hidden_size``: DeepSeek-V3, Moonlight, Kimi-K2, Qwen2-MoE) is replicated in the replica:
every TP rank holds it whole and runs it at TP 1 on its own sequence shard (no TP
collectives), so its gradient on each rank is its tokens' part, marked ``sequence_parallel``
and summed over the TP group like the router's and the norms' (``nutp_replicated``: tagged
kind None by ``build.load_global_init``). ``moe_router_pre_softmax`` is megatron's router's
own (softmax before top-k), unchanged. ``moe_layer_freq`` mixes dense (``NUTPMLP``) and MoE
layers.

Not built yet (refused by the builders here): capacity factor / token dropping, the
shared-expert gate, the global aux loss, grouped GEMM (and with it
``moe_mlp_glu_interleave_size``: megatron reads it only in its grouped-GEMM experts).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..layout import chunk_layers
from ..layout.experts import expert_bounds, local_experts


@dataclass(frozen=True)
class MoEDims:
    """The MoE settings this module builds (megatron's ``TransformerConfig`` names)."""

    num_moe_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_dtype: str | None = "fp32"  # None: routing in the model's dtype (megatron's)
    moe_token_dispatcher_type: str = "alltoall"
    # multi-token prediction (``model/mtp.py``): None builds none
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    # DeepSeek-V3 routing (issue #34); the defaults are megatron's (off)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1  # megatron's int or list (a tuple here)
    moe_z_loss_coeff: float | None = None
    moe_router_pre_softmax: bool = False  # OLMoE: softmax over all experts, then top-k

    def moe_layers(self, num_layers: int) -> list[bool]:
        """Which layers are MoE (megatron's ``moe_layer_freq``: every N-th from layer 0, or a
        0/1 list per layer)."""
        f = self.moe_layer_freq
        if isinstance(f, int):
            if f < 1:
                raise ValueError(f"model.moe_layer_freq={f}: must be >= 1")
            return [i % f == 0 for i in range(num_layers)]
        if len(f) != num_layers or any(x not in (0, 1) for x in f):
            raise ValueError(f"model.moe_layer_freq={list(f)}: must be {num_layers} entries of "
                             "0 (dense) or 1 (MoE)")
        return [x == 1 for x in f]

    def check(self, degree: int) -> None:
        """``ValueError`` naming the field for what this module does not build."""
        expert_bounds(self.num_moe_experts, degree)  # names model.num_moe_experts
        if self.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"model.moe_token_dispatcher_type="
                             f"{self.moe_token_dispatcher_type!r}: NUTP MoE builds 'alltoall'")
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(f"model.moe_router_load_balancing_type="
                             f"{self.moe_router_load_balancing_type!r}: NUTP MoE builds "
                             "'aux_loss', 'seq_aux_loss' or 'none' so far")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk}: must be in "
                             f"[1, {self.num_moe_experts}]")

    def config_fields(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "moe_grouped_gemm": False}
        if not isinstance(self.moe_layer_freq, int):
            out["moe_layer_freq"] = list(self.moe_layer_freq)
        return out


def moe_pg_collection(pgs: ProcessGroupCollection, *, single: Any,
                      stage: Any) -> ProcessGroupCollection:
    """A copy of the rank's collection with megatron's MoE groups set for EP = the replica's
    TP group and expert TP = 1 (``single``: this rank alone; ``stage``: the stage's ranks)."""
    out = copy.copy(pgs)
    out.ep = pgs.tp
    out.tp_ep = pgs.tp
    out.tp_cp = pgs.tp
    out.expt_tp = single
    out.tp_dp_cp = stage
    return out


class NUTPAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher for uneven local experts (see the module doc)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], *,
                 config: Any, pg_collection: ProcessGroupCollection) -> None:
        # megatron's constructor reshapes [E] chunks by the local expert count, which uneven
        # counts need not divide: it is given one local expert, then the real range is set and
        # the chunk orders are rebuilt (nothing else it builds depends on the count).
        super().__init__(1, local_expert_indices[:1], config=config,
                         pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        assert self.tp_size == 1, "NUTP MoE runs expert TP 1"
        if self.drop_and_pad or config.moe_expert_capacity_factor is not None:
            raise ValueError(f"model.moe_expert_capacity_factor="
                             f"{config.moe_expert_capacity_factor}: token dropping is not "
                             "built with NUTP MoE yet")
        self.bounds = np.asarray(expert_bounds(self.num_experts, self.ep_size), dtype=np.int64)
        chunks = torch.arange(self.ep_size * num_local_experts, device=self.permute_idx_device)
        # chunk (source rank i, local expert l) at i * L + l: sort by expert, restore by rank
        self.sort_input_by_local_experts = chunks.reshape(-1, num_local_experts).T.ravel()
        self.restore_output_by_local_experts = chunks.reshape(num_local_experts, -1).T.ravel()

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Split sizes of the all-to-all from the routing map: dropless, uneven experts."""
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        per_expert = routing_map.sum(dim=0).long()  # [E] tokens of this rank per expert
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        if self.ep_size == 1:
            self.num_global_tokens_per_local_expert = per_expert.view(1, -1)
            self._maybe_update_cuda_sync_point("before_finish")
            return per_expert
        csum = torch.cat([per_expert.new_zeros(1), per_expert.cumsum(0)])
        b = torch.as_tensor(self.bounds, device=per_expert.device)
        self.input_splits = csum[b[1:]] - csum[b[:-1]]  # [ep] tokens to each rank
        # [ep, E]: what every rank of the replica sends to each expert
        table = gather_from_sequence_parallel_region(
            per_expert, group=self.tp_ep_group).reshape(self.ep_size, self.num_experts)
        mine = table[:, lo:hi].contiguous()  # [ep, local experts]
        self.output_splits = mine.sum(dim=1)
        self.output_splits_tp = self.output_splits.sum().reshape(1)
        self._maybe_update_cuda_sync_point("before_ep_alltoall")
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = mine
            if not self.config.moe_permute_fusion:
                self._maybe_update_cuda_sync_point("before_permutation_2")
        return mine.sum(dim=0)


class _UnevenExperts(BaseMoELayer):
    """``BaseMoELayer.__init__`` with the NUTP expert range (runs inside ``MoELayer.__init__``,
    which calls ``super(MoELayer, self).__init__``: this class follows ``MoELayer`` in
    ``NUTPMoELayer``'s MRO)."""

    def __init__(self, config: Any, layer_number: int | None = None,
                 pg_collection: ProcessGroupCollection | None = None,
                 is_mtp_layer: bool = False) -> None:
        assert pg_collection is not None
        MegatronModule.__init__(self, config)  # what BaseMoELayer's super() call runs
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.ep_group = pg_collection.ep
        self.attn_tp_group = pg_collection.tp
        experts = local_experts(config.num_moe_experts, self.ep_group.size(),
                                self.ep_group.rank())
        self.num_local_experts = len(experts)
        self.local_expert_indices = list(experts)
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_expert_overlap = config.moe_shared_expert_overlap
        self.router: Any = None
        self.experts: Any = None
        self.shared_experts: Any = None
        self.token_dispatcher: Any = None


class NUTPMoELayer(MoELayer, _UnevenExperts):
    """megatron's ``MoELayer`` holding this rank's experts of the replica (see the module doc).
    Each local expert gets ``nutp_expert`` = its global index (on the expert module)."""

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None,
                 pg_collection: ProcessGroupCollection | None = None,
                 is_mtp_layer: bool = False, name: str | None = None) -> None:
        # megatron's stock all-to-all dispatcher cannot be built for uneven experts (its chunk
        # orders reshape [E] by the local count); the layer is built with the all-gather one
        # (whose constructor only stores the expert range) and NUTP's replaces it below.
        stock = copy.copy(config)
        stock.moe_token_dispatcher_type = "allgather"
        MoELayer.__init__(self, stock, submodules, layer_number, pg_collection, is_mtp_layer,
                          name)
        self.config = config
        assert pg_collection is not None
        self.token_dispatcher = NUTPAlltoAllTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config,
            pg_collection=pg_collection)
        for i, expert in enumerate(self.experts.local_experts):
            expert.nutp_expert = self.local_expert_indices[i]
        if self.shared_experts is not None and not isinstance(self.shared_experts,
                                                              NUTPSharedExpertMLP):
            raise TypeError("model.moe_shared_expert_intermediate_size: the layer spec must build "
                            "NUTPSharedExpertMLP (nutp_moe_layer_spec), not megatron's "
                            f"{type(self.shared_experts).__name__}")


class NUTPSharedExpertMLP(SharedExpertMLP):
    """megatron's shared expert. ``nutp_local_ffn`` columns: this rank's columns of the dense
    FFN unit space, its ``linear_fc1``/``linear_fc2`` tagged and synchronised like a dense
    MLP's (``build.param_kind``: its intermediate size is the dense ``ffn_hidden_size``).
    ``nutp_local_ffn=None``: a shared expert of its own size, whole on this rank (TP 1 over
    ``pg_collection.expt_tp``, this rank alone, on its own sequence shard); its parameters are
    ``nutp_replicated`` (kind None) and, under sequence parallelism, ``sequence_parallel``
    (each rank's gradient is its tokens' part: summed over the TP group)."""

    def __init__(self, config: Any, submodules: Any, gate: bool,
                 pg_collection: ProcessGroupCollection | None = None, name: str | None = None,
                 *, nutp_local_ffn: int | None) -> None:
        if gate:
            raise ValueError("model.moe_shared_expert_gate=True: not built with NUTP MoE yet")
        if config.moe_shared_expert_overlap:
            raise ValueError("model.moe_shared_expert_overlap=True: not built with NUTP MoE")
        assert pg_collection is not None
        cfg = copy.copy(config)
        if nutp_local_ffn is None:
            pgs = copy.copy(pg_collection)
            pgs.tp = pg_collection.expt_tp  # this rank alone
            cfg.tensor_model_parallel_size = 1
            cfg.sequence_parallel = False
            super().__init__(cfg, submodules, gate, pgs, name)
            for p in self.parameters():
                p.nutp_replicated = True  # type: ignore[attr-defined]
                p.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
                p.tensor_model_parallel = False  # type: ignore[attr-defined]
            return
        cfg.moe_shared_expert_intermediate_size = nutp_local_ffn * pg_collection.tp.size()
        super().__init__(cfg, submodules, gate, pg_collection, name)


def _shared_expert_builder(*, submodules: Any, local_ffn: int | None, config: Any,
                           pg_collection: Any, gate: bool, name: str | None = None) -> Any:
    return NUTPSharedExpertMLP(config, submodules, gate, pg_collection, name,
                               nutp_local_ffn=local_ffn)


def nutp_moe_submodule(mlp: Any, *, shared_local_ffn: int | None = None,
                       shared_replicated: bool = False) -> Any:
    """A 0.19 local spec's MoE ``mlp`` entry (``partial(MoELayer, submodules=...)``) rebuilt to
    construct ``NUTPMoELayer``; with ``shared_local_ffn`` its shared expert is
    ``NUTPSharedExpertMLP`` over that many FFN columns, with ``shared_replicated`` one of its
    own size, whole on every rank."""
    import functools

    if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
        raise TypeError(f"not a megatron-core 0.19 MoE layer spec entry: {mlp!r}")
    keywords = dict(mlp.keywords)
    if shared_local_ffn is not None or shared_replicated:
        sub = keywords["submodules"]
        keywords["submodules"] = dataclasses.replace(sub, shared_experts=functools.partial(
            _shared_expert_builder, submodules=sub.shared_experts.keywords["submodules"],
            local_ffn=shared_local_ffn))
    return functools.partial(NUTPMoELayer, *mlp.args, **keywords)


def expert_global_name(name: str, local_to_global: list[int]) -> str:
    """``...mlp.experts.local_experts.<local>...`` with the expert's global index."""
    import re

    m = re.match(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$", name)
    if m is None:
        return name
    return f"{m[1]}{local_to_global[int(m[2])]}{m[3]}"


def moe_transformer_config(model_cfg: Any, moe: MoEDims, *, degree: int,
                           sequence_parallel: bool, precision: str = "fp32", pp: int = 1) -> Any:
    """``build.transformer_config`` of the dense model plus the MoE fields (validated by
    megatron at TP1, then the degree and sequence parallelism set, as for the dense model;
    ``pp``: megatron's pipeline size, as ``transformer_config``'s)."""
    from megatron.core.transformer import TransformerConfig

    from .build import transformer_config

    base = transformer_config(model_cfg, degree=1, precision=precision, pp=pp)
    extra = {k: v for k, v in vars(base).items()
             if k not in {f.name for f in dataclasses.fields(TransformerConfig)}}
    config = dataclasses.replace(base, **moe.config_fields())
    for k, v in extra.items():  # yarn_* / Gemma attributes: not dataclass fields
        setattr(config, k, v)
    config.tensor_model_parallel_size = degree
    config.sequence_parallel = sequence_parallel and degree > 1
    # what megatron's expert linears read: expert parallelism = the replica's TP group, ETP 1
    config.expert_model_parallel_size = degree
    config.expert_tensor_parallel_size = 1
    return config


def nutp_moe_layer_spec(model_cfg: Any, moe: MoEDims, *, degree: int, tp_rank: int,
                        tp_group: Any, balance: str = "work") -> Any:
    """``build.nutp_layer_spec`` (NUTP attention and norms for this rank's units) with the MLP
    replaced by ``NUTPMoELayer`` over megatron's local MoE submodules (``TopKRouter``,
    ``SequentialMLP`` experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .build import nutp_layer_spec, unit_range

    moe.check(degree)
    spec = nutp_layer_spec(model_cfg, degree=degree, tp_rank=tp_rank, tp_group=tp_group,
                           balance=balance)
    stock = get_gpt_layer_local_spec(num_experts=moe.num_moe_experts, moe_grouped_gemm=False)
    shared = None
    replicated = shared_expert_replicated(model_cfg, moe)
    if moe.moe_shared_expert_intermediate_size is not None and not replicated:
        f0, f1 = unit_range(model_cfg, "fc1_weight", degree, tp_rank, balance)
        shared = f1 - f0
    spec.submodules.mlp = nutp_moe_submodule(stock.submodules.mlp, shared_local_ffn=shared,
                                             shared_replicated=replicated)
    return spec


def shared_expert_replicated(model_cfg: Any, moe: Any) -> bool:
    """A shared expert of its own size (not the dense FFN's): whole on every TP rank of a
    replica (``NUTPSharedExpertMLP``); the dense FFN's size is over the dense FFN's units."""
    size = getattr(moe, "moe_shared_expert_intermediate_size", None)
    return size is not None and int(size) != int(model_cfg.ffn_hidden_size)


def check_moe_plan(plan: Any, moe: MoEDims) -> None:
    """``ValueError`` naming the setting, before any process group: virtual pipeline stages,
    and every stage degree of every replica checked against the experts (``MoEDims.check``)."""
    if plan.vp != 1:
        raise ValueError(f"parallel.virtual_pipeline_model_parallel_size={plan.vp}: NUTP MoE "
                         "builds no virtual pipeline stages yet")
    if plan.pp > 1 and moe.moe_router_enable_expert_bias:
        raise ValueError(f"model.moe_router_enable_expert_bias=True: not with {plan.pp} pipeline"
                         " stages yet (the bias update runs in the one-stage step)")
    for degree in sorted({t for rep in plan.replicas for t in rep.tp}):
        moe.check(degree)


def build_moe_gpt_model(plan: Any, rank: int, model_cfg: Any, moe: MoEDims, groups: Any, *,
                        seed: int = 1234, mla: Any = None) -> Any:
    """This rank's NUTP GPT model with a MoE MLP in every layer (fp32):
    ``build.build_gpt_model``'s model with ``nutp_moe_layer_spec`` layers, initialised from the
    global weights; each local expert's tensors from its *global* name
    (``...local_experts.<global index>...``), tagged ``nutp_expert`` and ``nutp_name``.
    Pipeline stages (``plan.pp > 1``, no virtual stages): the rank's stage's layers at the
    stage's degree, whose MoE layers use the stage's TP group of the replica as expert
    parallelism (names and layer numbers global, as ``build_gpt_model``'s).
    ``mla`` (``model.mla.MLADims``): multi-latent attention over this rank's heads
    (``NUTPMLASelfAttention``) instead of GQA, in every layer (dense ones and MTP's too)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from .build import load_global_init, nutp_layer_spec, rope_kwargs, unit_range
    from .init import init_param_
    from .layers import NUTPGPTModel, NUTPNorm
    from .mtp import check_mtp, nutp_mtp_block_spec

    check_moe_plan(plan, moe)
    check_mtp(moe, pp=plan.pp, recompute=getattr(model_cfg, "recompute_granularity", None))
    i, stage, j = plan.rank_index[rank]
    degree = plan.replicas[i].tp[stage]
    pgs = moe_pg_collection(groups.pgs, single=groups.single, stage=groups.stage)
    balance = plan.request.parallel.unit_balance
    config = moe_transformer_config(model_cfg, moe, degree=degree, pp=plan.pp,
                                    sequence_parallel=plan.request.parallel.sequence_parallel)
    if degree > 1 and not config.sequence_parallel:
        raise ValueError("parallel.sequence_parallel=False: megatron's MoE layer needs sequence "
                         "parallelism at TP > 1 (NUTP MoE expert parallelism is the TP group)")
    layer = nutp_moe_layer_spec(model_cfg, moe, degree=degree, tp_rank=j, tp_group=pgs.tp,
                                balance=balance)
    dense = nutp_layer_spec(model_cfg, degree=degree, tp_rank=j, tp_group=pgs.tp,
                            balance=balance)  # moe_layer_freq's 0 layers: NUTPMLP
    if mla is not None:
        from .mla import mla_transformer_config, nutp_mla_attention_spec

        mla.check(model_cfg)
        config = mla_transformer_config(config, mla)
        h0, h1 = unit_range(model_cfg, "qkv_weight", degree, j, balance)
        for spec in (layer, dense):
            spec.submodules.self_attention = nutp_mla_attention_spec(
                local_heads=h1 - h0, single=groups.single,
                latent_norms=bool(getattr(model_cfg, "qk_layernorm", False)),
                q_latent=mla.q_lora_rank is not None)
    first, last = chunk_layers(model_cfg.num_layers, plan.pp, 1)[stage][0]
    block = TransformerBlockSubmodules(
        layer_specs=[layer if is_moe else dense
                     for is_moe in moe.moe_layers(model_cfg.num_layers)[first:last]],
        layer_norm=NUTPNorm)
    v0, v1 = unit_range(model_cfg, "word_embedding", degree, j, balance)
    fused = getattr(model_cfg, "cross_entropy_loss_fusion", False)  # as build_gpt_model
    model = NUTPGPTModel(config, block, vocab_range=(v0, v1),
                         bf16_loss_grad=plan.replicas[i].weight if fused else None,
                         max_sequence_length=model_cfg.seq_length,
                         position_embedding_type=getattr(model_cfg, "position_embedding_type",
                                                         "rope"),
                         **rope_kwargs(model_cfg),
                         share_embeddings_and_output_weights=model_cfg.tie_embeddings,
                         parallel_output=True, pg_collection=pgs,
                         pre_process=stage == 0, post_process=stage == plan.pp - 1,
                         mtp_block_spec=(nutp_mtp_block_spec(layer, moe.mtp_num_layers)
                                         if moe.mtp_num_layers else None))
    std = getattr(model_cfg, "init_std", 0.02)
    load_global_init(model, model_cfg, degree=degree, tp_rank=j, seed=seed, std=std,
                     balance=balance, layer_offset=first)
    mtp = [m.mtp_model_layer for m in model.mtp.layers] if moe.mtp_num_layers else []
    for layer_mod in [*model.decoder.layers, *mtp]:
        mlp = layer_mod.mlp
        if not isinstance(mlp, MoELayer):  # a dense layer (moe_layer_freq)
            continue
        if mlp.router.expert_bias is not None:  # the bias update's token counts: global
            mlp.router.nutp_count_group = groups.stage  # type: ignore[attr-defined]
        for name, p in mlp.experts.named_parameters():
            local = int(name.split(".")[1])  # local_experts.<l>.<...>
            gname = expert_global_name(p.nutp_name, mlp.local_expert_indices)
            p.nutp_name = gname  # type: ignore[attr-defined]
            p.nutp_expert = mlp.local_expert_indices[local]  # type: ignore[attr-defined]
            # megatron marks experts (its expert-DP buffers) only at EP > 1; NUTP syncs every
            # replica's experts by ExpertSync, TP1 replicas' too
            p.allreduce = False  # type: ignore[attr-defined]
            init_param_(p, name=gname, kind=None, units=None, dims=model_cfg, seed=seed,
                        std=std)
    return model


def update_expert_bias(model: Any) -> None:
    """megatron's aux-loss-free expert-bias update (``finalize_model_grads``'s
    ``_update_router_expert_bias`` and ``reset_model_temporary_tensors``), once per step after
    the gradient sync: every router's token counts summed over its ``nutp_count_group`` (the
    stage over all replicas, set by ``build_moe_gpt_model``: each rank routes only its own
    sequence shard, so the sum counts every token of the global batch once, as one process
    does), megatron's ``get_updated_expert_bias`` applied, the counts zeroed. Every rank gets
    the same bias bits (the same summed counts, the same update)."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None
               and m.training and not getattr(m, "frozen_expert_bias", False)]
    if not routers:
        return
    group = getattr(routers[0], "nutp_count_group", None)
    if group is None or any(getattr(r, "nutp_count_group", None) is not group for r in routers):
        raise RuntimeError("model.moe_router_enable_expert_bias=True: a router without NUTP's "
                           "count group (build the model with build_moe_gpt_model)")
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    bias = torch.stack([r.expert_bias for r in routers])
    new = get_updated_expert_bias(counts, bias, routers[0].config.moe_router_bias_update_rate,
                                  tp_dp_cp_group=group)
    for r, b in zip(routers, new, strict=True):
        r.expert_bias.copy_(b)
        r.local_tokens_per_expert.zero_()
