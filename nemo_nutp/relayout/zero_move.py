"""Move the distributed optimizer's state into a new layout in memory (``recovery.mode=live``
with ``recovery.live_redundancy``; ``sync/zero.py``).

Under the distributed optimizer every element of the model's optimizer state (fp32 master,
Adam moments) lives on exactly one rank, in a slice of a sync bucket, plus — with redundancy —
a copy on the next member of the bucket's group. Slices follow the sync layout, so a new
layout cuts them anew everywhere; what identifies an element across layouts is its *global
coordinate*: (stage, parameter name, element), the element numbered unit by unit in the
canonical order the sync buckets use (``layout.units``; a replicated parameter element by
element). ``move_zero`` (collective over the new world, every survivor, its old and its new
optimizer):

1. offers: each survivor's old primary slices, and the copies it keeps of the slices of ranks
   that are gone (dead, or left out by the new plan), as global-coordinate spans; needs: the
   spans of its new slices and of the new copies it keeps, less what it held itself (its old
   primaries and copies: copied locally). One ``all_gather_object`` of both lists over the new
   world.
2. every rank derives the same transfers from that directory (each need's span cut at the
   offers it meets; every element is offered exactly once, a gap — two gone ranks adjacent in
   one ring — raises ``MoveImpossible``); a span held by this rank itself is copied locally.
3. rounds of one exchange each (``p2p``): per round at most one message per ordered pair
   (a pair's spans, sorted by coordinate, cut into messages of ``chunk_bytes`` alike on both
   sides), each pair posting the lower rank's message first on both sides (NCCL-safe; on NCCL
   one batched group per round); masters and optimizer state of a span travel together
   (fp32).
4. the parameters from the masters (``publish_params``: the step's own all-gather), so the
   weights are those of the last committed step whatever a survivor's parameter all-gather
   had reached when the world stopped. A new copy and its new primary come from the same old
   holder: bit for bit equal.

Bytes received equal the lower bound (the elements of its new slices and copies this rank did
not hold, x 4 bytes x fields) by construction. Cost: the
directory is O(W x spans per rank) per rank (fine on CPU; at 10K ranks it should be computed
from the plans, ``sync/descriptors.py``, for the few ranks whose slices meet this one's:
not done); message buffers: ``chunk_bytes`` per peer per round.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ..sync import p2p
from .move import MoveImpossible

Key = tuple[int, str]  # (stage, parameter name)
Span = tuple[Key, int, int]  # global elements [a, b) of a parameter of a stage
Where = tuple[str, int, int]  # ("p" primary | "b" copy, param group, offset in its flat)


def _spans(opt: Any, stage: int, segments: list[Any], which: str, *,
           only: Any = None) -> list[tuple[Span, Where]]:
    """Global-coordinate spans of ``segments`` of ``opt`` (``only(bucket index)``: a filter)."""
    out = []
    for s in segments:
        if only is not None and not only(s.bucket):
            continue
        pc = opt.engine.buckets[s.bucket].spec.pieces[s.piece]
        e = opt.engine.order[pc.param]
        name = getattr(e.param, "nutp_name", e.name)
        if getattr(e.param, "nutp_tied_copy", False):
            name = "tied_copy:" + name
        shift = (0 if e.kind is None else pc.lo * e.numel_unit) - pc.offset
        out.append((((stage, name), s.a + shift, s.z + shift), (which, s.group, s.offset)))
    return out


def _transfers(dirs: list[tuple[list[Span], list[Span]]]
               ) -> list[tuple[int, int, Key, int, int, int, int]]:
    """Every (src, dst, key, lo, hi, offer index at src, need index at dst), the same list on
    every rank; ``MoveImpossible`` if some needed element is offered by nobody."""
    index: dict[Key, list[tuple[int, int, int, int]]] = defaultdict(list)
    for r, (offers, _) in enumerate(dirs):
        for j, (key, a, b) in enumerate(offers):
            index[key].append((a, b, r, j))
    for v in index.values():
        v.sort()
    starts = {k: [x[0] for x in v] for k, v in index.items()}
    out = []
    for dst, (_, needs) in enumerate(dirs):
        for i, (key, a, b) in enumerate(needs):
            found = 0
            v = index.get(key, [])
            k = max(0, bisect.bisect_right(starts.get(key, []), a) - 1)
            while k < len(v) and v[k][0] < b:
                oa, ob, src, j = v[k]
                lo, hi = max(a, oa), min(b, ob)
                if hi > lo:
                    out.append((src, dst, key, lo, hi, j, i))
                    found += hi - lo
                k += 1
            if found != b - a:
                raise MoveImpossible(f"optimizer state of {key} [{a}, {b}) is held by no "
                                     f"survivor ({found} of {b - a} elements): two ranks of "
                                     "one ring are gone")
    return out


def _common_step(old: Any, device: torch.device | None) -> int:
    step = old._step()
    t = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != -int(t[1]):
        raise RuntimeError(f"relayout: survivors hold different optimizer steps "
                           f"({-int(t[1])}..{int(t[0])})")
    return step


def _init_state(new: Any, step: int) -> None:
    """The new optimizer's state entries (filled by the move), as a stepped optimizer has."""
    if not step:
        return
    for m in (*new.masters, *new.backups):
        st = new.optimizer.state[m]
        for k in new._state_keys():
            st[k] = torch.zeros_like(m.data)
        st["step"] = torch.tensor(float(step))


def _view(fields: list[list[torch.Tensor]], where: Where, lo: int, n: int) -> list[torch.Tensor]:
    _, g, off = where
    return [f[off + lo:off + lo + n] for f in fields[g]]


@torch.no_grad()
def move_zero(old: Any, new: Any, *, dead: frozenset[int], stage: int, new_stage: int,
              chunk_bytes: int = 32 << 20) -> dict[str, Any]:
    """Fill ``new`` (the new layout's ``ZeroOptimizer``) from the survivors' ``old`` ones
    (module docstring); ``dead``: old ranks gone (their slices come from the copies).
    Collective over the new world. Returns this rank's figures (``live.move``'s keys)."""
    t0 = time.perf_counter()
    if not old.redundancy:
        raise MoveImpossible("the distributed optimizer without recovery.live_redundancy")
    device = new._dev()
    step = _common_step(old, device)
    offers = _spans(old, stage, old.segments, "p") + _spans(
        old, stage, old.backup_segments, "b", only=lambda i: old.slices[i].pred in dead)
    _init_state(new, step)
    src = {"p": old._fields(old.masters), "b": old._fields(old.backups)}
    dst = {"p": new._fields(new.masters), "b": new._fields(new.backups)}
    n_f = len(dst["p"][0]) if dst["p"] else 1
    if src["p"] and len(src["p"][0]) != n_f:
        raise RuntimeError("relayout: old and new optimizer keep different state fields")
    # what this rank held itself (its primaries and all its copies) is copied here; only the
    # rest is asked for: received bytes == the lower bound
    held = _spans(old, stage, old.segments, "p") + _spans(old, stage, old.backup_segments, "b")
    wanted = _spans(new, new_stage, new.segments, "p") + _spans(new, new_stage,
                                                                 new.backup_segments, "b")
    needs, local = _take_local(wanted, held, src, dst)
    dirs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(dirs, ([s for s, _ in offers], [s for s, _ in needs]))
    me = dist.get_rank()
    moves = [t for t in _transfers(dirs) if me in (t[0], t[1])]
    assert all(t[0] != t[1] for t in moves), "a span held here is asked for"
    pairs: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for t in moves:
        pairs[(t[0], t[1])].append(t)
    for ts in pairs.values():
        ts.sort(key=lambda t: (t[2], t[3]))
    limit = max(1, chunk_bytes // (4 * n_f))  # elements per message and round
    chunks = {sd: _chunks(ts, limit) for sd, ts in pairs.items()}
    order = pair_order(list(pairs), me)
    got = sent = peak = 0
    for r in range(max((len(c) for c in chunks.values()), default=0)):
        ops, unpack = [], []
        for s, d in order:
            if r >= len(chunks[(s, d)]):
                continue
            part = chunks[(s, d)][r]
            buf = torch.empty(sum(hi - lo for lo, hi, _, _ in part) * n_f,
                              dtype=torch.float32, device=device)
            if s == me:
                _pack_part(buf, part, offers, src)
                ops.append(p2p.Op("send", buf, d))
                sent += buf.numel() * 4
            else:
                ops.append(p2p.Op("recv", buf, s))
                unpack.append((buf, part))
                got += buf.numel() * 4
        peak = max(peak, sum(op.tensor.numel() * 4 for op in ops))
        for work in p2p.backend().exchange(ops):
            work.wait()
        for buf, part in unpack:
            off = 0
            for lo, hi, _, i in part:
                (_, na, _), nw = needs[i]
                for x in _view(dst[nw[0]], nw, lo - na, hi - lo):
                    x.copy_(buf[off:off + hi - lo])
                    off += hi - lo
    for b in new.backups if step else ():  # the copies' step, as a stepped optimizer has
        new.optimizer.state[b]["step"] = torch.tensor(float(step))
    new.publish_params()
    state = sum(t.numel() * 4 for fs in dst.values() for f in fs for t in f)
    old_state = sum(t.numel() * 4 for fs in src.values() for f in fs for t in f)
    bound = sum(b - a for (_, a, b) in (s for s, _ in needs)) * n_f * 4
    return {"received_bytes": got, "lower_bound_bytes": bound,
            "peak_memory_ratio": (old_state + state + peak) / max(1, state),
            "move_s": time.perf_counter() - t0, "local_bytes": local * n_f * 4}


def _chunks(ts: list[Any], limit: int) -> list[list[tuple[int, int, int, int]]]:
    """A pair's transfers (sorted) cut into messages of at most ``limit`` elements each,
    ``(lo, hi, offer index, need index)``; both sides cut the same list alike."""
    out: list[list[tuple[int, int, int, int]]] = [[]]
    room = limit
    for _, _, _, lo, hi, j, i in ts:
        while lo < hi:
            if room == 0:
                out.append([])
                room = limit
            n = min(room, hi - lo)
            out[-1].append((lo, lo + n, j, i))
            lo, room = lo + n, room - n
    return out if out[0] else []


def _pack_part(buf: torch.Tensor, part: list[tuple[int, int, int, int]], offers: list[Any],
               src: dict[str, list[list[torch.Tensor]]]) -> None:
    off = 0
    for lo, hi, j, _ in part:
        (_, a, _), w = offers[j]
        for y in _view(src[w[0]], w, lo - a, hi - lo):
            buf[off:off + hi - lo].copy_(y)
            off += hi - lo


def pair_order(pairs: list[tuple[int, int]], me: int) -> list[tuple[int, int]]:
    """This rank's messages ``(src, dst)`` in posting order: by peer, and with each peer the
    lower rank's message first, on both sides (NCCL's in-order pair semantics)."""
    return sorted(pairs, key=lambda sd: (sd[1] if sd[0] == me else sd[0], min(sd) != sd[0]))


def _take_local(wanted: list[tuple[Span, Where]], held: list[tuple[Span, Where]],
                src: dict[str, list[list[torch.Tensor]]],
                dst: dict[str, list[list[torch.Tensor]]]
                ) -> tuple[list[tuple[Span, Where]], int]:
    """Copy the parts of ``wanted`` this rank ``held`` (old primaries and copies); returns the
    rest (to be received) and the elements copied."""
    by: dict[Key, list[tuple[int, int, Where]]] = defaultdict(list)
    for (key, a, b), w in held:
        by[key].append((a, b, w))
    for v in by.values():
        v.sort(key=lambda x: x[0])
    starts = {k: [x[0] for x in v] for k, v in by.items()}
    rest: list[tuple[Span, Where]] = []
    copied = 0
    for (key, a, b), nw in wanted:
        v, at = by.get(key, []), a
        k = max(0, bisect.bisect_right(starts.get(key, []), a) - 1)
        while at < b:
            while k < len(v) and v[k][1] <= at:
                k += 1
            if k == len(v) or v[k][0] >= b:  # nothing held from ``at`` on
                rest.append(((key, at, b), (nw[0], nw[1], nw[2] + at - a)))
                break
            ha, hb, hw = v[k]
            if ha > at:  # a gap before the next held span
                rest.append(((key, at, ha), (nw[0], nw[1], nw[2] + at - a)))
                at = ha
            n = min(b, hb) - at
            for x, y in zip(_view(dst[nw[0]], nw, at - a, n), _view(src[hw[0]], hw, at - ha, n),
                            strict=True):
                x.copy_(y)
            copied += n
            at += n
    return rest, copied
