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

Multi-token prediction (``case.mtp_num_layers``, ``layout_run`` only): the MTP loss per step as
megatron's tracker holds it (every TP rank the replica's whole loss) and two negative controls:
``'mtp_per_rank'`` (the MTP loss counted once per TP rank: its scaling factor times the degree)
and ``'mtp_replica_count'`` (the MTP loss's gradient normalised by the replica's micro-batch
count instead of the global one: its scale divided by the replica's weight ``m_r/M``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .moe_reference import MoECase, causal_mask, dims, record_routing, step_batches


def moe_dims(case: MoECase, control: str | None = None) -> Any:
    from nemo_nutp.model.moe import MoEDims

    fields = {k: v for k, v in case.moe.fields().items() if k != "moe_grouped_gemm"}
    return MoEDims(**fields, **case.mtp_fields())


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

    from nemo_nutp.model.moe import build_moe_gpt_model
    from nemo_nutp.parallel.groups import build_groups

    from .moe_reference import reset_moe_globals

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
    tp = groups.tp
    total, aux = step0_backward(model, case, tp)
    grads: dict[str, torch.Tensor] = {}
    for _name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        name = p.nutp_name
        if getattr(p, "nutp_expert", None) is not None:
            grads[name] = g
        elif p.nutp_kind is None:  # replicated: partial sums under sequence parallel
            dist.all_reduce(g, group=tp)
            grads[name] = g
    every: list[Any] = [None] * tp.size()
    dist.all_gather_object(every, {k: v for k, v in grads.items() if ".experts." in k},
                           group=tp)
    for part in every:
        grads.update(part)
    return {"loss": total, "aux": aux, "grads": grads, "routing": gather_routing(maps, tp)}


def step0_backward(model: Any, case: MoECase, tp: Any) -> tuple[float, float]:
    """Step 0's whole global batch through one replica's ``model`` as the one process does it
    (each micro-batch's loss / n, megatron's aux-loss scale 1/n): the mean loss and
    megatron's load-balancing loss summed over the TP group."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from .moe_reference import aux_loss_of_step

    mask = causal_mask(dims(case).seq_length)
    batches = step_batches(case, 0)
    n = len(batches)
    total = 0.0
    for mb in batches:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
        loss = model(mb.tokens, mb.position_ids, mask, labels=mb.labels).float().mean()
        (loss / n).backward()
        total += float(loss.detach())
    aux = torch.tensor([aux_loss_of_step(n)], dtype=torch.float64)
    dist.all_reduce(aux, group=tp)
    return total / n, float(aux)


def gather_routing(maps: list[torch.Tensor], tp: Any) -> list[torch.Tensor]:
    """Every token's routing map of the replica: each rank's sequence shard, in rank order."""
    import torch.distributed as dist

    routing = []
    for m in maps:
        parts = [torch.empty_like(m) for _ in range(tp.size())]
        dist.all_gather(parts, m.contiguous(), group=tp)
        routing.append(torch.cat(parts))
    return routing


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


# ---------------------------------------------------------------- layouts of several replicas

def _shards(model: Any, *, grads: bool, values: dict[int, torch.Tensor] | None = None
            ) -> dict[str, tuple[Any, Any, torch.Tensor]]:
    """name -> (kind, units, tensor) of this rank; experts under their global names
    (``values``: per ``id(param)`` instead of the parameters / their ``main_grad``)."""
    out = {}
    for name, p in model.named_parameters():
        t = (values[id(p)] if values is not None else p.main_grad if grads else p
             ).detach().float().clone()
        key = p.nutp_name if getattr(p, "nutp_expert", None) is not None else (
            name.removeprefix("module."))
        out[key] = (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None), t)
    return out


def gather_replicas(s: Any, *, grads: bool = False, values: dict[int, torch.Tensor] | None = None
                    ) -> list[dict[str, torch.Tensor]] | None:
    """Every replica's global tensors (rank 0 returns them; None elsewhere)."""
    import torch.distributed as dist

    from nemo_nutp.model.assemble import assemble

    every: list[Any] = [None] * dist.get_world_size()
    ctx = s.groups.ctx
    dist.all_gather_object(every, (ctx.replica, ctx.tp_rank, _shards(s.model, grads=grads,
                                                                  values=values)))
    if dist.get_rank() != 0:
        return None
    out = []
    for i in range(len(s.plan.replicas)):
        mine = [sh for r, _, sh in sorted((e for e in every if e[0] == i), key=lambda e: e[1])]
        dense = [{k: v for k, v in sh.items() if ".experts." not in k} for sh in mine]
        merged = assemble(dense, s.model_cfg)
        for sh in mine:
            merged.update({k: v[2] for k, v in sh.items() if ".experts." in k})
        out.append(merged)
    return out


def _routing(s: Any, maps: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch.distributed as dist

    tp = s.groups.tp
    full = []
    for m in maps:
        parts = [torch.empty_like(m) for _ in range(tp.size())]
        dist.all_gather(parts, m.contiguous(), group=tp)
        full.append(torch.cat(parts))
    return full


def layout_run(case: MoECase, replicas: tuple[int, ...], control: str | None,
               ref: dict[str, Any], *, zero: bool = False,
               tweak: Any = None) -> dict[str, Any] | None:
    """``case`` on an NUTP layout (sequence parallel, clipping): per step the global loss, the
    grad norm (every rank's, which must be the same bits), the global aux loss and the router
    flips against ``ref``; step 0's synchronised gradients and the final parameters of every
    replica (rank 0 returns the record). ``zero``: NUTP's distributed optimizer (the step-0
    gradients assembled from the optimizer's slices: ``ZeroOptimizer.full_grads``);
    ``tweak(session)`` runs once after the session is built (negative controls)."""
    import dataclasses

    import torch.distributed as dist

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import StepOptions, reduce_replica_loss

    from .moe_reference import aux_loss_of_step, mtp_loss_of_step, reset_moe_globals

    reset_moe_globals()
    tb = max(replicas)
    plan = build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=tb * len(replicas), domain_size=tb, gpus_per_node=tb),
        model=ModelConfig(**case.model),
        parallel=ParallelSpec(tp_base=tb, sequence_parallel=True), replicas=replicas,
        global_batch=case.global_batch))
    moe = moe_dims(case)
    degree = plan.replicas[plan.rank_index[dist.get_rank()][0]].tp[0]
    if control == "aux_per_rank":
        moe = dataclasses.replace(moe, moe_aux_loss_coeff=moe.moe_aux_loss_coeff * degree)
    if control == "mtp_per_rank":
        moe = dataclasses.replace(moe, mtp_loss_scaling_factor=moe.mtp_loss_scaling_factor
                                  * degree)
    from .mla_jobs import mla_dims

    s = build_session(plan, dims(case), lr=case.lr, seed=case.seed,
                      micro_batch_size=case.micro_batch_size,
                      opts=StepOptions(clip_grad=case.clip_grad), moe=moe,
                      distributed_optimizer=zero, mla=mla_dims(case))
    if tweak is not None:
        tweak(s)
    ctx = s.groups.ctx
    if control == "shared_not_summed":  # a replicated shared expert's per-rank gradient
        for e in s.model.nutp_engine.order:  # taken as a full copy, not its tokens' part
            if ".shared_experts." in e.name:
                e.partial = False
    if control == "bias_per_replica":  # the expert-bias counts of this replica only
        for m in s.gpt.modules():
            if getattr(m, "expert_bias", None) is not None:
                m.nutp_count_group = s.groups.tp
    maps = record_routing(s.gpt)
    rec: dict[str, Any] = {"losses": [], "grad_norms": [], "aux_losses": [], "flips": [],
                           "norms_equal": True, "mtp_losses": [], "expert_bias": [],
                           "bias_equal": True}
    grads: list[Any] = []
    from megatron.core.transformer.moe.router import TopKRouter

    L = sum(isinstance(m, TopKRouter) for m in s.gpt.modules())  # MoE layers (MTP's included)
    if control == "mtp_replica_count":
        _mtp_scale_per_replica(ctx.weight)
    if control == "aux_replica_count":
        _aux_scale_per_replica(ctx.weight)
    for k in range(case.steps):
        maps.clear()
        res = s.step(k, after_sync=(lambda: grads.append(gather_replicas(
            s, grads=True, values=s.optimizer.full_grads() if zero else None)))
            if k == 0 else None)
        norms: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(norms, res.grad_norm)
        rec["norms_equal"] &= len(set(norms)) == 1
        aux = reduce_replica_loss(aux_loss_of_step(ctx.microbatches) * 1.0, weight=ctx.weight,
                                  degree=1, stage_group=s.groups.stage)
        rec["aux_losses"].append(aux)  # each TP rank its own tokens' part: summed, not /t
        rec["mtp_losses"].append([  # every TP rank the replica's whole loss: / t
            reduce_replica_loss(v, weight=ctx.weight, degree=s.groups.tp.size(),
                                stage_group=s.groups.stage)
            for v in mtp_loss_of_step(ctx.microbatches)])
        full = _routing(s, maps)
        want = ref["routing"][k][ctx.microbatch_offset * L:(ctx.microbatch_offset
                                                            + ctx.microbatches) * L]
        flips = sum(int((a != b).any(dim=1).sum()) for a, b in zip(full, want, strict=True))
        t = torch.tensor([flips if ctx.tp_rank == 0 else 0])
        dist.all_reduce(t, group=s.groups.stage)
        rec["flips"].append(int(t))
        rec["losses"].append(res.loss)
        rec["grad_norms"].append(res.grad_norm)
        if moe.moe_router_enable_expert_bias:  # every rank's biases after the step
            from .moe_reference import expert_biases

            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, expert_biases(s.gpt))
            rec["bias_equal"] &= all(e.keys() == every[0].keys() and all(
                torch.equal(e[k], every[0][k]) for k in e) for e in every)
            rec["expert_bias"].append(every)
    params = gather_replicas(s)
    _mtp_scale_per_replica(None)
    _aux_scale_per_replica(None)
    if dist.get_rank() != 0:
        return None
    rec["grads"], rec["params"] = grads[0], params
    return rec


def _mtp_scale_per_replica(weight: float | None) -> None:
    """Negative control ``mtp_replica_count``: every MTP loss scale set is divided by the
    replica's weight ``m_r/M`` (``None``: megatron's own ``set_loss_scale`` back)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    stock = MTPLossAutoScaler.__dict__.get("_stock_set_loss_scale",
                                           MTPLossAutoScaler.__dict__["set_loss_scale"])
    MTPLossAutoScaler._stock_set_loss_scale = stock  # type: ignore[attr-defined]
    if weight is None:
        MTPLossAutoScaler.set_loss_scale = stock  # type: ignore[method-assign]
        return
    MTPLossAutoScaler.set_loss_scale = staticmethod(  # type: ignore[method-assign]
        lambda scale: stock.__func__(scale / weight))


def _aux_scale_per_replica(weight: float | None) -> None:
    """Negative control ``aux_replica_count``: every aux-loss scale set (megatron's
    ``MoEAuxLossAutoScaler``) is divided by the replica's weight ``m_r/M``, i.e. the aux loss
    scaled by the replica's micro-batch count instead of the global one (``None``: megatron's
    own ``set_loss_scale`` back)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    stock = MoEAuxLossAutoScaler.__dict__.get("_stock_set_loss_scale",
                                              MoEAuxLossAutoScaler.__dict__["set_loss_scale"])
    MoEAuxLossAutoScaler._stock_set_loss_scale = stock  # type: ignore[attr-defined]
    if weight is None:
        MoEAuxLossAutoScaler.set_loss_scale = stock  # type: ignore[method-assign]
        return
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(  # type: ignore[method-assign]
        lambda scale: stock.__func__(scale / weight))


def layout_worker(rank: int, world: int, port: int, case: MoECase, replicas: tuple[int, ...],
                  controls: list[str | None], ref_path: str, outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import faulthandler

        # a hung collective leaves every rank's stack here (the test's timeout is longer)
        hang = open(os.path.join(outdir, f"hang_rank{rank}.txt"), "w")
        faulthandler.dump_traceback_later(240.0, exit=True, file=hang)
        ref = torch.load(ref_path, weights_only=False)
        for control in controls:
            rec = layout_run(case, replicas, control, ref)
            if rec is not None:
                name = "_".join(map(str, replicas))
                torch.save(rec, os.path.join(outdir, f"moe_{name}_{control}.pt"))
        faulthandler.cancel_dump_traceback_later()
        hang.close()

    gloo_rank(rank, world, port, outdir, body)


def layout_errors(ref: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """Per step relative errors of loss, grad norm, aux loss; step 0's worst gradient (and
    where), the final parameters' worst; whether replicas are bitwise equal."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
        errs = {k: rel(got[k], want[k]) for k in want}
        k = max(errs, key=lambda n: errs[n])
        return errs[k], k

    reps = rec["params"]
    equal = all(torch.equal(r[k], reps[0][k]) for r in reps[1:] for k in reps[0])
    gequal = all(torch.equal(r[k], rec["grads"][0][k]) for r in rec["grads"][1:]
                 for k in rec["grads"][0]
                 if ".experts." in k or ".router." in k or "norm" in k)
    mtp_ref = ref.get("mtp_losses", [])  # per step, one per MTP layer ([] without MTP)
    return {
        "loss": [abs(a - b) / abs(b) for a, b in zip(rec["losses"], ref["losses"], strict=True)],
        "grad_norm": [abs(a - b) / abs(b) for a, b in zip(rec["grad_norms"],
                                                         ref["grad_norms"], strict=True)],
        "aux": [abs(a - b) / abs(b) for a, b in zip(rec["aux_losses"], ref["aux_losses"],
                                                   strict=True)],
        "mtp": [abs(a - b) / abs(b) for x, y in zip(rec.get("mtp_losses", [[] for _ in mtp_ref]),
                                                    mtp_ref, strict=True)
                for a, b in zip(x, y, strict=True)],
        "grads": worst(rec["grads"][0], ref["grads"]),
        "params": worst(reps[0], ref["params"]),
        "replicas_equal": equal, "replica_grads_equal": gequal,
        "norms_equal": rec["norms_equal"], "flips": rec["flips"]}
