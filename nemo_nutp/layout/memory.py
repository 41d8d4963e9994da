"""Per-rank GPU memory model of a replica stage (pure, no ``torch``): does a degree fit?

For the most loaded rank of a stage at TP degree ``t`` (its real unit assignment, so uneven
shards show up) it counts, in bytes:

* **weights** ``param_bytes`` per element (bf16: 2), **gradients** ``grad_bytes`` (megatron's
  ``main_grad`` buffer: 4 when reduced in fp32), **optimizer state**: Adam's two moments (4 + 4)
  plus an fp32 master copy for half-precision weights (4); SGD: momentum (4) + master. With the
  distributed optimizer (``sync/zero.py``: ZeRO-1 over the sync owner groups, one owner per
  replica) the optimizer state is divided by the replica count; with its redundancy
  (``recovery.live_redundancy``) it is kept twice (a copy of each slice on another rank, and
  fp32 models keep masters).
* **activations** saved for backward per micro-batch, by component (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022, section 4, generalised
  to GQA, gated MLPs and dropout off): per layer, at half precision, the two norm inputs
  (``2 x 2sbh``), the QKV and fc1 inputs (``2sbh`` each), Q/K/V, the projection input, the fc1
  output and the fc2 input at this rank's widths, dropout masks (``sbh`` each) when dropout is
  on, and the core attention's own: ``[s, s]`` softmax probabilities (+ dropout mask and output)
  for megatron's local attention, only an fp32 log-sum-exp (``4 b heads s``) for SDPA / flash.
  Sequence parallelism divides the unsharded terms by ``t``. Recompute (megatron's settings):
  ``selective`` drops the core attention's terms; ``full`` keeps only each recompute chunk's
  input (``2sbh``, ``/t`` under SP) plus one chunk recomputed during backward (``uniform``:
  ``recompute_num_layers`` layers per chunk; ``block``: the first ``recompute_num_layers``
  layers of the stage recomputed, the rest stored).
* **in flight**: 1F1B keeps ``pp - stage`` micro-batches' activations on stage ``stage``
  (megatron's warm-up depth), one without pipelining.
* the last stage's logits: the logits, their fp32 copy and the saved fp32 softmax
  (``(2 + 8) s b V_rank`` bytes in bf16, one micro-batch). Activations are counted in the
  weights' precision (fp32 runs: twice Korthikanti's half-precision bytes, masks still 1 byte).
* ``reserve_gib``: CUDA context, NCCL and sync buffers, allocator fragmentation.
* **experts** (``moe``, a ``MoESpec``): in each MoE layer (``moe_layer_freq``) the dense FFN
  is replaced by what the rank really holds: its balanced range of routed experts
  (``experts.expert_bounds``: 8 experts over 3 ranks are 2/3/3, so the most loaded rank holds 3,
  not 8/3), the replicated router and the shared expert's FFN columns (balanced like units).
  Their gradients and optimizer state follow the same rules as every other weight (the
  distributed optimizer's share: each expert has one holder per replica, as each dense shard
  has). Activations of a MoE layer assume balanced routing: the rank's experts receive
  ``s b topk n_j / E`` tokens, each saving its permuted input, fc1 output, fc2 input and
  unpermuted output, plus the router's fp32 probabilities and the shared expert's widths.

Not modelled: the sync engine's extra buckets beyond the reserve, activation offloading,
CUDA graphs, fp8. The cross-check against Korthikanti's closed form
(``34 sbh + 5 a s^2 b`` per layer; ``sbh (10 + 24/t + 5as/(ht))`` with TP) is a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .experts import ExpertShape, expert_bounds, shared_expert_columns
from .specs import MemorySpec, ModelDims, MoESpec
from .units import (
    PARAM_KINDS,
    layer_kinds,
    replicated_shapes,
    space_bounds,
    unit_numel,
)

GIB = 1024 ** 3


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the most loaded rank of one stage at one degree."""

    weights: float
    grads: float
    optimizer: float
    activations: float  # all micro-batches in flight + one recomputed chunk + logits
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def stage_layer_ids(num_layers: int, pp: int, stage: int, vp: int = 1) -> list[list[int]]:
    """Global layer indices of each of the stage's ``vp`` model chunks (megatron's
    interleaving: chunk ``c`` of stage ``s`` holds block ``c * pp + s``)."""
    n = num_layers // (pp * vp)
    return [list(range((c * pp + stage) * n, (c * pp + stage + 1) * n)) for c in range(vp)]


def moe_layer_count(dims: ModelDims, moe: MoESpec | None, *, stage: int, pp: int,
                    vp: int = 1) -> int:
    """MoE layers on stage ``stage`` (0 without ``moe``)."""
    if moe is None:
        return 0
    pattern = moe.pattern(dims.num_layers)
    return sum(pattern[i] for chunk in stage_layer_ids(dims.num_layers, pp, stage, vp)
               for i in chunk)


def expert_shape(dims: ModelDims, moe: MoESpec) -> ExpertShape:
    return ExpertShape(moe.num_moe_experts, dims.hidden_size, moe.moe_ffn_hidden_size,
                       gated=dims.gated_linear_unit)


def moe_rank_params(dims: ModelDims, moe: MoESpec, t: int) -> np.ndarray:
    """(t,) parameter elements of one MoE layer's MLP on each TP rank of a replica of degree
    ``t``: its routed experts' range x one expert, the replicated router and its columns of
    the shared expert (the dense FFN of a MoE layer is not there)."""
    experts = np.diff(expert_bounds(moe.num_moe_experts, t)) * expert_shape(dims, moe).unit_numel()
    out = experts.astype(np.int64) + moe.num_moe_experts * dims.hidden_size
    cols, _ = shared_expert_columns(moe.moe_shared_expert_intermediate_size,
                                    dims.ffn_hidden_size, t)  # its own size: whole per rank
    out += cols * (3 if dims.gated_linear_unit else 2) * dims.hidden_size
    return out


def rank_param_counts(dims: ModelDims, t: int, *, stage: int, pp: int, balance: str = "work",
                      moe: MoESpec | None = None, vp: int = 1) -> np.ndarray:
    """(t,) parameter elements on each of the ``t`` ranks of a stage."""
    layers = dims.num_layers // pp
    n_moe = moe_layer_count(dims, moe, stage=stage, pp=pp, vp=vp)
    per_rank = np.zeros(t, dtype=np.int64)
    for kind in layer_kinds(dims):
        space = PARAM_KINDS[kind].space
        units = np.diff(space_bounds(dims, space, t, balance))
        per_rank += (layers - n_moe if space == "ffn" else layers) * unit_numel(kind, dims) * units
    if moe is not None and n_moe:
        per_rank += n_moe * moe_rank_params(dims, moe, t)
    rows = np.diff(space_bounds(dims, "vocab", t, balance)) * dims.hidden_size
    first, last = stage == 0, stage == pp - 1
    tables = int(first) + int(last and (not dims.tie_embeddings or pp > 1))
    per_rank += tables * rows
    replicated = sum(int(np.prod(s)) for s in replicated_shapes(dims).values()) * layers
    return per_rank + replicated + (dims.hidden_size if last else 0)


def rank_params(dims: ModelDims, t: int, *, stage: int, pp: int, balance: str = "work",
                moe: MoESpec | None = None, vp: int = 1) -> int:
    """Parameter elements on the most loaded of ``t`` ranks of a stage."""
    return int(rank_param_counts(dims, t, stage=stage, pp=pp, balance=balance, moe=moe,
                                 vp=vp).max())


def layer_activation_bytes(dims: ModelDims, t: int, spec: MemorySpec, *,
                           balance: str = "work", moe: MoESpec | None = None) -> float:
    """Bytes one layer saves for backward per micro-batch on the most loaded rank (no
    recompute of whole layers; ``selective`` drops the core attention's terms); ``moe``: a MoE
    layer's (balanced routing, see the module doc)."""
    s, b, h, d = dims.seq_length, spec.micro_batch_size, dims.hidden_size, dims.kv
    groups = int(np.diff(space_bounds(dims, "qg", t, balance)).max())
    heads = groups * dims.heads_per_group
    sbh = s * b * h
    e = spec.param_bytes  # activations are kept in the weights' precision
    sp = t if spec.sequence_parallel else 1
    halves = 2 if dims.gated_linear_unit else 1
    unsharded = (2 + 1 + 1) * e * sbh / sp + (2 * sbh / sp if spec.dropout else 0.0)
    qkv = e * s * b * d * (heads + 2 * groups)
    proj_in = e * s * b * d * heads
    if moe is None:
        ffn = int(np.diff(space_bounds(dims, "ffn", t, balance)).max())
        mlp = float(e * s * b * ffn * (halves + 1))  # fc1 output, fc2 input
    else:
        n = int(np.diff(expert_bounds(moe.num_moe_experts, t)).max())
        f = moe.moe_ffn_hidden_size
        routed = s * b * moe.moe_router_topk * n / moe.num_moe_experts
        mlp = e * routed * (2 * h + (halves + 1) * f) + 4.0 * s * b * moe.num_moe_experts / sp
        held, whole = shared_expert_columns(moe.moe_shared_expert_intermediate_size,
                                            dims.ffn_hidden_size, t)
        # one of its own size runs whole on the rank's sequence shard
        mlp += e * s * b * int(held.max()) * (halves + 1) / (t if whole else 1)
    core = 0.0
    if spec.recompute_granularity != "selective":
        if spec.flash_attention:
            core = 4.0 * b * heads * s  # fp32 log-sum-exp
        else:  # probabilities (+ dropout mask and output)
            core = b * heads * s * s * (e + (1 + e if spec.dropout else 0))
    return unsharded + qkv + proj_in + mlp + core


def stage_activation_bytes(dims: ModelDims, t: int, spec: MemorySpec, *, stage: int, pp: int,
                           microbatches: int | None = None, balance: str = "work",
                           moe: MoESpec | None = None) -> float:
    """Peak activation bytes of a stage: micro-batches in flight x what each keeps, one
    recomputed chunk, and the last stage's logits. Virtual pipeline stages (``spec.vp > 1``):
    chunk passes in flight x what each keeps of its chunk's layers (the largest chunk's, with
    MoE layers); megatron's interleaved schedule runs ``2 (pp - stage - 1) + (vp - 1) pp``
    warm-up passes (its default micro-batch group, ``pp``), so one more are in flight (all
    ``vp M`` when ``M == pp``)."""
    vp = spec.vp
    a_dense = layer_activation_bytes(dims, t, spec, balance=balance)
    a_moe = a_dense if moe is None else layer_activation_bytes(dims, t, spec, balance=balance,
                                                               moe=moe)
    pattern = (0,) * dims.num_layers if moe is None else moe.pattern(dims.num_layers)
    s, b, h = dims.seq_length, spec.micro_batch_size, dims.hidden_size
    chunk_in = spec.param_bytes * s * b * h / (t if spec.sequence_parallel else 1)
    n = spec.recompute_num_layers
    kept, transient = 0.0, 0.0
    for ids in stage_layer_ids(dims.num_layers, pp, stage, vp):
        a = [a_moe if pattern[i] else a_dense for i in ids]
        layers = len(a)
        if spec.recompute_granularity != "full":
            k, tr = sum(a), 0.0
        elif spec.recompute_method == "block":
            m = min(n, layers)
            k, tr = m * chunk_in + sum(a[m:]), max(a[:m]) if m else 0.0
        else:  # uniform (megatron's default method for full)
            k = -(-layers // n) * chunk_in
            tr = max(sum(a[i:i + n]) for i in range(0, layers, n))
        kept, transient = max(kept, k), max(transient, tr)
    in_flight = pp - stage if pp > 1 else 1
    if vp > 1:
        in_flight = 2 * (pp - stage - 1) + (vp - 1) * pp + 1
        if microbatches is not None:
            in_flight = vp * microbatches if microbatches == pp else \
                min(in_flight, vp * microbatches)
    elif microbatches is not None:
        in_flight = min(in_flight, microbatches)
    logits = 0.0
    if stage == pp - 1:
        v = int(np.diff(space_bounds(dims, "vocab", t, balance)).max())
        logits = (spec.param_bytes + 8.0) * s * b * v
    return in_flight * kept + transient + logits


def stage_memory(dims: ModelDims, t: int, spec: MemorySpec, *, stage: int, pp: int,
                 balance: str = "work", moe: MoESpec | None = None) -> StageMemory:
    """Memory of the most loaded rank of stage ``stage`` of ``pp`` at degree ``t`` (``moe``:
    the model's experts, see the module doc)."""
    n = rank_params(dims, t, stage=stage, pp=pp, balance=balance, moe=moe, vp=spec.vp)
    state = 8 if spec.optimizer == "adam" else 4
    redundant = spec.distributed_optimizer and spec.zero_redundancy
    master = 4 if spec.param_bytes < 4 or redundant else 0
    opt = n * (state + master) / (spec.replicas if spec.distributed_optimizer else 1)
    opt *= 2 if redundant else 1
    return StageMemory(
        weights=float(n * spec.param_bytes), grads=float(n * spec.grad_bytes),
        optimizer=float(opt),
        activations=stage_activation_bytes(dims, t, spec, stage=stage, pp=pp, balance=balance,
                                           moe=moe),
        reserve=spec.reserve_gib * GIB, capacity=spec.gpu_memory_gib * GIB)


def fits_every_stage(dims: ModelDims, t: int, spec: MemorySpec, *, pp: int,
                     balance: str = "work", moe: MoESpec | None = None) -> bool:
    """Degree ``t`` fits on every stage (the planner's conservative test for any stage)."""
    return all(stage_memory(dims, t, spec, stage=s, pp=pp, balance=balance, moe=moe).fits
               for s in range(pp))


MEMORY_FIELDS = ("parallel.tp_base", "parallel.pp", "train.distributed_optimizer=true",
                 "model.recompute_granularity=full", "train.micro_batch_size",
                 "parallel.sequence_parallel")
"""What a user changes to make a stage fit (named in the planner's errors)."""


def why_not(dims: ModelDims, t: int, spec: MemorySpec, *, pp: int, balance: str = "work",
            stage: int | None = None, moe: MoESpec | None = None) -> str:
    """One-line reason degree ``t`` does not fit ('' when it fits every stage, or ``stage``)."""
    for s in range(pp) if stage is None else (stage,):
        m = stage_memory(dims, t, spec, stage=s, pp=pp, balance=balance, moe=moe)
        if not m.fits:
            return (f"stage {s} at degree {t} needs {m.total / GIB:.1f} GiB per GPU (weights "
                    f"{m.weights / GIB:.1f}, grads {m.grads / GIB:.1f}, optimizer "
                    f"{m.optimizer / GIB:.1f}, activations {m.activations / GIB:.1f}, reserve "
                    f"{m.reserve / GIB:.1f}) > hardware.gpu_memory_gib={spec.gpu_memory_gib}; "
                    f"change {', '.join(remedies(spec))}")
    return ""


def remedies(spec: MemorySpec) -> list[str]:
    """``MEMORY_FIELDS`` less what ``spec`` already does (the distributed optimizer on, full
    recompute, sequence parallelism); with the distributed optimizer on one replica, more
    replicas (``cluster.num_gpus``) is what shards its state."""
    done = {"train.distributed_optimizer=true": spec.distributed_optimizer,
            "model.recompute_granularity=full": spec.recompute_granularity == "full",
            "parallel.sequence_parallel": spec.sequence_parallel}
    out = [f for f in MEMORY_FIELDS if not done.get(f, False)]
    if spec.distributed_optimizer and spec.replicas == 1:
        out.append("cluster.num_gpus (one replica: nothing to shard the optimizer state over)")
    return out
