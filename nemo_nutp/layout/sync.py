"""Sync layouts and reshard plans: how gradients of one unit space cross replicas.

For a pipeline stage and a unit space with ``U`` units, the *sync layout* partitions the units
into shards ``[s[k], s[k+1])``; each replica names one *owner* TP rank per shard. The DP reduction
of shard ``k`` happens among the owners of ``k`` (one per replica). Owners hold the shard in the
*sync buffer* order: units ascending by global index, each unit's elements in canonical order
(``units.global_index``), so the same element sits at the same offset in every replica.

* ``refine``: shards are cut at every boundary of every degree present; each shard lies inside one
  rank of every replica, so nothing moves (reshard bytes = 0) at the price of more, smaller groups.
* ``base``: shards are the ``max degree`` assignment (uniform DP groups for healthy replicas);
  a degraded replica's owner of a shard is the rank holding most of it, and the rest is moved to
  it. Moved units then equal the lower bound ``sum_k (shard_k size - max overlap)``.

``ReshardPlan.transfers`` lists ``(src, dst, first_unit, stop_unit)`` in TP-local rank indices.
The reverse plan (owner back to holders) is the same list with src/dst swapped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .units import assignment


@dataclass(frozen=True)
class SyncLayout:
    """Shards of one unit space in one stage, and each degree's owner of each shard."""

    num_units: int
    shards: np.ndarray  # boundaries, length S+1
    owners: dict[int, np.ndarray]  # degree -> (S,) TP-local owner rank index
    bounds: dict[int, np.ndarray]  # degree -> that degree's unit assignment (length degree+1)

    @property
    def num_shards(self) -> int:
        return len(self.shards) - 1


def overlaps(num_units: int, degree: int, shards: np.ndarray,
             bounds: np.ndarray | None = None) -> np.ndarray:
    """(S, degree) number of units of shard k held by rank j of a degree-``degree`` replica."""
    b = assignment(num_units, degree) if bounds is None else bounds
    lo = np.maximum(shards[:-1, None], b[None, :-1])
    hi = np.minimum(shards[1:, None], b[None, 1:])
    return np.maximum(hi - lo, 0)


def make_sync_layout(num_units: int, degrees: tuple[int, ...] | list[int],
                     mode: str = "refine", bounds: Callable[[int], np.ndarray] | None = None
                     ) -> SyncLayout:
    """Sync layout shared by replicas of the given degrees (duplicates allowed).

    ``bounds(t)`` gives a degree's unit assignment (default: ``assignment(num_units, t)``).
    """
    degs = sorted(set(int(t) for t in degrees))
    if not degs:
        raise ValueError("degrees=[]: a sync layout needs at least one replica")
    fn = bounds or (lambda t: assignment(num_units, t))
    b = {t: np.asarray(fn(t), dtype=np.int64) for t in degs}
    for t, bt in b.items():
        assert len(bt) == t + 1 and bt[0] == 0 and bt[-1] == num_units, (t, bt)
    if mode == "refine":
        shards = np.unique(np.concatenate(list(b.values())))
    elif mode == "base":
        shards = b[max(degs)].copy()
    else:
        raise ValueError(f"parallel.sync_layout={mode!r}: must be 'refine' or 'base'")
    owners = {t: np.argmax(overlaps(num_units, t, shards, b[t]), axis=1) for t in degs}
    return SyncLayout(num_units, shards, owners, b)


@dataclass(frozen=True)
class ReshardPlan:
    """Moves of a degree-``degree`` replica between its assignment and a sync layout."""

    degree: int
    transfers: tuple[tuple[int, int, int, int], ...]  # (src, dst, unit_lo, unit_hi)

    @property
    def moved_units(self) -> int:
        return sum(hi - lo for _, _, lo, hi in self.transfers)

    def reverse(self) -> ReshardPlan:
        return ReshardPlan(self.degree, tuple((d, s, lo, hi) for s, d, lo, hi in self.transfers))

    def sends(self, rank: int) -> list[tuple[int, int, int]]:
        return [(d, lo, hi) for s, d, lo, hi in self.transfers if s == rank]

    def recvs(self, rank: int) -> list[tuple[int, int, int]]:
        return [(s, lo, hi) for s, d, lo, hi in self.transfers if d == rank]


def reshard_plan(layout: SyncLayout, degree: int) -> ReshardPlan:
    """Transfers taking a degree-``degree`` replica's units to their shard owners."""
    b = layout.bounds[degree]
    own = layout.owners[degree]
    out: list[tuple[int, int, int, int]] = []
    for k in range(layout.num_shards):
        lo_k, hi_k = int(layout.shards[k]), int(layout.shards[k + 1])
        first = int(np.searchsorted(b, lo_k, side="right")) - 1
        for j in range(first, degree):
            lo, hi = max(lo_k, int(b[j])), min(hi_k, int(b[j + 1]))
            if lo >= hi_k:
                break
            if hi > lo and j != own[k]:
                out.append((j, int(own[k]), lo, hi))
    return ReshardPlan(degree, tuple(out))


def moved_lower_bound(num_units: int, degree: int, shards: np.ndarray,
                      bounds: np.ndarray | None = None) -> int:
    """Fewest units that must move for this replica, whatever owners are chosen."""
    ov = overlaps(num_units, degree, shards, bounds)
    return int((np.diff(shards) - ov.max(axis=1)).sum())


def owned_shards(layout: SyncLayout, degree: int, rank: int) -> np.ndarray:
    """Indices of the shards this TP-local rank owns."""
    return np.nonzero(layout.owners[degree] == rank)[0]
