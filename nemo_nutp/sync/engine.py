"""Cross-replica gradient sync for replicas of different TP degree.

Per step, for every parameter, in one *canonical order* shared by all ranks (reverse parameter
order, i.e. roughly backward order):

1. scale the accumulated gradient by the replica's weight ``w_r = samples_r / samples`` (so the
   sum over replicas is the exact global-batch gradient, never an average of averages);
2. sharded parameters: send the units this rank holds but does not own to their sync owner
   (reshard, async p2p, coalesced per peer into messages of about ``bucket_size`` elements,
   sent when their last parameter is posted); each owned shard's *sync buffer* — units
   ascending by global index, each unit's elements in canonical order, so the same element is
   paired in every replica — is a piece of a *bucket* of the shard's sync group (owners, one
   per replica): pieces going to the same group are packed into buckets of about
   ``bucket_size`` elements, and each bucket is one all-reduce, launched from the backward hooks
   as soon as its pieces are in;
3. reshard back: owners return reduced units to their holders in the same messages; every rank
   writes the reduced values into its own gradient at the unit's local positions;
4. replicated parameters (norms, row-parallel biases), packed into buckets the same way: without
   sequence parallelism every TP rank holds the replica's full gradient: the TP-rank-0 "leaders"
   all-reduce them — in the buckets of the leaders' group, which owns shard 0 of every space —
   and share the result with their TP group inside the grad-norm all-reduce below (for uniform
   layouts this is megatron's DP all-reduce); under sequence parallelism SP ranks hold partial
   sums (scaled by w_r), TP1 replicas full copies (w_r / t_r), and all ranks of the stage
   all-reduce them.

Buckets (``descriptors.plan_buckets``): pieces of sync shards with the same owners share buckets
whatever their unit space, so a rank launches about (groups it owns shards in) + (its elements /
``bucket_size``) all-reduces per step, plus the one TP-group all-reduce.

Units move as strided views of the gradient (``layout.units.unit_view_shape``): the engine holds
O(kinds + shards + parameters) descriptors (``descriptors.py``), never per-element indices.

Grad norm (the single-process value, the same bits on every rank of the stage): every element
of the reduced gradient is counted exactly once, *on the sync layout*. The owner of sync shard
``k`` of a parameter squares-and-sums its reduced piece (identical bits in every replica, since
all owners received the same all-reduce result); TP rank 0 does the same for each replicated
parameter. Each value goes into its own slot of a small per-TP-group vector (followed, without
sequence parallelism, by the leader's reduced replicated gradients in fp64); one all-reduce over
the TP group fills every slot from its single contributor (adding zeros is exact), and the same
vector summed in the same order gives the same total on every rank of every replica.
``grad_sumsq`` holds it after ``finish``; ``nonfinite_params()`` names the parameters whose slot
is NaN/Inf.

Distributed optimizer (``zero.py``, ``use_reduce_scatter``): each bucket is reduce-scattered
instead (member ``j`` of its group keeps slice ``j``), no reduced gradient returns to holders, and
each piece's slot is summed from its members' slices by one small all-reduce per group.

Memory (beyond megatron's grad buffer, which it reduces in place): a window, not a second copy
of the gradients. Buckets hold at most ``bucket_size`` elements (``plan_buckets`` cuts shard
pieces at unit boundaries); a bucket is staged — its pieces copied out of ``main_grad`` — only
once all its parameters are posted, and a new staging buffer waits until the ones alive fit in
``staging_bytes`` (``staging_buckets`` x ``bucket_size`` fp32 elements; ``_stage``); a bucket
that is one contiguous piece of the rank's own gradient is reduced in place there. The ``base``
layout's reshard messages live until the way back in ``finish``. ``peak_bytes`` is the
engine's own accounting of all of it.

Ordering contract: buckets are launched in one canonical order (``descriptors.plan_buckets``: a
restriction of one global order), a bucket only after its received pieces are in, so members
whose megatron buckets differ still pair the same operations. Nothing blocks inside backward
hooks: hooks only post async p2p and launch the buckets that are ready. The TP-group all-reduce
and the reshard-back p2p run in ``finish`` (after backward: the TP group also carries backward's
own collectives, and per-pair p2p must keep one order in both directions).

Modules: this one drives the step (posting, staging, launching, retiring buckets, ``finish``);
``state.py`` holds the records and unit views, ``reshard.py`` the reshard messages and their
pair order, ``norm.py`` the grad-norm kernels and the reduce-scatter norm.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from ..layout import PARAM_KINDS, SPACES, Plan
from ..parallel.comm import ops_of
from ..parallel.groups import NUTPGroups
from . import norm, p2p
from .descriptors import Piece, plan_buckets, rank_bucket_items, rank_sync, sync_key
from .reshard import Reshard
from .state import Bucket, Msg, Param, nbytes, read_units, write_units
from .state import Bucket as _Bucket  # noqa: F401  (the names sync/zero.py imports)
from .state import Param as _Param  # noqa: F401

DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per bucket when none is given: megatron's floor, fixed (it never grows with the
world, so the number of chances to overlap does not shrink at scale)."""


class GradSyncEngine:
    """Owns the per-step sync state of one rank; driven by the NUTP bucket groups."""

    def __init__(self, plan: Plan, groups: NUTPGroups,
                 named_params: list[tuple[str, torch.nn.Parameter]], *,
                 bucket_size: int | None = None, staging_buckets: float = 1.5) -> None:
        self.plan, self.groups, self.ctx = plan, groups, groups.ctx
        self.comm = ops_of(groups.comm)  # timed; delayed across domains (parallel/comm.py)
        self.dims = plan.request.model
        ctx = self.ctx
        self.ranks = plan.replicas[ctx.replica].ranks[ctx.stage]
        self.leaders = groups.leaders
        # One rule per stage for replicated params, so all replicas launch the same collective:
        # with sequence parallelism somewhere, or per-head norms (qk_layernorm: each TP rank's
        # gradient covers its heads), all ranks of the stage all-reduce (they hold partial
        # sums); otherwise TP-rank-0 leaders all-reduce and broadcast in their TP group.
        self.stage_mode = (plan.request.parallel.sequence_parallel
                           or bool(getattr(self.dims, "qk_layernorm", False)))
        self.bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
        if staging_buckets <= 0:
            raise ValueError(f"staging_buckets={staging_buckets}: must be > 0")
        # Staging window: bucket buffers alive at once, bytes (fp32 buckets; see _stage).
        self.staging_bytes = int(staging_buckets * self.bucket_size * 4)
        self._staging = 0  # bytes of staged (not aliased) bucket buffers alive now
        self.sync = rank_sync(plan, ctx.rank)
        self.order: list[Param] = [self._describe(n, p) for n, p in reversed(named_params)
                                    if p.requires_grad]
        self.index = {id(e.param): i for i, e in enumerate(self.order)}
        slot = 0
        for e in self.order:
            e.slot, slot = slot, slot + e.n_slots
        self.n_slots = slot
        self.buckets = self._buckets()
        self.reshard = Reshard(self.order, self.sync, ctx.rank, self.bucket_size, self._alloc)
        self.out_msgs, self.in_msgs = self.reshard.out_msgs, self.reshard.in_msgs
        self.pairs = self.reshard.pairs
        self._msg_numel = sum(m.spec.numel for m in self.out_msgs + self.in_msgs)
        # Replicated gradients the leader shares with its TP group (no sequence parallelism):
        # they ride in the grad-norm all-reduce, the others adding zeros (exact).
        self.shared = ([e for e in self.order if e.kind is None]
                       if not self.stage_mode and self.ctx.degree > 1 else [])
        self._sumsq: torch.Tensor | float = float("nan")  # see grad_sumsq
        # The distributed optimizer (zero.py) reads the reduced buckets after ``finish``: it
        # sets this and calls ``release_buckets`` once it has taken its slices.
        self.keep_buckets = False
        self.scattering = False  # see use_reduce_scatter
        self._scattered: norm.Scattered | None = None  # its norm plan, made at first use
        self.sumsq_slots: torch.Tensor | None = None
        # Sync buffers beyond megatron's DDP (which reduces its grad buffer in place), bytes:
        # bucket and message buffers, reduce-scatter slices, the norm vector; measured at the
        # step's peak (end of ``finish``: they only grow until then), max over steps.
        self.peak_bytes = 0
        self._live = 0  # bytes of those buffers alive now
        self._tp: torch.Tensor | None = None  # this step's norm slots + shared replicated grads
        self.reset()

    # ---------------------------------------------------------------- setup
    def _describe(self, name: str, p: torch.nn.Parameter) -> Param:
        kind = getattr(p, "nutp_kind", None)
        units = getattr(p, "nutp_units", None)
        e = Param(name=name, param=p, kind=kind, units=units,
                   partial=bool(getattr(p, "sequence_parallel", False)))
        if kind is None:
            return e
        view = self.sync.kinds[kind]
        space = self.sync.spaces[PARAM_KINDS[kind].space]
        assert units == view.units, (name, units, view.units)
        assert p.numel() == view.shape[0] * view.shape[1] * view.shape[2], (name, p.shape)
        e.view, e.numel_unit = view.shape, view.unit_numel
        e.n_slots = space.num_shards
        e.sends = space.sends
        return e

    def _replicated_key(self) -> Hashable | None:
        """Where this rank reduces replicated gradients: the whole stage (sequence parallel),
        the leaders' group — the owners of shard 0 of every space, so those pieces share their
        buckets — or nowhere (a non-leader; its TP group's leader shares the result)."""
        stage = self.ctx.stage
        if self.stage_mode:
            return ("stage", stage)
        if self.leaders is None:
            return None
        return sync_key(stage, tuple(rep.ranks[stage][0] for rep in self.plan.replicas))

    def _group(self, key: Hashable) -> dist.ProcessGroup:
        if key == ("stage", self.ctx.stage):
            return self.groups.stage
        assert isinstance(key, tuple) and len(key) == 2, key
        for space in SPACES:  # identical groups exist per space: all members take the first
            g = self.groups.sync.get((key[0], space, key[1]))
            if g is not None:
                return g
        assert self.leaders is not None and key == self._replicated_key(), key
        return self.leaders

    def _buckets(self) -> list[Bucket]:
        items = rank_bucket_items(self.sync, [(e.kind, e.param.numel()) for e in self.order],
                                  self._replicated_key())
        out = []
        for spec in plan_buckets(items, self.bucket_size):
            b = Bucket(spec, self._group(spec.key))
            for pc in spec.pieces:
                self.order[pc.param].pieces.append((b, pc))
            b.norm = norm.bucket_plan(b, self.order, self.ctx.tp_rank)  # slots assigned
            out.append(b)
        return out

    # ---------------------------------------------------------------- per step
    def reset(self) -> None:
        self.posted = 0  # params whose p2p / bucket pieces are posted (canonical prefix)
        self.launched = 0  # position in buckets (the launch order)
        self.retired = 0  # buckets [0, retired) are reduced, written back and freed
        self.staged = 0  # buckets [0, staged) are staged (pieces copied in, or aliased)
        for b in self.buckets:
            b.retired, b.alias = False, False
        self.ready = [False] * len(self.order)
        self.done = False
        self.reshard.reset()

    def mark_ready(self, params: Any) -> None:
        """Called from megatron's bucket readiness (backward hooks): post what is in order."""
        for p in params:
            self.ready[self.index[id(p)]] = True
        while self.posted < len(self.order) and self.ready[self.posted]:
            self._post(self.order[self.posted])
            self.posted += 1
        self._advance()
        self._stage(block=False)
        self._launch(block=False)

    @property
    def sent_bytes(self) -> int:
        """Reshard bytes this rank sent this step (there and back)."""
        return self.reshard.sent_bytes

    def _advance(self) -> None:
        self.reshard.advance(self.posted)  # never blocks

    def _alloc(self, t: torch.Tensor) -> torch.Tensor:
        """Account a new sync buffer (``peak_bytes``)."""
        self._live += nbytes(t)
        self.peak_bytes = max(self.peak_bytes, self._live)
        return t

    def _read(self, e: Param, lo: int, hi: int, out: torch.Tensor,
              t: torch.Tensor | None = None) -> None:
        read_units(e, lo, hi, out, t)  # (sync/zero.py moves its tensors with these)

    def _write(self, e: Param, lo: int, hi: int, src: torch.Tensor,
               t: torch.Tensor | None = None) -> None:
        write_units(e, lo, hi, src, t)

    def _buffer(self, b: Bucket, like: torch.Tensor) -> torch.Tensor:
        if b.buf is None:
            assert not b.retired, "a retired bucket is written again"
            if b.scatter is None:
                b.buf = torch.empty(b.spec.numel, dtype=like.dtype, device=like.device)
            else:  # padded to members x chunk; the padding reduces to zeros
                size, _, chunk = b.scatter
                b.buf = torch.zeros(size * chunk, dtype=like.dtype, device=like.device)
            self._alloc(b.buf)
            self._staging += nbytes(b.buf)
        return b.buf

    def _buffer_bytes(self, b: Bucket, like: torch.Tensor) -> int:
        n = b.spec.numel if b.scatter is None else b.scatter[0] * b.scatter[2]
        return n * like.element_size()

    def _aliasable(self, b: Bucket) -> bool:
        """Whether the bucket is one contiguous piece of this rank's own gradient, in canonical
        order (all-reduced in place there, as megatron does; no staging buffer): a single
        piece of a replicated parameter or of units laid out as whole rows (H = 1) that this
        rank holds, nothing received into it, no reduce-scatter padding."""
        if b.scatter is not None or b.in_msgs or len(b.spec.pieces) != 1:
            return False
        e = self.order[b.spec.pieces[0].param]
        if e.kind is None:
            return True
        pc = b.spec.pieces[0]
        return (e.pos_override is None and e.view is not None and e.view[0] == 1
                and e.units is not None and e.units[0] <= pc.lo and pc.hi <= e.units[1])

    def _stage(self, *, block: bool) -> None:
        """Stage the buckets whose parameters are all posted, in launch order, launching each:
        a bucket's pieces are copied from the (scaled) gradients only then, so no bucket sits
        half-filled while later parameters are computed. A new staging buffer is taken only
        while the staged buffers alive stay within the window (``_window``); else the oldest
        launched bucket is retired first — from the hooks (``block=False``) only if already complete
        (else staging stops until the next hook), in ``finish`` by waiting for it. Only
        launched buckets are waited for, all of them before (in the one global launch order)
        every bucket not yet launched, so no two ranks wait on each other in a cycle; the
        reshard sends are posted (``_post``/``_advance``) whatever the staging does. If
        nothing is staged the buffer is taken anyway (a bucket larger than the window)."""
        while self.staged < len(self.buckets):
            b = self.buckets[self.staged]
            if b.spec.ready_at >= self.posted:
                return
            if not self._aliasable(b):
                grad = self.order[b.spec.ready_at].param.main_grad  # type: ignore[attr-defined]
                need = self._buffer_bytes(b, grad)
                while self._staging + need > self._window(grad):
                    if self.launched < self.staged:
                        self._launch_ready(block=block)
                    if self.retired == self.launched:
                        if block or not self._staging:
                            break  # nothing to wait for: over the window, to make progress
                        return
                    oldest = self.buckets[self.retired]
                    if not block and oldest.work is not None and not oldest.work.is_completed():
                        return
                    self._retire_one(oldest)
                    self.retired += 1
            for pc in b.spec.pieces:
                self._fill(self.order[pc.param], b, pc)
            self.staged += 1
            self._launch_ready(block=block)
            self._retire(block=False)

    def _window(self, grad: torch.Tensor) -> int:
        """Bytes the staged buckets may take: ``staging_bytes`` less the reshard messages',
        which live from their first piece to the way back in ``finish`` (``base`` layout,
        degraded replicas), so that the two together stay within the window even if no
        collective completes before ``finish``; one bucket is staged whatever it is."""
        return max(0, self.staging_bytes - self._msg_numel * grad.element_size())

    def _fill(self, e: Param, b: Bucket, pc: Piece) -> None:
        """Stage one piece: copy it from the (scaled) gradient into its bucket, or alias the
        bucket to the gradient (``_aliasable``)."""
        grad = e.param.main_grad  # type: ignore[attr-defined]
        if b.buf is None and self._aliasable(b):
            if e.kind is None:
                b.buf = grad.view(-1)
            else:
                u, a = e.numel_unit, e.units[0]  # type: ignore[index]
                b.buf = grad.view(-1)[(pc.lo - a) * u:(pc.hi - a) * u]
            b.alias = True
            return
        seg = self._buffer(b, grad)[pc.offset:pc.offset + pc.numel]
        if e.kind is None:
            seg.copy_(grad.view(-1))
            return
        lo, hi = max(pc.lo, e.units[0]), min(pc.hi, e.units[1])  # type: ignore[index]
        if hi > lo:
            u = e.numel_unit
            self._read(e, lo, hi, seg[(lo - pc.lo) * u:(hi - pc.lo) * u])

    def use_reduce_scatter(self, slices: list[tuple[int, int, int]]) -> None:
        """Distributed optimizer (zero.py): reduce each bucket with a reduce-scatter; member
        ``j`` of its group keeps slice ``j`` (``bucket.out``), per bucket (members, j, chunk).
        Then nobody receives the reduced gradient itself (no return path, no replicated
        sharing: ``main_grad`` keeps the local, unreduced values after the sync); the grad
        norm is summed from the slices (``_finish_scattered``)."""
        assert len(slices) == len(self.buckets)
        for b, sl in zip(self.buckets, slices, strict=True):
            b.scatter = sl
        self.scattering = True
        self._scattered = None
        self.shared = []

    def _post(self, e: Param) -> None:
        grad = e.param.main_grad  # type: ignore[attr-defined]
        w = self.ctx.weight
        if e.kind is None:
            if self.stage_mode:  # partial sums (SP) add up over TP; full copies count t times
                grad.mul_(w if e.partial else w / self.ctx.degree)
            elif self.leaders is not None:
                grad.mul_(w)
            # else: the leader's result arrives in finish's TP all-reduce
            return  # the pieces are staged into their buckets by _stage
        grad.mul_(w)
        self.reshard.fill(e)  # sent by _advance once filled

    def _launch(self, *, block: bool) -> None:
        """Launch what is ready, then retire what is reduced (``_retire``)."""
        self._launch_ready(block=block)
        self._retire(block=block)

    def _launch_ready(self, *, block: bool) -> None:
        """Launch buckets strictly in order; stop at one not complete or with pieces missing."""
        while self.launched < len(self.buckets):
            b = self.buckets[self.launched]
            if self.launched >= self.staged:
                return
            if not block and not all(m.done or (m.work is not None and m.work.is_completed())
                                     for m in b.in_msgs):
                return
            for m in b.in_msgs:
                self._scatter_in(m, b)
            assert b.buf is not None
            if b.scatter is None:
                b.work = self.comm.all_reduce(b.buf, group=b.group, async_op=True)
            else:
                b.out = self._alloc(torch.empty(b.scatter[2], dtype=b.buf.dtype,
                                                device=b.buf.device))
                b.work = self.comm.reduce_scatter_tensor(b.out, b.buf, group=b.group,
                                                         async_op=True)
            self.launched += 1

    def _retire(self, *, block: bool) -> None:
        """Retire launched buckets in launch order: wait, write the reduced values back (own
        units into the gradient, returned units into their messages' buffers, the norm slots)
        and free the buffer, so the step's extra memory is the buckets in flight, not a second
        copy of the gradient. From the hooks (``block=False``) only those already complete:
        nothing ever waits there."""
        while self.retired < self.launched:
            b = self.buckets[self.retired]
            if not block and b.work is not None and not b.work.is_completed():
                return
            self._retire_one(b)
            self.retired += 1

    def _retire_one(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        assert b.buf is not None
        if b.scatter is None:
            # the pieces' sums of squares into their slots, all at once (norm.py)
            norm.add_bucket(b, b.norm, self._tp_buffer(b.buf.device)[:self.n_slots])
            for pc in b.spec.pieces:
                e = self.order[pc.param]
                seg = b.buf[pc.offset:pc.offset + pc.numel]
                if e.kind is None:  # replicated: back into the gradient
                    if not b.alias:
                        e.param.main_grad.view(-1).copy_(seg)  # type: ignore[attr-defined]
                    continue
                lo, hi = max(pc.lo, e.units[0]), min(pc.hi, e.units[1])  # type: ignore[index]
                if hi > lo and not b.alias:
                    u = e.numel_unit
                    self._write(e, lo, hi, seg[(lo - pc.lo) * u:(hi - pc.lo) * u])
            for m in b.in_msgs:  # the way back: reduced units into the message buffers
                assert m.buf is not None
                for tb, off, moff, n in m.targets:
                    if tb is b:
                        m.buf[moff:moff + n].copy_(b.buf[off:off + n])
        if not b.alias:
            self._live -= nbytes(b.buf)
            self._staging -= nbytes(b.buf)
        b.buf, b.retired = None, True  # reduce-scatter: the slice stays in b.out

    def _tp_buffer(self, device: torch.device) -> torch.Tensor:
        if self._tp is None:
            shared = sum(e.param.numel() for e in self.shared)
            self._tp = self._alloc(torch.zeros(self.n_slots + shared, dtype=torch.float64,
                                               device=device))
        return self._tp

    def _scatter_in(self, m: Msg, b: Bucket) -> None:
        """Wait for an incoming message (once) and copy its pieces for bucket ``b`` in (each
        bucket takes its own part when it launches: a message straddling two buckets never
        makes the later one allocate outside the staging window)."""
        if not m.done:
            assert m.work is not None, "a bucket's message was never posted"
            m.work.wait()
            m.done = True
        assert m.buf is not None
        for tb, off, moff, n in m.targets:
            if tb is b:
                self._buffer(b, m.buf)[off:off + n].copy_(m.buf[moff:moff + n])

    @property
    def grad_sumsq(self) -> float:
        """Squared grad norm of the last finished step (module docstring); reading it is the
        step's one host sync of the norm."""
        if isinstance(self._sumsq, torch.Tensor):
            self._sumsq = float(self._sumsq)
        return self._sumsq

    @grad_sumsq.setter
    def grad_sumsq(self, value: float) -> None:
        self._sumsq = value

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
        if not all(self.ready):
            if strict:
                missing = self.not_ready()
                raise RuntimeError(
                    f"gradient sync: {len(missing)} parameter(s) were never marked ready in "
                    f"backward (no gradient hook fired), e.g. {missing[:5]}; every parameter "
                    "must take part in the loss on every rank")
            return
        self._advance()  # everything is posted now: every message is filled
        self._stage(block=True)  # every piece staged (within the staging window)
        self._launch(block=True)  # and every bucket reduced and retired
        device = self.order[0].param.device if self.order else torch.device("cpu")
        shared = sum(e.param.numel() for e in self.shared)
        tp_buf = self._tp_buffer(device)
        sumsq = tp_buf[:self.n_slots]
        if self.scattering:
            self._finish_scattered(sumsq)
        else:
            self.reshard.back()
        if self.ctx.tp_rank == 0 and shared:
            tp_buf[self.n_slots:].copy_(torch.cat(
                [e.param.main_grad.reshape(-1) for e in self.shared]))  # type: ignore
        # One contributor per slot in every TP group: the sum is exact, the total the same bits
        # in every replica. (With pipeline stages this becomes the replica's model-parallel
        # group.)
        self.comm.all_reduce(tp_buf, group=self.groups.tp)
        off = self.n_slots
        for e in self.shared:  # fp32/bf16 -> fp64 -> back is exact
            grad = e.param.main_grad  # type: ignore[attr-defined]
            grad.view(-1).copy_(tp_buf[off:off + grad.numel()])
            off += grad.numel()
        self.sumsq_slots = sumsq
        self._sumsq = sumsq.sum()  # read (one host sync) only when the norm is asked for
        self._clear()
        self.done = True

    def pair_ops(self, outs: list[Any], ins: list[Any], *, back: bool) -> list[p2p.Op]:
        """One exchange over the reshard messages (``Reshard.pair_ops``)."""
        return self.reshard.pair_ops(outs, ins, back=back)

    def back_ops(self, outs: list[Any], ins: list[Any]) -> list[p2p.Op]:
        return self.reshard.pair_ops(outs, ins, back=True)

    def _finish_scattered(self, sumsq: torch.Tensor) -> None:
        """Reduce-scatter mode: wait; each piece's sum of squares from its members' slices
        (``norm.Scattered``)."""
        self.reshard.wait_sent()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        if self._scattered is None:
            self._scattered = norm.Scattered(self.order, self.buckets, self.ctx.tp_rank,
                                             self.comm)
        self._scattered(sumsq)

    def warm_up(self) -> None:
        """Initialise every communicator the sync uses now, not lazily inside step 0 under the
        step heartbeat (NCCL creates a communicator at its first collective, a pair's at its
        first un-batched p2p). Collective over this rank's groups, each visited in one global
        order (sorted by member ranks: no two ranks wait on each other's first use), then one
        element per reshard message in the step's own pair order, un-batched (the forward
        path) and as one exchange (the return path)."""
        device = self.order[0].param.device if self.order else torch.device("cpu")
        named: dict[int, tuple[tuple[int, ...], str, Any]] = {}
        candidates = [("tp", self.groups.tp), ("stage", self.groups.stage),
                      ("leaders", self.leaders), ("replica", self.groups.replica)]
        candidates += [("sync", b.group) for b in self.buckets]
        for label, g in candidates:
            if g is not None and id(g) not in named:
                named[id(g)] = (tuple(dist.get_process_group_ranks(g)), label, g)
        for _, _, g in sorted(named.values(), key=lambda x: (x[0], x[1])):
            dist.all_reduce(torch.zeros(1, device=device), group=g)
        self.reshard.warm_up(device)

    def nonfinite_params(self) -> list[str]:
        """Parameters whose reduced gradient holds NaN/Inf (the same list on every rank)."""
        return norm.nonfinite(self.order, self.sumsq_slots)

    def _clear(self) -> None:
        for b in self.buckets:
            b.work = None
            if not self.keep_buckets or b.scatter is not None:
                b.buf = None
            if not self.keep_buckets:
                b.out = None
        self.reshard.clear()
        self._tp = None
        self._live = self.live_bytes()
        self._staging = sum(nbytes(b.buf) for b in self.buckets if not b.alias)

    def live_bytes(self) -> int:
        """Bytes of the sync's buffers alive now (buckets, slices, messages; a bucket reduced in
        place in the gradient costs none)."""
        return (sum(0 if b.alias else nbytes(b.buf) for b in self.buckets)
                + sum(nbytes(b.out) for b in self.buckets)
                + self.reshard.live_bytes())

    def release_buckets(self) -> None:
        """Free the reduced bucket buffers kept for the distributed optimizer."""
        for b in self.buckets:
            b.buf, b.out = None, None
        self._live = self.live_bytes()
        self._staging = 0

