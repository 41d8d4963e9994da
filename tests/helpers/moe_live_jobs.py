"""Live re-layout of a MoE job, in-process: a rank holding experts dies, the survivors move
every expert (and its Adam state) in memory and continue (``relayout.plan_move(experts=...)``,
``relayout.move.move_state``), checked against the stock one-process run (``moe_reference``).

One spawned world of 5 gloo processes: layout [3, 2] (8 experts: 2/3/3 and 4/4), sequence
parallel, clipping on every step, fp32; trains ``BEFORE`` steps. Then old rank 1 (a TP3 rank,
experts 2-4) "dies": the default group is destroyed, rank 1 returns, the 4 survivors start a
new world in the same processes (new rank = ``survivor_rank_map``) with the layout [2, 2]
(the degraded replica's survivors now hold 4/4 experts: each takes the experts it lacks whole
from the healthy replica), build the new session, ``move_state`` the old session into it and
train the remaining steps of the case. Per step: the global loss, the grad norm (every rank's
bits equal), the load-balancing loss and the router flips against the reference; at the end
every replica's parameters (bitwise equal to each other) against the reference's.

Negative control (``control=True``): a second new session moved with the expert pieces that
cross the wire dropped (its new experts keep their fresh init and zero Adam state) trains the
same steps; its final parameters must leave the bounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from .moe_reference import MoECase, dims

OLD, NEW = (3, 2), (2, 2)
DEAD_GPU = 1  # old rank 1: replica 0, TP rank 1 of 3 (experts 2, 3, 4)
BEFORE = 2  # steps on the old layout (the case's other steps on the new one)


def plans(case: MoECase) -> tuple[Any, Any]:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, HealthReport, ParallelSpec, PlanRequest, build_plan

    req = PlanRequest(cluster=ClusterSpec(num_gpus=6, domain_size=3, gpus_per_node=3),
                      model=ModelConfig(**case.model),
                      parallel=ParallelSpec(tp_base=3, sequence_parallel=True), replicas=OLD,
                      global_batch=case.global_batch)
    return build_plan(req), build_plan(dataclasses.replace(
        req, replicas=NEW, health=HealthReport(failed_gpus=(DEAD_GPU,))))


def _session(plan: Any, case: MoECase) -> Any:
    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import StepOptions

    from .moe_jobs import moe_dims

    return build_session(plan, dims(case), lr=case.lr, seed=case.seed,
                         micro_batch_size=case.micro_batch_size,
                         opts=StepOptions(clip_grad=case.clip_grad), moe=moe_dims(case))


def _steps(s: Any, case: MoECase, ref: dict[str, Any], ks: range) -> dict[str, list[Any]]:
    """Train steps ``ks``; per step loss, grad norm, aux loss, flips, norms equal."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_nutp.train.step import reduce_replica_loss

    from .moe_jobs import _routing
    from .moe_reference import aux_loss_of_step, record_routing, reset_moe_globals

    reset_moe_globals()
    maps = record_routing(s.gpt)
    L = sum(isinstance(m, TopKRouter) for m in s.gpt.modules())
    ctx = s.groups.ctx
    rec: dict[str, list[Any]] = {"losses": [], "grad_norms": [], "aux": [], "flips": [],
                                 "norms_equal": []}
    for k in ks:
        maps.clear()
        res = s.step(k)
        norms: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(norms, res.grad_norm)
        rec["norms_equal"].append(len(set(norms)) == 1)
        rec["aux"].append(reduce_replica_loss(aux_loss_of_step(ctx.microbatches) * 1.0,
                                              weight=ctx.weight, degree=1,
                                              stage_group=s.groups.stage))
        full = _routing(s, maps)
        want = ref["routing"][k][ctx.microbatch_offset * L:(ctx.microbatch_offset
                                                            + ctx.microbatches) * L]
        flips = sum(int((a != b).any(dim=1).sum()) for a, b in zip(full, want, strict=True))
        t = torch.tensor([flips if ctx.tp_rank == 0 else 0])
        dist.all_reduce(t, group=s.groups.stage)
        rec["flips"].append(int(t))
        rec["losses"].append(res.loss)
        rec["grad_norms"].append(res.grad_norm)
    return rec


def _body(rank: int, port2: int, case: MoECase, control: bool, ref_path: str,
          outdir: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.live.link import move as link_move
    from nemo_nutp.relayout import plan_move, survivor_rank_map
    from nemo_nutp.relayout.move import MoveImpossible, move_state
    from nemo_nutp.relayout.plan import EXPERT, move_experts

    from .moe_jobs import gather_replicas, moe_dims
    from .moe_reference import reset_moe_globals
    from .relayout import _fields, _mismatches, unmatched

    ref = torch.load(ref_path, weights_only=False)
    old, new = plans(case)
    reset_moe_globals()
    s_old = _session(old, case)
    before = _steps(s_old, case, ref, range(BEFORE))
    rmap = survivor_rank_map(old, new)
    dist.destroy_process_group()
    if rank not in rmap:  # the dead rank: takes no further part
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rmap[rank],
                            world_size=new.world_size)
    from nemo_nutp.checkpoint import integrity

    integrity._CONTROL = None  # it cached the old world's group (the live path resets it too)
    experts = move_experts(dims(case), moe_dims(case))
    move = plan_move(old, new, rmap, experts=experts)
    assert move.possible, move.reason
    reset_moe_globals()
    a = _session(new, case)
    try:  # a plan without the experts is refused before any collective
        move_state(plan_move(old, new, rmap), old=s_old, new=a, group=dist.group.WORLD)
        refused = ""
    except MoveImpossible as e:
        refused = str(e)
    rep = move_state(move, old=s_old, new=a, group=dist.group.WORLD, bucket_bytes=16 << 10)
    # the live path's move (live/link.move: the plan with the model's experts) gives the same
    # bits; the new session as built differs from them (its experts' fresh init)
    moved = {k: v.clone() if torch.is_tensor(v) else v for k, v in _fields(a).items()}
    reset_moe_globals()
    b = _session(new, case)
    fresh = _mismatches(_fields(b), moved)
    link_stats = link_move(s_old, b, old_plan=old, rank_map=rmap)
    live_bad = _mismatches(_fields(b), moved)
    del b
    after = _steps(a, case, ref, range(BEFORE, case.steps))
    params = gather_replicas(a)
    bad_loss = None
    if control:  # the experts that cross the wire left out: fresh init on their new holders
        cut = dataclasses.replace(move, pieces=tuple(
            p for p in move.pieces if p.space != EXPERT or move.is_local(p)))
        reset_moe_globals()
        c = _session(new, case)
        move_state(cut, old=s_old, new=c, group=dist.group.WORLD, bucket_bytes=16 << 10)
        got = _steps(c, case, ref, range(BEFORE, case.steps))
        cparams = gather_replicas(c)
        if cparams is not None:  # rank 0: the final parameters' worst error, the first loss
            bad_loss = (got["losses"][0], max(
                float((cparams[0][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                for k, v in ref["params"].items()))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"report": rep.as_dict(), "posted": rep.posted,
                                   "old_rank": rank, "live_bad": live_bad[:8],
                                   "fresh_differs": [k for k in fresh if ".experts." in k][:4],
                                   "link": link_stats})
    if dist.get_rank() == 0:
        assert params is not None
        equal = all(torch.equal(p[k], params[0][k]) for p in params[1:] for k in params[0])
        torch.save(params[0], os.path.join(outdir, "params.pt"))
        expert_in = {n: sum(p.elems for p in move.pieces if p.dst == n and p.space == EXPERT
                            and not move.is_local(p)) * move.bytes_per_elem
                     for n in range(new.world_size)}
        res = {"before": before, "after": after, "replicas_equal": equal,
               "ranks": [{k: v for k, v in e.items() if k != "posted"} for e in every],
               "unmatched": unmatched([e["posted"] for e in every]),
               "plan_received": move.received_bytes, "plan_lower_bound": move.lower_bound_bytes,
               "expert_received": expert_in, "rank_map": rmap, "control": bad_loss,
               "refused": refused}
        with open(os.path.join(outdir, "moe_live.json"), "w") as f:
            json.dump(res, f, default=str)
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, port2: int, case: MoECase, control: bool,
           ref_path: str, outdir: str) -> None:
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from nemo_nutp.compat.cpu import apply_cpu_patches

        apply_cpu_patches()
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        _body(rank, port2, case, control, ref_path, outdir)
    except BaseException:
        with open(os.path.join(outdir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
