"""One optimizer step of a NUTP rank.

The replica runs its plan share of micro-batches (``no_sync`` on all but the last, so megatron
accumulates into ``main_grad``), each loss scaled by ``1 / m_r``; the NUTP DDP then scales by the
replica weight ``m_r / M`` and reduces across replicas, so every rank ends with the gradient of
the mean loss over all ``M`` micro-batches of the global batch. The step's reported loss is the
same global mean.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from ..data import MicroBatch


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean loss over the global batch
    replica_loss: float  # mean over this replica's micro-batches
    grad_norm: float
    times: dict[str, float]  # this rank: compute_s, sync_s, optimizer_s


def build_optimizer(model: Any, pgs: Any, *, lr: float, optimizer: str = "adam",
                    weight_decay: float = 0.0, clip_grad: float = 0.0,
                    adam_eps: float = 1e-8) -> Any:
    """megatron-core (non-distributed) optimizer over this rank's explicit process groups."""
    cfg = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                          clip_grad=clip_grad, adam_eps=adam_eps, params_dtype=torch.float32,
                          use_distributed_optimizer=False)
    opt = get_megatron_optimizer(cfg, [model], use_gloo_process_groups=False, pg_collection=pgs)
    for inner in getattr(opt, "chained_optimizers", [opt]):
        # Grad norm: count replicated params once per replica (TP rank 0), never via globals.
        inner.tp_group = pgs.tp
    return opt


def reduce_replica_loss(replica_loss: float, *, weight: float, degree: int,
                        stage_group: dist.ProcessGroup,
                        device: torch.device | None = None) -> float:
    """Global-batch mean loss: sum over replicas of weight x replica mean (``device``: where
    the group's collectives run, e.g. the rank's GPU under NCCL)."""
    t = torch.tensor([replica_loss * weight / degree], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=stage_group)
    return float(t.item())


def train_step(model: Any, optimizer: Any, batches: list[MicroBatch], mask: torch.Tensor | None
               ) -> tuple[float, float, dict[str, float]]:
    """Forward/backward this replica's micro-batches, sync, update.

    Returns (replica mean loss, grad norm, seconds spent in compute / exposed sync / optimizer).
    """
    t0 = time.perf_counter()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    n = len(batches)
    total = 0.0
    device = next(model.parameters()).device
    for i, mb in enumerate(batches):
        ctx = model.no_sync() if i < n - 1 else contextlib.nullcontext()
        with ctx:
            loss = model(mb.tokens.to(device), mb.position_ids.to(device),
                         None if mask is None else mask.to(device),
                         labels=mb.labels.to(device)).float().mean()
            (loss / n).backward()
        total += float(loss.detach())
    t1 = time.perf_counter()
    model.finish_grad_sync()
    t2 = time.perf_counter()
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (non-finite gradients)")
    t3 = time.perf_counter()
    if grad_norm is None or grad_norm == 0.0:  # clipping off: megatron did not compute it
        grad_norm = optimizer.get_grad_norm()  # grads of this step are still in place
    times = {"compute_s": t1 - t0, "sync_s": t2 - t1, "optimizer_s": t3 - t2}
    return total / n, float(grad_norm if grad_norm is not None else 0.0), times
