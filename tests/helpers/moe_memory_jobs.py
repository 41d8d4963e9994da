"""NUTP's MoE model built at a layout, its parameters counted per rank (no training): the
measured side of the planner's memory model (``layout.memory.rank_param_counts`` with
``PlanRequest.moe``), checked by ``tests/model/test_moe_memory_measured.py``."""

from __future__ import annotations

import os
from typing import Any

import torch

from .moe_jobs import moe_dims
from .moe_reference import MoECase, dims


def count_worker(rank: int, world: int, port: int, case: MoECase, replicas: tuple[int, ...],
                 outdir: str) -> None:
    """Every rank builds its part of ``case``'s NUTP MoE model on the layout ``replicas``
    (sequence parallel, one stage) and reports (degree, TP rank, parameter elements, local
    experts); rank 0 saves them all to ``outdir/moe_counts.pt``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        from nemo_nutp.config import ModelConfig
        from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
        from nemo_nutp.model.moe import build_moe_gpt_model
        from nemo_nutp.parallel.groups import build_groups

        from .moe_reference import reset_moe_globals

        reset_moe_globals()
        tb = max(replicas)
        plan = build_plan(PlanRequest(
            cluster=ClusterSpec(num_gpus=tb * len(replicas), domain_size=tb, gpus_per_node=tb),
            model=ModelConfig(**case.model),
            parallel=ParallelSpec(tp_base=tb, sequence_parallel=True), replicas=replicas,
            global_batch=case.global_batch))
        groups = build_groups(plan)
        if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
            parallel_state._set_global_memory_buffer()
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed, tp_rank=groups.ctx.tp_rank,
                                                        ep_rank=0, etp_rank=0)
        model = build_moe_gpt_model(plan, dist.get_rank(), dims(case), moe_dims(case), groups,
                                    seed=case.seed)
        degree = plan.replicas[plan.rank_index[dist.get_rank()][0]].tp[0]
        params = list(model.parameters())
        experts = {p.nutp_expert for p in params if getattr(p, "nutp_expert", None) is not None}
        mine = {"degree": degree, "tp_rank": groups.ctx.tp_rank,
                "params": sum(p.numel() for p in params), "experts": len(experts),
                "expert_params": sum(p.numel() for p in params
                                     if getattr(p, "nutp_expert", None) is not None)}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            torch.save(every, os.path.join(outdir, "moe_counts.pt"))

    gloo_rank(rank, world, port, outdir, body)
