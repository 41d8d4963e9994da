"""Cross-replica gradient sync for replicas of different TP degree.

Per step, for every parameter, in one *canonical order* shared by all ranks (reverse parameter
order, i.e. roughly backward order):

1. scale the accumulated gradient by the replica's weight ``w_r = samples_r / samples`` (so the
   sum over replicas is the exact global-batch gradient, never an average of averages);
2. sharded parameters: send the units this rank holds but does not own to their sync owner
   (reshard, async p2p), then all-reduce each owned shard's *sync buffer* — units ascending by
   global index, each unit's elements in canonical order — among the shard's owners (one per
   replica), so the same element is paired in every replica;
3. reshard back: owners return reduced units to their holders; every rank writes the reduced
   values into its own gradient at the unit's local positions;
4. replicated parameters (norms, row-parallel biases): without sequence parallelism every TP rank
   holds the replica's full gradient: the TP-rank-0 "leaders" all-reduce it and broadcast it in
   their TP group (for uniform layouts this is megatron's DP all-reduce); under sequence
   parallelism SP ranks hold partial sums (scaled by w_r), TP1 replicas full copies (w_r / t_r),
   and all ranks of the stage all-reduce them in one collective.

Grad norm (the single-process value, the same bits on every rank of the stage): every element
of the reduced gradient is counted exactly once, *on the sync layout*. The owner of sync shard
``k`` of a parameter squares-and-sums its reduced shard buffer (identical bits in every replica,
since all owners received the same all-reduce result); TP rank 0 does the same for each
replicated parameter. Each value goes into its own slot of a small per-TP-group vector; one
all-reduce over the TP group fills every slot from its single contributor (adding zeros is
exact), and the same vector summed in the same order gives the same total on every rank of every
replica. ``grad_sumsq`` holds it after ``finish``; ``nonfinite_params()`` names the parameters
whose slot is NaN/Inf.

Ordering contract: collectives on any group are *launched* in canonical order on every member
(a shard's all-reduce waits for its received pieces), so members whose megatron buckets differ
(uneven shards give different bucket boundaries) still pair the same operations. Nothing blocks
inside backward hooks: hooks only post async p2p and launch the collectives that are ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..layout import PARAM_KINDS, Plan, reshard_plan
from ..layout.sync import owned_shards
from ..layout.units import local_unit_positions, unit_numel
from ..parallel.groups import NUTPGroups


@dataclass
class _Shard:
    k: int
    lo: int  # shard units [lo, hi)
    hi: int
    group: dist.ProcessGroup
    recvs: list[tuple[int, int, int]]  # (src global rank, unit lo, unit hi)
    buf: torch.Tensor | None = None
    recv_work: list[Any] = field(default_factory=list)
    reduce_work: Any = None


@dataclass
class _Param:
    name: str
    param: torch.nn.Parameter
    kind: str | None
    units: tuple[int, int] | None
    numel_unit: int = 0
    pos: torch.Tensor | None = None  # (n_local, unit_numel) local flat positions
    sends: list[tuple[int, int, int]] = field(default_factory=list)  # (dst global, lo, hi)
    shards: list[_Shard] = field(default_factory=list)
    partial: bool = False  # replicated param holding a per-rank partial sum (sequence parallel)
    slot: int = 0  # first slot of this param in the grad-norm vector
    n_slots: int = 1  # sync shards (sharded) or 1 (replicated)
    send_work: list[Any] = field(default_factory=list)
    back_recv: list[tuple[Any, torch.Tensor, int, int]] = field(default_factory=list)
    reduce_work: Any = None


class GradSyncEngine:
    """Owns the per-step sync state of one rank; driven by the NUTP bucket groups."""

    def __init__(self, plan: Plan, groups: NUTPGroups,
                 named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.plan, self.groups, self.ctx = plan, groups, groups.ctx
        self.dims = plan.request.model
        ctx = self.ctx
        self.ranks = plan.replicas[ctx.replica].ranks[ctx.stage]
        self.leaders = groups.leaders
        # One rule per stage for replicated params, so all replicas launch the same collective:
        # with sequence parallelism somewhere, all ranks of the stage all-reduce (SP ranks hold
        # partial sums); otherwise TP-rank-0 leaders all-reduce and broadcast in their TP group.
        self.stage_mode = plan.request.parallel.sequence_parallel
        self.order: list[_Param] = [self._describe(n, p) for n, p in reversed(named_params)
                                    if p.requires_grad]
        self.index = {id(e.param): i for i, e in enumerate(self.order)}
        slot = 0
        for e in self.order:
            e.slot, slot = slot, slot + e.n_slots
        self.n_slots = slot
        self.grad_sumsq = float("nan")  # of the last finished step (see module docstring)
        self.sumsq_slots: torch.Tensor | None = None
        self.reset()

    # ---------------------------------------------------------------- setup
    def _describe(self, name: str, p: torch.nn.Parameter) -> _Param:
        kind = getattr(p, "nutp_kind", None)
        units = getattr(p, "nutp_units", None)
        e = _Param(name=name, param=p, kind=kind, units=units,
                   partial=bool(getattr(p, "sequence_parallel", False)))
        if kind is None:
            return e
        ctx, plan = self.ctx, self.plan
        space = PARAM_KINDS[kind].space
        lay = plan.sync[(ctx.stage, space)]
        b = lay.bounds[ctx.degree]
        assert units == (int(b[ctx.tp_rank]), int(b[ctx.tp_rank + 1])), (name, units)
        e.numel_unit = unit_numel(kind, self.dims)
        e.pos = torch.from_numpy(local_unit_positions(kind, self.dims, units[1] - units[0])).to(
            p.device)
        e.n_slots = len(lay.shards) - 1
        rp = reshard_plan(lay, ctx.degree)
        e.sends = [(self.ranks[d], lo, hi) for d, lo, hi in rp.sends(ctx.tp_rank)]
        recvs = [(self.ranks[s], lo, hi) for s, lo, hi in rp.recvs(ctx.tp_rank)]
        owners = plan.sync_owner_ranks(ctx.stage, space)
        for k in owned_shards(lay, ctx.degree, ctx.tp_rank):
            lo, hi = int(lay.shards[k]), int(lay.shards[k + 1])
            key = (ctx.stage, space, tuple(int(r) for r in owners[:, k]))
            e.shards.append(_Shard(k=int(k), lo=lo, hi=hi, group=self.groups.sync[key],
                                   recvs=[r for r in recvs if lo <= r[1] < hi]))
        return e

    # ---------------------------------------------------------------- per step
    def reset(self) -> None:
        self.sent_bytes = 0  # reshard bytes this rank sent this step (there and back)
        self.ready = np.zeros(len(self.order), dtype=bool)
        self.posted = 0  # params whose p2p / replicated collectives are posted
        self.launched = 0  # shard all-reduces launched, counted over the flattened queue
        self.queue: list[tuple[_Param, _Shard | None]] = []
        self.done = False

    def mark_ready(self, params: Any) -> None:
        """Called from megatron's bucket readiness (backward hooks): post what is in order."""
        for p in params:
            self.ready[self.index[id(p)]] = True
        while self.posted < len(self.order) and self.ready[self.posted]:
            self._post(self.order[self.posted])
            self.posted += 1
        self._launch(block=False)

    def _local(self, e: _Param, lo: int, hi: int) -> torch.Tensor:
        assert e.units is not None and e.pos is not None
        return e.pos[lo - e.units[0]:hi - e.units[0]].reshape(-1)

    def _post(self, e: _Param) -> None:
        grad = e.param.main_grad  # type: ignore[attr-defined]
        flat = grad.view(-1)
        w = self.ctx.weight
        if e.kind is None:
            if self.stage_mode:  # partial sums (SP) add up over TP; full copies count t times
                grad.mul_(w if e.partial else w / self.ctx.degree)
                self.queue.append((e, None))
            elif self.leaders is not None:
                grad.mul_(w)
                self.queue.append((e, None))
            return
        grad.mul_(w)
        for dst, lo, hi in e.sends:
            piece = flat[self._local(e, lo, hi)]
            e.send_work.append((dist.isend(piece, dst), piece))
            self.sent_bytes += piece.numel() * piece.element_size()
        for sh in e.shards:
            sh.buf = torch.empty((sh.hi - sh.lo) * e.numel_unit, dtype=grad.dtype,
                                 device=grad.device)
            for src, lo, hi in sh.recvs:
                view = sh.buf[(lo - sh.lo) * e.numel_unit:(hi - sh.lo) * e.numel_unit]
                sh.recv_work.append(dist.irecv(view, src))
            mine_lo, mine_hi = max(sh.lo, e.units[0]), min(sh.hi, e.units[1])  # type: ignore
            if mine_hi > mine_lo:
                off = (mine_lo - sh.lo) * e.numel_unit
                sh.buf[off:off + (mine_hi - mine_lo) * e.numel_unit] = flat[
                    self._local(e, mine_lo, mine_hi)]
            self.queue.append((e, sh))

    def _launch(self, *, block: bool) -> None:
        """Launch queued all-reduces strictly in order; stop at one whose pieces are missing."""
        while self.launched < len(self.queue):
            e, sh = self.queue[self.launched]
            if sh is None:
                group = self.groups.stage if self.stage_mode else self.leaders
                e.reduce_work = dist.all_reduce(e.param.main_grad, group=group,  # type: ignore
                                                async_op=True)
            else:
                if not block and not all(w.is_completed() for w in sh.recv_work):
                    return
                for w in sh.recv_work:
                    w.wait()
                sh.reduce_work = dist.all_reduce(sh.buf, group=sh.group, async_op=True)
            self.launched += 1

    def name_of(self, param: torch.nn.Parameter) -> str:
        return self.order[self.index[id(param)]].name

    def not_ready(self) -> list[str]:
        """Names of the parameters not yet marked ready this step."""
        return [e.name for e, r in zip(self.order, self.ready) if not r]

    def finish(self, *, strict: bool = False) -> None:
        """Complete the step's sync. Until every parameter was marked ready this is a no-op,
        or, with ``strict`` (end of backward), an error naming the parameters never marked."""
        if self.done:
            return
        if not self.ready.all():
            if strict:
                missing = self.not_ready()
                raise RuntimeError(
                    f"gradient sync: {len(missing)} parameter(s) were never marked ready in "
                    f"backward (no gradient hook fired), e.g. {missing[:5]}; every parameter "
                    "must take part in the loss on every rank")
            return
        self._launch(block=True)
        device = self.order[0].param.device if self.order else torch.device("cpu")
        sumsq = torch.zeros(self.n_slots, dtype=torch.float64, device=device)
        backs: list[Any] = []
        for e in self.order:
            if e.kind is None:
                self._finish_replicated(e)
                if self.ctx.tp_rank == 0:
                    sumsq[e.slot] = _sumsq(e.param.main_grad)  # type: ignore[attr-defined]
                continue
            flat = e.param.main_grad.view(-1)  # type: ignore[attr-defined]
            for work, _piece in e.send_work:
                work.wait()
            for dst, lo, hi in e.sends:  # our units come back reduced from their owner
                piece = torch.empty((hi - lo) * e.numel_unit, dtype=flat.dtype,
                                    device=flat.device)
                e.back_recv.append((dist.irecv(piece, dst), piece, lo, hi))
            for sh in e.shards:
                sh.reduce_work.wait()
                sumsq[e.slot + sh.k] = _sumsq(sh.buf)  # type: ignore[arg-type]
                mine_lo, mine_hi = max(sh.lo, e.units[0]), min(sh.hi, e.units[1])  # type: ignore
                if mine_hi > mine_lo:
                    off = (mine_lo - sh.lo) * e.numel_unit
                    flat[self._local(e, mine_lo, mine_hi)] = sh.buf[  # type: ignore[index]
                        off:off + (mine_hi - mine_lo) * e.numel_unit]
                for src, lo, hi in sh.recvs:
                    off = (lo - sh.lo) * e.numel_unit
                    view = sh.buf[off:off + (hi - lo) * e.numel_unit]  # type: ignore[index]
                    backs.append((dist.isend(view.contiguous(), src), None))
                    self.sent_bytes += view.numel() * view.element_size()
        for e in self.order:
            for work, piece, lo, hi in e.back_recv:
                work.wait()
                e.param.main_grad.view(-1)[self._local(e, lo, hi)] = piece  # type: ignore
        for work, _ in backs:
            work.wait()
        # One contributor per slot in every TP group: the sum is exact, the total the same bits
        # in every replica. (With pipeline stages this becomes the replica's model-parallel
        # group.)
        dist.all_reduce(sumsq, group=self.groups.tp)
        self.sumsq_slots = sumsq
        self.grad_sumsq = float(sumsq.sum())
        self._clear()
        self.done = True

    def nonfinite_params(self) -> list[str]:
        """Parameters whose reduced gradient holds NaN/Inf (the same list on every rank)."""
        if self.sumsq_slots is None:
            return []
        bad = ~torch.isfinite(self.sumsq_slots.cpu())
        return [e.name for e in self.order if bool(bad[e.slot:e.slot + e.n_slots].any())]

    def _finish_replicated(self, e: _Param) -> None:
        if e.reduce_work is not None:
            e.reduce_work.wait()
        if not self.stage_mode and self.ctx.degree > 1:  # leaders hold the result: share it
            dist.broadcast(e.param.main_grad, src=self.ranks[0],  # type: ignore[attr-defined]
                           group=self.groups.tp)

    def _clear(self) -> None:
        for e in self.order:
            e.send_work.clear()
            e.back_recv.clear()
            e.reduce_work = None
            for sh in e.shards:
                sh.buf, sh.reduce_work = None, None
                sh.recv_work.clear()


def _sumsq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares accumulated in fp64 (deterministic for the same tensor on any rank)."""
    return torch.sum(torch.square(t.float()), dtype=torch.float64)
