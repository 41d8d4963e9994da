"""The independent reference: *stock* megatron-core, one process, TP1.

megatron's own ``GPTModel`` with its own ``get_gpt_layer_local_spec()``, its own DDP, its own
optimizer (norm, clipping, mixed precision, loss scaler) and megatron's global ``parallel_state``
initialised at TP1/PP1 in a world of one process — nothing of this project's model, sync or step
code. What it shares with the NUTP run is only the input: the global initial weights (a pure
function of seed and parameter name, ``nemo_nutp.model.init.init_global``, copied in by name) and
the global batches: the synthetic ones, or a case's ``data`` file (``load_batches``: e.g. what
Bridge's own sampler gives one process of a recipe's dataset). A case's ``weight_decay`` is
applied by megatron's own ``OptimizerParamScheduler`` (constant: every parameter group decays by
``weight_decay x wd_mult``, 0 for biases and 1-D parameters). It trains a case for ``steps`` steps
on the whole global batch and records, per step, the loss, megatron's grad norm and whether the
step was skipped; at step 0 every synchronised ``main_grad``; at the end every parameter."""

from __future__ import annotations

import os
from typing import Any

import torch

from nemo_nutp.model.init import normalize_name

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _activation(dims: Any) -> Any:
    """megatron-core's activation for ``model.activation_func`` (the reference's own table)."""
    import torch.nn.functional as F
    from megatron.core.activations import fast_gelu, quick_gelu, squared_relu

    name = dims.activation_func or ("silu" if dims.gated_linear_unit else "gelu")
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "squared_relu": squared_relu,
            "quick_gelu": quick_gelu, "fast_gelu": fast_gelu}[name]


def _config(case: Any, dims: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    half = _DTYPE[case.precision]
    config = TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_query_groups,
        ffn_hidden_size=dims.ffn_hidden_size, kv_channels=dims.kv,
        gated_linear_unit=dims.gated_linear_unit, activation_func=_activation(dims),
        normalization=dims.normalization, layernorm_epsilon=dims.layernorm_epsilon,
        qk_layernorm=dims.qk_layernorm, window_size=dims.window_size,
        layernorm_zero_centered_gamma=dims.layernorm_zero_centered_gamma,
        softmax_scale=dims.softmax_scale,
        window_attn_skip_freq=dims.window_attn_skip_freq,
        add_bias_linear=dims.add_bias_linear,
        add_qkv_bias=dims.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=half,
        bf16=case.precision == "bf16", fp16=case.precision == "fp16",
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=getattr(dims, "cross_entropy_loss_fusion", False),
        cross_entropy_fusion_impl="native")
    if dims.position_embedding_type == "yarn":
        # YaRN's settings are attributes megatron's GPTModel reads off the config (as Bridge's
        # GPT provider declares them), not TransformerConfig fields
        for name in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                     "beta_slow", "mscale", "mscale_all_dim", "correction_range_round_to_int"):
            setattr(config, f"yarn_{name}", getattr(dims, f"yarn_{name}"))
    return config


def _build(case: Any, dims: Any) -> tuple[Any, Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.model.build import param_kind
    from nemo_nutp.model.init import init_global

    config = _config(case, dims)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        setattr(config, name, getattr(dims, name))  # Bridge's Gemma 2 provider fields
    spec = get_gpt_layer_local_spec(normalization=dims.normalization,
                                    qk_layernorm=dims.qk_layernorm)
    model: Any = GPTModel(config, gemma_spec(spec, dims),
                          vocab_size=dims.vocab_size, max_sequence_length=dims.seq_length,
                          position_embedding_type=dims.position_embedding_type,
                          rotary_base=dims.rotary_base, rotary_percent=dims.rotary_percent,
                          rope_scaling=dims.rope_scaling,
                          rope_scaling_factor=dims.rope_scaling_factor,
                          seq_len_interpolation_factor=dims.seq_len_interpolation_factor,
                          share_embeddings_and_output_weights=dims.tie_embeddings,
                          parallel_output=True)
    gemma_model(model, dims)
    # the NUTP run's initial weights (a control changes the reference's forward, not its
    # input: zero-centred gamma off with the same zero weights)
    init_dims = ModelConfig(**case.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_global(name, param_kind(name), init_dims, seed=case.seed,
                                std=dims.init_std, shape=tuple(p.shape)))
    if case.precision != "fp32":
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)
    half = _DTYPE[case.precision]
    sched = case.schedule if case.ref_schedule is None else case.ref_schedule
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer=case.optimizer, lr=case.lr, min_lr=sched.get("min_lr", 0.0) if sched else None,
        clip_grad=case.clip_grad,
        weight_decay=case.weight_decay,
        adam_eps=1e-8, params_dtype=half,
        bf16=case.precision == "bf16", fp16=case.precision == "fp16",
        initial_loss_scale=case.initial_loss_scale, use_distributed_optimizer=False), [ddp])
    return ddp, opt, model


def gemma_spec(spec: Any, dims: Any) -> Any:
    """Stock megatron's local layer spec with the reference's Gemma modules
    (``gemma_reference.py``) where ``dims`` turns a Gemma feature on; a block spec with the
    reference's final norm under zero-centred gamma."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from . import gemma_reference as g

    sub = spec.submodules
    attn = sub.self_attention.submodules
    mlp = sub.mlp.submodules if hasattr(sub.mlp, "submodules") else sub.mlp.keywords[
        "submodules"]  # 0.16: a ModuleSpec; 0.19: partial(MLP.as_mlp_submodule, ...)
    if dims.post_layernorm:
        attn.linear_proj = mlp.linear_fc2 = g.RefPostNormRowParallelLinear
    if dims.attn_logit_softcapping:
        attn.core_attention = g.RefSoftcapAttention
    if dims.rotary_base_local is not None:
        sub.self_attention.module = g.RefGemma3SelfAttention
    if not dims.layernorm_zero_centered_gamma:
        return spec
    sub.input_layernorm = sub.pre_mlp_layernorm = g.RefNorm
    if dims.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = g.RefNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * dims.num_layers, layer_norm=g.RefNorm)


def gemma_model(model: Any, dims: Any) -> None:
    """The reference's model-level Gemma modules: embedding scaling, final-logit softcapping,
    per-layer RoPE tables."""
    from . import gemma_reference as g

    if dims.apply_embedding_scaling:
        model.embedding.register_forward_hook(g.scale_embeddings)
    if dims.final_logit_softcapping:
        model.output_layer.__class__ = g.RefSoftcapOutputLayer
    if dims.rotary_base_local is not None:
        assert dims.seq_len_interpolation_factor is None and dims.rotary_percent == 1.0
        model.rotary_pos_emb = g.RefGemma3RotaryEmbedding(
            kv_channels=dims.kv, rotary_base=dims.rotary_base,
            rotary_base_local=dims.rotary_base_local, factor=dims.rope_scaling_factor_global)


def _schedule(case: Any, opt: Any) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` with the case's lr schedule (megatron's
    names; the reference's own in a negative control) and constant weight decay; None for a
    constant lr without weight decay (the optimizer's lr is the schedule). As in Megatron-LM's
    loop, it advances once per successful update (``run_reference``)."""
    sched = case.schedule if case.ref_schedule is None else case.ref_schedule
    if not case.weight_decay and not sched:
        return None
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wd = case.weight_decay
    decay = sched.get("lr_decay_iters", case.steps)
    return OptimizerParamScheduler(
        opt, init_lr=sched.get("lr_warmup_init", 0.0), max_lr=case.lr,
        min_lr=sched.get("min_lr", 0.0), lr_warmup_steps=sched.get("lr_warmup_iters", 0),
        lr_decay_steps=decay, lr_decay_style=sched.get("lr_decay_style", "constant"),
        start_wd=wd, end_wd=wd, wd_incr_steps=decay, wd_incr_style="constant")


def load_batches(path: str) -> list[list[dict[str, torch.Tensor]]]:
    """A case's ``data``: per step, the global batch's micro-batches in the order one process
    trains them, each ``{"tokens", "labels", "position_ids", "attention_mask", "loss_mask"}``
    (``[b, s]``; the mask ``[b, 1, s, s]``, True = masked). Steps past the file's are the
    synthetic stream's (what ``nutp-train`` reads when it continues a Bridge run)."""
    return list(torch.load(path))


def _step_batches(case: Any, dims: Any, step: int, data: list[Any] | None) -> list[Any]:
    from nemo_nutp.data import replica_microbatches

    if data is not None and step < len(data):
        return list(data[step])
    mask = torch.triu(torch.ones(dims.seq_length, dims.seq_length, dtype=torch.bool),
                      diagonal=1)[None, None]
    return [{"tokens": mb.tokens, "labels": mb.labels, "position_ids": mb.position_ids,
             "attention_mask": mask, "loss_mask": None}
            for mb in replica_microbatches(offset=0, count=case.global_batch, seed=case.seed,
                                           step=step, micro_batch_size=case.micro_batch_size,
                                           seq_length=dims.seq_length,
                                           vocab_size=dims.vocab_size)]


def _loss(ddp: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's mean token loss (over its loss mask, where it has one)."""
    per_token = ddp(mb["tokens"], mb["position_ids"], mb["attention_mask"],
                    labels=mb["labels"]).float()
    mask = mb["loss_mask"]
    if mask is None:
        return per_token.mean()
    mask = mask.float()
    return (per_token * mask).sum() / mask.sum()


def run_reference(case: Any) -> dict[str, Any]:
    """Train ``case`` on stock megatron-core (TP1, this process); see the module docstring."""
    from nemo_nutp.config import ModelConfig

    dims = ModelConfig(**{**case.model, **case.ref_model})  # ref_model: negative controls
    ddp, opt, _ = _build(case, dims)
    schedule = _schedule(case, opt)
    data = load_batches(case.data) if case.data is not None else None
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "skipped": [], "lrs": [],
                           "val_losses": {}}
    for step in range(case.steps):
        batches = _step_batches(case, dims, step, data)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        n, total, scale = len(batches), 0.0, float(opt.get_loss_scale())
        for i, mb in enumerate(batches):
            ctx = ddp.no_sync() if i < n - 1 else _Null()
            with ctx:
                loss = _loss(ddp, mb)
                scaled = loss / n
                (scaled * scale if scale != 1.0 else scaled).backward()
            total += float(loss.detach())
        ddp.finish_grad_sync()
        if step == 0:
            out["grads"] = {normalize_name(k): p.main_grad.detach().float().clone()
                            for k, p in ddp.named_parameters()}
        out["lrs"].append(float(opt.param_groups[0]["lr"]))
        ok, norm, _ = opt.step()
        if schedule is not None and ok:
            schedule.step(increment=1)
        if ok and not norm:  # clipping off: megatron did not compute it; grads still in place
            norm = opt.get_grad_norm()
        out["losses"].append(total / n)
        if case.eval_interval and (step + 1) % case.eval_interval == 0:
            k = (step + 1) // case.eval_interval - 1
            out["val_losses"][step] = _evaluate(case, dims, ddp, k)
        out["grad_norms"].append(float(norm) if ok else float("nan"))
        out["skipped"].append(not ok)
    out["params"] = {normalize_name(k): p.detach().float().clone()
                     for k, p in ddp.named_parameters()}
    return out


def _evaluate(case: Any, dims: Any, ddp: Any, k: int) -> float:
    """The k-th evaluation as megatron's ``evaluate`` does it: eval mode, no gradients, the
    mean token loss over ``eval_iters`` global batches of the synthetic stream's validation
    split (batches ``k x eval_iters ..``: the set continues from one evaluation to the next)."""
    from nemo_nutp.data import replica_microbatches

    mask = torch.triu(torch.ones(dims.seq_length, dims.seq_length, dtype=torch.bool),
                      diagonal=1)[None, None]
    ddp.eval()
    losses = []
    with torch.no_grad():
        for j in range(k * case.eval_iters, (k + 1) * case.eval_iters):
            for mb in replica_microbatches(offset=0, count=case.global_batch, seed=case.seed,
                                           step=j, micro_batch_size=case.micro_batch_size,
                                           seq_length=dims.seq_length,
                                           vocab_size=dims.vocab_size, split="valid"):
                losses.append(float(_loss(ddp, {"tokens": mb.tokens, "labels": mb.labels,
                                                "position_ids": mb.position_ids,
                                                "attention_mask": mask, "loss_mask": None})))
    ddp.train()
    return sum(losses) / len(losses)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def reference_worker(rank: int, world: int, port: int, cases: list[Any], outdir: str) -> None:
    """One process: megatron's global state at TP1, every case's reference saved as a file."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(1, 1)
        for case in cases:
            tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
            if case.hf_path is not None:
                from .hf_reference import run_hf_reference

                ref = run_hf_reference(case)
            else:
                ref = run_reference(case)
            torch.save(ref, os.path.join(outdir, f"ref_{case.name}.pt"))
        parallel_state.destroy_model_parallel()

    gloo_rank(rank, world, port, outdir, body)
