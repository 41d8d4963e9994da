"""The job config's schema: the dataclasses, each field with its docstring (``docs/config.md``
is generated from them), and their value checks.

``__post_init__`` checks values and never rewrites them: the loader (``config/loading.py``) maps
deprecated names and normalises spellings before a dataclass is built; values derived from a
config are in ``config/derived.py``. Nothing here creates a process group.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common import env
from ..common.faults import check_factor, configured
from ..layout import ClusterSpec, HealthReport, ModelDims, ParallelSpec
from ..layout.specs import bad_value, check_positive, normalize_replicas

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The shipped YAML tree (repository layout); ``NUTP_CONFIG_DIR`` overrides it."""
PRECISIONS = ("fp32", "bf16", "fp16")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
CORE_ATTENTIONS = ("auto", "sdpa", "megatron")
RENAMED = {"gated_mlp": "gated_linear_unit", "add_bias": "add_bias_linear",
           "position_embedding": "position_embedding_type"}
"""``model.*`` names of the previous release -> megatron-core's (accepted with a warning for
one release, mapped by the loader; a checkpoint's marker may still hold the old ones)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
POSITION_EMBEDDINGS = ("rope", "yarn", "learned_absolute", "none")
ROTARY = ("rope", "yarn")
"""The position embeddings that rotate query and key channels (``rotary_base`` applies)."""
YARN_REQUIRED = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                 "yarn_beta_fast", "yarn_beta_slow")
"""What YaRN cannot do without (megatron's ``GPTModel`` reads them as they are)."""
LOCAL_ONLY = ("qk_layernorm", "layernorm_zero_centered_gamma", "post_layernorm",
              "attn_logit_softcapping", "rotary_base_local")
"""``model.*`` settings built on megatron's local layers only (refused with TE layers)."""
ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu", "quick_gelu", "fast_gelu")
"""``model.activation_func`` by name: torch's ``F.silu``/``F.gelu``/``F.relu`` and megatron-core's
``activations`` module's others (``model/build.py:activation``)."""


@dataclass(frozen=True)
class ModelConfig(ModelDims):
    """Model shape (``ModelDims``) plus what only the runtime needs."""

    normalization: str = "RMSNorm"
    """'RMSNorm' or 'LayerNorm'."""
    activation_func: str | None = None
    """The MLP's activation (megatron ``activation_func``, by name: one of ``ACTIVATIONS``;
    gated with ``gated_linear_unit``: SwiGLU, GeGLU, ...). null: silu if gated_linear_unit,
    else gelu."""
    gated_mlp: bool | None = None
    """Deprecated: ``gated_linear_unit`` (megatron's name). Removed in the next release."""
    add_bias: bool | None = None
    """Deprecated: ``add_bias_linear`` (megatron's name). Removed in the next release."""
    position_embedding: str | None = None
    """Deprecated: ``position_embedding_type`` (megatron's name). Removed in the next release."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention (megatron ``window_size``): (left, right), query i attends to
    keys i - left .. i + right (causal: right 0); null: full causal attention."""
    window_attn_skip_freq: int | None = None
    """With ``window_size``: every this-many-th layer (1-based) attends fully, the others by
    the window (Gemma 3: 6); null: every layer by the window."""
    layernorm_epsilon: float = 1e-5
    """The norms' epsilon (megatron ``layernorm_epsilon``; Qwen and Llama 3: 1e-6 or 1e-5)."""
    position_embedding_type: str = "rope"
    """'rope', 'yarn' (RoPE with YaRN's frequency interpolation and attention scaling: the
    ``yarn_*`` fields), 'learned_absolute' or 'none' (no position information: NoPE; megatron
    ``position_embedding_type``)."""
    rotary_base: int = 10000
    """RoPE base (megatron ``rotary_base``; Llama 3: 500000). Only with rope."""
    rotary_percent: float = 1.0
    """Share of each head's channels RoPE rotates (partial RoPE; megatron ``rotary_percent``).
    Only with rope."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (megatron ``rope_scaling``). Only with rope."""
    rope_scaling_factor: float = 8.0
    """Its factor (megatron ``rope_scaling_factor``); read only with ``rope_scaling``."""
    seq_len_interpolation_factor: float | None = None
    """Linear position interpolation: positions divided by this (megatron
    ``seq_len_interpolation_factor``). Only with rope."""
    yarn_rotary_scaling_factor: float | None = None
    """YaRN's context-extension factor s (megatron/Bridge ``yarn_rotary_scaling_factor``; gpt-oss:
    32). Required with yarn, which is the only place the ``yarn_*`` fields are read."""
    yarn_original_max_position_embeddings: int | None = None
    """The pre-extension context length (gpt-oss: 4096). Required with yarn."""
    yarn_beta_fast: float | None = None
    """YaRN's ramp: channel pairs rotating more than this many times over the original context
    keep their frequency (gpt-oss: 32). Required with yarn."""
    yarn_beta_slow: float | None = None
    """...and those rotating fewer than this many times are interpolated by s (gpt-oss: 1).
    Required with yarn."""
    yarn_mscale: float | None = None
    """Attention concentration: q and k scaled by (0.1 mscale ln s + 1) / (0.1 mscale_all_dim
    ln s + 1); either null: 0.1 ln s + 1 (megatron's rule)."""
    yarn_mscale_all_dim: float | None = None
    """See ``yarn_mscale``."""
    yarn_correction_range_round_to_int: bool | None = None
    """Round the ramp's ends to whole channel pairs (megatron's default true; gpt-oss: false;
    null: false, as megatron reads it)."""
    rotary_base_local: int | None = None
    """Gemma 3's per-layer RoPE bases: the RoPE base of the sliding-window layers (Bridge's
    ``rotary_base[0]``, HF ``rope_local_base_freq``); ``rotary_base`` is then the full layers'.
    Needs ``window_size`` (which layers slide: ``window_attn_skip_freq``). null: one base."""
    rope_scaling_factor_global: float = 1.0
    """With ``rotary_base_local``: linear RoPE scaling of the full-attention layers only
    (their inverse frequencies divided by it: Bridge's Gemma 3 ``rope_scaling_factor``, HF
    ``rope_scaling: {rope_type: linear}``)."""
    layernorm_zero_centered_gamma: bool = False
    """Every norm (layers, final, QK and post norms) scales by ``1 + weight``, the weights
    initialised to 0 (megatron ``layernorm_zero_centered_gamma``; Gemma)."""
    softmax_scale: float | None = None
    """The attention scores' scale (megatron ``softmax_scale``); null: 1/sqrt(head width).
    Gemma 2's ``query_pre_attn_scalar`` q maps to 1/sqrt(q) (Bridge recipes)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: scaled attention scores become ``cap * tanh(scores / cap)`` before the mask
    and softmax (Bridge's ``attn_logit_softcapping``). megatron's core attention only (not
    SDPA, not TE). null: off."""
    final_logit_softcapping: float | None = None
    """Gemma 2: the output logits become ``cap * tanh(logits / cap)`` before the loss
    (Bridge's ``final_logit_softcapping``; elementwise, so exact per vocab shard). null: off."""
    apply_embedding_scaling: bool = False
    """Gemma: the embeddings times sqrt(hidden_size) (Bridge's ``EmbeddingScalingMixin``,
    HF Gemma's ``normalizer``)."""
    embedding_scale_rounded: bool = True
    """With ``apply_embedding_scaling``: the factor rounded to the embeddings' dtype first
    (Gemma 1/2 in Bridge, HF); false: the unrounded float (Bridge's Gemma 3 embedding). The
    same in fp32."""
    init_std: float = 0.02
    """Std of the normal init of weight matrices."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP output (megatron hidden_dropout)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    cross_entropy_loss_fusion: bool = False
    """megatron's fused cross entropy (``cross_entropy_fusion_impl=native``, on in Bridge's
    recipes): the same loss, and the logits gradient rounded to bf16 whatever the model's
    precision, as megatron-core's ``fusions/fused_cross_entropy.py`` does."""
    transformer_impl: str = "local"
    """'local' (megatron-core's own layers), 'transformer_engine' (TE layers, norms fused into
    linear_qkv/linear_fc1) or 'auto' (TE when CUDA and transformer_engine are present). The
    default is local: the TE path has not run on a GPU yet (docs/verified.md)."""
    core_attention: str = "auto"
    """With the local impl: 'sdpa' (torch scaled_dot_product_attention: causal, no [s, s]
    scores, no mask tensor), 'megatron' (DotProductAttention, explicit mask) or 'auto' (sdpa on
    CUDA, megatron on CPU)."""
    recompute_granularity: str | None = None
    """megatron activation recompute: null, 'selective' (core attention) or 'full'."""
    recompute_method: str | None = None
    """With recompute_granularity=full: 'uniform' or 'block'."""
    recompute_num_layers: int | None = None
    """With full: layers per recompute chunk (uniform) or recomputed layers per stage (block)."""

    def __post_init__(self) -> None:
        self._check_deprecated()
        super().__post_init__()
        self._check_impl()
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise bad_value("model.normalization", self.normalization,
                            "must be RMSNorm or LayerNorm")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise bad_value("model.position_embedding_type", self.position_embedding_type,
                            f"must be one of {POSITION_EMBEDDINGS}")
        self._check_window()
        if self.activation_func is not None and self.activation_func not in ACTIVATIONS:
            raise bad_value("model.activation_func", self.activation_func,
                            f"must be one of {ACTIVATIONS} (or null)")
        if not 0.0 < self.layernorm_epsilon < 1.0:
            raise bad_value("model.layernorm_epsilon", self.layernorm_epsilon,
                            "must be in (0, 1)")
        if self.position_embedding_type in ROTARY and self.kv % 2:
            # RoPE rotates channel pairs; megatron's rotate_half cannot split an odd width.
            if self.kv_channels is not None:
                raise bad_value("model.kv_channels", self.kv_channels,
                                "RoPE needs an even head dimension")
            raise bad_value("model.hidden_size", self.hidden_size,
                            f"RoPE needs an even head dimension "
                            f"({self.hidden_size}/{self.num_attention_heads} heads={self.kv})")
        self._check_rope()  # after the head width: an odd one is named as such
        self._check_gemma()
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad_value(f"model.{name}", getattr(self, name), "must be in [0, 1)")

    def _check_deprecated(self) -> None:
        """The previous release's names are mapped by the loader (``config/loading.py``);
        given here, they would be ignored."""
        for old, new in RENAMED.items():
            if getattr(self, old) is not None:
                raise bad_value(f"model.{old}", getattr(self, old),
                                f"deprecated: set model.{new} (load_config maps the old name)")

    def _check_window(self) -> None:
        w = self.window_size
        if w is not None:
            # a tuple (the loader turns YAML's list into one): the config stays hashable
            # (layout caches by model dims)
            if not isinstance(w, tuple) or len(w) != 2 or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in w):
                raise bad_value("model.window_size", list(w),
                                "must be [left, right] with integers >= 0 (or null)")
        f = self.window_attn_skip_freq
        if f is not None:
            if w is None:
                raise bad_value("model.window_attn_skip_freq", f, "needs model.window_size")
            check_positive("model.window_attn_skip_freq", f)

    def _check_rope(self) -> None:
        """RoPE settings: valid values, and none set away from its default without RoPE (it
        would be silently ignored)."""
        if isinstance(self.rotary_base, bool) or not isinstance(self.rotary_base, int) \
                or self.rotary_base < 2:
            raise bad_value("model.rotary_base", self.rotary_base, "must be an integer >= 2")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise bad_value("model.rotary_percent", self.rotary_percent, "must be in (0, 1]")
        if not self.rope_scaling_factor > 0:
            raise bad_value("model.rope_scaling_factor", self.rope_scaling_factor,
                            "must be > 0")
        f = self.seq_len_interpolation_factor
        if f is not None and not f > 0:
            raise bad_value("model.seq_len_interpolation_factor", f, "must be > 0 or null")
        pos = self.position_embedding_type
        rope_only: tuple[tuple[str, Any], ...] = (
            ("rotary_percent", 1.0), ("rope_scaling", False),
            ("seq_len_interpolation_factor", None))
        if pos not in ROTARY:
            rope_only = (("rotary_base", 10000), *rope_only)
        if pos != "rope":  # megatron's YaRN rotates every channel and reads none of these
            for name, default in rope_only:
                if getattr(self, name) != default:
                    raise bad_value(f"model.{name}", getattr(self, name),
                                    f"needs model.position_embedding_type=rope (is {pos})")
        self._check_yarn()
        if pos != "rope":
            return
        rot = int(self.kv * self.rotary_percent)
        if rot < 2 or rot % 2:
            # megatron rotates channel pairs of the first kv_channels * rotary_percent channels
            raise bad_value("model.rotary_percent", self.rotary_percent,
                            f"rotates {rot} of {self.kv} channels per head: needs an even "
                            f"number >= 2")

    def _check_yarn(self) -> None:
        """The ``yarn_*`` fields: all of ``YARN_REQUIRED`` with yarn, none without it (they
        would be silently ignored)."""
        names = [f for f in type(self).__dataclass_fields__ if f.startswith("yarn_")]
        if self.position_embedding_type != "yarn":
            for name in names:
                if getattr(self, name) is not None:
                    raise bad_value(f"model.{name}", getattr(self, name), "needs "
                                    f"model.position_embedding_type=yarn (is "
                                    f"{self.position_embedding_type})")
            return
        for name in YARN_REQUIRED:
            if getattr(self, name) is None:
                raise bad_value(f"model.{name}", None, "required with "
                                "model.position_embedding_type=yarn")
        if not self.yarn_rotary_scaling_factor > 0:  # type: ignore[operator]
            raise bad_value("model.yarn_rotary_scaling_factor",
                            self.yarn_rotary_scaling_factor, "must be > 0")
        check_positive("model.yarn_original_max_position_embeddings",
                       self.yarn_original_max_position_embeddings)
        if not self.yarn_beta_fast > self.yarn_beta_slow > 0:  # type: ignore[operator]
            raise bad_value("model.yarn_beta_fast", self.yarn_beta_fast,
                            f"must be > model.yarn_beta_slow ({self.yarn_beta_slow}) > 0")

    def _check_gemma(self) -> None:
        """Gemma 2/3's settings: valid values; none set where it would be ignored."""
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not v > 0):
                raise bad_value(f"model.{name}", v, "must be > 0 or null")
        if self.attn_logit_softcapping is not None and self.core_attention == "sdpa":
            raise bad_value("model.core_attention", self.core_attention,
                            "SDPA cannot softcap the attention scores (model."
                            "attn_logit_softcapping): set megatron or auto")
        if self.post_layernorm and self.add_bias_linear:
            raise bad_value("model.post_layernorm", True, "needs model.add_bias_linear=false "
                            "(the norm would come before the deferred row-parallel bias)")
        if not self.embedding_scale_rounded and not self.apply_embedding_scaling:
            raise bad_value("model.embedding_scale_rounded", False,
                            "needs model.apply_embedding_scaling=true")
        local = self.rotary_base_local
        if not self.rope_scaling_factor_global > 0:
            raise bad_value("model.rope_scaling_factor_global", self.rope_scaling_factor_global,
                            "must be > 0")
        if local is None:
            if self.rope_scaling_factor_global != 1.0:
                raise bad_value("model.rope_scaling_factor_global",
                                self.rope_scaling_factor_global, "needs model.rotary_base_local")
            return
        if isinstance(local, bool) or not isinstance(local, int) or local < 2:
            raise bad_value("model.rotary_base_local", local, "must be an integer >= 2 or null")
        if self.position_embedding_type != "rope":
            raise bad_value("model.rotary_base_local", local, "needs model.position_embedding_"
                            f"type=rope (is {self.position_embedding_type})")
        if self.window_size is None:
            raise bad_value("model.rotary_base_local", local, "needs model.window_size (the "
                            "sliding-window layers take the local base)")
        if self.rope_scaling:
            raise bad_value("model.rotary_base_local", local, "with model.rope_scaling=true: "
                            "Gemma 3 scales its full layers linearly "
                            "(model.rope_scaling_factor_global)")

    def _check_impl(self) -> None:
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise bad_value("model.transformer_impl", self.transformer_impl,
                            f"must be one of {TRANSFORMER_IMPLS}")
        if self.transformer_impl == "transformer_engine":
            for name in LOCAL_ONLY:
                if getattr(self, name) not in (None, False):
                    raise bad_value("model.transformer_impl", self.transformer_impl,
                                    f"model.{name} is built with local layers only (set local)")
        if self.core_attention not in CORE_ATTENTIONS:
            raise bad_value("model.core_attention", self.core_attention,
                            f"must be one of {CORE_ATTENTIONS}")
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g not in (None, "selective", "full"):
            raise bad_value("model.recompute_granularity", g, "must be null, selective or full")
        if m not in (None, "uniform", "block"):
            raise bad_value("model.recompute_method", m, "must be null, uniform or block")
        if g == "full" and (m is None or n is None or n < 1):
            raise bad_value("model.recompute_granularity", g, "needs model.recompute_method "
                            "(uniform|block) and model.recompute_num_layers >= 1")
        if g != "full" and (m is not None or n is not None):
            field = "model.recompute_method" if m is not None else "model.recompute_num_layers"
            raise bad_value(field, m if m is not None else n,
                            "only with model.recompute_granularity=full")


@dataclass(frozen=True)
class HealthConfig:
    """Which GPUs are down or slow now: explicit lists and/or a health-report file (named
    ``failures`` before: the loader maps that name, with a warning, for one release)."""

    failed_gpus: list[int] = field(default_factory=list)
    """Global GPU ids known to be failed."""
    slow_gpus: dict[int, float] | None = None
    """Stragglers: ``{gpu_id: relative_speed}``, speed in (0, 1] (the planner keeps or excludes
    each, whichever it predicts faster); None = none."""
    reserved_gpus: list[int] | None = None
    """GPUs held back from the plan while healthy: the hot spares and the healthy GPUs of a
    slice a spare replaced (set by a live job as it swaps spares in). None: the last
    ``recovery.spares`` TP slices."""
    slow_links: dict[int, float] | None = None
    """GPUs with a slow scale-out NIC: ``{gpu_id: relative_rate}``, rate in (0, 1]. Their
    replicas hand the GPU's cross-replica gradient units to its TP peers (a NIC-aware sync
    layout); a live job sets it itself when it finds a slow link. None = none."""
    report: str | None = None
    """Path of a health report (YAML/JSON with ``failed_gpus``, ``slow_gpus``, ``slow_links``);
    merged with the lists (the report's value wins for a GPU in both)."""

    def as_report(self) -> HealthReport:
        """The lists merged with the report file, as the planner's ``HealthReport``."""
        ids = list(self.failed_gpus)
        slow = {int(k): v for k, v in (self.slow_gpus or {}).items()}
        links = {int(k): v for k, v in (self.slow_links or {}).items()}
        if self.report:
            path = Path(self.report)
            if not path.exists() and (CONFIG_DIR / path).exists():
                path = CONFIG_DIR / path
            if not path.exists():
                raise bad_value("health.report", self.report, "file not found")
            rep = HealthReport.from_file(path)
            ids += list(rep.failed_gpus)
            slow.update(rep.slow_gpus)
            links.update(rep.slow_links)
        return HealthReport(tuple(ids), tuple(slow.items()), tuple(links.items()),
                            tuple(self.reserved_gpus or ()))


@dataclass(frozen=True)
class NutpConfig:
    """How degraded replicas are handled."""

    policy: str = "nutp"
    """'nutp' (reduced degree), 'drop' (status quo) or 'uniform-reduce' (public reference)."""
    replicas: list[Any] | None = None
    """Explicit degrees per replica, overriding the plan derived from failures: an int (that
    degree on every stage, e.g. [4, 3]) or a list of per-stage degrees (parallel.pp=2:
    [[4, 3], [4, 4]]). On the CPU default cluster (cpu_local) the cluster grows to fit them."""
    rebalance: bool = False
    """Re-solve micro-batch shares between steps from measured per-replica compute time
    (``train/rebalance.py``); the weights follow, so the math is unchanged."""
    rebalance_smoothing: float = 0.5
    """Weight of the newest step in the moving average of seconds per micro-batch, in (0, 1]."""
    rebalance_hysteresis: float = 0.05
    """Change shares only when the predicted step compute time drops by this fraction."""
    rebalance_max_shift: int = 2
    """Micro-batches moved between replicas per step at most."""
    rebalance_warmup: int = 1
    """Steps measured before the first change (the first step pays start-up costs)."""
    straggler_probe_interval: int = 0
    """Time a fixed local probe on every rank every this many steps to find a rank slower than
    its TP group (``train/stragglers.py``); 0 disables detection."""
    straggler_threshold: float = 1.5
    """A probe this many times slower than the median of its TP-group peers counts as slow."""
    straggler_window: int = 3
    """Consecutive slow probes that make a persistent straggler (reported with its GPU id)."""
    exclude_stragglers: bool = False
    """Stop after the next checkpoint once a straggler is found, leaving
    ``<output.dir>/stragglers.json`` for the relaunch (``health.report``) to re-plan."""

    def __post_init__(self) -> None:
        if not 0.0 < self.rebalance_smoothing <= 1.0:
            raise bad_value("nutp.rebalance_smoothing", self.rebalance_smoothing,
                            "must be in (0, 1]")
        if not 0.0 <= self.rebalance_hysteresis < 1.0:
            raise bad_value("nutp.rebalance_hysteresis", self.rebalance_hysteresis,
                            "must be in [0, 1)")
        check_positive("nutp.rebalance_max_shift", self.rebalance_max_shift)
        if isinstance(self.rebalance_warmup, bool) or self.rebalance_warmup < 0:
            raise bad_value("nutp.rebalance_warmup", self.rebalance_warmup, "must be >= 0")
        if self.straggler_probe_interval < 0:
            raise bad_value("nutp.straggler_probe_interval", self.straggler_probe_interval,
                            "must be >= 0 (0 disables)")
        if not 1.0 < self.straggler_threshold < math.inf:
            raise bad_value("nutp.straggler_threshold", self.straggler_threshold, "must be > 1")
        check_positive("nutp.straggler_window", self.straggler_window)
        if self.exclude_stragglers and self.straggler_probe_interval == 0:
            raise bad_value("nutp.exclude_stragglers", True,
                            "needs detection: set nutp.straggler_probe_interval > 0")


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation run."""

    steps: int = 30
    """Optimizer steps."""
    global_batch_size: int = 16
    """Samples per step, over all replicas."""
    micro_batch_size: int = 2
    """Samples per micro-batch."""
    lr: float = 3e-3
    """Peak learning rate (megatron ``lr``; the schedule's maximum)."""
    lr_warmup_iters: int = 0
    """Linear warmup from ``lr_warmup_init`` to ``lr`` over this many updates (megatron's
    name)."""
    lr_warmup_init: float = 0.0
    """Where the warmup starts."""
    lr_decay_style: str = "constant"
    """After the warmup: 'constant', 'linear', 'cosine', 'inverse-square-root' or 'WSD' (warmup,
    stable, decay), megatron-core's ``OptimizerParamScheduler``."""
    lr_decay_iters: int | None = None
    """Updates over which the lr decays to ``min_lr`` (null: ``steps``)."""
    min_lr: float = 0.0
    """The lr after the decay."""
    lr_wsd_decay_style: str = "exponential"
    """WSD's final decay: 'exponential', 'linear', 'cosine' or 'minus_sqrt'."""
    lr_wsd_decay_iters: int | None = None
    """WSD: the last this-many updates of ``lr_decay_iters`` decay (required with WSD)."""
    eval_interval: int = 0
    """Evaluate after every this-many steps (megatron's ``eval_interval``; 0: never). The
    validation loss goes into that step's metrics row (``val_loss``)."""
    eval_iters: int = 1
    """Validation global batches per evaluation (megatron's ``eval_iters``); successive
    evaluations read successive batches of the validation set, as megatron's do."""
    valid_data_path: str | None = None
    """A megatron-core indexed dataset (prefix) to validate on; required for evaluation with
    ``data_path`` (null with synthetic data: the synthetic stream's validation split)."""
    seed: int = 1234
    """Seed of weights and synthetic data."""
    optimizer: str = "adam"
    """'adam' or 'sgd'."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 0.0
    """Global grad-norm clip (0 disables)."""
    precision: str = "fp32"
    """'fp32' | 'bf16' | 'fp16' (fp16: megatron's dynamic loss scaler)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients across replicas in fp32 (megatron's main_grad and DDP
    ``grad_reduce_in_fp32``); false: in bf16 (needs ``precision=bf16``; fp32 parameters
    always reduce in fp32). Was also ``sync.grad_reduce_dtype`` (deprecated)."""
    initial_loss_scale: float = 4294967296.0
    """fp16: starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """fp16: floor of the dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale grows."""
    check_for_nan_in_grad: bool = True
    """Stop with an error naming the parameters when the global gradient has NaN/Inf (fp16
    overflow is handled by the loss scaler instead)."""
    large_grad_factor: float = 10.0
    """Stop with an error when the grad norm exceeds this factor times the largest of the previous
    ``large_grad_window`` steps (megatron's large-gradient check, its threshold 10; active once
    that many steps are seen; 0 disables)."""
    large_grad_window: int = 20
    """Steps of grad-norm history the large-gradient check compares against."""
    data_path: str | None = None
    """Prefix of a megatron-core indexed dataset (.bin/.idx); None = synthetic tokens."""
    distributed_optimizer: bool = False
    """ZeRO-1 over the sync owner groups (sync/zero.py): fp32 master + optimizer state kept
    for 1/R of the owned sync shards (R = replicas); fp32 or bf16 (fp16 rejected)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size"):
            check_positive(f"train.{name}", getattr(self, name))
        if self.global_batch_size % self.micro_batch_size:
            raise bad_value("train.global_batch_size", self.global_batch_size,
                            f"must be a multiple of train.micro_batch_size={self.micro_batch_size}")
        if self.optimizer not in ("adam", "sgd"):
            raise bad_value("train.optimizer", self.optimizer, "must be adam or sgd")
        if not self.lr > 0:
            raise bad_value("train.lr", self.lr, "must be > 0")
        self._check_schedule()
        self._check_eval()
        if not 0.0 <= self.clip_grad < math.inf:
            raise bad_value("train.clip_grad", self.clip_grad, "must be >= 0 (0 disables)")
        if self.distributed_optimizer and self.precision == "fp16":
            raise bad_value("train.distributed_optimizer", True,
                            "not supported with train.precision=fp16 (use bf16 or fp32)")
        self._check_numerics()

    def _check_eval(self) -> None:
        if isinstance(self.eval_interval, bool) or not isinstance(self.eval_interval, int) \
                or self.eval_interval < 0:
            raise bad_value("train.eval_interval", self.eval_interval,
                            "must be an integer >= 0 (0: no evaluation)")
        check_positive("train.eval_iters", self.eval_iters)
        if self.eval_interval and self.data_path and not self.valid_data_path:
            raise bad_value("train.valid_data_path", None, "required for evaluation "
                            "(train.eval_interval) with train.data_path: a held-out set")
        if self.valid_data_path and not self.eval_interval:
            raise bad_value("train.valid_data_path", self.valid_data_path,
                            "needs train.eval_interval > 0 (it would be ignored)")

    def _check_schedule(self) -> None:
        """What megatron's ``OptimizerParamScheduler`` would assert on, one line each."""
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise bad_value("train.lr_decay_style", self.lr_decay_style,
                            f"must be one of {LR_DECAY_STYLES}")
        if isinstance(self.lr_warmup_iters, bool) or not isinstance(self.lr_warmup_iters, int) \
                or self.lr_warmup_iters < 0:
            raise bad_value("train.lr_warmup_iters", self.lr_warmup_iters,
                            "must be an integer >= 0")
        if not 0.0 <= self.min_lr <= self.lr:
            raise bad_value("train.min_lr", self.min_lr, f"must be in [0, train.lr={self.lr}]")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise bad_value("train.lr_warmup_init", self.lr_warmup_init,
                            f"must be in [0, train.lr={self.lr}]")
        decay = self.lr_decay_iters
        if decay is not None:
            check_positive("train.lr_decay_iters", decay)
        if self.lr_warmup_iters >= (decay or self.steps):
            field = "train.lr_decay_iters" if decay is not None else "train.steps"
            raise bad_value("train.lr_warmup_iters", self.lr_warmup_iters,
                            f"must be < {field}={decay or self.steps}")
        wsd = self.lr_wsd_decay_iters
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise bad_value("train.lr_wsd_decay_style", self.lr_wsd_decay_style,
                                f"must be one of {WSD_DECAY_STYLES}")
            if wsd is None:
                raise bad_value("train.lr_wsd_decay_iters", None, "required with "
                                "train.lr_decay_style=WSD")
            check_positive("train.lr_wsd_decay_iters", wsd)
            if wsd > (decay or self.steps):
                raise bad_value("train.lr_wsd_decay_iters", wsd,
                                f"must be <= the decay's {decay or self.steps} updates")
        elif wsd is not None:
            raise bad_value("train.lr_wsd_decay_iters", wsd, "needs train.lr_decay_style=WSD")

    def _check_numerics(self) -> None:
        if self.precision not in PRECISIONS:
            raise bad_value("train.precision", self.precision, f"must be one of {PRECISIONS}")
        if self.precision == "fp16" and not self.grad_reduce_in_fp32:
            raise bad_value("train.grad_reduce_in_fp32", False,
                            "must be true with train.precision=fp16")
        for name in ("initial_loss_scale", "min_loss_scale"):
            if not 0.0 < getattr(self, name) < math.inf:
                raise bad_value(f"train.{name}", getattr(self, name), "must be a finite number > 0")
        if self.min_loss_scale > self.initial_loss_scale:
            raise bad_value("train.min_loss_scale", self.min_loss_scale,
                            f"exceeds train.initial_loss_scale={self.initial_loss_scale}")
        check_positive("train.loss_scale_window", self.loss_scale_window)
        if not (self.large_grad_factor == 0.0 or 1.0 < self.large_grad_factor < math.inf):
            raise bad_value("train.large_grad_factor", self.large_grad_factor,
                            "must be 0 (off) or a finite number > 1")
        check_positive("train.large_grad_window", self.large_grad_window)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass(frozen=True)
class OutputConfig:
    """Where results go."""

    dir: str = "runs/latest"
    """Run directory: metrics.jsonl, plan.json, plots."""


RESUME_ALIASES = {"true": "auto", "false": "never"}


@dataclass(frozen=True)
class CheckpointConfig:
    """Layout-portable checkpoints (``nemo_nutp.checkpoint``)."""

    dir: str | None = None
    """Checkpoint root; None = ``<output.dir>/checkpoints`` when saving."""
    interval: Any = 0
    """Save every this many steps (0 disables saving), or ``auto``: Young/Daly from the
    measured save stall and ``recovery.rate_per_gpu_day`` x the job's GPUs, clamped to
    ``[interval_min, interval_max]`` (``checkpoint/interval.py``)."""
    interval_min: int = 2
    """``interval=auto``: fewest steps between saves (also the first save's step)."""
    interval_max: int = 1000
    """``interval=auto``: most steps between saves."""
    async_save: bool = False
    """Snapshot the state to host memory and write, hash and publish in the background
    (megatron-core's async save); at most one save in flight."""
    resume: str = "auto"
    """'auto' (newest valid checkpoint, if any), 'required' (error if none) or 'never';
    true/false are aliases of auto/never."""
    load_dir: str | None = None
    """Where to resume from: a checkpoint root or one ``iter_N`` directory, NUTP's or stock
    megatron-core's; None = ``dir``. A given path with nothing loadable is an error."""
    load_optimizer: bool = True
    """Load optimizer state and step; false: weights only (fresh optimizer, step 0)."""
    strict: bool = False
    """A newest checkpoint that fails verification is an error, not a fallback to an older one."""

    def __post_init__(self) -> None:
        iv = self.interval  # "auto" in any case and true/false resume: the loader's spellings
        if iv != "auto" and (isinstance(iv, bool) or not isinstance(iv, int) or iv < 0):
            raise bad_value("checkpoint.interval", iv, "must be an integer >= 0 or auto")
        if self.interval_min < 1:
            raise bad_value("checkpoint.interval_min", self.interval_min, "must be >= 1")
        if self.interval_max < self.interval_min:
            raise bad_value("checkpoint.interval_max", self.interval_max,
                            f"must be >= checkpoint.interval_min ({self.interval_min})")
        if self.resume not in ("auto", "required", "never"):
            raise bad_value("checkpoint.resume", self.resume,
                            "must be auto, required or never (true/false: auto/never)")

    @property
    def saves(self) -> bool:
        """Whether the job saves checkpoints (``interval`` > 0 or auto)."""
        return self.interval == "auto" or int(self.interval) > 0


@dataclass(frozen=True)
class FaultConfig:
    """One injected fault for tests and demos (``common/faults.py``: the grammar, when each
    fires; env ``NUTP_FAULT`` wins)."""

    kind: str | None = None
    """None, 'kill' (SIGKILL), 'hang' (sleep forever), 'save_crash' (die inside a save),
    'slow' (compute ``factor`` x slower from ``step`` on: a straggler) or 'slow_link' (the
    rank's GPU's cross-domain traffic ``factor`` x slower from ``step`` on, under
    ``cluster.emulated_scale_out_mb_s``: a slow NIC)."""
    rank: int = 0
    """Global rank that fails (a phase fault: the process's rank in world 0, its slot;
    slow_link: the GPU this rank has in world 0)."""
    step: int = 0
    """Step (0-based) at whose start (or in whose ``phase``) the fault fires (in attempt
    ``attempt`` only)."""
    phase: str | None = None
    """kill/hang under ``recovery.mode=live``: the phase of the step (forward, backward, sync,
    vote, optimizer, gather, relayout); None: the step's start."""
    gen: int = 0
    """A phase fault's world (0: the first, 1: after one live re-layout, ...)."""
    factor: float = 3.0
    """kind 'slow': wall-time multiplier of the rank's forward/backward; 'slow_link': of its
    GPU's cross-domain ops (>= 1)."""
    until: int | None = None
    """kind 'slow' or 'slow_link': the step it ends at (not slowed from there on); None:
    never."""
    attempt: int = 0
    """The restart attempt it fires in (``NUTP_ATTEMPT``: 0 the first; a later one: a fault
    after a restart)."""


@dataclass(frozen=True)
class RecoveryConfig:
    """Automatic recovery: a supervisor restarts the job at reduced TP after a rank failure."""

    enabled: bool = False
    """Run the ranks under the recovery supervisor (needs ``checkpoint.interval`` > 0)."""
    mode: str = "restart"
    """On a failure: ``restart`` (stop every rank, re-plan, resume from the newest checkpoint)
    or ``live`` (survivors keep their processes: re-plan, new groups, state moved in memory;
    see ``health/commit.py``; falls back to restart, with the reason logged, where it can't)."""
    max_restarts: int = 3
    """Give up after this many restarts."""
    heartbeat_timeout_s: float = 60.0
    """Hang: no step heartbeat for this long (between steps, e.g. in a save, no rank activity
    either); the ranks not blocked in collectives are blamed."""
    startup_timeout_s: float = 300.0
    """Time a (re)started world may take to reach its first step."""
    probe_timeout_s: float = 60.0
    """Under a launcher: time a worker's device probe may take before its GPU counts as failed."""
    spares: int = 0
    """Hot spares (``recovery.mode=live``): the last this many TP slices of the cluster are held
    back from the plan, their ranks started as standby processes (imported, connected to the
    control process). A failure while one is free swaps the failed slice for it in one live
    re-layout: the replica keeps its base TP, no process starts; with none free, NUTP's
    degraded layout. 0: none."""
    live_redundancy: bool = False
    """``train.distributed_optimizer``: keep a copy of every optimizer slice on the next member
    of its sync group (ring), updated in the same step, so a live re-layout survives one rank's
    loss (``sync/zero.py``); doubles the optimizer state per rank. Off: such a failure restarts."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection: one fault (``kind: null``: none)."""
    faults: list[FaultConfig] = field(default_factory=list)
    """More faults, the same mappings (``recovery.faults=[{kind:kill,rank:1,step:2},...]``)."""
    rate_per_gpu_day: float = 419 / (54 * 16384)
    """Expected failures per GPU-day (the simulator's ``sim.failures.rate_per_gpu_day``: Llama 3
    405B's 419 in 54 days on 16,384 GPUs); ``checkpoint.interval=auto`` scales it by the job's
    GPU count."""

    def __post_init__(self) -> None:
        check_factor(self.fault, "recovery.fault")
        for i, fc in enumerate(self.faults):
            check_factor(fc, f"recovery.faults[{i}]")
        configured(self)  # each fault valid: ValueError naming recovery.fault(s)...
        if not self.rate_per_gpu_day >= 0:
            raise bad_value("recovery.rate_per_gpu_day", self.rate_per_gpu_day, "must be >= 0")
        if self.max_restarts < 0:
            raise bad_value("recovery.max_restarts", self.max_restarts, "must be >= 0")
        if self.spares < 0:
            raise bad_value("recovery.spares", self.spares, "must be >= 0")
        if self.mode not in ("restart", "live"):
            raise bad_value("recovery.mode", self.mode, "must be restart or live")
        for name in ("heartbeat_timeout_s", "startup_timeout_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad_value(f"recovery.{name}", getattr(self, name), "must be > 0")


GRAD_REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class SyncConfig:
    """Cross-replica gradient sync (``nemo_nutp.sync``)."""

    bucket_size: int = 40_000_000
    """Elements per communication bucket, per sync owner group; fixed (never grows with the
    world), so large jobs keep their chances to overlap backward."""
    grad_reduce_dtype: str | None = None
    """Deprecated: ``train.grad_reduce_in_fp32`` (megatron's name; fp32 -> true, bf16 -> false),
    mapped at load time. Removed in the next release."""

    def __post_init__(self) -> None:
        check_positive("sync.bucket_size", self.bucket_size)
        if self.grad_reduce_dtype is not None:
            raise bad_value("sync.grad_reduce_dtype", self.grad_reduce_dtype,
                            "deprecated: set train.grad_reduce_in_fp32 (load_config maps it)")


@dataclass(frozen=True)
class JobConfig:
    """A complete NUTP job."""

    cluster: ClusterSpec = field(default_factory=lambda: ClusterSpec(num_gpus=8, domain_size=4))
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelSpec = field(default_factory=lambda: ParallelSpec(tp_base=4))
    health: HealthConfig = field(default_factory=HealthConfig)
    nutp: NutpConfig = field(default_factory=NutpConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self) -> None:
        _check_layout(self)
        if self.recovery.live_redundancy and not self.train.distributed_optimizer:
            raise bad_value("recovery.live_redundancy", True, "needs train.distributed_optimizer="
                            "true (the non-distributed optimizer's state is replicated already)")
        if self.recovery.spares and not (self.recovery.enabled and self.recovery.mode == "live"):
            raise bad_value("recovery.spares", self.recovery.spares, "hot spares need "
                            "recovery.enabled=true recovery.mode=live (standby processes)")
        if self.recovery.spares and self.train.distributed_optimizer:
            raise bad_value("recovery.spares", self.recovery.spares,
                            "not with train.distributed_optimizer yet: its slices do not move "
                            "to joiners live (the replaced slice's ranks hold their state)")
        if self.recovery.spares and self.nutp.replicas is not None:
            raise bad_value("recovery.spares", self.recovery.spares,
                            "takes the cluster's last TP slices: not with explicit nutp.replicas")
        if self.recovery.enabled and not self.checkpoint.saves:
            raise bad_value("checkpoint.interval", self.checkpoint.interval,
                            "must be > 0 when recovery.enabled is true")
        if self.nutp.exclude_stragglers and not isinstance(self.checkpoint.interval, int):
            raise bad_value("checkpoint.interval", self.checkpoint.interval,
                            "must be a fixed number of steps when nutp.exclude_stragglers is true")
        if self.nutp.exclude_stragglers and not self.checkpoint.saves:
            raise bad_value("checkpoint.interval", self.checkpoint.interval,
                            "must be > 0 when nutp.exclude_stragglers is true")

    @property
    def checkpoint_dir(self) -> str | None:
        """The checkpoint root in use (None: checkpointing off)."""
        if self.checkpoint.dir:
            return self.checkpoint.dir
        return f"{self.output.dir}/checkpoints" if self.checkpoint.saves else None


CPU_CLUSTER = "cpu_local"
"""``cluster.name`` of the CPU default cluster (configs/cluster/cpu_local.yaml): its "GPUs" are
local processes, so it grows to fit explicit ``nutp.replicas``."""


def _check_layout(cfg: JobConfig) -> None:
    """Layout checks that need several sections, before any plan or process: explicit replicas
    have ``parallel.pp`` per-stage degrees (``derived.fit_cpu_cluster`` grows the CPU default
    cluster to fit them)."""
    p, m = cfg.parallel, cfg.model
    if m.num_layers % p.pp:
        raise bad_value("parallel.pp", p.pp, f"must divide model.num_layers={m.num_layers}")
    if m.recompute_num_layers is not None and m.recompute_num_layers > m.num_layers // p.pp:
        raise bad_value("model.recompute_num_layers", m.recompute_num_layers,
                        f"exceeds the layers per stage (model.num_layers / parallel.pp = "
                        f"{m.num_layers // p.pp})")
    if m.num_layers % (p.pp * p.vp):
        raise bad_value("parallel.virtual_pipeline_model_parallel_size", p.vp,
                        f"parallel.pp={p.pp} times it must divide model.num_layers="
                        f"{m.num_layers}")
    if p.vp > 1 and m.recompute_num_layers is not None and \
            m.recompute_num_layers > m.num_layers // (p.pp * p.vp):
        raise bad_value("model.recompute_num_layers", m.recompute_num_layers,
                        f"exceeds the layers per model chunk (model.num_layers / (parallel.pp * "
                        f"parallel.virtual_pipeline_model_parallel_size) = "
                        f"{m.num_layers // (p.pp * p.vp)})")
    if p.vp > 1 and cfg.recovery.enabled and cfg.recovery.mode == "live":
        raise bad_value("recovery.mode", "live", "not with parallel.virtual_pipeline_model_"
                        "parallel_size > 1 (the in-memory re-layout of model chunks is not "
                        "built yet; recovery.mode=restart resumes from checkpoints)")
    if p.vp > 1 and cfg.nutp.rebalance:
        raise bad_value("nutp.rebalance", True, "not with parallel.virtual_pipeline_model_"
                        "parallel_size > 1 (a moved share must stay a multiple of parallel.pp "
                        "for the interleaved schedule; not built yet)")
    if cfg.nutp.replicas is None:
        return
    normalize_replicas(cfg.nutp.replicas, p.pp)  # the loader grows the CPU cluster to fit them


def config_dir() -> Path:
    return Path(os.environ.get(env.CONFIG_DIR, CONFIG_DIR))
