"""The independent MoE reference: *stock* megatron-core 0.19.2, one process, TP1, EP1, fp32.

megatron's own ``GPTModel`` with its own local layer spec built for MoE
(``get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)``: ``MoELayer`` with
``TopKRouter``, ``SequentialMLP`` experts and the all-to-all token dispatcher), its own DDP and
optimizer (Adam, clipping on), megatron's global ``parallel_state`` at TP1/PP1/EP1 in a world of
one process. The only non-stock pieces are the CPU redirections of ``nemo_nutp/compat/cpu.py``
(``_MOE_SHIMMED_MODULES``: ``torch.cuda.Stream``/``Event`` and ``current_device()`` in the MoE
modules), which ``tests/helpers/dist.gloo_rank`` applies. With ``MoECase.mla`` (multi-latent
attention, ``mla_reference.py``): megatron's own ``MLATransformerConfig`` and local MLA spec, whose
one non-stock piece is the core-attention adapter ``mla_reference.MLACoreAttention`` (the local
``DotProductAttention`` does not take the ``k_channels``/``v_channels`` MLA passes).

Shape: Qwen3-MoE in miniature (``QWEN3_MOE``): GQA with qk-layernorm, RMSNorm, SwiGLU experts,
8 experts, top-2, softmax routing in fp32, the load-balancing aux loss (``aux_loss``,
coefficient > 0), no shared expert, every layer MoE.

What one step does is what megatron's ``forward_backward_no_pipelining`` does for a
``num_microbatches = n`` step, written out: each micro-batch's mean token loss is divided by
``n``, and ``MoEAuxLossAutoScaler.set_loss_scale(1 / n)`` scales the aux loss's gradient the
same way (``schedules.forward_step``). It records per step the loss, megatron's grad norm, the
load-balancing loss (megatron's tracker: summed over layers, mean over micro-batches, without
its coefficient) and every token's routing map (``[micro-batch][layer] -> bool[s*b, E]``, rows
in megatron's ``[s, b]`` order) for counting router flips; at step 0 every ``main_grad``; at the
end every parameter.

megatron's MoE metrics tracker and the aux-loss scale are process-global: :func:`reset_moe_globals`
runs before every case (a later case would otherwise add to the earlier one's numbers).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_nutp.model.init import normalize_name

QWEN3_MOE: dict[str, Any] = dict(
    num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, kv_channels=8,
    ffn_hidden_size=64, vocab_size=96, seq_length=12, qk_layernorm=True,
    normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False)
"""The dense part of the tiny Qwen3-MoE shape (``nemo_nutp.config.ModelConfig`` fields)."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE part (megatron's TransformerConfig names)."""

    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 16
    moe_aux_loss_coeff: float = 1e-2
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_dtype: str = "fp32"
    moe_token_dispatcher_type: str = "alltoall"
    # DeepSeek-V3 routing (issue #34); the defaults are megatron's (off)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1  # megatron's list as a tuple
    moe_z_loss_coeff: float | None = None
    moe_router_pre_softmax: bool = False  # OLMoE's (tests/train/test_moe_shared_size.py)

    def fields(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "moe_grouped_gemm": False}
        if not isinstance(self.moe_layer_freq, int):
            out["moe_layer_freq"] = list(self.moe_layer_freq)
        return out


DEEPSEEK_V3_MOE: dict[str, Any] = dict(QWEN3_MOE, num_layers=3)
"""The dense part of the tiny DeepSeek-V3-shaped routing case (GQA attention: MLA is not
this case's): 3 layers, the first dense (``DEEPSEEK_V3_ROUTING``)."""

DEEPSEEK_V3_ROUTING = MoEShape(
    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss",
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=64,
    moe_layer_freq=(0, 1, 1), moe_z_loss_coeff=1e-3)
"""DeepSeek-V3's routing in miniature: the sequence-level load-balancing loss (coefficient
raised from DeepSeek's 1e-4 to be live), sigmoid scores with the aux-loss-free expert bias
(update rate raised from DeepSeek's 1e-3 so the bias moves routing within 4 steps), 8 experts
in 2 groups, top-2 from the best group by its top-2 scores (DeepSeek's 8 groups, best 4, do not
fit 8 experts; top-2 from the best 2 of 4 groups would always equal the plain top-2), the routed
weights scaled by 2.5, one shared expert (its intermediate size the dense FFN's: NUTP builds it
over the dense FFN's units), the first layer dense; and the router z-loss (not DeepSeek's;
exercised here at 1e-3)."""


@dataclass(frozen=True)
class MoECase:
    name: str
    model: dict[str, Any] = field(default_factory=lambda: dict(QWEN3_MOE))
    moe: MoEShape = MoEShape()
    global_batch: int = 4  # micro-batches per step
    micro_batch_size: int = 2
    steps: int = 4
    lr: float = 1e-3
    clip_grad: float = 0.05  # below the tiny model's grad norms: every step clips
    seed: int = 1234
    mtp_num_layers: int = 0  # multi-token prediction layers (megatron's ``mtp_num_layers``)
    mtp_loss_scaling_factor: float = 0.1

    def mtp_fields(self) -> dict[str, Any]:
        """megatron's MTP fields of the case (none without MTP layers)."""
        if not self.mtp_num_layers:
            return {}
        return {"mtp_num_layers": self.mtp_num_layers,
                "mtp_loss_scaling_factor": self.mtp_loss_scaling_factor}
    mla: Any = None  # mla_reference.MLAShape: multi-latent attention (model: DSV3_MLA)


def dims(case: MoECase) -> Any:
    from nemo_nutp.config import ModelConfig

    return ModelConfig(**case.model)


def moe_config(case: MoECase, *, tp: int = 1, sequence_parallel: bool = False) -> Any:
    """megatron's TransformerConfig of the case: the dense reference's (``reference._config``)
    plus the MoE fields, at the given TP / sequence parallel."""
    from types import SimpleNamespace

    from .reference import _config

    base = _config(SimpleNamespace(precision="fp32"), dims(case))
    if case.mla is not None:
        from .mla_reference import mla_config

        base = mla_config(base, case.mla)
    return dataclasses.replace(base, tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel, **case.moe.fields(),
                               **case.mtp_fields())


def global_weight(case: MoECase, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The case's initial value of parameter ``name`` (global expert index in expert names): a
    pure function of (seed, name), the NUTP run's input too."""
    return initial_weight(dims(case), case.seed, name, shape)


def initial_weight(d: Any, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """NUTP's initial value of parameter ``name`` (global expert index in expert names) of a
    MoE model of ``d`` (``ModelConfig``): what ``model.moe.build_moe_gpt_model`` gives every
    replica, a pure function of (seed, name)."""
    from nemo_nutp.layout.units import global_shape
    from nemo_nutp.model.build import param_kind
    from nemo_nutp.model.init import init_global

    name = normalize_name(name)
    kind = None if ".experts." in name or ".router." in name else param_kind(name)
    if ".shared_experts." in name and kind is not None and tuple(shape) != global_shape(kind, d):
        kind = None  # a shared expert of its own size: replicated (model/moe.py)
    return init_global(name, kind, d, seed=seed, std=d.init_std, shape=shape)


def reset_moe_globals() -> None:
    """megatron's process-global MoE state: the metrics tracker and the aux-loss scale; the
    MTP loss tracker and the MTP loss scale (its default, 1)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )

    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)


def mtp_loss_of_step(num_microbatches: int) -> list[float]:
    """The MTP losses megatron's tracker holds for the step (one per MTP layer, each
    micro-batch's mean token loss, mean over micro-batches: ``track_mtp_metrics`` with the loss
    scale ``1 / num_microbatches``, before its data-parallel average); clears the tracker."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return []
    values = [float(v) / num_microbatches for v in tracker["loss_values"]]
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return values


def aux_loss_of_step(num_microbatches: int) -> float:
    """The load-balancing loss megatron's tracker holds for the step (summed over layers, mean
    over micro-batches, without its coefficient); clears the tracker as ``report`` does."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    value = 0.0
    for name in ("load_balancing_loss", "seq_load_balancing_loss"):  # the type's (one is set)
        entry = tracker.metrics.get(name)
        value += 0.0 if entry is None else float(entry.values.sum()) / num_microbatches
    tracker.clear()
    return value


def build(case: MoECase) -> tuple[Any, Any, Any]:
    """(model, DDP, optimizer): stock megatron GPTModel with MoE layers, the case's weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    d = dims(case)
    config = moe_config(case)
    layer_spec: Any = get_gpt_layer_local_spec(num_experts=case.moe.num_moe_experts,
                                               moe_grouped_gemm=False,
                                               qk_layernorm=d.qk_layernorm,
                                               normalization=d.normalization)
    if case.mla is not None:
        from .mla_reference import MLACoreAttention, mla_layer_spec

        layer_spec = mla_layer_spec(case.moe.num_moe_experts, qk_layernorm=d.qk_layernorm,
                                    normalization=d.normalization)
    spec = layer_spec
    if case.moe.moe_layer_freq != 1:  # dense and MoE layers: megatron's own block spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=d.normalization)
        if case.mla is not None:  # the named adapter, as mla_layer_spec sets it
            for ls in spec.layer_specs:
                ls.submodules.self_attention.submodules.core_attention = MLACoreAttention
    mtp = (get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
           if case.mtp_num_layers else None)
    model = GPTModel(config, spec, mtp_block_spec=mtp, vocab_size=d.vocab_size,
                     max_sequence_length=d.seq_length,
                     position_embedding_type=d.position_embedding_type,
                     rotary_base=d.rotary_base,
                     share_embeddings_and_output_weights=d.tie_embeddings, parallel_output=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(global_weight(case, name, tuple(p.shape)))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=case.lr, clip_grad=case.clip_grad, weight_decay=0.0, adam_eps=1e-8,
        params_dtype=torch.float32, use_distributed_optimizer=False), [ddp])
    return model, ddp, opt


def step_batches(case: MoECase, step: int) -> list[Any]:
    from nemo_nutp.data import replica_microbatches

    d = dims(case)
    return replica_microbatches(offset=0, count=case.global_batch, seed=case.seed, step=step,
                                micro_batch_size=case.micro_batch_size,
                                seq_length=d.seq_length, vocab_size=d.vocab_size)


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def record_routing(model: Any) -> list[torch.Tensor]:
    """Hooks every router: each forward appends its routing map (bool ``[tokens, E]``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[torch.Tensor] = []

    def hook(_mod: Any, _inp: Any, out: Any) -> None:
        maps.append(out[1].detach().bool().clone())

    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(hook)
    return maps


def expert_biases(model: Any) -> dict[str, torch.Tensor]:
    """Every router's ``expert_bias`` buffer by its global name (``...mlp.router``)."""
    return {normalize_name(k).removesuffix(".expert_bias"): b.detach().clone()
            for k, b in model.named_buffers() if k.endswith("expert_bias")}


def run_moe_reference(case: MoECase) -> dict[str, Any]:
    """Train ``case`` on stock megatron-core (TP1, EP1, this process); see the module doc."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    reset_moe_globals()
    model, ddp, opt = build(case)
    maps = record_routing(model)
    mask = causal_mask(dims(case).seq_length)
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "aux_losses": [], "routing": [],
                           "mtp_losses": []}
    for step in range(case.steps):
        batches = step_batches(case, step)
        n = len(batches)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        maps.clear()
        total = 0.0
        for i, mb in enumerate(batches):
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))  # schedules.forward_step
            ctx = ddp.no_sync() if i < n - 1 else _Null()
            with ctx:
                loss = ddp(mb.tokens, mb.position_ids, mask, labels=mb.labels).float().mean()
                (loss / n).backward()
            total += float(loss.detach())
        ddp.finish_grad_sync()
        if case.moe.moe_router_enable_expert_bias:  # what finalize_model_grads does next
            from megatron.core.distributed.finalize_model_grads import (
                _update_router_expert_bias,
                reset_model_temporary_tensors,
            )

            _update_router_expert_bias([model], model.config)
            reset_model_temporary_tensors(model.config, [model])
            out.setdefault("expert_bias", []).append(expert_biases(model))
        if step == 0:
            out["grads"] = {normalize_name(k): p.main_grad.detach().float().clone()
                            for k, p in ddp.named_parameters()}
        ok, norm, _ = opt.step()
        assert ok
        out["losses"].append(total / n)
        out["grad_norms"].append(float(norm))
        out["aux_losses"].append(aux_loss_of_step(n))
        out["mtp_losses"].append(mtp_loss_of_step(n))
        out["routing"].append(list(maps))
    out["params"] = {normalize_name(k): p.detach().float().clone()
                     for k, p in ddp.named_parameters()}
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def moe_reference_worker(rank: int, world: int, port: int, cases: list[MoECase],
                         outdir: str) -> None:
    """One process: megatron's global state at TP1, every case's reference saved as a file."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(1, 1)
        for case in cases:
            tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
            torch.save(run_moe_reference(case), os.path.join(outdir, f"moe_ref_{case.name}.pt"))
        parallel_state.destroy_model_parallel()

    gloo_rank(rank, world, port, outdir, body)


def reset_check_worker(rank: int, world: int, port: int, case: MoECase, outdir: str) -> None:
    """The reference twice in one process, with a stray forward's tracker entries left in
    between (what an earlier case leaves): saves both runs and the stray load-balancing sum."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
        first = run_moe_reference(case)
        model, _, _ = build(case)
        mb = step_batches(case, 0)[0]
        model(mb.tokens, mb.position_ids, causal_mask(dims(case).seq_length), labels=mb.labels)
        stray = float(get_moe_metrics_tracker().metrics["load_balancing_loss"].values.sum())
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
        second = run_moe_reference(case)
        torch.save({"first": first, "second": second, "stray": stray},
                   os.path.join(outdir, "reset_check.pt"))
        parallel_state.destroy_model_parallel()

    gloo_rank(rank, world, port, outdir, body)
