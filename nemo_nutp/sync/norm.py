"""The exact grad norm of the gradient sync (``engine.py``, "Grad norm" in its docstring).

Every element of the reduced gradient is counted exactly once, on the sync layout: each sync
shard's owner sums the squares of its reduced piece into the shard's slot of a small fp64
vector (TP rank 0 does the replicated parameters); the vector's all-reduce over the TP group
and its sum in slot order give the same bits on every rank of every replica.

Kernels (issue #22, finding 11): a bucket's pieces are reduced together — fused foreach
kernels for the sums of squares of all of them (``sumsqs``), one ``index_add_`` into their
slots (``Slots``) — not three small kernels per piece. Bits are the same on every rank holding
the same values: the squares go to fresh buffers (the foreach kernels' lane order depends on
each tensor's size and address alignment; a bucket aliased to the gradient sits at an offset
that differs between replicas) and every list is cut the same way on every member.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .descriptors import Piece
from .state import Bucket, Param


def sumsq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares accumulated in fp64 (deterministic for the same tensor on any rank)."""
    return torch.sum(torch.square(t.float()), dtype=torch.float64)


SQUARES_ELEMENTS = 8_000_000
"""Elements squared at once by ``sumsqs`` (a transient of 32 MB in fp32, or one piece if
larger), so a bucket's squares never take a second bucket of memory."""


def sumsqs(segs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sums of squares of ``segs`` as one 1-D fp64 tensor, ``sumsq``'s values per tensor
    (each square rounded in fp32, accumulated in fp64; the sum's order differs, so they agree
    within fp64 rounding, ~1e-16 relative) in a few fused launches per ``SQUARES_ELEMENTS``
    elements: foreach squares (fresh, aligned buffers), then a foreach fp64 L1 norm of them.
    Deterministic: the same tensors give the same bits."""
    vals: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    size = 0
    for t in [*segs, None]:
        if run and (t is None or size + t.numel() > SQUARES_ELEMENTS):
            f = [x.float() for x in run]  # (no copy for fp32 tensors)
            vals += torch._foreach_norm(torch._foreach_mul(f, f), 1, dtype=torch.float64)
            run, size = [], 0
        if t is not None:
            run.append(t)
            size += t.numel()
    return torch.stack(vals)


class Slots:
    """Adds values into the norm vector: ``dst[slot] += vals[row]`` per (row, slot) pair, in
    pair order per slot. One ``index_add_`` per pass in which every slot occurs once (CUDA adds
    repeated indices with atomics, in no fixed order, so a repeated slot would not get the same
    bits on every rank); the index tensors are made once per device, not per step."""

    def __init__(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.pairs = list(pairs)
        seen: dict[int, int] = {}
        self.passes: list[tuple[list[int], list[int]]] = []
        for row, slot in pairs:
            k = seen.get(slot, 0)
            seen[slot] = k + 1
            if k == len(self.passes):
                self.passes.append(([], []))
            self.passes[k][0].append(row)
            self.passes[k][1].append(slot)
        self._index: tuple[torch.device, list[tuple[torch.Tensor | None, torch.Tensor]]] | None
        self._index = None

    def add(self, dst: torch.Tensor, vals: torch.Tensor) -> None:
        if not self.passes:
            return
        if self._index is None or self._index[0] != dst.device:
            idx = []
            for rows, slots in self.passes:
                whole = rows == list(range(vals.numel()))
                idx.append((None if whole else torch.tensor(rows, device=dst.device),
                            torch.tensor(slots, device=dst.device)))
            self._index = (dst.device, idx)
        for rows_t, slots_t in self._index[1]:
            dst.index_add_(0, slots_t, vals if rows_t is None else vals.index_select(0, rows_t))


def bucket_plan(b: Bucket, order: list[Param], tp_rank: int) -> tuple[list[int], Slots]:
    """Which of the bucket's pieces count in this rank's slots (every sync shard piece; a
    replicated parameter only at TP rank 0), and where they go."""
    rows: list[int] = []
    pairs: list[tuple[int, int]] = []
    for i, pc in enumerate(b.spec.pieces):
        e = order[pc.param]
        if e.kind is None and tp_rank != 0:
            continue
        pairs.append((len(rows), e.slot + (pc.k if e.kind is not None else 0)))
        rows.append(i)
    return rows, Slots(pairs)


def add_bucket(b: Bucket, plan: tuple[list[int], Slots], slots: torch.Tensor) -> None:
    """Add the reduced bucket's sums of squares into ``slots`` (a shard cut over several
    buckets adds its parts in launch order, the same on every owner)."""
    rows, where = plan
    if not rows:
        return
    assert b.buf is not None
    pieces = torch.split(b.buf[:b.spec.numel], [pc.numel for pc in b.spec.pieces])
    where.add(slots, sumsqs([pieces[i] for i in rows]))


@dataclass
class _Group:
    buckets: list[tuple[Bucket, Piece]]
    size: int
    member: int
    cuts: list[tuple[int, Bucket, int, int]]  # (row, bucket, start, stop) in my slice
    column: Slots
    totals: Slots


class Scattered:
    """Reduce-scatter mode (distributed optimizer): each piece's sum of squares from its
    members' slices, into the norm slots.

    Per group, one small all-reduce of a (pieces x members) fp64 matrix, one contributor per
    entry (exact); each piece's row summed in member order gives the same bits on every
    member, which the owner adds into its slot (replicated: TP rank 0). The layout is fixed,
    so the plan is made once."""

    def __init__(self, order: list[Param], buckets: list[Bucket], tp_rank: int,
                 comm: Any) -> None:
        self.comm = comm  # parallel/comm.py's ops
        items: dict[Hashable, list[tuple[Bucket, Piece]]] = {}
        for b in buckets:  # canonical order: groups by their first bucket, on all members
            items.setdefault(b.spec.key, []).extend((b, pc) for pc in b.spec.pieces)
        self.groups = []
        for its in items.values():
            size, j, chunk = its[0][0].scatter  # type: ignore[misc]
            cuts, totals = [], []
            for r, (b, pc) in enumerate(its):
                _, j, chunk = b.scatter  # type: ignore[misc]
                a, z = max(j * chunk, pc.offset), min((j + 1) * chunk, pc.offset + pc.numel)
                if z > a:
                    cuts.append((r, b, a - j * chunk, z - j * chunk))
                e = order[pc.param]
                if e.kind is not None:
                    totals.append((r, e.slot + pc.k))
                elif tp_rank == 0:
                    totals.append((r, e.slot))
            self.groups.append(_Group(its, size, j, cuts,
                                      Slots([(i, c[0]) for i, c in enumerate(cuts)]),
                                      Slots(totals)))

    def __call__(self, slots: torch.Tensor) -> None:
        pending = []
        for g in self.groups:
            mat = torch.zeros(len(g.buckets), g.size, dtype=torch.float64, device=slots.device)
            if g.cuts:
                vals = sumsqs([b.out[a:z] for _, b, a, z in g.cuts])  # type: ignore[index]
                g.column.add(mat[:, g.member], vals)
            pending.append((g, mat, self.comm.all_reduce(mat, group=g.buckets[0][0].group,
                                                         async_op=True)))
        for g, mat, work in pending:
            work.wait()  # type: ignore[union-attr]
            g.totals.add(slots, mat.sum(dim=1))


def nonfinite(order: list[Param], slots: torch.Tensor | None) -> list[str]:
    """Parameters whose slots hold NaN/Inf."""
    if slots is None:
        return []
    bad = ~torch.isfinite(slots.cpu())
    return [e.name for e in order if bool(bad[e.slot:e.slot + e.n_slots].any())]
