"""The reshard messages of one rank's gradient sync (``engine.py``, step 2 and 3 of its
docstring): units a rank holds but does not own go to their sync owner and come back reduced.

Transfers are coalesced per peer into messages of about ``bucket_size`` elements
(``descriptors.plan_messages``); both sides list them in canonical order (parameter, shard,
unit), so they cut the same messages. Ordering contract (``p2p.py``): per peer, both directions'
messages are posted in one sequence both sides derive alike (``Msg.key``); the forward path
posts them one by one from the backward hooks (a receive at once, a send once its message is
filled), the way back as one exchange in ``finish``. Nothing here blocks in the hooks.

All p2p goes through ``p2p.backend()``; buffers are accounted by the engine's ``alloc``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layout import PARAM_KINDS
from . import p2p
from .descriptors import RankSync, plan_messages
from .state import Msg, Param, nbytes, read_units, write_units


class Reshard:
    """One rank's reshard messages and its per-peer posting state (reset every step)."""

    def __init__(self, order: list[Param], sync: RankSync, me: int, bucket_size: int,
                 alloc: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.order, self.alloc = order, alloc
        outs, ins = [], []
        for i, e in enumerate(order):
            if e.kind is None:
                continue
            u = e.numel_unit
            outs += [(dst, i, lo, hi, (hi - lo) * u) for dst, lo, hi in e.sends]
            for sh in sync.spaces[PARAM_KINDS[e.kind].space].owned:
                ins += [(src, i, lo, hi, (hi - lo) * u) for src, lo, hi in sh.recvs]
        self.out_msgs = [Msg(m, sender=me) for m in plan_messages(outs, bucket_size)]
        self.in_msgs = [Msg(m, sender=m.peer) for m in plan_messages(ins, bucket_size)]
        # Per peer, both directions' messages in the order both sides agree on (p2p.py): the
        # forward reshard posts each pair's operations in this order only.
        self.pairs: dict[int, list[tuple[p2p.Kind, Msg]]] = {}
        for kind, msgs in (("send", self.out_msgs), ("recv", self.in_msgs)):
            for m in msgs:
                self.pairs.setdefault(m.spec.peer, []).append((kind, m))  # type: ignore[arg-type]
        for seq in self.pairs.values():
            seq.sort(key=lambda km: km[1].key)
        for m in self.out_msgs:
            for item in m.spec.pieces:
                order[item[0]].out_pieces.append((m, item))
        self._targets()
        self.reset()

    def _targets(self) -> None:
        """Where each incoming piece goes: its owned shard's bucket pieces (``Param.pieces``,
        set before), cut where a transfer straddles two buckets."""
        for m in self.in_msgs:
            for param, lo, hi, moff, _n in m.spec.pieces:
                e = self.order[param]
                u = e.numel_unit
                for b, pc in e.pieces:
                    a, z = max(lo, pc.lo), min(hi, pc.hi)
                    if z <= a:
                        continue
                    m.targets.append((b, pc.offset + (a - pc.lo) * u, moff + (a - lo) * u,
                                      (z - a) * u))
                    if m not in b.in_msgs:
                        b.in_msgs.append(m)

    def reset(self) -> None:
        self.sent_bytes = 0  # reshard bytes this rank sent this step (there and back)
        self.pair_pos = dict.fromkeys(self.pairs, 0)  # per peer: operations posted this step

    def fill(self, e: Param) -> None:
        """Copy the (scaled) units of ``e`` this rank sends into their messages."""
        grad = e.param.main_grad  # type: ignore[attr-defined]
        for m, (_, lo, hi, off, n) in e.out_pieces:  # sent by advance once filled
            if m.buf is None:
                m.buf = self.alloc(torch.empty(m.spec.numel, dtype=grad.dtype,
                                               device=grad.device))
            read_units(e, lo, hi, m.buf[off:off + n])

    def advance(self, posted: int) -> None:
        """Post each pair's next operations in the pair's order: a receive at once, a send once
        its message is filled (its last parameter among the ``posted`` first). Never blocks."""
        for peer, seq in self.pairs.items():
            i = self.pair_pos[peer]
            while i < len(seq):
                kind, m = seq[i]
                if kind == "recv":
                    like = self.order[m.spec.pieces[0][0]].param.main_grad  # type: ignore
                    m.buf = self.alloc(torch.empty(m.spec.numel, dtype=like.dtype,
                                                   device=like.device))
                    m.work = p2p.backend().irecv(m.buf, peer)
                elif m.spec.pieces[-1][0] < posted:
                    assert m.buf is not None
                    m.work = p2p.backend().isend(m.buf, peer)
                    self.sent_bytes += nbytes(m.buf)
                else:
                    break
                i += 1
            self.pair_pos[peer] = i

    def pair_ops(self, outs: list[Any], ins: list[Any], *, back: bool) -> list[p2p.Op]:
        """One exchange over the reshard messages with one buffer per message (``outs``: per
        ``out_msgs``, ``ins``: per ``in_msgs``), per peer in the pair's order: forward
        (holders send, owners receive) or back (owners send, holders receive)."""
        seq = []
        for kind, msgs, bufs in (("send", self.out_msgs, outs), ("recv", self.in_msgs, ins)):
            if back:
                kind = "recv" if kind == "send" else "send"
            seq += [(m.spec.peer, m.key, kind, buf)
                    for m, buf in zip(msgs, bufs, strict=True)]
        seq.sort(key=lambda x: (x[0], x[1]))
        return [p2p.Op(kind, buf, peer) for peer, _, kind, buf in seq]  # type: ignore[arg-type]

    def back(self) -> None:
        """Owners return reduced pieces to their holders in the same coalesced messages
        (buffers reused; the engine's retire filled the incoming ones): one exchange, after
        every forward message, each pair's messages in the pair's order; then every holder
        writes its returned units into its gradient."""
        for m in self.out_msgs:  # forward sent: the buffer now receives the way back
            m.work.wait()
        for m in self.in_msgs:
            self.sent_bytes += nbytes(m.buf)
        ops = self.pair_ops([m.buf for m in self.out_msgs], [m.buf for m in self.in_msgs],
                            back=True)
        works = p2p.backend().exchange(ops)
        for m in self.out_msgs:
            m.work = None
        for work in works:
            work.wait()
        for m in self.out_msgs:
            for param, lo, hi, off, n in m.spec.pieces:
                write_units(self.order[param], lo, hi, m.buf[off:off + n])  # type: ignore

    def wait_sent(self) -> None:
        for m in self.out_msgs:
            m.work.wait()  # type: ignore[union-attr]

    def warm_up(self, device: torch.device) -> None:
        """One element per message in the step's own pair order, un-batched (the forward
        path), then as one exchange (the return path): every pair communicator exists before
        step 0."""
        if not self.pairs:
            return
        works = []
        for peer in sorted(self.pairs):
            for kind, _ in self.pairs[peer]:
                t = torch.zeros(1, device=device)
                works.append(p2p.backend().isend(t, peer) if kind == "send"
                             else p2p.backend().irecv(t, peer))
        for w in works:
            w.wait()
        ones = [torch.zeros(1, device=device) for _ in self.out_msgs]
        back = self.pair_ops(ones, [torch.zeros(1, device=device) for _ in self.in_msgs],
                             back=True)
        for w in p2p.backend().exchange(back):
            w.wait()

    def clear(self) -> None:
        for m in self.out_msgs + self.in_msgs:
            m.buf, m.work, m.done = None, None, False

    def live_bytes(self) -> int:
        return sum(nbytes(m.buf) for m in self.out_msgs + self.in_msgs)
