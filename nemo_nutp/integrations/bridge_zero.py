"""Bridge's distributed optimizer under NUTP: NUTP's ZeRO-1 (``sync/zero.py``) behind the
megatron-optimizer interface Bridge's ``train()`` calls.

A recipe with ``optimizer.use_distributed_optimizer=true`` (and so
``ddp.use_distributed_optimizer=true``, which Bridge keeps in step) gets, in ``bridge_run``'s
place of Bridge's ``setup_optimizer``: the NUTP DDP as usual (megatron's distributed-optimizer
buffers never reach it: ``ddp.use_distributed_optimizer`` is mapped onto this optimizer), this
``BridgeZeroOptimizer`` built from Bridge's ``OptimizerConfig`` (lr, min_lr, betas, eps, weight
decay, clip_grad; megatron's parameter groups with Bridge's default overrides, which are
``get_standard_config_overrides`` as ``ZeroOptimizer`` applies them), and Bridge's own scheduler
(``optim._get_scheduler``) bound to it: ``OptimizerParamScheduler`` writes lr and weight decay
into ``param_groups``, which are the inner optimizer's groups of the flat ZeRO masters.

``step()`` is megatron's ``FP32Optimizer.step`` contract, ``(success, grad_norm, num_zeros)``:
``prepare_grads`` (each rank receives its slice of every reduced bucket), the exact single-process
grad norm of the NUTP sync, clipping of the slices with megatron's
``clip_grad_by_total_norm_fp32`` by that norm (every rank the same factor), the update and the
parameter all-gather (``step_with_ready_grads``). ``num_zeros`` is None
(``optimizer.log_num_zeros_in_grad`` shows nothing under the distributed optimizer).

``ddp.overlap_param_gather`` (Bridge's recipes' default with the distributed optimizer) is
honoured: ``step()`` updates the slices, launches the parameter all-gathers (the first staging
window of buckets) and returns; NUTP's forward pre-hooks on every module with parameters
complete them at the first forward that follows (``ZeroOptimizer.settle``: the rest of the
buckets, then the return path to the TP holders), and so do a checkpoint save or load and the
end of ``train()``. The gathers overlap what Bridge does between two steps (logging, callbacks,
the next batch); megatron's hooks go further, bucket by bucket through the forward, which
NUTP's one return exchange per step does not allow. ``bridge_run`` turns the field off on the
config so that Bridge's loop does not toggle megatron's forward pre-hooks (the NUTP hooks are
always on). Under ``recovery.mode=live`` the gather completes within ``step()`` (substituted,
with a notice): the vote's boundary needs the parameters settled before the next step. With
MoE the experts' slices are gathered within ``step()`` (a notice says so); the dense buckets
still overlap.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from ..sync.zero import ZeroOptimizer


def wants_zero(cfg: Any) -> bool:
    """Whether a Bridge ``ConfigContainer`` asks for the distributed optimizer (either field:
    Bridge's ``validate()`` turns both on when one is)."""
    return bool(cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer)


class BridgeZeroOptimizer(ZeroOptimizer):
    """NUTP's ZeRO-1 with the methods Bridge's ``train_step`` calls on a megatron optimizer."""

    is_stub_optimizer = False

    def __init__(self, model: Any, config: Any, *, redundancy: bool = False,
                 overlap_param_gather: bool = False) -> None:
        super().__init__(model, config, redundancy=redundancy,
                         overlap_param_gather=overlap_param_gather)
        self.clip_grad = float(config.clip_grad or 0.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # fp32 / bf16: no loss scale (fp16 is refused)

    def prepare_model_params_for_param_sync(self) -> None:
        return None  # gathered in step() or by NUTP's forward pre-hooks (module docstring)

    def grad_norm(self) -> float:
        """The exact single-process grad norm of this step (after ``prepare_grads``)."""
        return math.sqrt(self.engine.grad_sumsq)

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """prepare -> clip by the exact norm -> update + gather; collective."""
        self.prepare_grads()
        norm = self.grad_norm()
        if self.clip_grad > 0.0:
            params = self.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=self.clip_grad, total_norm=norm)
        self.step_with_ready_grads()
        return True, norm, None


def overlap_param_gather(cfg: Any, recovery: Any) -> bool:
    """``ddp.overlap_param_gather`` as NUTP's ZeRO runs it: honoured, except under
    ``recovery.mode=live`` (module docstring), where a notice says so."""
    if not cfg.ddp.overlap_param_gather:
        return False
    if recovery.enabled and recovery.mode == "live":
        from torch import distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print("nutp-bridge: ddp.overlap_param_gather=true: the parameters are gathered "
                  "within the optimizer step under recovery.mode=live (the vote's step "
                  "boundary needs them settled)", flush=True)
        return False
    if getattr(cfg.model, "num_moe_experts", None):
        from torch import distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print("nutp-bridge: ddp.overlap_param_gather=true: with MoE the expert parameters "
                  "are gathered within the optimizer step (the dense ones overlap the next "
                  "forward)", flush=True)
    return True


def setup_zero_optimizer(cfg: Any, model: list[Any], *, redundancy: bool = False,
                         overlap: bool = False) -> tuple[BridgeZeroOptimizer, Any]:
    """(NUTP's ZeRO-1 over the NUTP DDP ``model[0]``, Bridge's scheduler bound to it), what
    Bridge's ``setup_optimizer`` returns for a megatron optimizer. Only one model chunk
    (virtual stages: the one NUTP DDP over all chunks). ``redundancy``:
    ``recovery.live_redundancy`` (a copy of each slice on the next replica, for live
    re-layouts); ``overlap``: ``ddp.overlap_param_gather`` (``overlap_param_gather``)."""
    from megatron.bridge.training.optim import _get_scheduler

    if len(model) != 1:
        raise ValueError("optimizer.use_distributed_optimizer=True: one model chunk only "
                         "under NUTP (the one NUTP DDP over every chunk)")
    optimizer = BridgeZeroOptimizer(model[0], cfg.optimizer, redundancy=redundancy,
                                    overlap_param_gather=overlap)
    return optimizer, _get_scheduler(cfg.optimizer, cfg.scheduler, optimizer)
