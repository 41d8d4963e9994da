"""One optimizer step of a NUTP rank.

The replica runs its plan share of micro-batches (``no_sync`` on all but the last, so megatron
accumulates into ``main_grad``), each loss scaled by ``1 / m_r`` (and by the fp16 loss scale);
the NUTP DDP then scales by the replica weight ``m_r / M`` and reduces across replicas, so every
rank ends with the gradient of the mean loss over all ``M`` micro-batches of the global batch.

The optimizer step is megatron's own ``prepare_grads`` / ``step_with_ready_grads`` (fp32 master
weights, fp16 unscaling and overflow skip), with the grad norm taken from the NUTP sync (counted
once per unit on the sync layout, the same bits on every replica) instead of megatron's per-TP-
group norm; clipping uses megatron's ``clip_grad_by_total_norm_fp32`` with that norm, so every
replica applies the same factor. Models without a NUTP engine (plain megatron DDP) keep
megatron's own norm.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer

from ..data import MicroBatch
from ..model.build import DTYPES


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean loss over the global batch
    replica_loss: float  # mean over this replica's micro-batches
    grad_norm: float  # NaN when an fp16 step was skipped (overflow)
    times: dict[str, float]  # this rank: compute_s, sync_s, optimizer_s
    skipped: bool = False  # fp16 overflow: the loss scaler skipped the update


@dataclass(frozen=True)
class StepOptions:
    """What one optimizer step does besides the update (all from ``train.*``)."""

    clip_grad: float = 0.0
    check_for_nan_in_grad: bool = True
    large_grad_factor: float = 0.0
    large_grad_window: int = 20
    slow_factor: float = 1.0  # injected straggler (common/faults.py kind slow): compute x f


def step_options(train: Any) -> StepOptions:
    """``StepOptions`` from a ``train`` config section."""
    return StepOptions(clip_grad=train.clip_grad, check_for_nan_in_grad=train.check_for_nan_in_grad,
                       large_grad_factor=train.large_grad_factor,
                       large_grad_window=train.large_grad_window)


class GradChecks:
    """megatron's gradient checks on the global grad norm: NaN/Inf and unexpectedly large.

    The norm is the same on every rank, so every rank raises together (no rank is left waiting
    in a collective)."""

    def __init__(self, opts: StepOptions) -> None:
        self.opts = opts
        self.history: deque[float] = deque(maxlen=max(1, opts.large_grad_window))

    def check(self, grad_norm: float, *, step: int | None, names: Callable[[], list[str]]
              ) -> None:
        where = "" if step is None else f" at step {step}"
        if self.opts.check_for_nan_in_grad and not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"grad norm is {grad_norm}{where}: non-finite gradient in {names()[:8]} "
                "(train.check_for_nan_in_grad=true)")
        f = self.opts.large_grad_factor
        if f > 0 and len(self.history) == self.history.maxlen and \
                grad_norm > f * max(self.history):
            raise FloatingPointError(
                f"grad norm {grad_norm:.4g}{where} is more than train.large_grad_factor={f} x "
                f"the largest of the previous {len(self.history)} steps ({max(self.history):.4g})")
        self.history.append(grad_norm)


def build_optimizer(model: Any, pgs: Any, *, lr: float, optimizer: str = "adam",
                    weight_decay: float = 0.0, clip_grad: float = 0.0,
                    adam_eps: float = 1e-8, precision: str = "fp32",
                    initial_loss_scale: float = 2.0 ** 32, min_loss_scale: float = 1.0,
                    loss_scale_window: int = 1000, distributed: bool = False,
                    redundancy: bool = False, min_lr: float | None = None) -> Any:
    """megatron-core (non-distributed) optimizer over this rank's explicit process groups:
    fp32 (``FP32Optimizer``) or, for bf16/fp16 models, megatron's mixed-precision optimizer with
    fp32 master weights (fp16: dynamic loss scaler). ``distributed``
    (``train.distributed_optimizer``): NUTP's ZeRO-1 over the sync owner groups
    (``sync/zero.py``), same update math and checkpoint form; ``redundancy``
    (``recovery.live_redundancy``): its slices kept twice, for live re-layouts.
    ``weight_decay`` is megatron's constant schedule: each parameter group decays by
    ``weight_decay x wd_mult`` (0 for biases and 1-D parameters), as ``OptimizerParamScheduler``
    sets it in Megatron-LM's and Bridge's loops; megatron's optimizer alone would decay every
    group by ``weight_decay``. ``min_lr``: the schedule's (megatron's groups carry ``max_lr``
    = ``lr`` and ``min_lr``, which its ``OptimizerParamScheduler`` reads per group)."""
    cfg = OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                          clip_grad=clip_grad, adam_eps=adam_eps,
                          params_dtype=DTYPES[precision], bf16=precision == "bf16",
                          fp16=precision == "fp16", initial_loss_scale=initial_loss_scale,
                          min_loss_scale=min_loss_scale, loss_scale_window=loss_scale_window,
                          use_distributed_optimizer=False)
    if distributed:
        from ..sync.zero import ZeroOptimizer

        return _decay_by_group(ZeroOptimizer(model, cfg, redundancy=redundancy), weight_decay)
    opt = _decay_by_group(get_megatron_optimizer(cfg, [model], use_gloo_process_groups=False,
                                                 pg_collection=pgs), weight_decay)
    for inner in getattr(opt, "chained_optimizers", [opt]):
        # Replicated params counted once per TP group (TP rank 0), never via globals.
        inner.tp_group = pgs.tp
    return opt


def _decay_by_group(opt: Any, weight_decay: float) -> Any:
    for group in opt.param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    return opt


def reduce_replica_loss(replica_loss: float, *, weight: float, degree: int,
                        stage_group: dist.ProcessGroup,
                        device: torch.device | None = None) -> float:
    """Global-batch mean loss: sum over replicas of weight x replica mean (``device``: where
    the group's collectives run, e.g. the rank's GPU under NCCL)."""
    t = torch.tensor([replica_loss * weight / degree], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=stage_group)
    return float(t.item())


def _inner(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def loss_scale(optimizer: Any) -> float:
    """The factor backward's loss is multiplied by (fp16: megatron's dynamic scale; else 1)."""
    return float(optimizer.get_loss_scale())


def optimizer_step(model: Any, optimizer: Any, opts: StepOptions, checks: GradChecks | None,
                   *, step: int | None = None, phase: Callable[[str], None] | None = None
                   ) -> tuple[bool, float]:
    """megatron's optimizer step with the NUTP grad norm: (updated, grad norm). ``phase``: told
    ``"optimizer"`` just before the update (after the vote).

    fp16 overflow: megatron's ``prepare_grads`` finds it (and lowers the scale); the update is
    skipped and the norm is NaN."""
    scale = loss_scale(optimizer)
    if optimizer.prepare_grads():  # main grads in place (unscaled); True = fp16 overflow
        return False, float("nan")
    engine = getattr(model, "nutp_engine", None)
    if engine is not None:
        grad_norm = math.sqrt(engine.grad_sumsq) / scale
        names: Callable[[], list[str]] = engine.nonfinite_params
    else:  # plain megatron DDP (references, uniform comparisons): megatron's own norm
        grad_norm = float(optimizer.get_grad_norm())
        names = list
    if checks is not None:
        checks.check(grad_norm, step=step, names=names)
    if opts.clip_grad > 0.0:
        for inner in _inner(optimizer):
            params = inner.get_parameters()
            if params:
                # Looked up at call time: compat.cpu replaces the module attribute, and this
                # module may be imported before the patches (train/worker.py's package import).
                clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=opts.clip_grad,
                                                        total_norm=grad_norm)
    if phase is not None:
        phase("optimizer")
    optimizer.step_with_ready_grads()
    return True, grad_norm


def set_moe_loss_scale(model: Any, value: float) -> None:
    """MoE models: the scale of the aux losses' gradient, the main loss's (megatron's
    ``schedules.forward_step`` sets it per micro-batch: loss scale / micro-batches). With the
    replica's weight applied by the sync, as for the main loss, each aux loss counts as in one
    process over the global batch. The same for the multi-token prediction loss
    (``MTPLossAutoScaler``, also set by megatron's schedule per micro-batch)."""
    config = getattr(model, "config", None)
    if getattr(config, "mtp_num_layers", None) is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(torch.tensor(value))
    if getattr(config, "num_moe_experts", None) is None:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(value))


def clock(device: torch.device | None) -> float:
    """``perf_counter`` once the device has finished its queued work: CUDA kernels run
    asynchronously, so without the sync a phase's GPU time (the optimizer's, the sync's) lands
    in whichever later phase first waits for the device (the next step's compute), and goodput
    and rebalancing read wrong times. One sync per phase boundary, three per step."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_step(model: Any, optimizer: Any, batches: list[MicroBatch], mask: torch.Tensor | None,
               *, opts: StepOptions | None = None, checks: GradChecks | None = None,
               step: int | None = None, after_sync: Callable[[], None] | None = None,
               before_update: Callable[[float], None] | None = None,
               phase: Callable[[str], None] | None = None
               ) -> tuple[float, float, dict[str, float], bool]:
    """Forward/backward this replica's micro-batches, sync, update.

    Returns (replica mean loss, grad norm, seconds in compute / exposed sync / optimizer,
    whether the update was skipped). ``after_sync`` runs between the gradient sync and the
    optimizer (tests read the synchronised gradients there); then ``before_update`` with the
    replica mean loss (the live path's commit vote, ``health/commit.py``). ``phase`` is told
    where the step is (``"sync"``: the buckets are posted, not finished; ``"optimizer"``).
    """
    opts = opts or StepOptions()
    device = next(model.parameters()).device
    t0 = clock(device)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    n = len(batches)
    scale = loss_scale(optimizer)
    total = torch.zeros((), dtype=torch.float64, device=device)  # one host sync, at the end
    for i, mb in enumerate(batches):
        ctx = model.no_sync() if i < n - 1 else contextlib.nullcontext()
        t_mb = time.perf_counter()
        set_moe_loss_scale(model, scale / n)
        with ctx:
            loss = model(mb.tokens.to(device), mb.position_ids.to(device),
                         None if mask is None else mask.to(device),
                         labels=mb.labels.to(device)).float().mean()
            scaled = loss / n
            (scaled * scale if scale != 1.0 else scaled).backward()
        total += loss.detach()
        if opts.slow_factor > 1.0:  # real wall time, proportional to this rank's work
            time.sleep((opts.slow_factor - 1.0) * (clock(device) - t_mb))
    t1 = clock(device)
    if phase is not None:
        phase("sync")
    model.finish_grad_sync()
    if getattr(getattr(model, "config", None), "moe_router_enable_expert_bias", False):
        from ..model.moe import update_expert_bias  # megatron-core 0.19 (MoE)

        update_expert_bias(model)  # as megatron's finalize_model_grads: after the grad sync
    if after_sync is not None:
        after_sync()
    if before_update is not None:
        before_update(float(total) / n)
    t2 = clock(device)
    ok, grad_norm = optimizer_step(model, optimizer, opts, checks, step=step, phase=phase)
    t3 = clock(device)
    times = {"compute_s": t1 - t0, "sync_s": t2 - t1, "optimizer_s": t3 - t2}
    return float(total) / n, grad_norm, times, not ok
