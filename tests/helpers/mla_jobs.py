"""NUTP MLA + MoE replicas (``nemo_nutp/model/mla.py``) checked against the stock reference
(``moe_reference.py`` with ``MoECase.mla``), one replica a world: each replica of degree ``t``
trains step 0's whole global batch as the one process does and records the loss, megatron's
load-balancing loss (summed over the TP group), every token's routing map and *every*
gradient under its global name, assembled over the TP group:

* sharded by head: the up-projections (rows, the ``mla_q_weight`` / ``mla_kv_up_weight``
  kinds) and ``linear_proj`` (columns, the ``proj_weight`` kind), concatenated in rank order;
* the word embedding / output layer (vocab rows), the dense kinds, concatenated likewise;
* experts: each by its global index, from its holder;
* replicated (down-projections, latent norms, layer norms, router): summed over the TP group
  (sequence parallel: each rank holds its own tokens' part), as the gradient sync sums them.

Negative controls (``control``): ``down_once`` leaves the down-projections' gradients unsummed
(rank 0's own tokens only); ``down_twice`` sums them twice (the TP sum, then times the degree).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .moe_reference import MoECase, dims, record_routing

CONTROLS = (None, "down_once", "down_twice")


def mla_dims(case: MoECase) -> Any:
    from nemo_nutp.model.mla import MLADims

    return None if case.mla is None else MLADims(**{
        k: v for k, v in case.mla.fields().items() if k != "multi_latent_attention"})


def _plan(case: MoECase, degree: int) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    return build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=degree, domain_size=degree, gpus_per_node=degree),
        model=ModelConfig(**case.model),
        parallel=ParallelSpec(tp_base=degree, sequence_parallel=True),
        replicas=(degree,), global_batch=case.global_batch))


def _cat(g: torch.Tensor, tp: Any, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts: list[Any] = [None] * tp.size()  # uneven shards: gloo's all_gather needs equal sizes
    dist.all_gather_object(parts, g.contiguous(), group=tp)
    return torch.cat(parts, dim=dim)


def mla_replica_step(case: MoECase, degree: int, control: str | None) -> dict[str, Any]:
    """Step 0 of ``case`` on one replica of ``degree`` (collective over the world)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nemo_nutp.layout import PARAM_KINDS
    from nemo_nutp.model.moe import build_moe_gpt_model
    from nemo_nutp.parallel.groups import build_groups

    from .moe_jobs import gather_routing, moe_dims, step0_backward
    from .moe_reference import reset_moe_globals

    reset_moe_globals()
    plan = _plan(case, degree)
    groups = build_groups(plan)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(case.seed, tp_rank=groups.ctx.tp_rank,
                                                    ep_rank=0, etp_rank=0)
    model = build_moe_gpt_model(plan, dist.get_rank(), dims(case), moe_dims(case), groups,
                                seed=case.seed, mla=mla_dims(case))
    maps = record_routing(model)
    tp = groups.tp
    total, aux = step0_backward(model, case, tp)
    grads: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for _name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        name = p.nutp_name
        if getattr(p, "nutp_expert", None) is not None:
            experts[name] = g
        elif p.nutp_kind is not None:
            grads[name] = _cat(g, tp, PARAM_KINDS[p.nutp_kind].axis)
        else:  # replicated: partial sums under sequence parallel
            down = "_down_proj." in name
            if not (down and control == "down_once"):
                dist.all_reduce(g, group=tp)
            if down and control == "down_twice":
                g *= degree
            grads[name] = g
    every: list[Any] = [None] * tp.size()
    dist.all_gather_object(every, experts, group=tp)
    for part in every:
        grads.update(part)
    return {"loss": total, "aux": aux, "grads": grads, "routing": gather_routing(maps, tp)}


def mla_replica_worker(rank: int, world: int, port: int,
                       runs: list[tuple[MoECase, str | None]], outdir: str) -> None:
    """Each (case, control) of ``runs`` in this one world, saved as
    ``mla_tp<world>_<case>_<control>.pt``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import torch.distributed as dist

        for case, control in runs:
            res = mla_replica_step(case, world, control)
            if dist.get_rank() == 0:
                torch.save(res, os.path.join(outdir, f"mla_tp{world}_{case.name}_{control}.pt"))

    gloo_rank(rank, world, port, outdir, body)


def mla_errors(ref: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """Relative errors of step 0: loss, aux loss, every gradient (by name), router flips,
    and the reference's gradients the replica did not record."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    want = ref["grads"]
    errs = {k: rel(v, want[k]) for k, v in res["grads"].items()}
    flips = sum(int((a != b).any(dim=1).sum())
                for a, b in zip(res["routing"], ref["routing"][0], strict=True))
    worst = max(errs, key=lambda k: errs[k])
    return {"loss": abs(res["loss"] - ref["losses"][0]) / abs(ref["losses"][0]),
            "aux": abs(res["aux"] - ref["aux_losses"][0]) / abs(ref["aux_losses"][0]),
            "grads": errs, "worst": (errs[worst], worst), "flips": flips,
            "missing": sorted(set(want) - set(res["grads"]))}


def _unsummed_down_projections() -> None:
    """Negative control: the down-projections' weights not marked partial, so the gradient
    sync does not sum them over the TP group (each rank keeps its own tokens' part)."""
    import nemo_nutp.model.mla as mla

    stock = mla._replicated_linear

    def patched(*args: Any, **kwargs: Any) -> Any:
        lin = stock(*args, **kwargs)
        lin.weight.sequence_parallel = False
        return lin

    mla._replicated_linear = patched  # type: ignore[assignment]


def mla_layout_worker(rank: int, world: int, port: int, case: MoECase,
                      replicas: tuple[int, ...], controls: list[str | None], ref_path: str,
                      outdir: str) -> None:
    """``moe_jobs.layout_run`` of an MLA case per control (None, or ``down_unsummed``: last,
    it patches this process), each record saved as ``moe_<layout>_<control>.pt``."""
    from tests.helpers.dist import gloo_rank

    from .moe_jobs import layout_run

    def body() -> None:
        ref = torch.load(ref_path, weights_only=False)
        for control in controls:
            if control == "down_unsummed":
                _unsummed_down_projections()
            rec = layout_run(case, replicas, None, ref)
            if rec is not None:
                name = "_".join(map(str, replicas))
                torch.save(rec, os.path.join(outdir, f"moe_{name}_{control}.pt"))

    gloo_rank(rank, world, port, outdir, body)
