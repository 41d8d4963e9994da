"""The exact grad norm of the gradient sync (``engine.py``, "Grad norm" in its docstring).

Every element of the reduced gradient is counted exactly once, on the sync layout: each sync
shard's owner sums the squares of its reduced piece into the shard's slot of a small fp64
vector (TP rank 0 does the replicated parameters); the vector's all-reduce over the TP group
and its sum in slot order give the same bits on every rank of every replica.

``sumsq`` is the kernel (fp64 accumulation, deterministic for the same tensor on any rank).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from .descriptors import Piece
from .state import Bucket, Param


def sumsq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares accumulated in fp64 (deterministic for the same tensor on any rank)."""
    return torch.sum(torch.square(t.float()), dtype=torch.float64)


def scattered(order: list[Param], buckets: list[Bucket], slots: torch.Tensor,
              tp_rank: int) -> None:
    """Reduce-scatter mode (distributed optimizer): each piece's sum of squares from its
    members' slices, into ``slots``.

    Per group, one small all-reduce of a (pieces x members) fp64 matrix, one contributor per
    entry (exact); each piece's row summed in member order gives the same bits on every
    member, which the owner writes into its slot (replicated: TP rank 0)."""
    items: dict[Hashable, list[tuple[Bucket, Piece]]] = {}
    for b in buckets:  # canonical order: groups by their first bucket, on all members
        items.setdefault(b.spec.key, []).extend((b, pc) for pc in b.spec.pieces)
    pending = []
    for its in items.values():
        size = its[0][0].scatter[0]  # type: ignore[index]
        mat = torch.zeros(len(its), size, dtype=torch.float64, device=slots.device)
        for r, (b, pc) in enumerate(its):
            _, j, chunk = b.scatter  # type: ignore[misc]
            a, z = max(j * chunk, pc.offset), min((j + 1) * chunk, pc.offset + pc.numel)
            if z > a:
                mat[r, j] = sumsq(b.out[a - j * chunk:z - j * chunk])  # type: ignore
        pending.append((its, mat, dist.all_reduce(mat, group=its[0][0].group,
                                                  async_op=True)))
    for its, mat, work in pending:
        work.wait()  # type: ignore[union-attr]
        totals = mat.sum(dim=1)
        for r, (_, pc) in enumerate(its):
            e = order[pc.param]
            if e.kind is not None:
                slots[e.slot + pc.k] += totals[r]
            elif tp_rank == 0:
                slots[e.slot] = totals[r]


def nonfinite(order: list[Param], slots: torch.Tensor | None) -> list[str]:
    """Parameters whose slots hold NaN/Inf."""
    if slots is None:
        return []
    bad = ~torch.isfinite(slots.cpu())
    return [e.name for e in order if bool(bad[e.slot:e.slot + e.n_slots].any())]
