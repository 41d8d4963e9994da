"""Per-rank sync descriptors and the bucket plan: O(kinds + shards + parameters), never
O(elements). Pure Python over the plan; no ``torch``, no process group, no model.

* ``rank_sync(plan, rank)`` — what one rank needs to move and reduce its gradients:
  per unit space its units, its reshard sends and receives (global ranks) and its owned sync
  shards with their owner tuples (the key of the shard's sync group); per parameter kind the
  ``(H, n, W)`` view under which local unit ``u`` is ``view.transpose(0, 1)[u]`` in canonical
  order (``layout.units.unit_view_shape``). The same for every layer of a stage.
* ``plan_buckets(items, bucket_size)`` — packs the pieces that go to the same group into
  buckets of at most ``bucket_size`` elements (a shard's piece is cut at unit boundaries to
  fit, so a bucket exceeds it only by a single unit or replicated parameter larger than the
  room left; the cuts depend only on the group's own pieces, the same on every member), and
  orders all buckets of the rank canonically:
  by the canonical position of the bucket's last parameter, then by group key, then by the
  bucket's index in its group. The order is a restriction of one global order, so every member
  of a group launches that group's buckets in the same order and no two ranks wait on each
  other in a cycle (what NCCL needs, and gloo too).
* ``stage_params(dims, ...)`` — the (kind, shape) of every parameter of a stage in megatron's
  order, for sizing descriptors and buckets without building a model (benchmarks).
"""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from ..layout import PARAM_KINDS, SPACES, Plan, reshard_plan
from ..layout.specs import ModelDims
from ..layout.sync import owned_shards
from ..layout.units import layer_kinds, local_shape, replicated_shapes, unit_view_shape

Transfer = tuple[int, int, int]  # (peer global rank, first unit, stop unit)


@dataclass(frozen=True)
class OwnedShard:
    """A sync shard this rank owns: units [lo, hi), the owners (the group key) and the pieces
    other TP ranks of the replica send here."""

    k: int
    lo: int
    hi: int
    owners: tuple[int, ...]
    recvs: tuple[Transfer, ...]


@dataclass(frozen=True)
class SpaceSync:
    """One unit space of one rank."""

    space: str
    units: tuple[int, int]
    num_shards: int
    sends: tuple[Transfer, ...]
    owned: tuple[OwnedShard, ...]


@dataclass(frozen=True)
class KindView:
    """A sharded parameter kind on one rank: its units and its (H, n, W) unit view."""

    kind: str
    units: tuple[int, int]
    shape: tuple[int, int, int]

    @property
    def unit_numel(self) -> int:
        return self.shape[0] * self.shape[2]


@dataclass(frozen=True)
class RankSync:
    """Everything layout-dependent the gradient sync of one rank needs."""

    rank: int
    stage: int
    tp_rank: int
    degree: int
    spaces: dict[str, SpaceSync]
    kinds: dict[str, KindView]


def rank_sync(plan: Plan, rank: int) -> RankSync:
    """The rank's descriptors (``ValueError`` if the rank is not in the plan)."""
    if rank not in plan.rank_index:
        raise ValueError(f"rank={rank}: not in the plan (world_size={plan.world_size})")
    i, stage, j = plan.rank_index[rank]
    degree = plan.replicas[i].tp[stage]
    ranks = plan.replicas[i].ranks[stage]
    dims = plan.request.model
    spaces: dict[str, SpaceSync] = {}
    for space in SPACES:
        lay = plan.sync[(stage, space)]
        b = lay.bounds[degree]
        rp = reshard_plan(lay, degree, i)
        recvs = [(ranks[s], lo, hi) for s, lo, hi in rp.recvs(j)]
        owners = plan.sync_owner_ranks(stage, space)
        owned = []
        for k in owned_shards(lay, degree, j, i):
            lo, hi = int(lay.shards[k]), int(lay.shards[k + 1])
            owned.append(OwnedShard(int(k), lo, hi, tuple(int(r) for r in owners[:, k]),
                                    tuple(r for r in recvs if lo <= r[1] < hi)))
        spaces[space] = SpaceSync(space, (int(b[j]), int(b[j + 1])), lay.num_shards,
                                  tuple((ranks[d], lo, hi) for d, lo, hi in rp.sends(j)),
                                  tuple(owned))
    kinds = {}
    for kind, pk in PARAM_KINDS.items():
        lo, hi = spaces[pk.space].units
        kinds[kind] = KindView(kind, (lo, hi), unit_view_shape(kind, dims, hi - lo))
    return RankSync(rank, stage, j, degree, spaces, kinds)


@dataclass(frozen=True)
class Piece:
    """One parameter's part of a bucket: a sync shard's units [lo, hi) (``k`` >= 0) or a whole
    replicated parameter (``k`` = -1), at ``offset`` in the bucket."""

    param: int  # canonical position of the parameter
    k: int
    lo: int
    hi: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketSpec:
    """One collective: ``key`` names the group, ``index`` its place among the group's buckets."""

    key: Hashable
    index: int
    pieces: tuple[Piece, ...]
    numel: int

    @property
    def ready_at(self) -> int:
        """Canonical position of the last parameter; launchable once it is posted."""
        return self.pieces[-1].param


BucketItem = tuple[int, Hashable, int, int, int, int]  # (param, key, k, lo, hi, numel)


def plan_buckets(items: Iterable[BucketItem], bucket_size: int) -> list[BucketSpec]:
    """Buckets of the items (given in canonical order), in canonical launch order."""
    if bucket_size < 1:
        raise ValueError(f"sync.bucket_size={bucket_size}: must be >= 1 element")
    open_: dict[Hashable, list[Piece]] = {}
    fill: dict[Hashable, int] = {}
    count: dict[Hashable, int] = {}
    out: list[BucketSpec] = []

    def close(key: Hashable) -> None:
        out.append(BucketSpec(key, count.get(key, 0), tuple(open_.pop(key)), fill.pop(key)))
        count[key] = count.get(key, 0) + 1

    for param, key, k, lo, hi, numel in items:
        unit = numel // (hi - lo) if k >= 0 and hi > lo else 0
        while True:  # a shard's piece is cut at unit boundaries to fit the room left
            off = fill.get(key, 0)
            fit = (bucket_size - off) // unit if unit else 1
            if off and fit == 0:
                close(key)
                continue
            take = min(hi - lo, max(1, fit)) if unit else hi - lo
            n = take * unit if unit else numel
            open_.setdefault(key, []).append(Piece(param, k, lo, lo + take, off, n))
            fill[key] = off + n
            if fill[key] >= bucket_size:
                close(key)
            if lo + take >= hi:
                break
            lo, numel = lo + take, numel - n
    for key in list(open_):
        close(key)
    out.sort(key=lambda b: (b.ready_at, repr(b.key), b.index))
    return out


@dataclass(frozen=True)
class MessageSpec:
    """Reshard pieces between one pair of ranks, coalesced: ``pieces`` are (param, lo, hi,
    offset, numel) in canonical order. Sender and receiver derive the same messages from their
    own lists (a send's matching receive has the same units, in the same order)."""

    peer: int
    index: int
    pieces: tuple[tuple[int, int, int, int, int], ...]
    numel: int


def plan_messages(transfers: Iterable[tuple[int, int, int, int, int]], bucket_size: int
                  ) -> list[MessageSpec]:
    """Messages of (peer, param, lo, hi, numel) transfers given in canonical order: per peer,
    a message closes once it holds ``bucket_size`` elements or more."""
    open_: dict[int, list[tuple[int, int, int, int, int]]] = {}
    fill: dict[int, int] = {}
    out: list[MessageSpec] = []
    count: dict[int, int] = {}

    def close(peer: int) -> None:
        out.append(MessageSpec(peer, count.get(peer, 0), tuple(open_.pop(peer)),
                               fill.pop(peer)))
        count[peer] = count.get(peer, 0) + 1

    for peer, param, lo, hi, numel in transfers:
        off = fill.get(peer, 0)
        open_.setdefault(peer, []).append((param, lo, hi, off, numel))
        fill[peer] = off + numel
        if fill[peer] >= bucket_size:
            close(peer)
    for peer in list(open_):
        close(peer)
    return out


def sync_key(stage: int, owners: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Group key of the shards owned by ``owners`` (one rank per replica), whatever their unit
    space: pieces of QKV, FFN and vocab shards with the same owners share buckets."""
    return (stage, owners)


def rank_bucket_items(rs: RankSync, params: list[tuple[str | None, int]],
                      replicated: Hashable | None) -> list[BucketItem]:
    """The pieces of a rank, in canonical order; ``params`` = (kind or None, numel) in canonical
    order. A sharded parameter contributes one piece per owned sync shard; a replicated one a
    whole piece under the key ``replicated`` (None: this rank does not reduce them)."""
    items: list[BucketItem] = []
    for i, (kind, numel) in enumerate(params):
        if kind is None:
            if replicated is not None:
                items.append((i, replicated, -1, 0, 0, numel))
            continue
        view = rs.kinds[kind]
        for sh in rs.spaces[PARAM_KINDS[kind].space].owned:
            items.append((i, sync_key(rs.stage, sh.owners), sh.k, sh.lo, sh.hi,
                          (sh.hi - sh.lo) * view.unit_numel))
    return items


def stage_params(dims: ModelDims, degree: int, units: dict[str, tuple[int, int]], *,
                 layers: int | None = None, embedding: bool = True, output: bool = True
                 ) -> list[tuple[str | None, tuple[int, ...]]]:
    """(kind or None, local shape) of every trainable parameter of a stage, megatron's order
    (embedding, layers, final norm, output layer); ``units`` = each kind's (lo, hi)."""
    def sharded(kind: str) -> tuple[str, tuple[int, ...]]:
        lo, hi = units[kind]
        return kind, local_shape(kind, dims, hi - lo)

    out: list[tuple[str | None, tuple[int, ...]]] = []
    if embedding:
        out.append(sharded("word_embedding"))
    rep = replicated_shapes(dims)
    for _ in range(dims.num_layers if layers is None else layers):
        out.append((None, rep["input_layernorm"]))
        for kind in layer_kinds(dims):
            out.append(sharded(kind))
        out += [(None, s) for n, s in rep.items() if n != "input_layernorm"]
    if output:
        out.append((None, (dims.hidden_size,)))  # final norm
        if not dims.tie_embeddings:
            out.append(sharded("output_layer"))
    return out


def nbytes(obj: object) -> int:
    """Serialized size of descriptors (what a rank must hold to describe its sync)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def index_bytes(params: list[tuple[str | None, tuple[int, ...]]]) -> int:
    """What per-element int64 index maps of the sharded parameters would take (the old way)."""
    return 8 * sum(int(np.prod(s)) for k, s in params if k is not None)
