"""``nutp-bridge`` on the shrunk Qwen3-MoE recipe (``bridge_moe_jobs``) at 4 layers over two
pipeline stages of per-stage degrees, against Bridge's own stock one-process run of the same
recipe (``bridge_moe_jobs.stock_worker``), each recording the load-balancing loss Bridge
logs (what megatron's tracker ``report`` hands Bridge's ``training_log``: its writers and
``total_loss_dict``) and every router's routing map."""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

LAYERS = ["model.num_layers=4"]
"""Both runs: 4 layers (2 a stage on the NUTP side)."""
NUTP_PP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
           "model.pipeline_model_parallel_size=2", "nutp.replicas=[[2,2],[2,1]]"]
"""NUTP's layout (7 ranks): replica 0 at TP2 on both stages, replica 1 at TP2 on stage 0 and
TP1 on stage 1 (its stage-1 rank faces both stage-0 ranks: it is in two of NUTP's pipeline
groups); the planner's shares are 4 and 2 of the 6 micro-batches (uneven weights)."""


def logged_aux() -> list[float]:
    """Every ``MoEMetricsTracker.report`` of this process appends the load-balancing loss it
    hands Bridge (the aggregated scalar), recorded by wrapping the class's ``_aggregate``."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    logged: list[float] = []
    real = MoEMetricsTracker._aggregate

    def aggregate(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        if "load_balancing_loss" in out:
            logged.append(float(out["load_balancing_loss"]))
        return out

    MoEMetricsTracker._aggregate = aggregate  # type: ignore[method-assign]
    return logged


def stock_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    """``bridge_moe_jobs.stock_worker`` at 4 layers, and the aux loss it logged
    (``stock_aux.json``)."""
    from .bridge_moe_jobs import stock_worker as stock

    logged = logged_aux()
    stock(rank, world, port, [*LAYERS, *overrides], outdir)
    Path(outdir, "stock_aux.json").write_text(json.dumps(logged))


def nutp_worker(rank: int, world: int, port: int, overrides: list[str],
                controls: list[str | None], outdir: str) -> None:
    """``nutp-bridge``'s run at ``NUTP_PP`` once per control; rank 0 writes
    ``nutp_pp_<control>.json``: per step the loss and grad norm (and whether every rank's grad
    norm is the same bits), the aux loss Bridge logged on every rank, the router flips against
    the stock run's routing maps, whether the replicas end bitwise equal. Controls (negative):
    ``aux_scale_unset_stage1``: stage 1 never sets megatron's aux-loss gradient scale;
    ``aux_megatron_sync``: the tracker reduced megatron's way (its stock ``_sync_metrics``)."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        hang = open(os.path.join(outdir, f"hang_rank{rank}.txt"), "w")
        faulthandler.dump_traceback_later(240.0, exit=True, file=hang)
        for control in controls:
            run(rank, world, overrides, control, outdir)
        faulthandler.cancel_dump_traceback_later()
        hang.close()

    gloo_rank(rank, world, port, outdir, body)


def run(rank: int, world: int, overrides: list[str], control: str | None, outdir: str) -> None:
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations import bridge_moe_metrics, bridge_run
    from nemo_nutp.layout import build_plan, chunk_layers
    from tests.helpers.moe_pipeline_jobs import gather_replicas
    from tests.helpers.moe_reference import reset_moe_globals

    from .bridge_moe_jobs import load, record_all_routing

    reset_moe_globals()
    job = load([*NUTP_PP, *LAYERS, *overrides])
    plan = build_plan(plan_request(job.nutp))
    stage = plan.rank_index[rank][1]
    tracker_class = bridge_moe_metrics.tracker_class()
    real_aggregate = MoEMetricsTracker._aggregate
    real_set = MoEAuxLossAutoScaler.set_loss_scale
    real_across = tracker_class.across_stages
    if control == "broken":
        if stage == 1:  # stage 1 never sets megatron's aux-loss gradient scale
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
            MoEAuxLossAutoScaler.set_loss_scale = staticmethod(  # type: ignore[method-assign]
                lambda scale: None)
        # the logged aux loss not summed over the replica's stages (each rank its own stage's)
        tracker_class.across_stages = lambda self, v: v  # type: ignore[method-assign]
    else:
        assert control is None, control
    logged = logged_aux()
    maps = record_all_routing()
    try:
        got = bridge_run.train_rank(job, plan, outdir, seed=job.nutp.train.seed)
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = real_set  # type: ignore[method-assign]
        tracker_class.across_stages = real_across  # type: ignore[method-assign]
        MoEMetricsTracker._aggregate = real_aggregate  # type: ignore[method-assign]
    groups = got["groups"]
    ctx = groups.ctx
    tp = groups.tp
    layers = job.nutp.model.num_layers
    first, last = chunk_layers(layers, plan.pp, 1)[ctx.stage][0]
    n_l = last - first
    ref = torch.load(Path(outdir, "stock_routing.pt"))
    steps = len(got["steps"])
    per_step = len(ref) // steps  # the stock run's router calls a step (M micro-batches x L)
    assert len(maps) == steps * ctx.microbatches * n_l, (len(maps), ctx.microbatches, n_l)
    flips = []
    for k in range(steps):
        n = 0
        for idx in range(ctx.microbatches * n_l):
            m = maps[k * ctx.microbatches * n_l + idx]
            parts = [torch.empty_like(m) for _ in range(tp.size())]
            dist.all_gather(parts, m.contiguous(), group=tp)
            mb, layer = divmod(idx, n_l)
            want = ref[k * per_step + (ctx.microbatch_offset + mb) * layers + first + layer]
            n += int((torch.cat(parts) != want).any(dim=1).sum())
        flips.append(n if ctx.tp_rank == 0 else 0)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (flips, [s["grad_norm"] for s in got["steps"]], logged))
    reps = gather_replicas(SimpleNamespace(groups=groups, model=got["model"], plan=plan,
                                           model_cfg=job.nutp.model))
    if rank != 0:
        return
    assert reps is not None
    out = {"steps": got["steps"],
           "norms_same_bits": all(e[1] == every[0][1] for e in every),
           "flips": [sum(e[0][k] for e in every) for k in range(steps)],
           "aux": [e[2] for e in every],
           "replicas_bitwise_equal": all(torch.equal(r[k], reps[0][k]) for r in reps[1:]
                                         for k in reps[0]),
           "tensors": len(reps[0]), "shares": [r.microbatches for r in plan.replicas]}
    Path(outdir, f"nutp_pp_{control}.json").write_text(json.dumps(out))
