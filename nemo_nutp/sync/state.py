"""The gradient sync's per-rank records (``engine.py``): buckets, reshard messages, parameter
entries, and the strided unit views that move a gradient's units in canonical order.

Plain data plus view arithmetic: no collective, no process group. Sizes are O(kinds + shards +
parameters) per rank; a unit is addressed by a view of the gradient, never by per-element
indices (except the tests' ``pos_override``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import p2p
from .descriptors import BucketSpec, MessageSpec, Piece, Transfer


@dataclass(eq=False)
class Bucket:
    """One all-reduce (or reduce-scatter) of a sync group, and this step's state of it."""

    spec: BucketSpec
    group: dist.ProcessGroup
    buf: torch.Tensor | None = None
    in_msgs: list[Msg] = field(default_factory=list)  # reshard messages bringing pieces
    work: Any = None
    scatter: tuple[int, int, int] | None = None  # reduce-scatter: (members, my index, chunk)
    out: torch.Tensor | None = None  # reduce-scatter: my reduced slice (chunk elements)
    retired: bool = False  # reduced, written back and its buffer freed (this step)
    alias: bool = False  # buf is a view of the gradient itself (reduced in place)
    norm: Any = None  # which pieces count in this rank's norm slots (norm.bucket_plan)


@dataclass(eq=False)
class Msg:
    """A coalesced reshard message (one p2p each way per step); incoming ones know where in
    which bucket each piece goes."""

    spec: MessageSpec
    # incoming: (bucket, offset there, offset here, elements), per piece and bucket piece it
    # meets (a transfer may straddle the cut between two buckets)
    targets: list[tuple[Bucket, int, int, int]] = field(default_factory=list)
    buf: torch.Tensor | None = None
    work: Any = None
    done: bool = False  # incoming: received and scattered into its buckets
    sender: int = -1  # global rank of the forward sender (pair_order)

    @property
    def key(self) -> tuple[int, int, int]:
        """Its place in the pair's sequence, the same on both sides (``p2p.pair_order``)."""
        return p2p.pair_order(self.spec.pieces[-1][0], self.sender, self.spec.index)


@dataclass
class Param:
    """One parameter as the sync sees it (canonical position = its index in ``engine.order``)."""

    name: str
    param: torch.nn.Parameter
    kind: str | None
    units: tuple[int, int] | None
    view: tuple[int, int, int] | None = None  # (H, n_local, W), see unit_view_shape
    numel_unit: int = 0
    sends: tuple[Transfer, ...] = ()  # (dst global, lo, hi)
    pieces: list[tuple[Bucket, Piece]] = field(default_factory=list)
    out_pieces: list[tuple[Msg, tuple[int, int, int, int, int]]] = field(default_factory=list)
    partial: bool = False  # replicated param holding a per-rank partial sum (sequence parallel)
    slot: int = 0  # first slot of this param in the grad-norm vector
    n_slots: int = 1  # sync shards (sharded) or 1 (replicated)
    pos_override: torch.Tensor | None = None  # explicit index map (negative-control tests)

    @property
    def pos(self) -> torch.Tensor | None:
        """(n_local, unit_numel) local flat position of each local unit's canonical elements
        (built on demand from the view; O(elements), for tests only). Setting it makes the
        engine pair by these positions instead of the views."""
        if self.pos_override is not None or self.view is None:
            return self.pos_override
        h, n, w = self.view
        return torch.arange(h * n * w).view(h, n, w).transpose(0, 1).reshape(n, h * w)

    @pos.setter
    def pos(self, value: torch.Tensor | None) -> None:
        self.pos_override = value


def units_view(e: Param, lo: int, hi: int, t: torch.Tensor | None = None) -> torch.Tensor:
    """(hi - lo, H, W) strided view of units [lo, hi) of the gradient (or of ``t``, a tensor
    shaped like the parameter), canonical order."""
    assert e.units is not None and e.view is not None
    h, n, w = e.view
    a = e.units[0]
    t = e.param.main_grad if t is None else t  # type: ignore[attr-defined]
    return t.view(h, n, w).transpose(0, 1)[lo - a:hi - a]  # type: ignore[union-attr]


def read_units(e: Param, lo: int, hi: int, out: torch.Tensor,
               t: torch.Tensor | None = None) -> None:
    """Copy units [lo, hi) of the gradient (or of ``t``) into the 1-D ``out`` (canonical
    order)."""
    t = e.param.main_grad if t is None else t  # type: ignore[attr-defined]
    if e.pos_override is not None:
        a = e.units[0]  # type: ignore[index]
        idx = e.pos_override[lo - a:hi - a].reshape(-1)
        out.copy_(t.view(-1)[idx])  # type: ignore[union-attr]
    else:
        out.view(hi - lo, e.view[0], e.view[2]).copy_(  # type: ignore[index]
            units_view(e, lo, hi, t))


def write_units(e: Param, lo: int, hi: int, src: torch.Tensor,
                t: torch.Tensor | None = None) -> None:
    """Write the 1-D canonical-order ``src`` into units [lo, hi) of the gradient (or of
    ``t``)."""
    t = e.param.main_grad if t is None else t  # type: ignore[attr-defined]
    if e.pos_override is not None:
        a = e.units[0]  # type: ignore[index]
        idx = e.pos_override[lo - a:hi - a].reshape(-1)
        t.view(-1)[idx] = src  # type: ignore[union-attr]
    else:
        units_view(e, lo, hi, t).copy_(src.view(hi - lo, e.view[0], e.view[2]))  # type: ignore


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
