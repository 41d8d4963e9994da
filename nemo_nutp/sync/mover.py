"""Moves per-parameter tensors to the sync layout's buckets and back (the distributed
optimizer's data path, ``zero.py``): the gradient sync's reshard messages reused for
parameters and optimizer state. Collective over the rank's TP group (p2p via ``p2p``) and,
without sequence parallelism, one TP broadcast of the replicated parameters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import p2p
from .engine import GradSyncEngine, _Param


class BucketMover:
    """Moves per-parameter tensors (shaped like the local parameters) to the sync layout's
    buckets and back, over the engine's reshard messages; the data path of the gradient sync
    reused for parameters and optimizer state."""

    def __init__(self, engine: GradSyncEngine) -> None:
        self.engine = engine
        self.where = {id(b): i for i, b in enumerate(engine.buckets)}

    def to_buckets(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Full bucket buffers of ``tensors`` (one per entry of ``engine.order``): holders send
        the units they do not own to their owner. Replicas hold the same values, so no reduction."""
        eng = self.engine
        bufs = [torch.zeros(b.spec.numel, dtype=dtype, device=_device(tensors))
                for b in eng.buckets]
        ins = [torch.empty(m.spec.numel, dtype=dtype, device=_device(tensors))
               for m in eng.in_msgs]
        outs = []
        for m in eng.out_msgs:
            buf = torch.empty(m.spec.numel, dtype=dtype, device=_device(tensors))
            for param, lo, hi, off, n in m.spec.pieces:
                eng._read(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
            outs.append(buf)
        works = p2p.backend().exchange(eng.pair_ops(outs, ins, back=False))
        for i, e in enumerate(eng.order):
            for b, pc in e.pieces:
                seg = bufs[self.where[id(b)]][pc.offset:pc.offset + pc.numel]
                self._local(e, pc, seg, tensors[i], write=False)
        for work in works:
            work.wait()
        for m, buf in zip(eng.in_msgs, ins, strict=True):
            for b, off, moff, n in m.targets:
                bufs[self.where[id(b)]][off:off + n].copy_(buf[moff:moff + n])
        return bufs

    def from_buckets(self, bufs: list[torch.Tensor | None], tensors: list[torch.Tensor]) -> None:
        """Write full bucket buffers into ``tensors``: owners write their own units and return
        the others to their holders; replicated values reach the leader's TP group."""
        eng = self.engine
        dtype, device = tensors[0].dtype, tensors[0].device
        outs = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.out_msgs]
        ins = []
        for m in eng.in_msgs:
            buf = torch.empty(m.spec.numel, dtype=dtype, device=device)
            for b, off, moff, n in m.targets:
                buf[moff:moff + n].copy_(bufs[self.where[id(b)]][off:off + n])  # type: ignore
            ins.append(buf)
        works = p2p.backend().exchange(eng.back_ops(outs, ins))
        for i, e in enumerate(eng.order):
            for b, pc in e.pieces:
                src = bufs[self.where[id(b)]]
                assert src is not None
                self._local(e, pc, src[pc.offset:pc.offset + pc.numel], tensors[i], write=True)
        for work in works:
            work.wait()
        for m, buf in zip(eng.out_msgs, outs, strict=True):
            for param, lo, hi, off, n in m.spec.pieces:
                eng._write(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
        self._share_replicated(tensors)

    def from_gathered(self, gathered: Iterable[tuple[int, torch.Tensor]],
                      tensors: list[torch.Tensor]) -> None:
        """``from_buckets`` over buckets that arrive one by one (``(bucket index, buffer)`` in
        bucket order) and are dropped once written: owners write their own units at once and
        copy the returned ones into the (smaller) message buffers; then the same one exchange
        of the return path as ``from_buckets``."""
        eng = self.engine
        dtype, device = tensors[0].dtype, tensors[0].device
        ins = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.in_msgs]
        slot = {id(m): j for j, m in enumerate(eng.in_msgs)}
        for i, buf in gathered:
            b = eng.buckets[i]
            for pc in b.spec.pieces:
                self._local(eng.order[pc.param], pc, buf[pc.offset:pc.offset + pc.numel],
                            tensors[pc.param], write=True)
            for m in b.in_msgs:
                for tb, off, moff, n in m.targets:
                    if tb is b:
                        ins[slot[id(m)]][moff:moff + n].copy_(buf[off:off + n])
        outs = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.out_msgs]
        for work in p2p.backend().exchange(eng.back_ops(outs, ins)):
            work.wait()
        for m, buf in zip(eng.out_msgs, outs, strict=True):
            for param, lo, hi, off, n in m.spec.pieces:
                eng._write(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
        self._share_replicated(tensors)

    def _local(self, e: _Param, pc: Any, seg: torch.Tensor, t: torch.Tensor, *,
               write: bool) -> None:
        if e.kind is None:
            if write:
                t.view(-1).copy_(seg)
            else:
                seg.copy_(t.view(-1))
            return
        assert e.units is not None
        lo, hi = max(pc.lo, e.units[0]), min(pc.hi, e.units[1])
        if hi <= lo:
            return
        part = seg[(lo - pc.lo) * e.numel_unit:(hi - pc.lo) * e.numel_unit]
        if write:
            self.engine._write(e, lo, hi, part, t)
        else:
            self.engine._read(e, lo, hi, part, t)

    def _share_replicated(self, tensors: list[torch.Tensor]) -> None:
        """Without sequence parallelism only the TP-rank-0 leader holds replicated values in
        its buckets: broadcast them in the TP group (the engine's rule for gradients)."""
        eng = self.engine
        idx = [i for i, e in enumerate(eng.order) if e.kind is None]
        if eng.stage_mode or eng.ctx.degree == 1 or not idx:
            return
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.broadcast(flat, src=eng.ranks[0], group=eng.groups.tp)
        off = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].view(-1).copy_(flat[off:off + n])
            off += n


def _device(tensors: list[torch.Tensor]) -> torch.device | None:
    return tensors[0].device if tensors else None
