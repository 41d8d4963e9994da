"""Parity harness: NUTP layouts vs an unsharded single-process reference (spawned workers).

Each spawned group runs several cases. For every case, every rank trains the NUTP layout; after
each step the ranks' shards are gathered, every replica is assembled into global tensors and
replicas are compared bitwise; rank 0 trains the single-process TP1 reference (megatron-core's
own DDP on a 1-rank group, all micro-batches of the global batch) on the same global batches and
compares losses and parameters. Results are written as JSON per case for the test to assert.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

TOL = 1e-5
TENSOR_TOL = 5e-5  # per tensor under Adam: see tests/runtime/test_parity.py


@dataclass(frozen=True)
class Case:
    name: str
    replicas: tuple[int, ...]
    model: dict[str, Any] = field(default_factory=dict)
    global_batch: int = 8  # micro-batches
    micro_batch_size: int = 2
    steps: int = 5
    sequence_parallel: bool = False
    sync_layout: str = "refine"
    bucket_size: int | None = None
    control: str | None = None  # negative controls: "flat_offsets" | "equal_weights"
    vs_megatron_ddp: bool = False  # uniform layouts: also train plain megatron DDP
    lr: float = 1e-3
    optimizer: str = "adam"


def make_plan(case: Case) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(case.replicas)
    req = PlanRequest(cluster=ClusterSpec(num_gpus=tb * len(case.replicas), domain_size=tb,
                                          gpus_per_node=tb),
                      model=ModelConfig(**case.model),
                      parallel=ParallelSpec(tp_base=tb, sequence_parallel=case.sequence_parallel,
                                            sync_layout=case.sync_layout),
                      replicas=case.replicas, global_batch=case.global_batch)
    return build_plan(req)


def _apply_control(session: Any, control: str | None) -> None:
    eng = session.model.nutp_engine
    if control == "flat_offsets":  # the public reference's pairing: by flat offset, not unit
        for e in eng.order:
            if e.pos is not None:
                e.pos = torch.arange(e.pos.numel()).view_as(e.pos)
    elif control == "equal_weights":  # "average of replica averages"
        n = len(session.plan.replicas)
        eng.ctx = dataclasses.replace(eng.ctx, weight=1.0 / n)
    else:
        assert control is None, control


def _reference(case: Case, single: Any, train: bool
               ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single process, TP1, megatron-core's own DDP on a 1-rank group; every micro-batch.

    megatron's optimizer set-up gathers param-group keys over the whole world, so every rank
    builds a reference (collectively); only the rank with ``train=True`` runs it.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_nutp.data import replica_microbatches
    from nemo_nutp.model import build_gpt_model, transformer_config
    from nemo_nutp.model.assemble import assemble, local_shards
    from nemo_nutp.train.session import causal_mask
    from nemo_nutp.train.step import build_optimizer, train_step

    plan = make_plan(dataclasses.replace(case, replicas=(1,)))
    pgs = ProcessGroupCollection()
    for f in ("tp", "pp", "cp", "tp_cp", "mp", "tp_ep_pp", "dp", "dp_cp", "intra_dp_cp",
              "expt_dp", "ep", "expt_tp", "tp_ep"):
        setattr(pgs, f, single)
    pgs.embd = pgs.pos_embd = None
    cfg = plan.request.model
    module = build_gpt_model(plan, 0, cfg, pgs, seed=1234)
    ddp = DistributedDataParallel(transformer_config(cfg, degree=1),
                                  DistributedDataParallelConfig(), module, pg_collection=pgs)
    opt = build_optimizer(ddp, pgs, lr=case.lr, optimizer=case.optimizer)
    losses: list[float] = []
    params: list[dict[str, torch.Tensor]] = []
    for step in range(case.steps if train else 0):
        batches = replica_microbatches(offset=0, count=case.global_batch, seed=1234, step=step,
                                       micro_batch_size=case.micro_batch_size,
                                       seq_length=cfg.seq_length, vocab_size=cfg.vocab_size)
        loss, _, _ = train_step(ddp, opt, batches, causal_mask(cfg.seq_length))
        losses.append(loss)
        params.append(assemble([local_shards(module)], cfg))
    return losses, params


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| (Frobenius)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst element, relative to the tensor's largest magnitude (reported, not asserted)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_case(case: Case, outdir: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.model.assemble import assemble, local_shards
    from nemo_nutp.train.session import build_session

    plan = make_plan(case)
    session = build_session(plan, plan.request.model, lr=case.lr, seed=1234,
                            optimizer=case.optimizer,
                            micro_batch_size=case.micro_batch_size, bucket_size=case.bucket_size)
    _apply_control(session, case.control)
    rank = dist.get_rank()
    losses, replica_equal, assembled = [], True, []
    for step in range(case.steps):
        losses.append(session.step(step).loss)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (session.groups.ctx.replica, local_shards(
            session.model.module)))
        if rank == 0:
            per_rep = [assemble([s for r, s in gathered if r == i], plan.request.model)
                       for i in range(len(plan.replicas))]
            for other in per_rep[1:]:
                replica_equal &= all(torch.equal(other[k], per_rep[0][k]) for k in per_rep[0])
            assembled.append(per_rep[0])
    megatron = _megatron_ddp(case, session) if case.vs_megatron_ddp else None
    ref_losses, ref_params = _reference(case, session.groups.single, train=rank == 0)
    if rank == 0:
        loss_rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        per_param = {k: _rel(assembled[-1][k], ref_params[-1][k]) for k in ref_params[-1]}
        param_rel = max(per_param.values())
        keys = sorted(ref_params[-1])
        model_rel = _rel(torch.cat([assembled[-1][k].reshape(-1) for k in keys]),
                         torch.cat([ref_params[-1][k].reshape(-1) for k in keys]))
        param_rel_max = max(_rel_max(assembled[-1][k], ref_params[-1][k])
                            for k in ref_params[-1])
        result = {"case": case.name, "losses": losses, "ref_losses": ref_losses,
                  "loss_rel": loss_rel, "param_rel": param_rel, "param_rel_max": param_rel_max,
                  "model_rel": model_rel,
                  "per_param": per_param,
                  "replicas_equal": replica_equal,
                  "shares": [r.microbatches for r in plan.replicas],
                  "global_tp_group_untouched": _no_global_groups()}
        if megatron is not None:
            result.update(megatron)
        with open(os.path.join(outdir, f"{case.name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def _no_global_groups() -> bool:
    from megatron.core import parallel_state as ps

    return ps._TENSOR_MODEL_PARALLEL_GROUP is None and ps._DATA_PARALLEL_GROUP is None


def _megatron_ddp(case: Case, nutp_session: Any) -> dict[str, Any] | None:
    """Uniform layouts: plain megatron-core DDP over the same-TP-position DP groups."""
    import copy

    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_nutp.model import build_gpt_model, transformer_config
    from nemo_nutp.model.assemble import local_shards
    from nemo_nutp.train.step import build_optimizer, reduce_replica_loss, train_step

    plan, groups = nutp_session.plan, nutp_session.groups
    ctx = groups.ctx
    position_group = None
    for key, g in groups.sync.items():  # uniform + refine: sync groups are the DP groups
        if key[1] == "qg":
            position_group = g
    pgs = copy.copy(groups.pgs)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = pgs.expt_dp = position_group
    cfg = plan.request.model
    module = build_gpt_model(plan, ctx.rank, cfg, pgs, seed=1234)
    ddp = DistributedDataParallel(transformer_config(cfg, degree=ctx.degree),
                                  DistributedDataParallelConfig(), module, pg_collection=pgs)
    opt = build_optimizer(ddp, pgs, lr=case.lr, optimizer=case.optimizer)
    losses = []
    for step in range(case.steps):
        loss, _, _ = train_step(ddp, opt, nutp_session.batches(step), nutp_session.mask)
        losses.append(reduce_replica_loss(loss, weight=ctx.weight, degree=ctx.degree,
                                          stage_group=groups.stage))
    mine, theirs = local_shards(nutp_session.model.module), local_shards(module)
    bitwise = all(torch.equal(mine[k][2], theirs[k][2]) for k in mine)
    maxdiff = max(float((mine[k][2] - theirs[k][2]).abs().max()) for k in mine)
    flags = torch.tensor([float(bitwise), maxdiff])
    dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
    dist.all_reduce(flags[:1], op=dist.ReduceOp.MIN)
    return {"megatron_losses": losses, "megatron_bitwise": bool(flags[0] == 1.0),
            "megatron_maxdiff": float(flags[1])}


def worker(rank: int, world: int, port: int, cases: list[Case], outdir: str) -> None:
    from tests._dist import gloo_rank

    def body() -> None:
        for case in cases:
            run_case(case, outdir)

    gloo_rank(rank, world, port, outdir, body)
