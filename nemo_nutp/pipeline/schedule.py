"""Forward/backward of one replica's micro-batches through megatron's pipeline schedule.

``pipeline_step`` runs megatron-core's own 1F1B schedule (``get_forward_backward_func``; with
virtual pipeline stages its interleaved schedule over the rank's model chunks) with
this rank's explicit groups and the NUTP stage-boundary communicator; megatron's DDP
accumulates into ``main_grad`` with ``no_sync`` until the last micro-batch's backward, whose
hooks drive the NUTP cross-replica sync as with ``pp == 1``. Then the sync is finished, tied
embeddings are combined and the whole-model grad norm and the loss are shared
(``PipelineFinalizer``), and megatron's optimizer step runs as in ``train/step.py``.
Each replica runs its own share of micro-batches; the loss of each is divided by that share
(megatron's schedule) and the NUTP DDP scales by the replica weight, as without stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from ..data import MicroBatch
from ..layout import Plan
from ..parallel.groups import NUTPGroups
from .finalize import PipelineFinalizer
from .p2p import NUTPP2PCommunicator


class PipelineRunner:
    """What a pipelined rank needs every step (built once per session)."""

    def __init__(self, plan: Plan, groups: NUTPGroups, model: Any, *,
                 micro_batch_size: int) -> None:
        self.plan, self.groups, self.model = plan, groups, model
        # virtual pipeline stages: megatron's interleaved schedule over the rank's chunks
        # (the DDP wraps them as one ``ModelChunks``; its ``no_sync`` covers them all) reads
        # its config from the first chunk
        self.chunks: list[Any] = list(model.module.chunks) if plan.vp > 1 else [model]
        if plan.vp > 1 and len(self.chunks) != plan.vp:
            raise ValueError(f"{len(self.chunks)} model chunks, the plan has "
                             f"parallel.virtual_pipeline_model_parallel_size={plan.vp}")
        self.config = get_model_config(self.chunks[0]) if plan.vp > 1 else model.config
        if plan.vp > 1 and (self.config.overlap_p2p_comm
                            or self.config.overlap_p2p_comm_warmup_flush):
            # (only the interleaved schedule reads it)
            raise ValueError("overlap_p2p_comm=True: not with NUTP's virtual pipeline stages "
                             "(every stage-boundary exchange completes inside its call; no "
                             "handles to wait on)")
        self.config.no_sync_func = model.no_sync
        self.config.grad_sync_func = None
        self.config.finalize_model_grads_func = None  # NUTP finishes the sync itself
        self.comm = NUTPP2PCommunicator(groups.pgs.pp, self.config, plan=plan,
                                        rank=groups.ctx.rank, comm=groups.comm)
        self.finalizer = PipelineFinalizer(plan, groups, model)
        # Pipeline communicators before step 0 (the sync's are warmed at DDP build)
        self.comm.warm_up()
        self.finalizer.warm_up()
        self.micro_batch_size = micro_batch_size
        self.last = groups.ctx.stage == plan.pp - 1
        self.schedule = get_forward_backward_func(pp_size=plan.pp,
                                                  vp_size=plan.vp if plan.vp > 1 else None)

    def forward_backward(self, batches: list[MicroBatch], mask: torch.Tensor | None,
                         scale: float, *, forward_only: bool = False) -> float:
        """Run the schedule (``forward_only``: megatron's forward-only pass, no gradients);
        this replica's mean loss on the last stage (NaN elsewhere)."""
        device = next(self.model.parameters()).device
        mask_d = None if mask is None else mask.to(device)
        output_chunk = self.chunks[-1] if self.last else None  # computes the loss
        self.config.grad_scale_func = None if scale == 1.0 else (lambda t: t * scale)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}  # megatron divides loss in place

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            mb = next(data_iterator)
            out = model(mb.tokens.to(device), mb.position_ids.to(device), mask_d,
                        labels=mb.labels.to(device) if model is output_chunk else None)
            return out, loss_func

        one = len(self.chunks) == 1  # else every chunk reads every micro-batch in turn
        stats = self.schedule(
            forward_step_func=forward_step,
            data_iterator=iter(batches) if one else [iter(batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=len(batches), seq_length=self.plan.request.model.seq_length,
            micro_batch_size=self.micro_batch_size, forward_only=forward_only,
            p2p_communicator=self.comm, pg_collection=self.groups.pgs)
        if not self.last:
            return float("nan")
        return float(torch.stack([s["loss"].float() for s in stats]).mean())

    def evaluate(self, batches: list[MicroBatch], mask: torch.Tensor | None) -> float:
        """Forward only (validation): this replica's mean loss, on every rank of the replica
        (the last stage's TP rank 0 shares it over the replica group)."""
        loss = self.forward_backward(batches, mask, 1.0, forward_only=True)
        device = next(self.model.parameters()).device
        box = torch.zeros(1, dtype=torch.float64, device=device)
        if self.last and self.groups.ctx.tp_rank == 0:
            box[0] = loss
        dist.all_reduce(box, group=self.groups.replica)
        return float(box[0])

    def step(self, optimizer: Any, batches: list[MicroBatch], mask: torch.Tensor | None, *,
             scale: float, after_sync: Callable[[], None] | None = None,
             phase: Callable[[str], None] | None = None) -> tuple[float, float, float]:
        """Forward/backward + finished sync: (replica loss, compute s, sync s). ``phase``:
        told ``"sync"`` before the sync is finished (the buckets are posted)."""
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = self.forward_backward(batches, mask, scale)
        t1 = time.perf_counter()
        if phase is not None:
            phase("sync")
        self.model.finish_grad_sync()
        loss = self.finalizer.finish(loss)
        if after_sync is not None:
            after_sync()
        return loss, t1 - t0, time.perf_counter() - t1
