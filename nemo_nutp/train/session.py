"""Build everything one rank trains with: groups, model, NUTP DDP, optimizer, data slice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig

from ..data import MicroBatch, replica_microbatches
from ..data.indexed import IndexedTokenSource
from ..layout import Plan
from ..model import build_gpt_model
from ..model.build import transformer_config
from ..parallel import NUTPGroups, build_groups
from ..sync import NUTPDistributedDataParallel
from .step import StepResult, build_optimizer, reduce_replica_loss, train_step


@dataclass
class RankSession:
    plan: Plan
    groups: NUTPGroups
    model: NUTPDistributedDataParallel
    optimizer: Any
    model_cfg: Any
    micro_batch_size: int
    seed: int
    mask: torch.Tensor | None
    source: IndexedTokenSource | None = None

    def batches(self, step: int) -> list[MicroBatch]:
        """This replica's micro-batches of the step's global batch."""
        ctx = self.groups.ctx
        if self.source is not None:
            m = self.plan.request.global_batch
            return [self.source.microbatch(step=step, index=ctx.microbatch_offset + k,
                                           num_microbatches=m,
                                           micro_batch_size=self.micro_batch_size)
                    for k in range(ctx.microbatches)]
        return replica_microbatches(offset=ctx.microbatch_offset, count=ctx.microbatches,
                                    seed=self.seed, step=step,
                                    micro_batch_size=self.micro_batch_size,
                                    seq_length=self.model_cfg.seq_length,
                                    vocab_size=self.model_cfg.vocab_size)

    def step(self, step: int) -> StepResult:
        """Train one step; the loss is the global-batch mean (a collective over the stage)."""
        replica_loss, grad_norm, times = train_step(self.model, self.optimizer,
                                                    self.batches(step), self.mask)
        ctx = self.groups.ctx
        loss = reduce_replica_loss(replica_loss, weight=ctx.weight, degree=ctx.degree,
                                   stage_group=self.groups.stage,
                                   device=next(self.model.parameters()).device)
        return StepResult(loss=loss, replica_loss=replica_loss, grad_norm=grad_norm, times=times)


def causal_mask(seq_length: int) -> torch.Tensor:
    """Explicit causal mask (True = masked); megatron's local attention needs one on CPU."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]


def build_session(plan: Plan, model_cfg: Any, *, lr: float, seed: int, micro_batch_size: int,
                  optimizer: str = "adam", weight_decay: float = 0.0, clip_grad: float = 0.0,
                  bucket_size: int | None = None, groups: NUTPGroups | None = None,
                  device: torch.device | None = None, data_path: str | None = None
                  ) -> RankSession:
    """Collective over the world: create groups (unless given), the model, DDP and optimizer."""
    groups = groups or build_groups(plan)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()  # scratch buffers only; no groups
    ctx = groups.ctx
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=ctx.tp_rank, ep_rank=0,
                                                    etp_rank=0)
    module = build_gpt_model(plan, ctx.rank, model_cfg, groups.pgs, seed=seed)
    if device is not None:
        module = module.to(device)
    config = transformer_config(model_cfg, degree=ctx.degree,
                                sequence_parallel=plan.request.parallel.sequence_parallel)
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=bucket_size)
    model = NUTPDistributedDataParallel(config, ddp_cfg, module, plan=plan, groups=groups)
    opt = build_optimizer(model, groups.pgs, lr=lr, optimizer=optimizer,
                          weight_decay=weight_decay, clip_grad=clip_grad)
    source = None if data_path is None else IndexedTokenSource(
        data_path, vocab_size=model_cfg.vocab_size, seq_length=model_cfg.seq_length)
    return RankSession(plan=plan, groups=groups, model=model, optimizer=opt, model_cfg=model_cfg,
                       micro_batch_size=micro_batch_size, seed=seed,
                       mask=causal_mask(model_cfg.seq_length), source=source)
