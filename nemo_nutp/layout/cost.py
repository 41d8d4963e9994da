"""Stage cost model shared by the planner and the goodput simulator (pure, no ``torch``).

A replica stage at TP degree ``t`` spends, per micro-batch, on its *slowest rank*:

* compute: forward + backward FLOPs of the rank's units (``units.rank_work``: the planner's real
  assignment, so query-group granularity and uneven shards show up), ``FWD_BWD`` x 2 FLOPs per
  multiply-add and token;
* TP communication: megatron's 4 all-reduces per layer (2 forward, 2 backward) of the hidden
  activations, ring volume ``2 (t-1)/t`` per rank (``tp_bytes``; with sequence parallel the
  reduce-scatter + all-gather pair moves the same volume);
* stage-boundary traffic (``boundary_bytes``): the activation a stage receives from the previous
  stage and sends to the next one, and the same sizes back for their gradients. Without sequence
  parallel every receiving rank needs the whole activation ``A`` (the senders hold ``A``
  replicated, so each of ``t`` senders serves ``t_next / t`` receivers); with sequence parallel
  each side holds ``A / t`` and only the pieces move.

* MoE (``moe``, a ``MoESpec``): in each MoE layer the rank's MLP work is its experts' share of
  the routed tokens under balanced routing (``topk x n_j / E`` of the replica's tokens through
  one expert each, ``n_j`` its experts: 8 over 3 ranks are 2/3/3, so the rank with 3 is the
  slowest), its shared-expert columns and its sequence shard's router; the layer's TP traffic
  is the attention's two collectives (and the shared expert's two), plus the token all-to-all
  inside the replica (``alltoall_bytes``: dispatch and combine, forward and backward, each
  rank sending ``(t-1)/t`` of its ``topk`` copies of its ``tokens / t``), counted with the TP
  traffic on the scale-up links.

``CostSpec`` turns these into seconds (achieved FLOP/s, link bandwidths, a latency per message,
a fixed per-layer cost that does not shrink with the degree, the first stage's dense embedding
gradient per table element).
Without a spec (``None``) the model is compute-only in relative units: the planner's behaviour
before a hardware was named, and what the simulator's ``cost.mode='compute'`` matches.

``stage_layers(num_layers, pp)`` is the layer split every stage uses (even: ``pp`` divides
``num_layers``, checked by the planner).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .experts import expert_bounds, shared_expert_columns
from .memory import moe_layer_count
from .specs import CostSpec, ModelDims, MoESpec, bad_value
from .units import rank_work, space_bounds

FWD_BWD = 3.0
"""Forward + backward cost in forward passes (backward computes input and weight gradients)."""
FLOPS_PER_MAC = 2.0


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """``[first, last_exclusive)`` transformer layers of each of ``pp`` stages (even split)."""
    if pp < 1 or num_layers % pp:
        raise bad_value("parallel.pp", pp, f"must divide model.num_layers={num_layers}")
    n = num_layers // pp
    return [(s * n, (s + 1) * n) for s in range(pp)]


def chunk_layers(num_layers: int, pp: int, vp: int = 1) -> list[list[tuple[int, int]]]:
    """Per stage, ``[first, last_exclusive)`` layers of each of its ``vp`` model chunks:
    chunk ``c`` of stage ``s`` holds block ``c * pp + s`` of ``pp * vp`` even blocks
    (megatron's interleaving). ``vp == 1``: ``stage_layers``."""
    if vp < 1 or num_layers % (pp * vp):
        raise bad_value("parallel.virtual_pipeline_model_parallel_size", vp,
                        f"parallel.pp={pp} times it must divide model.num_layers={num_layers}")
    n = num_layers // (pp * vp)
    return [[((c * pp + s) * n, (c * pp + s + 1) * n) for c in range(vp)] for s in range(pp)]


def moe_rank_work(dims: ModelDims, moe: MoESpec, t: int) -> np.ndarray:
    """(t,) forward multiply-adds per token of the replica of one MoE layer's MLP on each of
    its ``t`` ranks (balanced routing): its experts' share of the routed tokens, its columns of
    the shared expert, its sequence shard's router."""
    h, halves = dims.hidden_size, 2 if dims.gated_linear_unit else 1
    n = np.diff(expert_bounds(moe.num_moe_experts, t)).astype(np.float64)
    work = moe.moe_router_topk * n / moe.num_moe_experts * (halves + 1) * \
        moe.moe_ffn_hidden_size * h + moe.num_moe_experts * h / t
    held, whole = shared_expert_columns(moe.moe_shared_expert_intermediate_size,
                                        dims.ffn_hidden_size, t)
    # one of its own size: whole on every rank, each rank its own sequence shard's tokens
    work = work + held * (halves + 1) * h / (t if whole else 1)
    return work


def stage_rank_work(dims: ModelDims, t: int, layers: int, *, with_vocab: bool,
                    balance: str = "work", moe: MoESpec | None = None,
                    moe_layers: int = 0) -> np.ndarray:
    """``units.rank_work`` with ``moe_layers`` of the ``layers`` MoE layers (their dense FFN
    replaced by ``moe_rank_work``)."""
    work = rank_work(dims, t, layers, with_vocab, balance)
    if moe is None or not moe_layers:
        return work
    h, halves = dims.hidden_size, 2 if dims.gated_linear_unit else 1
    ffn = np.diff(space_bounds(dims, "ffn", t, balance)) * float((halves + 1) * h)
    return work + moe_layers * (moe_rank_work(dims, moe, t) - ffn)


def stage_flops(dims: ModelDims, t: int, layers: int, *, with_vocab: bool, tokens: int,
                balance: str = "work", moe: MoESpec | None = None,
                moe_layers: int = 0) -> float:
    """Forward + backward FLOPs of the slowest of ``t`` ranks for one micro-batch."""
    work = float(stage_rank_work(dims, t, layers, with_vocab=with_vocab, balance=balance,
                                 moe=moe, moe_layers=moe_layers).max())
    return FWD_BWD * FLOPS_PER_MAC * work * tokens


def tp_bytes(dims: ModelDims, t: int, layers: int, *, tokens: int, act_bytes: int = 2) -> float:
    """Bytes one rank moves in TP all-reduces for one micro-batch (ring: 2 (t-1)/t x size)."""
    return layers * 4 * 2 * (t - 1) / t * tokens * dims.hidden_size * act_bytes


def alltoall_bytes(dims: ModelDims, moe: MoESpec, t: int, moe_layers: int, *, tokens: int,
                   act_bytes: int = 2) -> float:
    """Bytes one rank sends in the MoE token all-to-alls of one micro-batch (balanced routing):
    per MoE layer dispatch and combine, forward and backward, each ``(t-1)/t`` of the rank's
    ``topk`` copies of its ``tokens / t``."""
    return moe_layers * 4 * (t - 1) / t * tokens / t * moe.moe_router_topk * \
        dims.hidden_size * act_bytes


def boundary_bytes(dims: ModelDims, t: int, *, t_prev: int | None, t_next: int | None,
                   tokens: int, sequence_parallel: bool = False, act_bytes: int = 2,
                   n_prev: int = 1, n_next: int = 1) -> float:
    """Bytes one rank of a stage at degree ``t`` sends + receives at its stage boundaries per
    micro-batch, forward activations and backward gradients (``None``: no such neighbour);
    ``n_prev``/``n_next``: crossings per micro-batch (virtual stages: one per chunk)."""
    a = float(tokens * dims.hidden_size * act_bytes)
    total = 0.0
    if t_prev is not None:  # receive: the whole activation, or this rank's chunk under SP
        total += n_prev * (a / t if sequence_parallel else a)
    if t_next is not None:  # send: its chunk, or the whole one to t_next / t receivers
        total += n_next * (a / t if sequence_parallel else a * t_next / t)
    return 2.0 * total  # the gradients go the other way with the same sizes


def crossings(stage: int, pp: int, vp: int = 1) -> tuple[int, int]:
    """Boundary crossings per micro-batch of a stage (from the previous stage, to the next):
    one each way without virtual stages; with ``vp`` chunks the stages form a ring and every
    chunk crosses, but nothing enters the first chunk of stage 0 or leaves the last chunk of
    the last stage."""
    if vp == 1:
        return int(stage > 0), int(stage < pp - 1)
    return vp - int(stage == 0), vp - int(stage == pp - 1)


@dataclass(frozen=True)
class StageTime:
    """Seconds (or relative units without a spec) of one micro-batch on a stage."""

    compute: float
    tp: float
    boundary: float

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.boundary


def stage_time(dims: ModelDims, spec: CostSpec | None, *, t: int, stage: int, pp: int,
               tokens: int, t_prev: int | None = None, t_next: int | None = None,
               sequence_parallel: bool = False, balance: str = "work",
               vp: int = 1, moe: MoESpec | None = None) -> StageTime:
    """One micro-batch on stage ``stage`` of ``pp`` at degree ``t`` (slowest rank); ``vp``
    chunks per rank: its boundary crossings per micro-batch (``crossings``; ``t_prev`` /
    ``t_next`` then the ring's neighbours); ``moe``: the model's experts (the module doc)."""
    layers = dims.num_layers // pp
    n_moe = moe_layer_count(dims, moe, stage=stage, pp=pp, vp=vp)
    flops = stage_flops(dims, t, layers, with_vocab=stage == pp - 1, tokens=tokens,
                        balance=balance, moe=moe, moe_layers=n_moe)
    if spec is None:
        return StageTime(flops, 0.0, 0.0)
    ab = spec.act_bytes
    # a MoE layer's MLP runs no TP collectives (its tokens go by all-to-all), its shared
    # expert does (megatron's shared expert: a TP MLP)
    mlp_collectives = 2 if moe is not None and moe.moe_shared_expert_intermediate_size and \
        not shared_expert_columns(moe.moe_shared_expert_intermediate_size,
                                  dims.ffn_hidden_size, t)[1] else 0  # (replicated: none)
    tp = tp_bytes(dims, t, layers, tokens=tokens, act_bytes=ab)
    messages = 4 * layers
    if moe is not None and n_moe:
        skipped = n_moe * (2 - mlp_collectives)
        tp += alltoall_bytes(dims, moe, t, n_moe, tokens=tokens, act_bytes=ab) - \
            tp_bytes(dims, t, skipped, tokens=tokens, act_bytes=ab) / 4
        messages += 4 * n_moe - skipped
    tp = tp / (spec.tp_gbps * 1e9)
    tp = tp * (1.0 - spec.tp_overlap) + (messages * spec.latency_s if t > 1 else 0.0)
    n_prev, n_next = crossings(stage, pp, vp) if vp > 1 else (1, 1)
    nb = n_prev * (t_prev is not None) + n_next * (t_next is not None)
    bd = boundary_bytes(dims, t, t_prev=t_prev, t_next=t_next, tokens=tokens,
                        sequence_parallel=sequence_parallel, act_bytes=ab,
                        n_prev=n_prev, n_next=n_next)
    bd = bd / (spec.p2p_gbps * 1e9) + 2 * nb * spec.latency_s
    compute = flops / spec.flops + layers * spec.layer_overhead_s
    if stage == 0 and spec.table_elem_s:
        rows = int(np.diff(space_bounds(dims, "vocab", t, balance)).max())
        compute += rows * dims.hidden_size * spec.table_elem_s
    return StageTime(compute, tp, bd)


def sync_seconds(groups: list[tuple[tuple[int, ...], int]], rate_mb_s: float,
                 link_rate: dict[int, float], domain_size: int) -> dict[int, float]:
    """The cross-replica sync term (issue #36): seconds each GPU's scale-out NIC spends on one
    step's gradient reduction. ``groups``: (member GPUs, bytes) of every reduction; one whose
    members lie in one scale-up domain costs nothing here; otherwise each member's NIC carries
    the bytes at ``rate_mb_s`` times the group's slowest member's relative rate (``link_rate``:
    GPU -> rate in (0, 1], 1.0 when absent): a collective runs at its slowest end. A GPU's ops
    queue on its one NIC, so its time is their sum; the step waits for the largest."""
    out: dict[int, float] = {}
    for gpus, nbytes in groups:
        if len({g // domain_size for g in gpus}) < 2:
            continue
        s = nbytes / (rate_mb_s * 1e6 * min(link_rate.get(g, 1.0) for g in gpus))
        for g in gpus:
            out[g] = out.get(g, 0.0) + s
    return out
