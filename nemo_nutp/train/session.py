"""Build everything one rank trains with: groups, model, NUTP DDP, optimizer, data slice."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from ..data import MicroBatch, replica_microbatches
from ..data.indexed import IndexedTokenSource
from ..layout import Plan
from ..model import ModelChunks, build_gpt_chunks
from ..model.build import enable_cuda_math, needs_attention_mask, transformer_config
from ..parallel import NUTPGroups, build_groups
from ..pipeline import PipelineRunner
from ..sync import NUTPDistributedDataParallel
from .schedule import Schedule
from .step import (
    GradChecks,
    StepOptions,
    StepResult,
    build_optimizer,
    clock,
    loss_scale,
    optimizer_step,
    reduce_replica_loss,
    train_step,
)


@dataclass(frozen=True)
class Precision:
    """Mixed precision of a run (``train.precision`` and its loss-scaler settings)."""

    precision: str = "fp32"
    grad_reduce_in_fp32: bool = True
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000


def precision_of(train: Any) -> Precision:
    """``Precision`` from a ``train`` config section."""
    return Precision(precision=train.precision, grad_reduce_in_fp32=train.grad_reduce_in_fp32,
                     initial_loss_scale=train.initial_loss_scale,
                     min_loss_scale=train.min_loss_scale,
                     loss_scale_window=train.loss_scale_window)


class StepListener(Protocol):
    """Told about every step of a session (``recovery.mode=live``: ``live.manager.LiveManager``).

    ``vote`` runs after the gradient reduction (the global loss in hand) and before any
    optimizer state changes; it may raise to stop the step. ``stepped`` runs as soon as the
    step's result is known, before any other collective of the loop."""

    def vote(self, loss: float) -> None: ...

    def stepped(self, result: StepResult) -> None: ...

    def phase(self, name: str) -> None:
        """Where the step is: ``"sync"`` (buckets posted, not finished), ``"optimizer"`` (after
        the vote, before the update); ``"gather"`` comes from the distributed optimizer."""


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
    gpt: Any  # the unwrapped model, NUTPGPTModel (names and shards as in checkpoints);
    # virtual pipeline stages: the rank's chunks (ModelChunks)
    source: IndexedTokenSource | None = None
    valid_source: IndexedTokenSource | None = None  # train.valid_data_path
    opts: StepOptions = field(default_factory=StepOptions)
    checks: GradChecks | None = None
    pipeline: PipelineRunner | None = None  # pp > 1
    precision: str = "fp32"
    listener: StepListener | None = None  # recovery.mode=live: the vote, the step's result
    scheduler: Any = None  # megatron's OptimizerParamScheduler (train/schedule.py), or None
    skips: int = 0  # skipped steps among those counted: the schedule's clock is step - skips
    counted_through: int = -1  # the last step whose skip is counted in ``skips``
    lr: float | None = None  # the lr of the newest step's update
    last_skipped: bool | None = None  # whether step ``counted_through`` was skipped

    def count_step(self, step: int, skipped: bool) -> None:
        """Count ``step``'s outcome once (a live re-layout may report a step already counted)."""
        if step > self.counted_through:
            self.counted_through = step
            self.skips += int(skipped)
            self.last_skipped = skipped

    def lr_of(self, step: int) -> float | None:
        """The lr a counted ``step`` updated with (a re-layout's recovered metrics row)."""
        if self.scheduler is None or step > self.counted_through:
            return None
        from .schedule import lr_at_clock

        return lr_at_clock(self.scheduler, step - self.skips_before(step))

    def skips_before(self, step: int) -> int:
        """Skipped steps before the newest counted one, if that is ``step`` (the clock it ran
        at); else all counted."""
        if step != self.counted_through or self.last_skipped is None:
            return self.skips
        return self.skips - int(self.last_skipped)

    def _clock(self, step: int) -> None:
        if self.scheduler is not None:
            from .schedule import set_clock

            self.lr = set_clock(self.scheduler, step - self.skips)

    def _global_loss(self, replica_loss: float) -> float:
        ctx = self.groups.ctx
        return reduce_replica_loss(replica_loss, weight=ctx.weight, degree=ctx.degree,
                                   stage_group=self.groups.stage,
                                   device=next(self.model.parameters()).device)

    def batches(self, step: int, *, split: str = "train") -> list[MicroBatch]:
        """This replica's micro-batches of global batch ``step`` of the training or validation
        (``split='valid'``) data."""
        ctx = self.groups.ctx
        source = self.source if split == "train" else self.valid_source
        if source is not None:
            m = self.plan.request.global_batch
            return [source.microbatch(step=step, index=ctx.microbatch_offset + k,
                                      num_microbatches=m, micro_batch_size=self.micro_batch_size)
                    for k in range(ctx.microbatches)]
        return replica_microbatches(offset=ctx.microbatch_offset, count=ctx.microbatches,
                                    seed=self.seed, step=step,
                                    micro_batch_size=self.micro_batch_size,
                                    seq_length=self.model_cfg.seq_length,
                                    vocab_size=self.model_cfg.vocab_size, split=split)

    def evaluate(self, first: int, iters: int) -> float:
        """The validation loss over validation global batches ``first .. first + iters - 1``,
        as megatron's ``evaluate`` computes it (the model in eval mode, no gradients; every
        token weighted alike). Collective over the world: each replica its share of every
        batch, combined by the replicas' weights like a training loss."""
        was_training = self.model.training
        self.model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for k in range(first, first + iters):
                    batches = self.batches(k, split="valid")
                    if self.pipeline is not None:
                        replica = self.pipeline.evaluate(batches, self.mask)
                    else:
                        replica = _forward_loss(self.model, batches, self.mask)
                    total += self._global_loss(replica)
        finally:
            self.model.train(was_training)
        return total / iters

    def step(self, step: int, *, after_sync: Any = None) -> StepResult:
        """Train one step; the loss is the global-batch mean (a collective over the stage).
        With a ``listener``, the loss is reduced before the update and its vote follows."""
        losses: list[float] = []

        def before_update(replica_loss: float) -> None:
            losses.append(self._global_loss(replica_loss))
            pre = getattr(self.optimizer, "before_vote", None)
            if pre is not None:  # distributed optimizer: its collectives before the vote
                pre()
            assert self.listener is not None
            self.listener.vote(losses[0])

        hook = None if self.listener is None else before_update
        phase = None if self.listener is None else self.listener.phase
        self._clock(step)
        if self.pipeline is None:
            replica_loss, grad_norm, times, skipped = train_step(
                self.model, self.optimizer, self.batches(step), self.mask, opts=self.opts,
                checks=self.checks, step=step, after_sync=after_sync, before_update=hook,
                phase=phase)
        else:
            replica_loss, grad_norm, times, skipped = self._pipeline_step(step, after_sync,
                                                                          hook, phase)
        loss = losses[0] if losses else self._global_loss(replica_loss)
        result = StepResult(loss=loss, replica_loss=replica_loss, grad_norm=grad_norm,
                            times=times, skipped=skipped)
        self.count_step(step, skipped)
        if self.listener is not None:
            self.listener.stepped(result)
        return result

    def apply_update(self, step: int) -> tuple[bool, float]:
        """The optimizer step from the gradients this rank holds (a live re-layout completes a
        voted step whose result was lost this way): (updated, grad norm)."""
        phase = None if self.listener is None else self.listener.phase
        self._clock(step)
        ok, norm = optimizer_step(self.model, self.optimizer, self.opts, self.checks, step=step,
                                  phase=phase)
        self.count_step(step, not ok)
        return ok, norm

    def _pipeline_step(self, step: int, after_sync: Any, before_update: Any = None,
                       phase: Any = None) -> tuple[float, float, dict[str, float], bool]:
        """``train_step`` for pipeline stages: megatron's 1F1B schedule, then the same
        optimizer step."""
        assert self.pipeline is not None
        loss, compute_s, sync_s = self.pipeline.step(
            self.optimizer, self.batches(step), self.mask, scale=loss_scale(self.optimizer),
            after_sync=after_sync, phase=phase)
        if self.opts.slow_factor > 1.0:  # injected straggler: compute x factor
            time.sleep((self.opts.slow_factor - 1.0) * compute_s)
            compute_s *= self.opts.slow_factor
        if before_update is not None:
            before_update(loss)
        device = next(self.model.parameters()).device
        t = clock(device)
        ok, grad_norm = optimizer_step(self.model, self.optimizer, self.opts, self.checks,
                                       step=step, phase=phase)
        times = {"compute_s": compute_s, "sync_s": sync_s,
                 "optimizer_s": clock(device) - t}
        return loss, grad_norm, times, not ok


def _forward_loss(model: Any, batches: list[MicroBatch], mask: torch.Tensor | None) -> float:
    """This replica's mean micro-batch loss, forward only."""
    device = next(model.parameters()).device
    m = None if mask is None else mask.to(device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mb in batches:
        total += model(mb.tokens.to(device), mb.position_ids.to(device), m,
                       labels=mb.labels.to(device)).float().mean()
    return float(total) / len(batches)


def causal_mask(seq_length: int) -> torch.Tensor:
    """Explicit causal mask (True = masked); megatron's local attention needs one on CPU."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]


def _mask(model_cfg: Any, device: torch.device | None) -> torch.Tensor | None:
    """The explicit causal mask, on the device once (not copied per micro-batch), only for
    megatron's local ``DotProductAttention``; SDPA / TE mask causally themselves (None)."""
    if not needs_attention_mask(model_cfg):  # the same resolution as build_gpt_model
        return None
    mask = causal_mask(model_cfg.seq_length)
    return mask if device is None else mask.to(device)


def build_session(plan: Plan, model_cfg: Any, *, lr: float, seed: int, micro_batch_size: int,
                  optimizer: str = "adam", weight_decay: float = 0.0,
                  opts: StepOptions | None = None, precision: Precision | None = None,
                  bucket_size: int | None = None, groups: NUTPGroups | None = None,
                  device: torch.device | None = None, data_path: str | None = None,
                  distributed_optimizer: bool = False,
                  live_redundancy: bool = False, schedule: Schedule | None = None,
                  valid_data_path: str | None = None, moe: Any = None,
                  mla: Any = None) -> RankSession:
    """Collective over the world: create groups (unless given), the model, DDP and optimizer.

    bf16/fp16: the model is megatron's ``Float16Module`` around the NUTP GPT (half-precision
    params, fp32 ``main_grad`` accumulation and cross-replica reduction unless
    ``grad_reduce_in_fp32`` is off), and megatron's mixed-precision optimizer keeps fp32 master
    weights. ``schedule``: the lr / weight-decay schedule (megatron's scheduler, advanced per
    successful update); None: ``lr`` and ``weight_decay`` constant. ``moe``
    (``model.moe.MoEDims``, megatron-core 0.19, fp32; pipeline stages without virtual ones):
    every layer's MLP is ``NUTPMoELayer`` (experts as units inside each replica stage,
    ``sync/experts.py`` across replicas, per stage; with ``distributed_optimizer`` their state
    sliced among each shard's holders, ``sync/zero.py``).
    ``mla`` (``model.mla.MLADims``, with ``moe`` only, one stage): multi-latent attention,
    heads as units.
    """
    opts = opts or StepOptions()
    prec = precision or Precision()
    if moe is not None:  # before any process group
        from ..model.moe import check_moe_plan

        check_moe_plan(plan, moe)
        if mla is not None and plan.pp > 1:
            raise ValueError(f"model.kv_lora_rank={model_cfg.kv_lora_rank}: multi-latent "
                             f"attention over {plan.pp} pipeline stages is not tested yet")
        if distributed_optimizer and plan.pp > 1:
            raise ValueError(f"train.distributed_optimizer=true: not with NUTP MoE over {plan.pp}"
                             " pipeline stages yet (each is tested alone)")
    groups = groups or build_groups(plan)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()  # scratch buffers only; no groups
    ctx = groups.ctx
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=ctx.tp_rank, ep_rank=0,
                                                    etp_rank=0)
    pgs = groups.pgs
    if moe is not None:
        from ..model.moe import build_moe_gpt_model, moe_pg_collection

        if prec.precision != "fp32":
            raise ValueError(f"train.precision={prec.precision!r}: NUTP MoE trains fp32 so far")
        pgs = moe_pg_collection(groups.pgs, single=groups.single, stage=groups.stage)
        chunks = [build_moe_gpt_model(plan, ctx.rank, model_cfg, moe, groups, seed=seed,
                                      mla=mla)]
    else:
        if mla is not None:
            raise ValueError("model.kv_lora_rank: multi-latent attention is built with MoE "
                             "only so far (build_session(moe=...))")
        chunks = build_gpt_chunks(plan, ctx.rank, model_cfg, groups.pgs, seed=seed,
                                  precision=prec.precision)
    if device is not None:
        chunks = [c.to(device) for c in chunks]
        if device.type == "cuda":
            enable_cuda_math(prec.precision)
    config = transformer_config(model_cfg, degree=ctx.degree, precision=prec.precision,
                                sequence_parallel=plan.request.parallel.sequence_parallel,
                                pp=plan.pp, vp=plan.vp) if moe is None else chunks[0].config
    gpt: Any
    module: Any
    if plan.vp == 1:  # one model
        gpt = chunks[0]
        module = gpt if prec.precision == "fp32" else Float16Module(config, gpt)
    else:  # virtual pipeline stages: the chunks as one module for the DDP
        gpt = ModelChunks(list(chunks))
        module = gpt if prec.precision == "fp32" else ModelChunks(
            [Float16Module(c.config, c) for c in chunks])
    ddp_cfg = DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=bucket_size,
        grad_reduce_in_fp32=prec.grad_reduce_in_fp32 or prec.precision == "fp32",
        check_for_nan_in_grad=False)  # checked on the global norm instead (train/step.py)
    model = NUTPDistributedDataParallel(
        config, ddp_cfg, module, plan=plan, groups=groups, pg_collection=pgs,
        num_experts=None if moe is None else moe.num_moe_experts)
    opt = build_optimizer(model, pgs, lr=lr, optimizer=optimizer,
                          weight_decay=weight_decay, clip_grad=opts.clip_grad,
                          precision=prec.precision, initial_loss_scale=prec.initial_loss_scale,
                          min_loss_scale=prec.min_loss_scale,
                          loss_scale_window=prec.loss_scale_window,
                          distributed=distributed_optimizer, redundancy=live_redundancy,
                          min_lr=None if schedule is None else schedule.min_lr)
    source = None if data_path is None else IndexedTokenSource(
        data_path, vocab_size=model_cfg.vocab_size, seq_length=model_cfg.seq_length)
    valid = None if valid_data_path is None else IndexedTokenSource(
        valid_data_path, vocab_size=model_cfg.vocab_size, seq_length=model_cfg.seq_length,
        key="train.valid_data_path")
    checks = GradChecks(opts) if (opts.check_for_nan_in_grad or opts.large_grad_factor) else None
    pipeline = (PipelineRunner(plan, groups, model, micro_batch_size=micro_batch_size)
                if plan.pp > 1 else None)
    return RankSession(plan=plan, groups=groups, model=model, optimizer=opt, model_cfg=model_cfg,
                       micro_batch_size=micro_batch_size, seed=seed, gpt=gpt,
                       mask=_mask(model_cfg, device), source=source, valid_source=valid,
                       opts=opts,
                       checks=checks, pipeline=pipeline, precision=prec.precision,
                       scheduler=None if schedule is None else schedule.scheduler(opt))
