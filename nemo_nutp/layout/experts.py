"""Experts as units: MoE expert parallelism inside each replica, at the replica's own degree.

The ``expert`` unit space has one unit per routed expert (``num_experts`` units). A replica of
degree ``t`` holds **all** experts over its ``t`` TP ranks (expert parallelism = the replica's
TP group, expert TP = 1): rank ``j`` holds experts ``[b[j], b[j+1])`` of the same balanced
``units.assignment`` as every other space (8 over 3 ranks: 2/3/3). A unit moves whole: all of
one expert's weights (its fc1 and fc2, each its own tensor in megatron's ``SequentialMLP`` and
grouped-GEMM experts alike), so an expert's *elements* keep their local order everywhere and
canonical order is the expert's own memory order.

Contract:
* Every expert is held by exactly one rank of every replica (``holders``), whatever the degrees.
* The expert sync layout is ``sync.make_sync_layout`` over the expert space: ``refine`` shards
  lie inside one rank of every replica (owner = holder, nothing moves), ``base`` shards are the
  largest degree's assignment, and a degraded replica moves the lower bound of experts.
* Routers (``[num_experts, hidden]``, fp32) are replicated: not a unit space (``ROUTER``).
* Token dispatch (``rank_token_counts``): the all-to-all's per-rank split is the sum of the
  routed-token counts over each rank's expert range; with uneven experts it cannot be read off
  a ``[ranks, experts_per_rank]`` reshape, which is what megatron's dispatcher assumes.

Pure Python + numpy; no ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sync import SyncLayout, make_sync_layout, moved_lower_bound, reshard_plan
from .units import assignment

EXPERT_SPACE = "expert"
ROUTER = "router"
"""The replicated router weight's name inside a MoE layer (``mlp.router.weight``)."""


@dataclass(frozen=True)
class ExpertShape:
    """A MoE layer's routed experts (megatron's ``num_moe_experts``, ``moe_ffn_hidden_size``)."""

    num_experts: int
    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """One expert's tensors (megatron's ``SequentialMLP`` local expert, no biases)."""
        f, h = self.ffn_hidden_size, self.hidden_size
        return {"linear_fc1.weight": ((2 if self.gated else 1) * f, h),
                "linear_fc2.weight": (h, f)}

    def unit_numel(self) -> int:
        """Elements of one expert unit (all its tensors)."""
        return sum(int(np.prod(s)) for s in self.weight_shapes().values())

    def router_shape(self) -> tuple[int, int]:
        return (self.num_experts, self.hidden_size)


def check_expert_degree(num_experts: int, degree: int, *,
                        field: str = "model.num_moe_experts") -> None:
    """``ValueError`` naming ``field`` when a replica of ``degree`` cannot hold one expert per
    rank at least (the ranks of an expert-parallel group each need an expert)."""
    if num_experts < 1:
        raise ValueError(f"{field}={num_experts}: a MoE layer needs at least one expert")
    if degree > num_experts:
        raise ValueError(f"{field}={num_experts}: fewer experts than the TP degree {degree} "
                         "(each rank of a replica holds at least one expert)")


def expert_bounds(num_experts: int, degree: int) -> np.ndarray:
    """Boundaries (length degree+1): TP rank j of the replica holds experts [b[j], b[j+1])."""
    check_expert_degree(num_experts, degree)
    return assignment(num_experts, degree)


def local_experts(num_experts: int, degree: int, tp_rank: int) -> range:
    """Global indices of the experts TP rank ``tp_rank`` holds, in its local order."""
    b = expert_bounds(num_experts, degree)
    if not 0 <= tp_rank < degree:
        raise ValueError(f"tp_rank={tp_rank}: must be in [0, {degree})")
    return range(int(b[tp_rank]), int(b[tp_rank + 1]))


def holders(num_experts: int, degree: int) -> np.ndarray:
    """(num_experts,) the TP rank holding each expert in a replica of ``degree``."""
    b = expert_bounds(num_experts, degree)
    return np.searchsorted(b, np.arange(num_experts), side="right") - 1


def rank_token_counts(tokens_per_expert: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per destination rank, the routed tokens to its experts: ``tokens_per_expert`` summed
    over each rank's expert range (the all-to-all's split sizes). Works on any trailing
    ``[..., num_experts]`` array."""
    tpe = np.asarray(tokens_per_expert)
    csum = np.concatenate([np.zeros((*tpe.shape[:-1], 1), dtype=tpe.dtype),
                           np.cumsum(tpe, axis=-1)], axis=-1)
    b = np.asarray(bounds)
    return np.take(csum, b[1:], axis=-1) - np.take(csum, b[:-1], axis=-1)


def expert_sync_layout(num_experts: int, degrees: tuple[int, ...] | list[int],
                       mode: str = "refine") -> SyncLayout:
    """The expert space's sync layout for replicas of the given degrees (see module doc)."""
    for t in degrees:
        check_expert_degree(num_experts, int(t))
    return make_sync_layout(num_experts, degrees, mode)


def expert_moves(num_experts: int, degrees: tuple[int, ...] | list[int],
                 mode: str = "refine") -> dict[int, tuple[int, int]]:
    """Per degree: (experts its reshard plan moves, the lower bound for its shards)."""
    lay = expert_sync_layout(num_experts, degrees, mode)
    return {t: (reshard_plan(lay, t).moved_units,
                moved_lower_bound(num_experts, t, lay.shards, lay.bounds[t]))
            for t in lay.bounds}


def shared_expert_columns(shared: int | None, ffn: int, degree: int) -> tuple[np.ndarray, bool]:
    """((degree,) shared-expert columns each TP rank holds, replicated). A shared expert of the
    dense FFN's size (``shared == ffn``) is over the dense FFN's units (``assignment``); one of
    its own size is whole on every rank of the replica (``model/moe.py``), each rank running
    it on its own sequence shard: its work and activations per rank are ``shared / degree``
    columns' worth, and it runs no TP collectives. None: no shared expert (zeros)."""
    if not shared:
        return np.zeros(degree, dtype=np.int64), False
    if int(shared) == int(ffn):
        return np.diff(assignment(int(shared), degree)), False
    return np.full(degree, int(shared), dtype=np.int64), True
