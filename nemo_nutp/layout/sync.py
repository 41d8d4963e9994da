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

*NIC-aware owners* (``nic_aware``, issue #36): a replica with a GPU whose scale-out NIC is slow
(``health.slow_links``: GPU -> relative rate) has its own owners (``SyncLayout.replica_owners``,
keyed by the replica's position in the plan): the slow GPU hands the part of its shards above its
rate's fair share to its TP peers, which reduce it across replicas instead (the hand-over is the
reshard p2p inside the replica, over the scale-up domain). The cuts this needs refine the shards
of every replica (a sub-shard keeps its parent's owner elsewhere, or the owner of most of it).
The math is that of any sync layout: only who reduces which units across replicas changes.

``ReshardPlan.transfers`` lists ``(src, dst, first_unit, stop_unit)`` in TP-local rank indices.
The reverse plan (owner back to holders) is the same list with src/dst swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from .units import assignment


@dataclass(frozen=True)
class SyncLayout:
    """Shards of one unit space in one stage, and each degree's owner of each shard."""

    num_units: int
    shards: np.ndarray  # boundaries, length S+1
    owners: dict[int, np.ndarray]  # degree -> (S,) TP-local owner rank index
    bounds: dict[int, np.ndarray]  # degree -> that degree's unit assignment (length degree+1)
    replica_owners: Mapping[int, np.ndarray] = field(default_factory=dict)
    """replica position -> (S,) its own TP-local owners (NIC-aware; others use their degree's)."""

    @property
    def num_shards(self) -> int:
        return len(self.shards) - 1

    def owners_of(self, degree: int, replica: int | None = None) -> np.ndarray:
        """(S,) TP-local owner of each shard in a replica of ``degree`` (``replica``: its
        position in the plan, for NIC-aware owners)."""
        own = self.replica_owners.get(replica) if replica is not None else None
        return self.owners[degree] if own is None else own


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


def reshard_plan(layout: SyncLayout, degree: int, replica: int | None = None) -> ReshardPlan:
    """Transfers taking a degree-``degree`` replica's units to their shard owners."""
    b = layout.bounds[degree]
    own = layout.owners_of(degree, replica)
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


def owned_shards(layout: SyncLayout, degree: int, rank: int, replica: int | None = None
                 ) -> np.ndarray:
    """Indices of the shards this TP-local rank owns."""
    return np.nonzero(layout.owners_of(degree, replica) == rank)[0]


def _waterfill(load: np.ndarray, rate: np.ndarray, unit: float, units: int) -> np.ndarray:
    """Units per rank (summing to ``units``) that minimise the latest finish time
    ``(load + n * unit) / rate``: the water level ``T`` with ``sum(max(0, (T rate - load) /
    unit)) = units`` found by bisection, rounded down, each unit left over where it then
    finishes soonest. O(ranks x 60)."""
    if unit <= 0:  # units without bytes: any owner costs nothing; an even split
        return np.diff(np.linspace(0, units, len(rate) + 1).round().astype(np.int64))
    unit = float(unit)
    lo, hi = 0.0, float((load.max() + units * unit) / rate.min())
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.maximum(0.0, (mid * rate - load) / unit).sum() >= units:
            hi = mid
        else:
            lo = mid
    n = np.minimum(np.floor(np.maximum(0.0, (hi * rate - load) / unit)), units).astype(np.int64)
    while n.sum() > units:  # bisection's level can round a little high
        j = int(np.argmax(np.where(n > 0, (load + n * unit) / rate, -np.inf)))
        n[j] -= 1
    for _ in range(units - int(n.sum())):
        j = int(np.argmin((load + (n + 1) * unit) / rate))
        n[j] += 1
    return n


def refine(layout: SyncLayout, cuts: np.ndarray | list[int]) -> SyncLayout:
    """The layout with extra shard boundaries: degree owners re-chosen by overlap (a sub-shard
    of a shard inside one rank keeps that rank), per-replica owners inherited from the parent."""
    shards = np.unique(np.concatenate([layout.shards, np.asarray(cuts, dtype=np.int64)]))
    if len(shards) == len(layout.shards):
        return layout
    parent = np.searchsorted(layout.shards, shards[:-1], side="right") - 1
    owners = {t: np.argmax(overlaps(layout.num_units, t, shards, b), axis=1)
              for t, b in layout.bounds.items()}
    rep = {i: own[parent] for i, own in layout.replica_owners.items()}
    return replace(layout, shards=shards, owners=owners, replica_owners=rep)


def nic_aware(layout: SyncLayout, replica: int, degree: int, rates: Mapping[int, float],
              load: dict[int, float] | None = None, unit_bytes: float = 1.0) -> SyncLayout:
    """The layout with replica ``replica``'s (degree ``degree``) owners re-chosen for its TP
    ranks' scale-out ``rates`` (TP-local rank -> relative rate, 1.0 when absent). A rank slower
    than the fastest owns nothing: a collective runs at its slowest end, so a unit it owned would
    hold its partners in the other replicas as long as itself. The fastest ranks share the units
    so that each finishes its cross-replica traffic at about the same time, counting ``load``
    (what the rank owns in spaces placed before, updated here with ``unit_bytes`` per unit;
    ``_waterfill``); a rank above its number hands its highest units to those below theirs.
    Unchanged when every rate is equal."""
    r = np.array([float(rates.get(j, 1.0)) for j in range(degree)])
    if degree < 2 or np.all(r == r[0]):
        return layout
    load = {} if load is None else load
    own = layout.owners_of(degree, replica)
    size = np.diff(layout.shards)
    have = np.array([int(size[own == j].sum()) for j in range(degree)])
    total = int(have.sum())
    # A slow NIC slows its partners too (a collective runs at its slowest end): it owns
    # nothing while a peer runs at the full rate; the full-rate peers share its units.
    use = r >= r.max()
    target = np.zeros(degree, dtype=np.int64)
    target[use] = _waterfill(np.array([load.get(j, 0.0) for j in range(degree)])[use], r[use],
                             unit_bytes, total)
    need = {j: int(target[j] - have[j]) for j in range(degree) if target[j] > have[j]}
    cuts: list[int] = []
    moves: list[tuple[int, int, int]] = []  # (lo, hi, new owner)
    takers = sorted(need, key=lambda j: (load.get(j, 0.0) / r[j], j))
    for j in range(degree):
        give = int(have[j] - target[j])
        for k in reversed(np.nonzero(own == j)[0]):  # its highest units first
            lo, hi = int(layout.shards[k]), int(layout.shards[k + 1])
            while give > 0 and hi > lo and takers:
                dst = takers[0]
                n = min(give, need[dst], hi - lo)
                moves.append((hi - n, hi, dst))
                cuts += [hi - n, hi]
                hi, give, need[dst] = hi - n, give - n, need[dst] - n
                if need[dst] == 0:
                    takers.pop(0)
    out = refine(layout, cuts)
    mine = out.owners_of(degree, replica).copy()
    for lo, hi, dst in moves:
        k = int(np.searchsorted(out.shards, lo, side="right")) - 1
        assert out.shards[k] == lo and out.shards[k + 1] == hi, (lo, hi)
        mine[k] = dst
    for j in range(degree):
        load[j] = load.get(j, 0.0) + unit_bytes * float(np.diff(out.shards)[mine == j].sum())
    return replace(out, replica_owners={**out.replica_owners, replica: mine})
