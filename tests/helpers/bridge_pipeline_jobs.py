"""Bridge's Llama 3 8B recipe, shrunk for CPU with its training switches kept, for the pipeline
comparison (``tests/integrations/test_bridge_pipeline.py``): Bridge's own stock run of it
(``bridge_stock.stock_rank``) and ``nutp-bridge``'s (``bridge_run.train_rank``), each one rank
of a spawned gloo world."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LLAMA3_8B = "megatron.bridge.recipes.llama.llama3:llama3_8b_pretrain_config"

SHRUNK = [
    # the model: 4 layers of Llama 3 8B's shape kinds (GQA 4 query heads over 2 groups, SwiGLU,
    # RMSNorm, RoPE at base 500000, untied output), small enough for CPU
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.kv_channels=16", "model.ffn_hidden_size=128",
    "model.vocab_size=256", "model.seq_length=32", "dataset.seq_length=32",
    "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
    # the CPU layout of at most 8 ranks
    "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2",
    "model.context_parallel_size=1",
    # NullTokenizer at the model's vocabulary (the recipe's tokenizer, smaller)
    "tokenizer.vocab_size=256", "tokenizer.use_tokenizer_vocab_size=false",
    # CPU substitutions (kernels: the same math; Bridge's validate() asserts TE for RoPE fusion)
    "model.apply_rope_fusion=false", "model.gradient_accumulation_fusion=false",
    "model.bias_activation_fusion=false", "model.masked_softmax_fusion=false",
    "model.bias_dropout_fusion=false", "model.cross_entropy_fusion_impl=native",
    "model.persist_layer_norm=false",
    "comm_overlap=null",
    # a short run with the recipe's schedule kinds: warmup, then cosine decay; evaluation
    # during training every 2 steps
    "train.train_iters=4", "train.global_batch_size=8", "train.micro_batch_size=1",
    "scheduler.lr_warmup_iters=2", "scheduler.lr_decay_iters=4",
    "validation.eval_interval=2", "validation.eval_iters=2",
    # the validation sampler (Bridge's ``cyclic`` one) without data sharding: with sharding
    # each data-parallel rank draws from its own slice of the set, so the batches Bridge
    # evaluates depend on the data-parallel size (8 DP2 stock values differ from a DP1 run's);
    # without it every global batch is the same samples at any data-parallel size
    "dataset.data_sharding=false",
    "dataset.num_workers=0", "logger.log_interval=1", "logger.tensorboard_dir=null",
    "checkpoint.save=null", "checkpoint.load=null",
]
"""What the test changes in the recipe; every other switch is the recipe's own (the
distributed optimizer, its lr and min lr, clipping, weight decay, its mock data)."""

FP32 = ["mixed_precision=null", "model.bf16=false", "model.params_dtype=torch.float32",
        "optimizer.bf16=false"]
"""The fp32 comparison (the issue's own override list)."""

STOCK_ONLY = ["model.sequence_parallel=false", "ddp.overlap_param_gather=false",
              "optimizer.overlap_param_gather=false"]
"""The stock side only: megatron's ``WrappedTorchNorm`` refuses sequence parallelism on CPU
(the same math), and megatron's parameter-gather pre-hook needs CUDA streams."""


def load(overrides: list[str]) -> Any:
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from tests.helpers.hf_offline import offline_hf

    offline_hf()
    return load_bridge_job(LLAMA3_8B, None, [*SHRUNK, *overrides])


def stock_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    """Bridge's stock run (no NUTP); writes its initial weights for the NUTP run."""
    from tests.helpers.bridge_stock import stock_rank
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        stock_rank(load([*overrides, *STOCK_ONLY]), outdir, Path(outdir, "stock_init"))

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    gloo_rank(rank, world, port, outdir, body)


def nutp_worker(rank: int, world: int, port: int, overrides: list[str], init: str,
                outdir: str) -> None:
    """``nutp-bridge``'s run from the stock run's initial weights; every rank's record in
    ``pipeline_rank<r>.json``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed, init_from=init)
        Path(outdir, f"pipeline_rank{rank}.json").write_text(json.dumps(
            {"steps": got["steps"], "evals": got["evals"], "stage": got["groups"].ctx.stage,
             "eval_parts": got["eval_parts"],
             "sequence_parallel": bool(got["model"].config.sequence_parallel),
             "degree": got["groups"].ctx.degree,
             "replica": got["groups"].ctx.replica}))

    gloo_rank(rank, world, port, outdir, body)
