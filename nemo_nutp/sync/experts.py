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

Distributed optimizer (``sync/zero.py``, ``use_reduce_scatter``): step 2 becomes a
reduce-scatter among the shard's holders: member ``j`` of the group (group-rank order) receives
slice ``j`` of the packed buffer (``ExpertSlice``: ``bucket_slice`` cuts, padded to ``chunk``), the
summed gradient of the elements whose optimizer state it keeps; ``main_grad`` keeps the local,
unreduced values (as the dense engine's reduce-scatter leaves it). The grad norm: one fp64 slot
per (expert tensor, member), filled by that member from its slice, summed over the stage (one
contributor per slot: exact), added in a fixed order: every element once, the same bits on every
rank. ``gather`` is the way back: the members' updated slices all-gathered into the parameters.

Not built yet: the ``base`` layout (moving experts to owners inside a replica), bucketing and
overlap with backward (the all-reduces run after backward), the distributed optimizer over
pipeline stages (refused). The group creation is collective over the world (every stage's
groups, in stage order).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Plan
from ..layout.experts import expert_sync_layout
from ..parallel.groups import NUTPGroups

_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class ExpertSlice:
    """This rank's slice ``[start, stop)`` of shard ``shard``'s packed expert buffer (``numel``
    elements; member ``index`` of ``size`` holders keeps it; ``chunk``: the padded slice
    length of the reduce-scatter and the all-gather)."""

    shard: int
    numel: int
    size: int
    index: int
    start: int
    stop: int
    chunk: int


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
        self.stage = groups.stage
        self.replicas = len(plan.replicas)
        self.slices: list[ExpertSlice] | None = None  # distributed optimizer: use_reduce_scatter
        self.out: list[torch.Tensor | None] = []

    def use_reduce_scatter(self) -> list[ExpertSlice]:
        """Distributed optimizer (``sync/zero.py``): reduce-scatter each shard among its
        holders instead of the all-reduce (module doc); this rank's slices, shard order."""
        self.slices = []
        for k, (group, items) in enumerate(zip(self.groups, self.params, strict=True)):
            if group is None or not items:
                continue
            numel = sum(p.numel() for _, p in items)
            size = dist.get_world_size(group)
            index = dist.get_group_rank(group, self.ctx.rank)
            chunk = max(1, math.ceil(numel / size))
            self.slices.append(ExpertSlice(k, numel, size, index, min(numel, index * chunk),
                                           min(numel, (index + 1) * chunk), chunk))
        return self.slices

    def _finish_scattered(self, engine: Any) -> None:
        assert self.slices is not None
        w = self.ctx.weight
        slots = torch.zeros(len(self.slot), self.replicas, dtype=torch.float64)
        self.out = []
        for sl in self.slices:
            items = self.params[sl.shard]
            flat = torch.zeros(sl.chunk * sl.size, dtype=torch.float32,
                               device=items[0][1].device)
            off = 0
            for _, p in items:
                flat[off:off + p.numel()].copy_(p.main_grad.reshape(-1))  # type: ignore
                off += p.numel()
            flat.mul_(w)
            out = torch.empty(sl.chunk, dtype=torch.float32, device=flat.device)
            dist.reduce_scatter_tensor(out, flat, group=self.groups[sl.shard])
            self.out.append(out)
            off = 0
            for name, p in items:  # this member's part of each tensor: its own slot
                a, z = max(off, sl.start), min(off + p.numel(), sl.stop)
                if z > a:
                    slots[self.slot[name], sl.index] = torch.sum(
                        out[a - sl.start:z - sl.start].double() ** 2)
                off += p.numel()
        dist.all_reduce(slots, group=self.stage)
        self.sumsq = float(slots.sum())
        engine.grad_sumsq = engine.grad_sumsq + self.sumsq

    def items(self, shard: int) -> list[tuple[str, torch.nn.Parameter]]:
        """Shard ``shard``'s local expert tensors in packing order (global-name order)."""
        return self.params[shard]

    @torch.no_grad()
    def gather(self, mine: list[torch.Tensor], targets: dict[int, torch.Tensor]) -> None:
        """The way back: per slice (``self.slices`` order) all-gather the members' ``mine``
        (``chunk`` values each) among the shard's holders and write every local expert tensor's
        values into ``targets[id(param)]`` (shaped like the parameter); collective over the
        holders of this rank's shards, in shard order."""
        assert self.slices is not None
        for sl, piece in zip(self.slices, mine, strict=True):
            full = torch.empty(sl.chunk * sl.size, dtype=piece.dtype, device=piece.device)
            dist.all_gather_into_tensor(full, piece.contiguous(), group=self.groups[sl.shard])
            off = 0
            for _, p in self.params[sl.shard]:
                t = targets[id(p)]
                t.view(-1).copy_(full[off:off + p.numel()])
                off += p.numel()

    def finish(self, engine: Any) -> None:
        """Reduce the expert gradients across replicas and add their squares to
        ``engine.grad_sumsq`` (call after ``engine.finish``)."""
        if self.slices is not None:
            self._finish_scattered(engine)
            return
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
