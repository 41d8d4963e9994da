"""Turn a plan's rank lists into process groups; hand each rank an explicit collection.

Contract:
* every rank calls ``build_groups`` with the same plan; groups are created in one fixed order
  (TP, PP, stage/DP, stage leaders, sync groups by stage and space, replicas when pp > 1):
  no deadlock; this rank's size-1 group is created by this rank alone
  (``use_local_synchronization``: no world-wide call per rank);
* the returned ``NUTPGroups.pgs`` is a megatron-core ``ProcessGroupCollection`` holding *this
  rank's* groups; NUTP never initialises or reads megatron's global ``parallel_state`` groups, so
  any layer that falls back to a global TP group fails loudly instead of computing wrong math;
* ``sync[(stage, space, owners)]`` maps the owner tuple of a shard to its DP group;
* ``pgs.pp`` holds one rank per stage with this rank at its stage's position (a rank of a
  stage with fewer TP ranks is in several of the plan's pipeline groups; megatron's schedule
  reads only its size and position — activations move by ``pipeline.p2p``'s map, not by it);
  ``pgs.embd`` is None: tied embeddings are reduced by vocab unit (``pipeline.finalize``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from ..layout import SPACES, Plan
from .comm import Comm, Domains


@dataclass(frozen=True)
class RankContext:
    """Where a global rank sits in the plan."""

    rank: int
    replica: int  # position in plan.replicas
    stage: int
    tp_rank: int
    degree: int
    weight: float
    microbatches: int
    microbatch_offset: int  # first global micro-batch index of this replica


def rank_context(plan: Plan, rank: int) -> RankContext:
    if rank not in plan.rank_index:
        raise ValueError(f"rank={rank}: not in the plan (world_size={plan.world_size})")
    i, s, j = plan.rank_index[rank]
    rep = plan.replicas[i]
    offset = sum(r.microbatches for r in plan.replicas[:i])
    return RankContext(rank=rank, replica=i, stage=s, tp_rank=j, degree=rep.tp[s],
                       weight=rep.weight, microbatches=rep.microbatches,
                       microbatch_offset=offset)


@dataclass
class NUTPGroups:
    """This rank's process groups."""

    ctx: RankContext
    pgs: ProcessGroupCollection
    tp: dist.ProcessGroup
    stage: dist.ProcessGroup  # all ranks of this stage over replicas (replicated params)
    leaders: dist.ProcessGroup | None  # TP-rank-0 of every replica of the stage (None if not one)
    single: dist.ProcessGroup | None = None  # this rank alone (cp=1; single-process references)
    replica: dist.ProcessGroup | None = None  # this replica, all stages (= tp when pp == 1)
    sync: dict[tuple[int, str, tuple[int, ...]], dist.ProcessGroup] = field(default_factory=dict)
    comm: Comm | None = None  # the data path's ops: timed, emulated network (parallel/comm.py)


def _new_group(ranks: list[int], backend: str | None) -> dist.ProcessGroup | None:
    g = dist.new_group(ranks=sorted(ranks), backend=backend)
    return g if dist.get_rank() in ranks else None


def build_groups(plan: Plan, *, backend: str | None = None) -> NUTPGroups:
    """Create every group of the plan (collective over the world) and return this rank's."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before build_groups")
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"world_size={dist.get_world_size()}: the plan needs "
                         f"{plan.world_size} ranks")
    rank = dist.get_rank()
    ctx = rank_context(plan, rank)
    domains = Domains(plan.rank_to_gpu, plan.request.cluster.domain_size)
    # megatron-core's TP collectives (inside its layers) bypass parallel/comm.py: they must stay
    # inside one scale-up domain, as a replica stage's TP group does by construction.
    for ranks in plan.tp_groups():
        assert not domains.crosses(ranks), f"TP group {ranks} spans scale-up domains"
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, lists in (("tp", plan.tp_groups()), ("pp", plan.pp_groups()),
                        ("stage", plan.stage_groups())):
        for ranks in lists:
            g = _new_group(ranks, backend)
            if g is not None and kind not in mine:  # a rank is in exactly one TP/stage group
                mine[kind] = g
    leaders = None
    for s in range(plan.pp):
        g = _new_group([rep.ranks[s][0] for rep in plan.replicas], backend)
        leaders = g if g is not None else leaders
    sync: dict[tuple[int, str, tuple[int, ...]], dist.ProcessGroup] = {}
    for s in range(plan.pp):
        for space in SPACES:
            for ranks in plan.sync_groups(s, space):
                g = _new_group(ranks, backend)
                if g is not None:
                    sync[(s, space, tuple(ranks))] = g
    replica = mine["tp"]
    if plan.pp > 1:  # the replica's model-parallel group: all its stages
        for rep in plan.replicas:
            g = _new_group([r for ranks in rep.ranks for r in ranks], backend)
            replica = g if g is not None else replica
    # This rank alone (cp = ep = 1): created by this rank only (a local barrier of one), not W
    # world-wide new_group calls for W size-1 groups (issue #22).
    single = dist.new_group(ranks=[rank], backend=backend, use_local_synchronization=True)
    assert single is not None
    pgs = ProcessGroupCollection()
    pgs.tp = mine["tp"]
    pgs.pp = mine["pp"]
    pgs.cp = single
    pgs.tp_cp = mine["tp"]
    pgs.mp = replica  # the replica's TP x PP ranks
    pgs.tp_ep_pp = replica
    pgs.dp = mine["stage"]
    pgs.dp_cp = mine["stage"]
    # megatron 0.19's MoE metrics average over it (no GTP re-materialisation: ``dp_cp``)
    pgs.dp_cp_gtp_remat = mine["stage"]
    pgs.intra_dp_cp = mine["stage"]
    pgs.expt_dp = mine["stage"]
    pgs.embd = None
    pgs.pos_embd = None
    pgs.ep = single
    pgs.expt_tp = mine["tp"]
    pgs.tp_ep = mine["tp"]
    comm = Comm(domains, rank, rate_mb_s=plan.request.cluster.emulated_scale_out_mb_s)
    return NUTPGroups(ctx=ctx, pgs=pgs, tp=mine["tp"], stage=mine["stage"], leaders=leaders,
                      single=single, sync=sync, replica=replica, comm=comm)
