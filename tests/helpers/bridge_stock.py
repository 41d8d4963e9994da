"""Bridge's own stock run of a recipe (no NUTP), one rank of a CPU/gloo world: the reference of
the uniform-layout test.

What Bridge's ``setup()`` does for a recipe with ``dist.use_decentralized_pg``, minus what has no
CPU path (``initialize_megatron`` asserts CUDA); its data is Bridge's own pipeline
(``setup_data_iterators`` over its DP group, the recipe's dataset): Bridge's HyperCommGrid
process groups
(``initialize._create_pg_collection``), Bridge's seeding, the recipe provider's
``provide_distributed_model`` (stock megatron ``GPTModel`` with Bridge's local layer spec where
TE is absent, megatron's DDP through Bridge's ``_ddp_wrap``), Bridge's ``setup_optimizer``,
``_update_model_config_funcs`` (megatron's own ``finalize_model_grads``), then Bridge's
``train()`` (with its validation iterator: evaluation during training where the recipe asks;
each evaluation's loss in ``stock_evals_rank<r>.json``). Its initial weights are written in
megatron-core's format (the ``model`` part of a Bridge checkpoint), for the NUTP run to start
from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def save_initial(model: list[Any], root: Path, pgs: Any) -> Path:
    """Bridge's model state (``{"model": sharded_state_dict}``) as ``root/iter_0000000``.
    Virtual pipeline stages: every chunk's sharded state under ``model`` (megatron's sharded
    keys carry each chunk's global layer offsets, so the chunks fill one tensor per key)."""
    from megatron.core import dist_checkpointing

    path = root / "iter_0000000"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    meta = {"dp_cp_group": pgs.dp_cp}
    state = model[0].module.sharded_state_dict(metadata=meta) if len(model) == 1 else {
        f"chunk{i}": m.module.sharded_state_dict(metadata=meta) for i, m in enumerate(model)}
    dist_checkpointing.save({"model": state}, str(path))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("0")
    dist.barrier()
    return path


def stock_rank(job: Any, out_dir: str, init_root: Path, *,
               prepare: Callable[[list[Any]], None] | None = None) -> list[dict[str, float]]:
    """Collective: Bridge's stock TPxDP run of ``job.bridge``; returns the per-step record.
    ``prepare(model)``: called on Bridge's model chunks before the optimizer exists (it may set
    the initial weights, then nothing is saved, and hook modules); None: Bridge's own initial
    weights, saved under ``init_root``."""
    from megatron.bridge.data.loaders import setup_data_iterators
    from megatron.bridge.training import initialize as bridge_init
    from megatron.bridge.training import train as bridge_train
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.checkpointing import create_checkpoint_manager
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.setup import _update_model_config_funcs
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from nemo_nutp.compat.bridge_cpu import apply_bridge_cpu_patches
    from nemo_nutp.integrations.bridge_data import dataset_provider
    from nemo_nutp.integrations.bridge_run import recording

    apply_bridge_cpu_patches()
    cfg = job.bridge
    cfg.dist.use_decentralized_pg = True
    cfg.dist.use_gloo_process_groups = False  # megatron's extra gloo groups (the world is gloo)
    cfg.dataset.skip_getting_attention_mask_from_dataset = False
    cfg.validate()  # the uniform layout passes Bridge's own checks as they are
    # (looked up after the CPU patches: gloo groups where Bridge asks for NCCL)
    pgs = bridge_init._create_pg_collection(cfg.model, num_distributed_optimizer_instances=1)
    if getattr(pgs, "dp_cp_gtp_remat", None) is None:  # megatron's MoE metrics read it (else
        pgs.dp_cp_gtp_remat = pgs.dp_cp  # its global parallel_state, which GPU setup makes)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    seed = cfg.rng.seed
    bridge_init._set_random_seed(seed, pg_collection=pgs)  # CPU: Python/numpy/torch only
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=pgs.tp.rank(), ep_rank=0,
                                                    etp_rank=0)
    if not _have_te():  # Bridge's default is the TE spec; its local spec where TE is absent
        from megatron.bridge.models.gpt_provider import local_layer_spec

        cfg.model.transformer_layer_spec = local_layer_spec
        if getattr(cfg.model, "num_moe_experts", None) and cfg.model.moe_layer_freq != 1:
            cfg.model.transformer_layer_spec = local_block_spec  # dense and MoE layers mixed
    model = cfg.model.provide_distributed_model(
        ddp_config=cfg.ddp, pg_collection=pgs, use_cpu_initialization=True,
        # (bf16/fp16: Bridge's setup() keeps the default Float16Module wrapper)
        overlap_param_gather_with_optimizer_step=cfg.optimizer.overlap_param_gather_with_optimizer_step,
        data_parallel_random_init=cfg.rng.data_parallel_random_init)
    state = GlobalState()
    state.cfg = cfg
    cfg.model.timers = state.timers
    cfg.optimizer.timers = state.timers
    if prepare is not None:
        prepare(model)
    optimizer, scheduler = setup_optimizer(
        optimizer_config=cfg.optimizer, scheduler_config=cfg.scheduler, model=model,
        use_gloo_process_groups=False, pg_collection=pgs)
    _update_model_config_funcs(model, cfg.model, cfg.ddp, optimizer,
                               align_grad_reduce=cfg.dist.align_grad_reduce, pg_collection=pgs)
    if prepare is None:
        save_initial(model, init_root, pgs)
    dp = pgs.dp.size()
    mbs = cfg.train.micro_batch_size
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(dist.get_rank(), None, cfg.train.global_batch_size, mbs, dp)

    def reduce(replica_loss: float) -> float:  # equal shares: the mean over DP ranks
        t = torch.tensor([replica_loss], dtype=torch.float64)
        dist.all_reduce(t, group=pgs.dp)
        return float(t) / dp

    eval_parts: list[tuple[float, float]] = []
    record, forward = recording(optimizer, reduce, eval_parts=eval_parts)
    # Bridge's own data pipeline over its DP group (what setup() builds), the recipe's dataset
    data, valid, _ = setup_data_iterators(cfg=cfg, train_state=state.train_state,
                                          model_length=len(model),
                                          train_valid_test_datasets_provider=dataset_provider(
                                              cfg, pgs), dp_group=pgs.dp)
    evals: list[dict[str, float]] = []
    callbacks = CallbackManager()  # Bridge's own reduced validation loss (what it prints)
    callbacks.register("on_eval_end", lambda ctx: evals.append(  # (the last stage's)
        {"step": int(state.train_state.step),
         "val_loss": float(ctx.total_loss_dict.get("lm loss", float("nan")))}))
    bridge_train.train(forward, model, optimizer, scheduler, data, valid, state,
                       create_checkpoint_manager(cfg.checkpoint), pgs,
                       callback_manager=callbacks)
    Path(out_dir, f"stock_rank{dist.get_rank()}.json").write_text(json.dumps(record))
    Path(out_dir, f"stock_evals_rank{dist.get_rank()}.json").write_text(json.dumps(evals))
    Path(out_dir, f"stock_eval_parts_rank{dist.get_rank()}.json").write_text(
        json.dumps(eval_parts))  # each evaluation micro-batch's (loss sum, tokens), in order
    return record


def stock_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    from .bridge_jobs import load

    def body() -> None:
        stock_rank(load(overrides), outdir, Path(outdir, "stock_init"))

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    gloo_rank(rank, world, port, outdir, body)


def local_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """megatron's decoder block spec with local layers (what Bridge's DeepSeek-V3 and GLM-4.5
    providers set, TE off): ``moe_layer_freq``'s dense and MoE layers, the norms by
    ``config.normalization``; one pipeline stage (``pp_rank=0``: no megatron globals here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=config.normalization, vp_stage=vp_stage,
                                      pp_rank=0)
