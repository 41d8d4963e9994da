"""Pair-order replay: the gradient sync's own posting code, every rank of a replica stage, one
process, no process group, no data.

Each rank's ``GradSyncEngine`` is built from the real plan and descriptors over parameters of
the stage's real shapes on the ``meta`` device (no memory, no arithmetic); collectives are
stubbed (they complete at once) and every p2p operation is recorded — at the adapter
(``nemo_nutp.sync.p2p.BACKEND``) and, for code that calls torch directly (the posting code
before the adapter existed), at ``dist.isend`` / ``dist.irecv`` / ``dist.batch_isend_irecv`` of
the sync modules. One step is driven as megatron drives it (``mark_ready`` per parameter in
backward order, then ``finish``), then the distributed optimizer's ``BucketMover`` moves
parameters to the buckets and back.

``mismatches`` then checks NCCL's rule per rank pair: un-batched p2p between two ranks runs in
posting order and each operation blocks until the peer's matching one, so the two sides' op
sequences must match head to head (one side's ``send`` against the other's ``recv`` of the same
size, op by op). Gloo accepts other orders; NCCL hangs on them.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

import nemo_nutp.sync.engine as engine_mod
import nemo_nutp.sync.zero as zero_mod
from nemo_nutp.layout import SPACES, Plan
from nemo_nutp.parallel.groups import NUTPGroups, rank_context
from nemo_nutp.sync.descriptors import rank_sync
from nemo_nutp.sync.shapes import stage_parameters

Record = tuple[int, str, int]  # (peer, "send" | "recv", elements)


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Recorder:
    """p2p stand-in: records (peer, kind, numel) per posting rank; every op completes."""

    def __init__(self) -> None:
        self.rank = -1
        self.ops: dict[int, list[Record]] = defaultdict(list)

    def isend(self, tensor: torch.Tensor, peer: int, *args: Any, **kw: Any) -> _Done:
        self.ops[self.rank].append((int(peer), "send", tensor.numel()))
        return _Done()

    def irecv(self, tensor: torch.Tensor, peer: int, *args: Any, **kw: Any) -> _Done:
        self.ops[self.rank].append((int(peer), "recv", tensor.numel()))
        return _Done()

    def exchange(self, ops: list[Any]) -> list[_Done]:
        return [self.isend(op.tensor, op.peer) if op.kind == "send"
                else self.irecv(op.tensor, op.peer) for op in ops]

    def batch_isend_irecv(self, ops: list[Any]) -> list[_Done]:
        return [self.isend(op.tensor, op.peer) if op.op.__name__ == "isend"
                else self.irecv(op.tensor, op.peer) for op in ops]


def _fake_dist(rec: Recorder) -> types.SimpleNamespace:
    def collective(*args: Any, **kw: Any) -> _Done:
        return _Done()

    import torch.distributed as dist

    return types.SimpleNamespace(
        all_reduce=collective, reduce_scatter_tensor=collective, broadcast=collective,
        all_gather_into_tensor=collective, isend=rec.isend, irecv=rec.irecv,
        batch_isend_irecv=rec.batch_isend_irecv, P2POp=dist.P2POp, ProcessGroup=object,
        get_backend=lambda *a, **k: "nccl")


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Route the sync modules' collectives to no-ops and their p2p to a ``Recorder``."""
    rec = Recorder()
    fake = _fake_dist(rec)
    mods: list[Any] = [engine_mod, zero_mod]
    try:  # the grad-norm module (its reduce-scatter norm all-reduces), since the engine's split
        import nemo_nutp.sync.norm as norm_mod
    except ImportError:
        pass
    else:
        mods.append(norm_mod)
    try:
        import nemo_nutp.sync.mover as mover_mod  # the mover's own module (after its split)

        mods.append(mover_mod)
    except ImportError:
        pass
    try:  # the data path's ops (parallel/comm.py: Direct, for groups without a Comm)
        import nemo_nutp.parallel.comm as comm_mod

        mods.append(comm_mod)
    except ImportError:
        pass
    mods = [m for m in mods if hasattr(m, "dist")]
    saved: list[tuple[Any, str, Any]] = [(m, "dist", m.dist) for m in mods]
    try:
        from nemo_nutp.sync import p2p
    except ImportError:  # the posting code before the adapter
        p2p = None  # type: ignore[assignment]
    if p2p is not None:
        saved += [(p2p, "BACKEND", p2p.BACKEND), (p2p, "dist", p2p.dist)]
        p2p.BACKEND = rec
        p2p.dist = fake  # type: ignore[assignment]
    for m in mods:
        m.dist = fake
    try:
        yield rec
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def fake_groups(plan: Plan, rank: int) -> NUTPGroups:
    """This rank's groups as names (the stubbed collectives never look inside)."""
    ctx = rank_context(plan, rank)
    rs = rank_sync(plan, rank)
    sync: dict[tuple[int, str, tuple[int, ...]], Any] = {}
    for space in SPACES:
        for sh in rs.spaces[space].owned:
            sync[(ctx.stage, space, sh.owners)] = ("sync", ctx.stage, sh.owners)
    return NUTPGroups(ctx=ctx, pgs=None, tp=("tp", rank), stage=("stage", ctx.stage),  # type: ignore[arg-type]
                      leaders=("leaders", ctx.stage) if ctx.tp_rank == 0 else None,
                      sync=sync)


def _engine(plan: Plan, rank: int, *, bucket_size: int, layers: int | None
            ) -> Any:
    """The engine's own construction for ``rank``, over fake groups."""
    return engine_mod.GradSyncEngine(plan, fake_groups(plan, rank),
                                     stage_parameters(plan, rank, layers=layers),
                                     bucket_size=bucket_size)


def replay_ranks(plan: Plan, ranks: list[int], *, bucket_size: int, layers: int | None = None,
                 step: bool = True, mover: bool = True) -> dict[int, list[Record]]:
    """Every rank's recorded p2p of one step (``step``) and of the distributed optimizer's
    moves (``mover``)."""
    with recording() as rec:
        for r in ranks:
            rec.rank = r
            eng = _engine(plan, r, bucket_size=bucket_size, layers=layers)
            if step:
                for e in eng.order:  # backward order, one readiness call per parameter
                    eng.mark_ready([e.param])
                eng.finish(strict=True)
            if mover:
                eng.keep_buckets = True
                mv = zero_mod.BucketMover(eng)
                tensors = [torch.empty_like(e.param) for e in eng.order]
                bufs = mv.to_buckets(tensors, torch.float32)
                mv.from_buckets(list(bufs), tensors)
        return dict(rec.ops)


def _members(plan: Plan, group: Any) -> tuple[int, ...]:
    """Global ranks of a fake group, in group-rank order (``parallel.groups`` makes every
    group over its sorted ranks)."""
    kind, stage = group[0], group[1]
    if kind == "sync":
        return tuple(sorted(group[2]))
    if kind == "leaders":
        return tuple(sorted(rep.ranks[stage][0] for rep in plan.replicas))
    assert kind == "stage", group
    return tuple(sorted(r for rep in plan.replicas for r in rep.ranks[stage]))


def replay_ring(plan: Plan, ranks: list[int], *, bucket_size: int, layers: int | None = None
                ) -> dict[int, list[Record]]:
    """Every rank's recorded p2p of the distributed optimizer's redundancy ring
    (``zero.ring_ops``: each bucket's chunk to the next member of its group), for ``ranks``:
    all ranks of one stage, every replica (the ring crosses replicas)."""
    with recording() as rec:
        for r in ranks:
            rec.rank = r
            eng = _engine(plan, r, bucket_size=bucket_size, layers=layers)
            slices = []
            for b in eng.buckets:
                members = _members(plan, b.group)
                j = members.index(r)
                start, stop, chunk = zero_mod.bucket_slice(b.spec.numel, len(members), j)
                slices.append(zero_mod._Slice(b.group, len(members), j, start, stop, chunk,
                                              members))
            bufs = [torch.empty(sl.chunk, device="meta") for sl in slices]
            rec.exchange(zero_mod.ring_ops(slices, bufs, bufs, r))
        return dict(rec.ops)


def stage_ranks(plan: Plan) -> list[list[int]]:
    """Per stage, its ranks in every replica."""
    return [sorted(r for rep in plan.replicas for r in rep.ranks[s]) for s in range(plan.pp)]


def mismatches(ops: dict[int, list[Record]]) -> list[str]:
    """Per rank pair, where the two op sequences stop matching head to head (empty: none)."""
    per: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for r, seq in ops.items():
        for peer, kind, n in seq:
            per[(r, peer)].append((kind, n))
    bad = []
    for a, b in sorted({tuple(sorted(k)) for k in per}):
        sa, sb = per.get((a, b), []), per.get((b, a), [])
        for i in range(max(len(sa), len(sb))):
            x = sa[i] if i < len(sa) else None
            y = sb[i] if i < len(sb) else None
            if x is None or y is None or x[0] == y[0] or x[1] != y[1]:
                bad.append(f"ranks {a}<->{b} op {i}: {a} posts {x}, {b} posts {y}")
                break
    return bad


def p2p_ranks(plan: Plan) -> list[list[int]]:
    """The replica stages whose ranks exchange reshard messages (p2p never leaves one)."""
    out = []
    for rep in plan.replicas:
        for ranks in rep.ranks:
            if any(sp.sends or any(sh.recvs for sh in sp.owned)
                   for r in ranks for sp in rank_sync(plan, r).spaces.values()):
                out.append(list(ranks))
    return out
