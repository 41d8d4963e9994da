"""NUTP MoE over pipeline stages with per-stage degrees, checked against the stock one-process
reference (``moe_reference.py``; the case's ``model`` with 4 layers: 2 per stage).

One world runs the layout (``build_session(moe=...)`` with ``parallel.pp=2``: megatron's 1F1B
schedule, the NUTP stage boundary, ``ExpertSync`` per stage, ``pipeline.finalize``'s norm with
the stages' experts) and records what the reference records:

* per step the global loss and every rank's grad norm (all the same bits);
* the load-balancing loss: megatron's tracker on every rank holds its own stage's layers and
  its own tokens (sequence parallel): ``tracker sum / micro-batches * replica weight`` summed
  over the world is the one-process value (the layers of the stages are disjoint, the TP ranks'
  tokens are disjoint, the replicas' weights sum to 1);
* router flips: every rank's routing maps of its stage's layers, gathered over the stage's TP
  group, against the reference's maps of the same micro-batch and global layer;
* step 0's synchronised gradients and the final parameters of every replica, assembled per
  stage (experts by global index).

Negative controls: ``control='aux_scale_unset_stage1'``: stage 1 never sets megatron's
aux-loss gradient scale (its routers' aux gradient counts 1 instead of 1 / micro-batches);
``aux_stage0`` (recorded in every run): the aux loss reported from stage 0's tracker alone
(not reduced across the stages).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .moe_reference import MoECase, dims, record_routing


def make_plan(case: MoECase, replicas: tuple[tuple[int, ...], ...]) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    pp = len(replicas[0])
    tb = max(max(r) for r in replicas)
    return build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=tb * pp * len(replicas), domain_size=tb, gpus_per_node=tb),
        model=ModelConfig(**case.model),
        parallel=ParallelSpec(tp_base=tb, sequence_parallel=True, pp=pp), replicas=replicas,
        global_batch=case.global_batch))


def _shards(model: Any, *, grads: bool) -> dict[str, tuple[Any, Any, torch.Tensor]]:
    """global name -> (kind, units, tensor) of this rank (experts under their global index)."""
    out = {}
    for _, p in model.named_parameters():
        t = (p.main_grad if grads else p).detach().float().clone()
        out[p.nutp_name] = (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None), t)
    return out


def gather_replicas(s: Any, *, grads: bool = False) -> list[dict[str, torch.Tensor]] | None:
    """Every replica's global tensors, assembled stage by stage (rank 0; None elsewhere)."""
    import torch.distributed as dist

    from nemo_nutp.model.assemble import assemble

    every: list[Any] = [None] * dist.get_world_size()
    ctx = s.groups.ctx
    dist.all_gather_object(every, (ctx.replica, ctx.stage, ctx.tp_rank,
                                   _shards(s.model, grads=grads)))
    if dist.get_rank() != 0:
        return None
    out = []
    for i in range(len(s.plan.replicas)):
        merged: dict[str, torch.Tensor] = {}
        for stage in range(s.plan.pp):
            mine = [sh for r, st, _, sh in sorted(
                (e for e in every if e[:2] == (i, stage)), key=lambda e: e[2])]
            merged.update(assemble([{k: v for k, v in sh.items() if ".experts." not in k}
                                    for sh in mine], s.model_cfg))
            for sh in mine:
                merged.update({k: v[2] for k, v in sh.items() if ".experts." in k})
        out.append(merged)
    return out


def _apply_control(s: Any, control: str | None) -> None:
    if control == "aux_scale_unset_stage1" and s.groups.ctx.stage == 1:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(  # type: ignore[method-assign]
            lambda scale: None)
    else:
        assert control in (None, "aux_scale_unset_stage1"), control


def pipeline_run(case: MoECase, replicas: tuple[tuple[int, ...], ...], control: str | None,
                 ref: dict[str, Any]) -> dict[str, Any] | None:
    """``case`` on the layout (sequence parallel, clipping): see the module doc (rank 0
    returns the record)."""
    import torch.distributed as dist

    from nemo_nutp.layout import chunk_layers
    from nemo_nutp.model.moe import MoEDims
    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import StepOptions

    from .moe_reference import aux_loss_of_step, reset_moe_globals

    reset_moe_globals()
    plan = make_plan(case, replicas)
    moe = MoEDims(**{k: v for k, v in case.moe.fields().items() if k != "moe_grouped_gemm"})
    s = build_session(plan, dims(case), lr=case.lr, seed=case.seed,
                      micro_batch_size=case.micro_batch_size,
                      opts=StepOptions(clip_grad=case.clip_grad), moe=moe)
    _apply_control(s, control)
    ctx = s.groups.ctx
    L = case.model["num_layers"]
    first, last = chunk_layers(L, plan.pp, 1)[ctx.stage][0]
    maps = record_routing(s.gpt)
    rec: dict[str, Any] = {"losses": [], "grad_norms": [], "aux_losses": [], "aux_stage0": [],
                           "flips": [],
                           "norms_equal": True, "shares": [r.microbatches for r in
                                                           plan.replicas]}
    grads: list[Any] = []
    for k in range(case.steps):
        maps.clear()
        res = s.step(k, after_sync=(lambda: grads.append(gather_replicas(s, grads=True)))
                     if k == 0 else None)
        norms: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(norms, res.grad_norm)
        rec["norms_equal"] &= len({repr(x) for x in norms}) == 1
        mine = aux_loss_of_step(ctx.microbatches) * ctx.weight
        aux = torch.tensor([mine, mine if ctx.stage == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(aux)  # layers over stages, tokens over TP ranks, replicas by weight
        rec["aux_losses"].append(float(aux[0]))
        rec["aux_stage0"].append(float(aux[1]))
        # routing: per micro-batch of the replica, per layer of the stage
        n_l = last - first
        assert len(maps) == ctx.microbatches * n_l, (len(maps), ctx.microbatches, n_l)
        flips = 0
        tp = s.groups.tp
        for idx, m in enumerate(maps):
            parts = [torch.empty_like(m) for _ in range(tp.size())]
            dist.all_gather(parts, m.contiguous(), group=tp)
            mb, layer = divmod(idx, n_l)
            want = ref["routing"][k][(ctx.microbatch_offset + mb) * L + first + layer]
            flips += int((torch.cat(parts) != want).any(dim=1).sum())
        t = torch.tensor([flips if ctx.tp_rank == 0 else 0])
        dist.all_reduce(t)
        rec["flips"].append(int(t))
        rec["losses"].append(res.loss)
        rec["grad_norms"].append(res.grad_norm)
    params = gather_replicas(s)
    if dist.get_rank() != 0:
        return None
    rec["grads"], rec["params"] = grads[0], params
    return rec


def pipeline_worker(rank: int, world: int, port: int, case: MoECase,
                    replicas: tuple[tuple[int, ...], ...], controls: list[str | None],
                    ref_path: str, outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import faulthandler

        # a hung collective leaves every rank's stack here (the test's timeout is longer)
        hang = open(os.path.join(outdir, f"hang_rank{rank}.txt"), "w")
        faulthandler.dump_traceback_later(300.0, exit=True, file=hang)
        ref = torch.load(ref_path, weights_only=False)
        for control in controls:
            rec = pipeline_run(case, replicas, control, ref)
            if rec is not None:
                torch.save(rec, os.path.join(outdir, f"moe_pp_{control}.pt"))
        faulthandler.cancel_dump_traceback_later()
        hang.close()

    gloo_rank(rank, world, port, outdir, body)
