"""Cross-replica gradient sync of MoE expert weights: the ``expert`` unit space.

Each replica holds every expert once over its own TP ranks (``layout/experts.py``). The expert
space's sync layout is ``layout.experts.expert_sync_layout`` in ``refine`` mode: every shard
lies inside one rank of every replica, so the owner of a shard in a replica is the rank that
holds its experts and nothing moves inside a replica. Per step, after the dense engine's
``finish`` (``engine.py``):

1. every local expert gradient is scaled by the replica's weight ``w_r`` (as the engine scales
   every other gradient: the sum over replicas is the global-batch gradient);
2. per shard, in ascending shard order (one global order: no two ranks wait on each other), the
   shard's holders (one per replica) all-reduce the gradients of their experts of that shard,
   packed in one buffer in global-name order (the same element at the same offset in every
   replica);
3. the grad norm: one fp64 slot per expert tensor of the model, filled by its holder, summed
   over the TP group (one contributor per slot: exact) and added to the engine's total in a
   fixed order, so every rank of every replica gets the same bits.

Pipeline stages: each stage's experts are synced over that stage's ranks (the layout of the
stage's degrees, one shard group per shard and stage); ``sumsq`` keeps the stage's expert sum
of squares for ``pipeline.finalize``, which builds the whole model's norm itself.

Not built yet: the ``base`` layout (moving experts to owners inside a replica), bucketing and
overlap with backward (the all-reduces run after backward), the distributed optimizer. The
group creation is collective over the world (every stage's groups, in stage order).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Plan
from ..layout.experts import expert_sync_layout
from ..parallel.groups import NUTPGroups

_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


class ExpertSync:
    """The expert space's sync for one rank (collective construction: every rank of the world
    creates the shard groups in the same order)."""

    def __init__(self, plan: Plan, groups: NUTPGroups,
                 named_params: list[tuple[str, torch.nn.Parameter]], *,
                 num_experts: int) -> None:
        self.ctx, self.tp = groups.ctx, groups.tp
        self.sumsq = 0.0  # this stage's expert gradients' sum of squares (after ``finish``)
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.groups: list[dist.ProcessGroup | None] = []
        for s in range(plan.pp):  # every stage's groups on every rank, in one order
            degrees = [rep.tp[s] for rep in plan.replicas]
            lay = expert_sync_layout(num_experts, degrees, "refine")
            shard_groups: list[dist.ProcessGroup | None] = []
            for k in range(lay.num_shards):
                owners = tuple(sorted(rep.ranks[s][int(lay.owners[rep.tp[s]][k])]
                                      for rep in plan.replicas))
                if owners not in made:
                    g = dist.new_group(ranks=list(owners))
                    made[owners] = g if self.ctx.rank in owners else None
                shard_groups.append(made[owners])
            if s == self.ctx.stage:
                self.layout, self.groups = lay, shard_groups
        # local expert tensors by shard, each shard's in global-name order
        self.params: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in self.groups]
        forms: set[tuple[str, str]] = set()
        for _, p in named_params:
            expert = getattr(p, "nutp_expert", None)
            if expert is None:
                continue
            m = _EXPERT.match(p.nutp_name)  # type: ignore[attr-defined]
            assert m is not None, p.nutp_name  # type: ignore[attr-defined]
            forms.add((m[1], m[3]))
            k = int((self.layout.shards <= expert).sum()) - 1
            assert self.groups[k] is not None, (p.nutp_name, k)  # type: ignore[attr-defined]
            self.params[k].append((p.nutp_name, p))  # type: ignore[attr-defined]
        for items in self.params:
            items.sort(key=lambda item: item[0])
        # every expert tensor of the stage (its ranks know them all): its norm slot
        names = sorted(f"{a}{e}{b}" for a, b in forms for e in range(num_experts))
        self.slot = {n: i for i, n in enumerate(names)}

    def finish(self, engine: Any) -> None:
        """Reduce the expert gradients across replicas and add their squares to
        ``engine.grad_sumsq`` (call after ``engine.finish``)."""
        w = self.ctx.weight
        slots = torch.zeros(len(self.slot), dtype=torch.float64)
        for group, items in zip(self.groups, self.params, strict=True):
            if group is None or not items:
                continue
            grads = [p.main_grad for _, p in items]  # type: ignore[attr-defined]
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(w)
            dist.all_reduce(flat, group=group)
            off = 0
            for (name, _), g in zip(items, grads, strict=True):
                piece = flat[off:off + g.numel()]
                g.view(-1).copy_(piece)
                slots[self.slot[name]] = torch.sum(piece.double() ** 2)
                off += g.numel()
        dist.all_reduce(slots, group=self.tp)
        self.sumsq = float(slots.sum())
        engine.grad_sumsq = engine.grad_sumsq + self.sumsq
