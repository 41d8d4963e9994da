"""Run a Bridge recipe with NUTP through Bridge's own ``train()`` (one rank of a gloo/NCCL world).

``train_rank(job, plan, out_dir)`` builds, on this rank: the NUTP groups, the recipe's model as
the NUTP GPT (``model_config_of``: every field that changes the math is honoured or rejected by
name), the NUTP DDP, Bridge's optimizer and scheduler (``setup_optimizer``) with the exact NUTP
grad norm, megatron's micro-batch calculator at this replica's share, the finalize / grad-scale
functions Bridge's ``setup()`` would set (here: NUTP's gradient finalisation), and then calls
``megatron.bridge.training.train.train``. Only ``pp=1`` (no virtual stages) for now.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REJECTED = {
    # provider field -> value the NUTP model has (anything else is rejected by name)
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "apply_query_key_layer_scaling": False,
    "qk_layernorm": False,
    "num_moe_experts": None,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "mtp_num_layers": None,
    "layernorm_zero_centered_gamma": False,
    "fp8": None,
}


def model_config_of(provider: Any, *, vocab_size: int) -> Any:
    """NUTP's ``ModelConfig`` of a Bridge ``GPTModelProvider``; ``ValueError`` naming
    ``model.<field>`` for a setting the NUTP model cannot honour."""
    from ..config.schema import ModelConfig

    for name, want in REJECTED.items():
        have = getattr(provider, name, want)
        if have != want and not (want is None and not have):
            raise ValueError(f"model.{name}={have}: not supported by the NUTP model "
                             f"(needs {want})")
    gated = bool(provider.gated_linear_unit)
    act = provider.activation_func
    if act is not (F.silu if gated else F.gelu):
        raise ValueError(f"model.activation_func={getattr(act, '__name__', act)}: the NUTP "
                         f"model uses {'silu' if gated else 'gelu'} with "
                         f"gated_linear_unit={gated}")
    if provider.add_bias_linear != provider.add_qkv_bias and provider.add_qkv_bias:
        raise ValueError(f"model.add_qkv_bias={provider.add_qkv_bias}: must equal "
                         f"model.add_bias_linear={provider.add_bias_linear}")
    pos = provider.position_embedding_type
    if pos not in ("rope", "learned_absolute"):
        raise ValueError(f"model.position_embedding_type={pos}: rope or learned_absolute")
    heads = provider.num_attention_heads
    return ModelConfig(
        num_layers=provider.num_layers, hidden_size=provider.hidden_size,
        num_attention_heads=heads, num_query_groups=provider.num_query_groups or heads,
        ffn_hidden_size=provider.ffn_hidden_size, vocab_size=vocab_size,
        seq_length=provider.seq_length, gated_mlp=gated,
        tie_embeddings=bool(provider.share_embeddings_and_output_weights),
        add_bias=bool(provider.add_bias_linear), kv_channels=provider.kv_channels,
        normalization=provider.normalization, position_embedding=pos,
        init_std=float(provider.init_method_std),
        hidden_dropout=float(provider.hidden_dropout),
        attention_dropout=float(provider.attention_dropout))


def precision_of(cfg: Any) -> str:
    m = cfg.model
    return "bf16" if m.bf16 else "fp16" if m.fp16 else "fp32"


def _batches(plan: Any, ctx: Any, dims: Any, *, seed: int, mbs: int,
             steps: int) -> Iterator[dict[str, torch.Tensor]]:
    """This replica's micro-batches of every step (all TP ranks of a replica the same), as
    Bridge's GPT batch dicts."""
    from ..compat.cpu import cpu_attention_mask
    from ..data import replica_microbatches

    mask = cpu_attention_mask(dims.seq_length)
    for step in range(steps):
        for mb in replica_microbatches(offset=ctx.microbatch_offset, count=ctx.microbatches,
                                       seed=seed, step=step, micro_batch_size=mbs,
                                       seq_length=dims.seq_length, vocab_size=dims.vocab_size):
            yield {"tokens": mb.tokens, "labels": mb.labels, "position_ids": mb.position_ids,
                   "loss_mask": torch.ones(mb.tokens.shape, dtype=torch.float),
                   "attention_mask": mask.expand(mbs, 1, -1, -1)}


def _nutp_finalize(model_chunks: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
    """NUTP's gradient finalisation (megatron's ``finalize_model_grads`` slot): the NUTP DDP's
    cross-replica sync, weighted by the replicas' micro-batch shares."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()


def validate_as_uniform(cfg: Any) -> None:
    """Bridge's ``ConfigContainer.validate()`` (derived scheduler steps, mixed precision, ...)
    without its TP-divisibility assertion: NUTP's replicas need not divide the world, so the
    check runs with TP1 (the layout itself was validated by the NUTP planner)."""
    tp = cfg.model.tensor_model_parallel_size
    cfg.model.tensor_model_parallel_size = 1
    try:
        cfg.validate()
    finally:
        cfg.model.tensor_model_parallel_size = tp


def train_rank(job: Any, plan: Any, out_dir: str, *, seed: int) -> dict[str, Any]:
    """Collective over the world: build and train this rank; returns the per-step record."""
    from megatron.bridge.training import train as bridge_train
    from megatron.bridge.training.checkpointing import create_checkpoint_manager
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from ..compat.bridge_cpu import apply_bridge_cpu_patches
    from ..parallel import build_groups
    from ..train.step import reduce_replica_loss
    from .bridge import exact_grad_norm, nutp_ddp, nutp_provider

    apply_bridge_cpu_patches()
    cfg = job.bridge
    validate_as_uniform(cfg)
    cfg.dist.use_decentralized_pg = True  # explicit process groups (NUTP's), never mpu globals
    if not torch.cuda.is_available():  # megatron's local attention needs the explicit mask
        cfg.dataset.skip_getting_attention_mask_from_dataset = False
    groups = build_groups(plan)
    ctx = groups.ctx
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=ctx.tp_rank, ep_rank=0,
                                                    etp_rank=0)
    dims = plan.request.model
    provider = nutp_provider(cfg.model, plan, groups, seed=seed)
    chunks = provider.provide_distributed_model(
        ddp_config=cfg.ddp, wrap_with_ddp=False, pg_collection=groups.pgs,
        use_cpu_initialization=True, mixed_precision_wrapper=None)
    cfg.ddp.overlap_grad_reduce = True
    model = nutp_ddp(chunks, cfg.ddp, plan, groups)
    state = GlobalState()
    state.cfg = cfg
    cfg.model.timers = state.timers
    cfg.optimizer.timers = state.timers
    optimizer, scheduler = setup_optimizer(
        optimizer_config=cfg.optimizer, scheduler_config=cfg.scheduler, model=model,
        use_gloo_process_groups=False, pg_collection=groups.pgs)
    exact_grad_norm(optimizer, model[0])
    mc = model[0].config
    mc.no_sync_func = model[0].no_sync
    mc.finalize_model_grads_func = _nutp_finalize
    mc.grad_scale_func = optimizer.scale_loss
    mbs = cfg.train.micro_batch_size
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(ctx.rank, None, ctx.microbatches * mbs, mbs, 1)
    record: list[dict[str, float]] = []
    losses: list[float] = []
    step = optimizer.step

    def recorded_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        replica = sum(losses) / len(losses)  # this replica's mean over its micro-batches
        losses.clear()
        loss = reduce_replica_loss(replica, weight=ctx.weight, degree=ctx.degree,
                                   stage_group=groups.stage)
        norm = float(out[1]) if out[1] is not None else float("nan")
        record.append({"loss": loss, "grad_norm": norm})
        return out

    def recorded_forward(state: Any, data_iterator: Any, model: Any,
                         return_schedule_plan: bool = False) -> Any:
        output, loss_fn = forward_step(state, data_iterator, model, return_schedule_plan)

        def loss_func(*args: Any, **kwargs: Any) -> Any:
            out = loss_fn(*args, **kwargs)
            losses.append(float(out[0].detach().sum()) / float(out[1]))
            return out
        return output, loss_func

    optimizer.step = recorded_step
    data = _batches(plan, ctx, dims, seed=seed, mbs=mbs, steps=cfg.train.train_iters)
    bridge_train.train(recorded_forward, model, optimizer, scheduler, data, None, state,
                       create_checkpoint_manager(cfg.checkpoint), groups.pgs)
    out = {"rank": ctx.rank, "replica": ctx.replica, "steps": record}
    Path(out_dir, f"bridge_rank{ctx.rank}.json").write_text(json.dumps(out))
    return {**out, "model": model[0], "groups": groups}
