"""Inputs of the planner: cluster, health, parallel configuration and model dimensions.

Pure Python, no ``torch``. Every dataclass validates itself in ``__post_init__`` and raises
``ValueError`` naming the field (as ``section.field``) and the offending value, so bad input is
rejected before any process exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNC_LAYOUTS = ("refine", "base")


def bad_value(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {why}")


def interleave_error(microbatches: int, pp: int, group: int | None = None) -> str | None:
    """megatron's interleaved schedule's rule on a rank's micro-batch count (0.16 and 0.19,
    ``forward_backward_pipelining_with_interleaving``): with ``group`` contiguous micro-batches
    per virtual stage (megatron's ``microbatch_group_size_per_vp_stage``, default ``pp``),
    ``pp <= group <= microbatches`` and ``microbatches % group`` is 0 or ``>= pp``; with the
    default that is ``microbatches % pp == 0``. None when it holds, else why not."""
    g = pp if group is None else group
    if not pp <= g <= microbatches:
        return (f"the interleaved schedule needs at least parallel.pp={pp} micro-batches "
                f"(megatron: pp <= microbatch_group_size_per_vp_stage={g} <= micro-batches)")
    if 0 < microbatches % g < pp:
        return (f"the interleaved schedule needs a multiple of parallel.pp={pp} micro-batches "
                f"(megatron: micro-batches % microbatch_group_size_per_vp_stage={g} must be 0 "
                f"or >= pp)")
    return None


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_value(name, value, "must be a positive integer")


RECOMPUTE_GRANULARITIES = (None, "selective", "full")
RECOMPUTE_METHODS = (None, "uniform", "block")


@dataclass(frozen=True)
class MemorySpec:
    """What the memory model needs besides the model shape and the degree."""

    gpu_memory_gib: float
    """Usable memory of one GPU (the hardware file's ``gpu_memory_gib``)."""
    param_bytes: int = 2
    """Bytes per weight element (bf16/fp16: 2, fp32: 4)."""
    grad_bytes: int = 4
    """Bytes per gradient element (megatron ``main_grad``: 4 in fp32, 2 reduced in bf16)."""
    optimizer: str = "adam"
    """'adam' or 'sgd'."""
    distributed_optimizer: bool = False
    """Optimizer state sharded over the replicas (``train.distributed_optimizer``)."""
    replicas: int = 1
    """Replicas the distributed optimizer shards over."""
    zero_redundancy: bool = False
    """``recovery.live_redundancy``: every distributed-optimizer slice kept twice (fp32 models
    keep their masters too)."""
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    sequence_parallel: bool = False
    """megatron sequence parallelism (unsharded activations divided by the degree)."""
    flash_attention: bool = True
    """Core attention without ``[s, s]`` scores (SDPA / TE); False: megatron's local one."""
    dropout: bool = False
    """Hidden or attention dropout on (its masks are saved)."""
    recompute_granularity: str | None = None
    """None, 'selective' (core attention) or 'full' (megatron's recompute settings)."""
    recompute_method: str | None = None
    """With 'full': 'uniform' or 'block'."""
    recompute_num_layers: int = 1
    """With 'full': layers per recompute chunk (uniform) or recomputed layers (block)."""
    reserve_gib: float = 4.0
    """Set aside for the CUDA context, NCCL and sync buffers, fragmentation."""
    vp: int = 1
    """Model chunks per rank (``parallel.virtual_pipeline_model_parallel_size``): the
    interleaved schedule keeps more, smaller chunk passes in flight."""

    def __post_init__(self) -> None:
        if not self.gpu_memory_gib > 0:
            raise bad_value("hardware.gpu_memory_gib", self.gpu_memory_gib, "must be > 0")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise bad_value("model.recompute_granularity", self.recompute_granularity,
                            "must be null, selective or full")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise bad_value("model.recompute_method", self.recompute_method,
                            "must be null, uniform or block")
        if self.replicas < 1 or self.micro_batch_size < 1 or self.recompute_num_layers < 1:
            raise bad_value("memory", (self.replicas, self.micro_batch_size,
                                  self.recompute_num_layers), "counts must be >= 1")


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs numbered 0..num_gpus-1, cut into consecutive scale-up (NVLink) domains."""

    num_gpus: int
    """Total GPUs in the allocation."""
    domain_size: int = 8
    """GPUs per scale-up domain (8 for DGX H100, 32 for NVL32, 72 for NVL72); a trailing partial
    domain holds the remainder when num_gpus is not a multiple."""
    gpus_per_node: int = 8
    """GPUs per host (for launchers)."""
    name: str = "cluster"
    """Free-form label shown in tables."""
    hardware: str | None = None
    """GPU file in ``configs/sim/hardware`` (e.g. ``h100_nvl8``) whose FLOP/s and link speeds
    the planner's stage cost model uses (``layout.cost``); None: compute-only model."""
    emulated_scale_out_mb_s: float | None = None
    """For tests and demos: every data-path op on a process group whose GPUs span more than one
    scale-up domain is really delayed to this rate (MB/s, in proportion to its bytes) on a
    helper thread (``parallel/comm.py``); None: the network as it is."""

    def __post_init__(self) -> None:
        check_positive("cluster.num_gpus", self.num_gpus)
        r = self.emulated_scale_out_mb_s
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float))
                              or not 0 < r < float("inf")):
            raise bad_value("cluster.emulated_scale_out_mb_s", r,
                            "must be a rate > 0 (MB/s), or null: no emulation")
        check_positive("cluster.domain_size", self.domain_size)
        check_positive("cluster.gpus_per_node", self.gpus_per_node)
        if self.num_gpus % self.gpus_per_node:
            raise bad_value(
                "cluster.gpus_per_node", self.gpus_per_node,
                f"must divide cluster.num_gpus={self.num_gpus}",
            )

    def domain_bounds(self) -> list[tuple[int, int]]:
        """[start, stop) GPU id range of each scale-up domain."""
        d = self.domain_size
        return [(s, min(s + d, self.num_gpus)) for s in range(0, self.num_gpus, d)]


@dataclass(frozen=True)
class HealthReport:
    """Which GPUs are unusable right now."""

    failed_gpus: tuple[int, ...] = ()
    """Global ids of failed GPUs."""
    slow_gpus: tuple[tuple[int, float], ...] = ()
    """Stragglers: (GPU id, relative speed in (0, 1]) pairs, sorted by id; a mapping
    ``{gpu_id: speed}`` is accepted. A GPU that is also failed counts as failed."""
    slow_links: tuple[tuple[int, float], ...] = ()
    """GPUs whose scale-out NIC is slow: (GPU id, relative rate in (0, 1]) pairs, sorted by id
    (a mapping is accepted). Their replicas' sync layouts hand the GPU's cross-replica units to
    its TP peers (``layout.sync.nic_aware``); compute is not affected."""

    reserved_gpus: tuple[int, ...] = ()
    """GPUs held back from the plan while healthy: hot spares (``recovery.spares``) and the
    healthy GPUs of a slice a spare replaced. Counted as idle healthy GPUs."""

    def __post_init__(self) -> None:
        for g in self.reserved_gpus:
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise bad_value("health.reserved_gpus", g,
                                "GPU ids must be non-negative integers")
        object.__setattr__(self, "reserved_gpus", tuple(sorted(set(self.reserved_gpus))))
        for g in self.failed_gpus:
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise bad_value("health.failed_gpus", g, "GPU ids must be non-negative integers")
        object.__setattr__(self, "failed_gpus", tuple(sorted(set(self.failed_gpus))))
        pairs = dict(self.slow_gpus)  # a mapping or (id, speed) pairs
        for g, v in pairs.items():
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise bad_value("health.slow_gpus", g, "GPU ids must be non-negative integers")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise bad_value(f"health.slow_gpus[{g}]", v, "relative speed must be in (0, 1]")
        object.__setattr__(self, "slow_gpus",
                                tuple(sorted((g, float(v)) for g, v in pairs.items())))
        links = dict(self.slow_links)
        for g, v in links.items():
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise bad_value("health.slow_links", g, "GPU ids must be non-negative integers")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise bad_value(f"health.slow_links[{g}]", v,
                                "relative scale-out rate must be in (0, 1]")
        object.__setattr__(self, "slow_links",
                           tuple(sorted((g, float(v)) for g, v in links.items())))

    def gpu_speed(self, num_gpus: int) -> list[float]:
        """Relative speed of every GPU (1.0 unless reported slow)."""
        out = [1.0] * num_gpus
        for g, v in self.slow_gpus:
            out[g] = v
        return out

    def check_against(self, cluster: ClusterSpec) -> None:
        bad = [g for g in self.failed_gpus if g >= cluster.num_gpus]
        if bad:
            raise bad_value(
                "health.failed_gpus", bad[0],
                f"GPU id out of range for cluster.num_gpus={cluster.num_gpus}",
            )
        bad = [g for g in self.reserved_gpus if g >= cluster.num_gpus]
        if bad:
            raise bad_value("health.reserved_gpus", bad[0],
                            f"GPU id out of range for cluster.num_gpus={cluster.num_gpus}")
        for key, pairs in (("slow_gpus", self.slow_gpus), ("slow_links", self.slow_links)):
            bad = [g for g, _ in pairs if g >= cluster.num_gpus]
            if bad:
                raise bad_value(f"health.{key}", bad[0],
                                f"GPU id out of range for cluster.num_gpus={cluster.num_gpus}")

    @classmethod
    def from_file(cls, path: str | Path) -> HealthReport:
        """Load ``{"failed_gpus": [...]}`` from a YAML or JSON file."""
        text = Path(path).read_text()
        try:
            if str(path).endswith(".json"):
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except ValueError as e:  # json.JSONDecodeError
            raise bad_value("health", str(path), f"malformed JSON: {e}") from None
        except Exception as e:  # yaml.YAMLError: problem + where
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            why = getattr(e, "problem", None) or type(e).__name__
            raise bad_value("health", str(path), f"malformed YAML: {why}{where}") from None
        if not isinstance(data, dict) or set(data) - {"failed_gpus", "slow_gpus", "slow_links"}:
            raise bad_value("health", str(path), "file must hold a mapping with only "
                            "'failed_gpus', 'slow_gpus' and 'slow_links'")
        maps = {}
        for key in ("slow_gpus", "slow_links"):
            m = data.get(key) or {}
            if not isinstance(m, dict):
                raise bad_value(f"health.{key}", m, "must be a mapping {gpu_id: relative_value}")
            try:  # JSON keys are strings
                maps[key] = {int(k): v for k, v in m.items()}
            except (TypeError, ValueError):
                raise bad_value(f"health.{key}", list(m), "GPU ids must be integers") from None
        return cls(tuple(data.get("failed_gpus") or ()), tuple(maps["slow_gpus"].items()),
                   tuple(maps["slow_links"].items()))

    @classmethod
    def from_cli(cls, text: str) -> HealthReport:
        """Parse ``"3,17,40-43"`` (ids and inclusive ranges)."""
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            a, sep, b = part.partition("-")
            try:
                lo, hi = int(a), (int(b) if sep else None)
            except ValueError:
                raise bad_value("health.failed_gpus", part,
                                "expected an id or a range a-b") from None
            if hi is None:
                ids.append(lo)
            elif lo > hi:
                raise bad_value("health.failed_gpus", part,
                                f"reversed range (did you mean {hi}-{lo}?)")
            else:
                ids.extend(range(lo, hi + 1))
        return cls(tuple(ids))


@dataclass(frozen=True)
class ModelDims:
    """Shape of a GPT model; everything the layout math needs."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int = 4
    """KV heads (GQA groups); equal to num_attention_heads for MHA."""
    ffn_hidden_size: int = 128
    """MLP inner width (per half for gated MLPs)."""
    vocab_size: int = 101
    """Vocabulary rows (need not divide any TP degree)."""
    seq_length: int = 12
    """Tokens per sample."""
    gated_linear_unit: bool = True
    """SwiGLU-style gated MLP (fc1 holds gate and up halves)."""
    tie_embeddings: bool = False
    """Output layer shares the word embedding."""
    add_bias_linear: bool = False
    """Linear layers carry biases (column-parallel biases shard, row-parallel ones replicate)."""
    add_qkv_bias: bool = False
    """The QKV projection carries a bias even without ``add_bias_linear`` (megatron
    ``add_qkv_bias``: Qwen2); it moves with its query group."""
    kv_channels: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads (see ``kv``)."""
    qk_layernorm: bool = False
    """A norm over each query and key head (megatron ``qk_layernorm``: Qwen3, Gemma 3, OLMo 2).
    Its weights are replicated; each TP rank's gradient is a partial sum over its heads, summed
    over the TP group in the sync, as sequence-parallel norms are."""
    post_layernorm: bool = False
    """A norm on the outputs of ``linear_proj`` and ``linear_fc2`` before the residual add
    (Gemma 2/3, EXAONE 4; Bridge's ``TERowParallelLinearLayerNorm``: keys
    ``...linear_proj.post_layernorm.weight``, ``...linear_fc2.post_layernorm.weight``). Its
    weights are replicated (the row-parallel output is whole after the all-reduce; under
    sequence parallelism each rank's gradient covers its sequence shard, as other norms)."""
    kv_lora_rank: int | None = None
    """Multi-latent attention (MLA, DeepSeek-V2/V3; megatron ``MLATransformerConfig``): the KV
    latent width; None: no MLA. With MLA the heads are the units (``num_query_groups =
    num_attention_heads``), ``kv_channels = v_head_dim``; built with MoE only
    (``model.mla``), refused elsewhere."""
    q_lora_rank: int | None = None
    """MLA's query latent width; None: queries projected from the hidden state directly."""
    qk_head_dim: int | None = None
    """MLA's per-head query/key width without RoPE."""
    qk_pos_emb_head_dim: int | None = None
    """MLA's per-head RoPE part of queries/keys (one key RoPE head shared by all heads)."""
    v_head_dim: int | None = None
    """MLA's per-head value width."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "seq_length"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise bad_value("model.num_query_groups", self.num_query_groups,
                            f"must divide model.num_attention_heads={self.num_attention_heads}")
        # kv_channels stays None when derived: a schema default must not freeze one model's
        # head width into every other model loaded over it.
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise bad_value("model.hidden_size", self.hidden_size,
                                f"must be divisible by model.num_attention_heads="
                                f"{self.num_attention_heads} (or set model.kv_channels)")
        else:
            check_positive("model.kv_channels", self.kv_channels)
        if self.kv_lora_rank is not None:
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                check_positive(f"model.{name}", getattr(self, name))
            if self.q_lora_rank is not None:
                check_positive("model.q_lora_rank", self.q_lora_rank)
            if self.num_query_groups != self.num_attention_heads:
                raise bad_value("model.num_query_groups", self.num_query_groups,
                                "MLA's units are heads: must be model.num_attention_heads="
                                f"{self.num_attention_heads}")
            if self.kv != self.v_head_dim:
                raise bad_value("model.kv_channels", self.kv_channels,
                                f"must be model.v_head_dim={self.v_head_dim} with MLA")
        else:
            for name in ("q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                if getattr(self, name) is not None:
                    raise bad_value(f"model.{name}", getattr(self, name),
                                    "an MLA setting: needs model.kv_lora_rank")

    @property
    def mla(self) -> bool:
        """Multi-latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def norm_params(self) -> int:
        """Parameters per norm vector element: 2 with LayerNorm (weight, bias), else 1."""
        return 2 if getattr(self, "normalization", "RMSNorm") == "LayerNorm" else 1

    @property
    def qkv_bias(self) -> bool:
        """Whether linear_qkv has a bias (megatron: ``add_bias_linear or add_qkv_bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def kv(self) -> int:
        """Per-head width: model.kv_channels, or hidden_size // num_attention_heads."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class MoESpec:
    """A MoE model's experts as the planner counts them (megatron's ``TransformerConfig``
    names; ``PlanRequest.moe``). Each MoE layer's MLP is ``num_moe_experts`` routed experts
    (units of the ``expert`` space, ``layout/experts.py``: balanced ranges over a replica's TP
    ranks), a replicated router ``[num_moe_experts, hidden]`` and, when
    ``moe_shared_expert_intermediate_size`` is set, a shared expert: a dense gated MLP of that
    width, sharded over TP like the dense FFN. Layers ``moe_layer_freq`` marks 0 keep the dense
    FFN of ``model.ffn_hidden_size``."""

    num_moe_experts: int
    """Routed experts per MoE layer."""
    moe_router_topk: int
    """Experts each token is routed to (the compute term)."""
    moe_ffn_hidden_size: int
    """One routed expert's inner width (per half when gated)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared expert(s) of every MoE layer (None: none)."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """megatron's pattern: an int ``k`` (layer ``i`` is MoE when ``i % k == 0``) or one 0/1 per
    layer (DeepSeek-V3: ``(0,) * 3 + (1,) * 58``, its first 3 layers dense)."""

    def __post_init__(self) -> None:
        check_positive("model.num_moe_experts", self.num_moe_experts)
        check_positive("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if not (_is_int(self.moe_router_topk) and 1 <= self.moe_router_topk
                <= self.num_moe_experts):
            raise bad_value("model.moe_router_topk", self.moe_router_topk,
                            f"must be in [1, model.num_moe_experts={self.num_moe_experts}]")
        if self.moe_shared_expert_intermediate_size is not None:
            check_positive("model.moe_shared_expert_intermediate_size",
                           self.moe_shared_expert_intermediate_size)
        f = self.moe_layer_freq
        if isinstance(f, int):  # (check_positive refuses a bool)
            check_positive("model.moe_layer_freq", f)
        else:
            pattern = tuple(f) if hasattr(f, "__iter__") and not isinstance(f, str) else ()
            if not pattern or any(not _is_int(x) or x not in (0, 1) for x in pattern):
                raise bad_value("model.moe_layer_freq", list(pattern),
                                "must be a positive int or a list of 0/1, one per layer")
            object.__setattr__(self, "moe_layer_freq", pattern)

    def pattern(self, num_layers: int) -> tuple[int, ...]:
        """1 for every MoE layer, 0 for every dense one (megatron's ``moe_layer_pattern``)."""
        f = self.moe_layer_freq
        if isinstance(f, int):
            return tuple(int(i % f == 0) for i in range(num_layers))
        if len(f) != num_layers:
            raise bad_value("model.moe_layer_freq", list(f),
                            f"has {len(f)} entries; model.num_layers={num_layers}")
        return f


@dataclass(frozen=True)
class ParallelSpec:
    """How replicas are cut: TP degree per replica stage, pipeline stages, batch."""

    tp_base: int = 8
    """TP degree of a healthy replica stage: a slice of tp_base GPUs inside one domain."""
    pp: int = 1
    """Pipeline stages per replica (each stage is one slice)."""
    dp: int | None = None
    """Replicas to use; None uses every replica the cluster can hold."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: every degree must divide model.seq_length."""
    min_tp: int = 1
    """Smallest degree a stage may run at (memory floor); below it the replica is dropped."""
    unit_balance: str = "work"
    """'work': FFN columns sized so every rank's layer work is even (a rank with an extra query
    group takes fewer columns); 'units': every parameter split into counts differing by <= 1."""
    sync_layout: str = "refine"
    """'refine': shards at every replica's boundaries (nothing moves, more DP groups);
    'base': shards of the tp_base layout (degraded replicas reshard, one group per shard)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """megatron's virtual pipeline stages (interleaved 1F1B): model chunks per rank; chunk ``c``
    of stage ``s`` holds layer block ``c * pp + s``. None or 1: no interleaving."""

    @property
    def vp(self) -> int:
        """Model chunks per rank (1 without interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    def __post_init__(self) -> None:
        check_positive("parallel.tp_base", self.tp_base)
        check_positive("parallel.pp", self.pp)
        v = self.virtual_pipeline_model_parallel_size
        if v is not None:
            check_positive("parallel.virtual_pipeline_model_parallel_size", v)
            if v > 1 and self.pp < 2:
                raise bad_value("parallel.virtual_pipeline_model_parallel_size", v,
                                f"needs parallel.pp > 1 (parallel.pp={self.pp})")
        check_positive("parallel.min_tp", self.min_tp)
        if self.dp is not None:
            check_positive("parallel.dp", self.dp)
        if self.min_tp > self.tp_base:
            raise bad_value("parallel.min_tp", self.min_tp,
                            f"exceeds parallel.tp_base={self.tp_base}")
        if self.unit_balance not in ("work", "units"):
            raise bad_value("parallel.unit_balance", self.unit_balance, "must be 'work' or 'units'")
        if self.sync_layout not in SYNC_LAYOUTS:
            raise bad_value("parallel.sync_layout", self.sync_layout,
                            f"must be one of {SYNC_LAYOUTS}")


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner reads."""

    cluster: ClusterSpec
    model: ModelDims = field(default_factory=ModelDims)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    health: HealthReport = field(default_factory=HealthReport)
    policy: str = "nutp"
    """'nutp' | 'drop' | 'uniform-reduce'."""
    replicas: tuple[Any, ...] | None = None
    """Explicit degrees, overriding what health implies: per replica an int (that degree on
    every stage) or a sequence of ``parallel.pp`` per-stage degrees; normalised to a tuple of
    per-stage tuples, e.g. ``(4, (4, 3))`` with pp=2 -> ``((4, 4), (4, 3))``."""
    global_batch: int = 64
    """Micro-batches per step (train.global_batch_size / train.micro_batch_size), split among
    replicas in proportion to speed."""
    world_size: int | None = None
    """If set (e.g. by the launcher), the plan's world size must equal it."""
    micro_batch_size: int = 1
    """Samples per micro-batch (the cost model's tokens per micro-batch: x model.seq_length)."""
    cost: CostSpec | None = None
    """Hardware constants of the stage cost model (``layout.cost``); None: compute only."""
    memory: MemorySpec | None = None
    """GPU memory model inputs (``layout.memory``): degrees that do not fit are never planned;
    None: memory unchecked (CPU runs, hardware without ``gpu_memory_gib``)."""
    moe: MoESpec | None = None
    """The model's experts (``nutp-bridge``: its provider's ``num_moe_experts`` etc.); the
    memory model counts what each rank holds of them; None: a dense model."""

    def __post_init__(self) -> None:
        check_positive("global_batch", self.global_batch)
        check_positive("micro_batch_size", self.micro_batch_size)
        if self.world_size is not None:
            check_positive("world_size", self.world_size)
        if self.replicas is not None:
            object.__setattr__(self, "replicas", normalize_replicas(self.replicas,
                                                                    self.parallel.pp))
        if self.moe is not None:
            self.moe.pattern(self.model.num_layers)  # a per-layer list of the right length


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def normalize_replicas(replicas: Any, pp: int) -> tuple[tuple[int, ...], ...]:
    """``nutp.replicas`` as one tuple of ``pp`` per-stage degrees per replica; ValueError
    naming ``nutp.replicas`` for anything else."""
    shown = _plain(replicas)
    if isinstance(replicas, (str, bytes)) or not hasattr(replicas, "__iter__"):
        raise bad_value("nutp.replicas", shown, "must be a list (one entry per replica)")
    out = []
    for k, entry in enumerate(replicas):
        if _is_int(entry):
            out.append((int(entry),) * pp)
            continue
        if isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
            raise bad_value("nutp.replicas", shown,
                            f"entry {k} ({entry!r}) must be an int or a list "
                            "of per-stage degrees")
        degs = tuple(entry)
        if not all(_is_int(d) for d in degs):
            raise bad_value("nutp.replicas", shown, f"entry {k} ({_plain(entry)}) must hold ints")
        if len(degs) != pp:
            raise bad_value("nutp.replicas", shown, f"entry {k} has {len(degs)} per-stage degrees; "
                            f"parallel.pp={pp} needs {pp} (or one int for every stage)")
        out.append(tuple(int(d) for d in degs))
    if not out:
        raise bad_value("nutp.replicas", shown, "must name at least one replica (or be null)")
    return tuple(out)


def _plain(x: Any) -> Any:
    """Lists of ints for messages (tuples and OmegaConf lists print as lists)."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        return x
    return [_plain(v) for v in x]


@dataclass(frozen=True)
class CostSpec:
    """Per-rank constants that turn the stage cost model into seconds."""

    flops: float
    """Achieved FLOP/s of one rank on the model's matmuls (peak x MFU)."""
    tp_gbps: float
    """GB/s per rank and direction for TP collectives (scale-up domain)."""
    p2p_gbps: float
    """GB/s per rank and direction for stage-boundary sends (often across domains)."""
    tp_overlap: float = 0.0
    """Fraction of TP communication hidden behind compute."""
    latency_s: float = 0.0
    """Fixed cost of one collective or point-to-point message."""
    act_bytes: int = 2
    """Bytes per activation element on the wire (bf16: 2)."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per layer and micro-batch on every rank whatever its degree (operator
    dispatch; about 0 on GPUs, where launches overlap; measurable on CPUs)."""
    table_elem_s: float = 0.0
    """Seconds per element of the first stage's local word-embedding table per micro-batch:
    its backward writes a dense gradient of the table (memory-bound, not a multiply-add;
    0 on GPUs, where it is small next to the matmuls)."""
    name: str = "hardware"
    """Where the numbers come from (shown in tables)."""

    def __post_init__(self) -> None:
        for k in ("flops", "tp_gbps", "p2p_gbps"):
            if not float(getattr(self, k)) > 0:
                raise bad_value(f"cost.{k}", getattr(self, k), "must be > 0")
        if not 0.0 <= self.tp_overlap <= 1.0:
            raise bad_value("cost.tp_overlap", self.tp_overlap, "must be in [0, 1]")
        for k in ("latency_s", "layer_overhead_s", "table_elem_s"):
            if getattr(self, k) < 0:
                raise bad_value(f"cost.{k}", getattr(self, k), "must be >= 0")

    @classmethod
    def from_hardware(cls, *, peak_tflops: float, nvlink_gbps: float, network_gbps: float,
                      mfu: float = 0.45, tp_overlap: float = 0.3, latency_s: float = 5e-6,
                      name: str = "hardware") -> CostSpec:
        """From a ``configs/sim/hardware`` file (the simulator's MFU/overlap defaults):
        TP on the scale-up links, stage boundaries on the scale-out network."""
        return cls(flops=peak_tflops * 1e12 * mfu, tp_gbps=nvlink_gbps, p2p_gbps=network_gbps,
                   tp_overlap=tp_overlap, latency_s=latency_s, name=name)
