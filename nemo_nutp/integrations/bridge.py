"""Megatron-Bridge (the NeMo framework's LLM recipes) with NUTP: the three plug-in points.

This module never imports Bridge at import time. ``nutp-bridge`` (``bridge_cli``/``bridge_run``)
uses them to run a recipe through Bridge's own ``train()``; on CPU Bridge imports through the
scoped shim of ``nemo_nutp.compat.bridge_cpu`` (tested in ``tests/integrations``, Python 3.12).
The three plug-in points, in the order a Bridge user applies them (docs/bridge.md):

1. **Model** — ``nutp_provider(provider, plan, groups)``: a copy of a Bridge
   ``GPTModelProvider`` (e.g. a recipe's ``ConfigContainer.model``) whose ``provide()`` returns
   this rank's ``NUTPGPTModel``: megatron's GPT with the NUTP layer spec (TE spec when TE is
   present), uneven vocab shards and the global, layout-independent init. Bridge's own
   ``provide()`` builds a stock ``GPTModel``, whose equal-chunk vocab split cannot hold NUTP's
   uneven shards; everything else Bridge does around it (``provide_distributed_model``: device,
   ``Float16Module``, hooks) is unchanged.
2. **DDP** — call ``provider.provide_distributed_model(ddp_config, wrap_with_ddp=False,
   pg_collection=groups.pgs)`` and wrap the chunks with ``nutp_ddp(chunks, ddp_config, plan,
   groups)`` (Bridge has no DDP registry; its ``_ddp_wrap`` is megatron's DDP).
3. **Optimizer** — ``exact_grad_norm(optimizer, ddp)`` on megatron's optimizer (Bridge's
   ``setup_optimizer`` / ``get_megatron_optimizer`` with ``pg_collection=groups.pgs``): its
   ``get_grad_norm``/``clip_grad_norm`` use the NUTP norm, so megatron's own ``step()`` (what
   Bridge's ``train_step`` calls) clips with the single-process value on every replica.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from ..layout import Plan
from ..parallel.groups import NUTPGroups


def nutp_provider(provider: Any, plan: Plan, groups: NUTPGroups, *, seed: int = 1234,
                  moe: Any = None, mla: Any = None) -> Any:
    """A copy of a Bridge ``GPTModelProvider`` whose ``provide()`` builds this rank's NUTP GPT.

    The model shape is read from the provider (``num_layers``, ``hidden_size``, ...) and must
    match ``plan.request.model`` (checked). ``moe`` (``model.moe.MoEDims``, from
    ``bridge_run.moe_of``): every layer's MLP is NUTP's MoE layer (experts as units inside each
    replica, ``model/moe.py``; fp32, one stage). ``mla`` (``model.mla.MLADims``, from
    ``bridge_run.mla_of``, with ``moe``): multi-latent attention over each rank's heads."""
    from ..model import build_gpt_model

    dims = plan.request.model
    for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        if getattr(provider, field) != getattr(dims, field):
            raise ValueError(f"model.{field}={getattr(dims, field)}: the Bridge provider has "
                             f"{field}={getattr(provider, field)}")
    precision = "bf16" if provider.bf16 else "fp16" if provider.fp16 else "fp32"
    base = type(provider)

    class NUTPProvider(base):  # type: ignore[misc, valid-type]
        def provide(self, pre_process: Any = None, post_process: Any = None,
                    vp_stage: Any = None) -> Any:
            if moe is not None:
                from ..model.moe import build_moe_gpt_model

                return build_moe_gpt_model(plan, groups.ctx.rank, dims, moe, groups, seed=seed,
                                           mla=mla)
            # virtual pipeline stages: chunk ``vp_stage`` (Bridge's get_model asks for each)
            return build_gpt_model(plan, groups.ctx.rank, dims, groups.pgs, seed=seed,
                                   precision=precision,
                                   vp_stage=vp_stage if plan.vp > 1 else None)

    out = copy.copy(provider)
    out.__class__ = NUTPProvider
    return out


def nutp_ddp(chunks: list[Any], ddp_config: Any, plan: Plan, groups: NUTPGroups, *,
             moe: Any = None) -> list[Any]:
    """Wrap model chunks (from ``provide_distributed_model(wrap_with_ddp=False)``) in the NUTP
    DDP; ``ddp_config.overlap_grad_reduce`` must be on. Virtual pipeline stages: one DDP over
    all of them (``model.ModelChunks``: one grad buffer and sync engine, every chunk's
    parameters sync at the stage's degree), as ``nutp-train`` has them; Bridge's list of chunks
    is then ``bridge_pipeline.chunk_views`` of it. ``moe``: the experts' cross-replica sync
    (``sync/experts.py``) over megatron's MoE groups of the replica (``moe_groups``)."""
    from ..model import ModelChunks
    from ..sync import NUTPDistributedDataParallel

    if len(chunks) > 1:
        module = ModelChunks(chunks)
        return [NUTPDistributedDataParallel(chunks[0].config, ddp_config, module, plan=plan,
                                            groups=groups)]
    if moe is not None:
        return [NUTPDistributedDataParallel(chunk.config, ddp_config, chunk, plan=plan,
                                            groups=groups, num_experts=moe.num_moe_experts,
                                            pg_collection=moe_groups(groups))
                for chunk in chunks]
    return [NUTPDistributedDataParallel(chunk.config, ddp_config, chunk, plan=plan,
                                        groups=groups) for chunk in chunks]


def moe_groups(groups: NUTPGroups) -> Any:
    """The rank's process-group collection with megatron's MoE groups of its replica
    (``model.moe.moe_pg_collection``: expert parallelism = the replica's TP group, expert
    TP 1), what the MoE model, its DDP and optimizer read."""
    from ..model.moe import moe_pg_collection

    return moe_pg_collection(groups.pgs, single=groups.single, stage=groups.stage)


def exact_grad_norm(optimizer: Any, ddp: Any) -> Any:
    """Make megatron's optimizer use the NUTP grad norm (counted once per unit on the sync
    layout, the same bits on every replica) in ``get_grad_norm`` and ``clip_grad_norm``, so its
    own ``step()`` clips exactly as a single process would. Returns the optimizer."""
    engine = ddp.nutp_engine
    # The norm was summed on the loss-scaled gradients; fp16's scaler may grow the scale inside
    # prepare_grads, so the scale of *this* step's backward is captured before it.
    scale = [float(optimizer.get_loss_scale())]
    prepare = optimizer.prepare_grads

    def prepare_grads() -> bool:
        scale[0] = float(optimizer.get_loss_scale())
        return bool(prepare())

    def grad_norm() -> float:
        return math.sqrt(engine.grad_sumsq) / scale[0]

    def clip(opt: Any) -> Any:
        def clip_grad_norm(clip_grad: float) -> float:
            norm = grad_norm()
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=norm)
            return norm
        return clip_grad_norm

    optimizer.prepare_grads = prepare_grads
    for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        opt.get_grad_norm = grad_norm
        opt.clip_grad_norm = clip(opt)
    return optimizer
