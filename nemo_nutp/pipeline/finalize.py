"""After a pipelined step's gradient sync: tied embeddings, the grad norm and the loss.

Runs on every rank of a replica with ``pp > 1`` after the NUTP DDP finished its per-stage
cross-replica sync (each stage's gradients are then the global-batch gradients of that
stage's parameters, the same bits in every replica).

* **Tied embeddings** (first stage: word embedding; last stage: its copy as the output
  layer, ``nutp_tied_copy``): the two stages hold the vocab at their own degrees, so the pairs
  are made by vocab *unit* — rank ``j`` of the first stage and rank ``k`` of the last exchange
  the rows ``[b0[j], b0[j+1]) ∩ [bL[k], bL[k+1])`` — never by rank position. Both sides then hold
  ``G0 + GL`` (added in that order on both, so the two copies stay the same bits and keep the
  same weights after the update).
* **Grad norm**: every stage's sum of squares from the engine (the tied copies excluded;
  MoE: plus the stage's expert gradients', ``sync/experts.ExpertSync.sumsq``),
  plus, when tied, the combined embedding gradient's per-row sums of squares (computed by the
  first stage's holder of each row: the same bits whichever rank holds it), go into one
  vector with one contributor per slot; one all-reduce over the replica fills it, and the same
  vector summed in the same order gives the same total on every rank of every replica.
* **Loss**: the last stage's replica loss rides in the same all-reduce, so every stage knows it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..layout import Plan
from ..parallel.comm import ops_of
from ..parallel.groups import NUTPGroups


class PipelineFinalizer:
    """One rank's post-sync step for a pipelined replica."""

    def __init__(self, plan: Plan, groups: NUTPGroups, model: Any) -> None:
        self.plan, self.groups, self.ctx = plan, groups, groups.ctx
        self.engine = model.nutp_engine
        self.experts = getattr(model, "nutp_experts", None)  # MoE: sync/experts.ExpertSync
        ctx, pp = self.ctx, plan.pp
        rep = plan.replicas[ctx.replica]
        self.first, self.last = ctx.stage == 0, ctx.stage == pp - 1
        self.tied: torch.nn.Parameter | None = None
        self.pairs: list[tuple[int, int, int]] = []  # (peer, local lo, local hi) rows
        self.vocab = plan.request.model.vocab_size if plan.request.model.tie_embeddings else 0
        named = {id(p): (n, p) for n, p in model.named_parameters()}
        for _, p in named.values():
            if self.vocab and (getattr(p, "nutp_tied_copy", False) or (
                    self.first and getattr(p, "nutp_kind", None) == "word_embedding")):
                self.tied = p
        tied_ids = {id(self.tied)} if self.tied is not None else set()
        self.keep = torch.tensor([i for e in self.engine.order if id(e.param) not in tied_ids
                                  for i in range(e.slot, e.slot + e.n_slots)], dtype=torch.long)
        if self.tied is not None:
            lo, hi = self.tied.nutp_units  # type: ignore[attr-defined]
            other = pp - 1 if self.first else 0
            bounds = plan.unit_bounds(other, "vocab", rep.tp[other])
            for k, peer in enumerate(rep.ranks[other]):
                a, b = max(lo, int(bounds[k])), min(hi, int(bounds[k + 1]))
                if b > a:
                    self.pairs.append((peer, a - lo, b - lo))
        self.nccl = dist.get_backend(groups.tp) == "nccl"
        self.ops = ops_of(groups.comm)  # timed; delayed across domains (parallel/comm.py)

    def warm_up(self) -> None:
        """The tied-embedding pairs' communicators now (first and last stage; see
        ``NUTPP2PCommunicator.warm_up``)."""
        if self.tied is None:
            return
        device = self.tied.device
        ops = [("recv", torch.empty(1, device=device), peer) for peer, _, _ in self.pairs]
        ops += [("send", torch.zeros(1, device=device), peer) for peer, _, _ in self.pairs]
        self.ops.exchange(ops, nccl=self.nccl)

    def _combine_tied(self) -> torch.Tensor | None:
        """G0 + GL on both stages' holders; the first stage's per-row sums of squares."""
        if self.tied is None:
            return None
        grad = self.tied.main_grad  # type: ignore[attr-defined]
        theirs = [torch.empty_like(grad[lo:hi]) for _, lo, hi in self.pairs]
        ops = [("recv", t, peer) for t, (peer, _, _) in zip(theirs, self.pairs, strict=True)]
        ops += [("send", grad[lo:hi].clone(), peer) for peer, lo, hi in self.pairs]
        self.ops.exchange(ops, nccl=self.nccl)
        for t, (_, lo, hi) in zip(theirs, self.pairs, strict=True):
            if self.first:
                grad[lo:hi].add_(t)  # G0 + GL
            else:
                grad[lo:hi].copy_(t + grad[lo:hi])  # the same G0 + GL bits
        if not self.first:
            return None
        return torch.sum(torch.square(grad.float()), dim=1, dtype=torch.float64)

    def finish(self, replica_loss: float) -> float:
        """Tied gradients combined, ``engine.grad_sumsq`` set to the whole model's; returns the
        replica's loss (known to every rank)."""
        pp, ctx = self.plan.pp, self.ctx
        rows = self._combine_tied()
        slots = self.engine.sumsq_slots
        device = slots.device
        vec = torch.zeros(pp + 1 + self.vocab, dtype=torch.float64, device=device)
        if ctx.tp_rank == 0:
            vec[ctx.stage] = slots[self.keep.to(device)].sum()
            if self.experts is not None:  # the stage's experts (summed over its TP group)
                vec[ctx.stage] += self.experts.sumsq
            if self.last:
                vec[pp] = replica_loss
        if rows is not None:
            lo, hi = self.tied.nutp_units  # type: ignore[union-attr]
            vec[pp + 1 + lo:pp + 1 + hi] = rows
        self.ops.all_reduce(vec, group=self.groups.replica)
        total = vec[:pp].sum() + vec[pp + 1:].sum()
        self.engine.grad_sumsq = float(total)
        return float(vec[pp])
