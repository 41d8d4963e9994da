"""NUTP MoE worlds (``nemo_nutp/model/moe.py``) checked against the stock reference
(``moe_reference.py``), one replica at a time: each replica of a layout is a world of its own
degree (the cross-replica sync of expert weights is not built yet), trains the *whole* global
batch of step 0 as the one process does, and records what the reference records for it:

* the loss (the replica's mean micro-batch loss, each micro-batch's loss reduced over its
  vocab shards by NUTP's GPT model),
* the load-balancing loss (megatron's tracker on every rank, summed over the TP group: each
  rank counts its own tokens),
* every token's routing map (each rank's sequence shard, gathered over the TP group into
  megatron's ``[s, b]`` row order),
* the gradients: each rank's local experts by global name; the router, the norms and other
  replicated parameters summed over the TP group (sequence parallel: each rank holds its
  tokens' part).

``control='aux_per_rank'`` (negative control): every TP rank counts the aux loss of the replica's
tokens ``t`` times over (its coefficient times the degree), as a layer that counted each token
once per TP rank would.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .moe_reference import MoECase, causal_mask, dims, record_routing, step_batches


def moe_dims(case: MoECase, control: str | None = None) -> Any:
    from nemo_nutp.model.moe import MoEDims

    fields = {k: v for k, v in case.moe.fields().items() if k != "moe_grouped_gemm"}
    return MoEDims(**fields)


def _plan(case: MoECase, degree: int) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    return build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=degree, domain_size=degree, gpus_per_node=degree),
        model=ModelConfig(**case.model),
        parallel=ParallelSpec(tp_base=degree, sequence_parallel=True),
        replicas=(degree,), global_batch=case.global_batch))


def replica_step(case: MoECase, degree: int, control: str | None) -> dict[str, Any]:
    """Step 0 of ``case`` on one replica of ``degree`` (collective over the world)."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from nemo_nutp.model.moe import build_moe_gpt_model
    from nemo_nutp.parallel.groups import build_groups

    from .moe_reference import aux_loss_of_step, reset_moe_globals

    reset_moe_globals()
    plan = _plan(case, degree)
    groups = build_groups(plan)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(case.seed, tp_rank=groups.ctx.tp_rank,
                                                    ep_rank=0, etp_rank=0)
    moe = moe_dims(case)
    if control == "aux_per_rank":
        moe = dataclasses.replace(moe, moe_aux_loss_coeff=moe.moe_aux_loss_coeff * degree)
    model = build_moe_gpt_model(plan, dist.get_rank(), dims(case), moe, groups,
                                seed=case.seed)
    maps = record_routing(model)
    mask = causal_mask(dims(case).seq_length)
    batches = step_batches(case, 0)
    n = len(batches)
    total = 0.0
    for mb in batches:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
        loss = model(mb.tokens, mb.position_ids, mask, labels=mb.labels).float().mean()
        (loss / n).backward()
        total += float(loss.detach())
    tp = groups.tp
    aux = torch.tensor([aux_loss_of_step(n)], dtype=torch.float64)
    dist.all_reduce(aux, group=tp)
    grads: dict[str, torch.Tensor] = {}
    for _name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        name = p.nutp_name
        if getattr(p, "nutp_expert", None) is not None:
            grads[name] = g
        elif p.nutp_kind is None:  # replicated: partial sums under sequence parallel
            dist.all_reduce(g, group=tp)
            grads[name] = g
    routing = []
    for m in maps:
        parts = [torch.empty_like(m) for _ in range(tp.size())]
        dist.all_gather(parts, m.contiguous(), group=tp)
        routing.append(torch.cat(parts))
    every: list[Any] = [None] * tp.size()
    dist.all_gather_object(every, {k: v for k, v in grads.items() if ".experts." in k},
                           group=tp)
    for part in every:
        grads.update(part)
    return {"loss": total / n, "aux": float(aux), "grads": grads, "routing": routing}


def replica_worker(rank: int, world: int, port: int, case: MoECase,
                   controls: list[str | None], outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import torch.distributed as dist

        for control in controls:
            res = replica_step(case, world, control)
            if dist.get_rank() == 0:
                torch.save(res, os.path.join(outdir, f"moe_tp{world}_{control}.pt"))

    gloo_rank(rank, world, port, outdir, body)


def compare(ref: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """Relative errors of step 0 (loss, aux loss, per-gradient max) and router flips."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    grads = ref["grads"]
    errs = {k: rel(v, grads[k]) for k, v in res["grads"].items()}
    flips = 0
    for a, b in zip(res["routing"], ref["routing"][0], strict=True):
        flips += int((a != b).any(dim=1).sum())
    return {"loss": abs(res["loss"] - ref["losses"][0]) / abs(ref["losses"][0]),
            "aux": abs(res["aux"] - ref["aux_losses"][0]) / abs(ref["aux_losses"][0]),
            "grads": errs, "flips": flips,
            "missing": sorted(k for k in grads if (".experts." in k or ".router." in k)
                              and k not in res["grads"])}
