"""Which Megatron-Bridge pretraining recipes NUTP trains, and what refuses the others (issue #32).

Every distinct text-LLM pretraining recipe function of the installed Megatron-Bridge
(``recipes()``: every public ``*pretrain*`` function under ``megatron.bridge.recipes``, aliases
dropped by function identity; vision-language and diffusion recipes excluded by package,
``EXCLUDED``), per recipe:

* ``model`` (the config half, always): the recipe's model, shrunk (``shrink()``: 2 layers, 2
  query groups at the recipe's GQA ratio, head dim 16 (8 with 8+ heads per group), hidden =
  heads x head dim (half of it where the recipe decouples head dim from width), FFN 128, vocab
  256, sequence 32, windows 8; every switch kept:
  normalisation and its epsilon, activation and gating, biases, QKV bias, qk-layernorm, tied
  embeddings, position embedding and every RoPE setting, window pattern, MoE / MTP / ... as
  shipped; a MoE recipe's experts cut to 8, top-k to 2 at most, expert FFN 16, a shared
  expert to 16 per shared expert, a per-layer ``moe_layer_freq`` cut to the 2 layers (its
  leading dense layer kept: [0, 1]), its every MoE switch kept; an MLA recipe's latents and
  head dims cut (``MLA_SHRINK``), its RoPE and YaRN kept; with sequence parallelism on and the
  CPU MoE kernels, ``MOE_RUNTIME``), in fp32
  at replicas [2,1] with clipping, through ``nutp-bridge``'s own checks
  (``bridge_config.load_bridge_job``: Bridge's overrides, the precision and dataset checks,
  ``bridge_run.model_config_of``, ``nutp-train``'s schema) and the NUTP planner. The runtime
  settings are the parity runs' (``tests/helpers/bridge_jobs.PARITY``: fp32, no distributed
  optimizer, Adam at a constant rate, clipping 0.05) and PP / CP / TP comm overlap / FP8 are
  reset: they belong to ``as_shipped``, not to the model. A refusal is ``model: refused`` with
  ``model_field`` parsed from the one-line error (``model.<field>=...``); any other exception
  is ``error`` (a bug). ``--train``: each accepted model trains 3 steps through Bridge's own
  ``train()`` at [2,1] (one 3-rank gloo world trains every recipe in turn) against stock
  single-process megatron-core on the same batches (``tests/helpers/reference.py``, one process
  for every recipe; a MoE recipe: Bridge's own stock run of the same shrunk recipe in one
  process from NUTP's initial weights, ``tests/helpers/bridge_moe_jobs.py``, one process for
  every MoE recipe): losses and grad norms within 1e-5 (``TOL``) and the final parameters within
  ``TENSOR_TOL`` per tensor -> ``trains``, else ``mismatch`` with the numbers.
* ``as_shipped``: the recipe unshrunk, as shipped, through the same checks and the planner
  (on ``configs/cluster/dgx_h100.yaml``, H100 nodes, as many GPUs as the recipe's name says,
  at least one node),
  then ``RUNTIME_PENDING`` (what the NeMo-path issue #33 has not built under NUTP's Bridge path
  yet); ``refused`` with ``as_shipped_field`` naming the setting. ``--train``: each recipe
  accepted as shipped also trains 3 steps in the same world with its own switches
  (``SHIPPED_RUNTIME``: the shrunk model, a CPU layout, the CPU substitutions; its mixed
  precision by name, distributed optimizer, sequence parallelism, recompute, schedule kind and
  evaluation kept) -> ``as_shipped: trains`` when every loss and grad norm is finite and the
  replicas end bitwise equal (correctness of each runtime switch is the Bridge tests'
  business: bf16, the distributed optimizer, evaluation, pipeline stages against Bridge's
  stock runs), else ``mismatch``, or ``error`` with the one-line reason.

HF configs: recipes that read one (``AutoBridge.from_hf_pretrained``) get the committed stand-in
under ``configs/hf/hub`` (a Hugging Face cache layout, ``HF_HUB_OFFLINE=1``; see its README);
never the network. A recipe whose config is not there, or needs remote code, is ``refused``
(``hf_config`` / ``remote_code``), never ``error``. Tokenizers: Bridge's ``NullTokenizer`` at
the shrunk vocabulary.

Usage: .venv312/bin/python benchmarks/recipe_coverage.py [--train] [--only REGEX]
Writes runs/bench/recipe_coverage.json (temp name, then renamed); prints a table by family.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench" / "recipe_coverage.json"
LAYOUT = [2, 1]
TOL = 1e-5
EXCLUDED = {"qwen_vl": "vision-language", "gemma3_vl": "vision-language",
            "gemma4_vl": "vision-language", "glm_vl": "vision-language",
            "kimi_vl": "vision-language", "nemotron_vl": "vision-language",
            "nemotron_omni": "vision-language", "qwen_omni": "vision-language",
            "qwen2_audio": "audio-language", "flux": "diffusion", "wan": "diffusion"}
"""Packages under ``megatron.bridge.recipes`` whose recipes are not text-LLM pretraining."""
RUNTIME_PENDING: dict[str, Any] = {}
"""Settings NUTP's Bridge path does not run yet (issue #33) that its own checks let through:
none now (the distributed optimizer runs as NUTP's ZeRO-1; with bf16/fp16 parameters the
config check refuses it by name)."""
FAMILY_BY_PREFIX = {"llama31": "llama3.1", "llama32": "llama3.2", "qwen25": "qwen2.5",
                    "vanilla": "gpt", "gpt3": "gpt3"}
_FIELD = re.compile(r"\b([a-z_]+(?:\.[A-Za-z0-9_]+)+)=")

sys.path.insert(0, str(ROOT))

from tests.helpers.hf_offline import offline_hf  # noqa: E402  (the repository root first)


def recipes() -> list[dict[str, str]]:
    """Every distinct text-LLM pretraining recipe function: ``{name, spec, family}``."""
    import importlib
    import inspect
    import pkgutil

    offline_hf()
    import megatron.bridge.recipes as pkg

    seen: dict[Any, str] = {}
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name.split(".")[3] in EXCLUDED:
            continue
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if (inspect.isfunction(fn) and "pretrain" in name and not name.startswith("_")
                    and fn.__module__.startswith(pkg.__name__)
                    and fn.__module__.split(".")[3] not in EXCLUDED):
                seen.setdefault(fn, f"{fn.__module__}:{fn.__name__}")
    out = [{"name": fn.__name__, "spec": spec, "family": family_of(spec)}
           for fn, spec in seen.items()]
    return sorted(out, key=lambda r: (r["family"], r["name"]))


def family_of(spec: str) -> str:
    module, name = spec.split(":")
    base = module.rsplit(".", 1)[1]
    first = name.split("_")[0]
    if first in FAMILY_BY_PREFIX:
        return FAMILY_BY_PREFIX[first]
    if base in ("llama3", "qwen2"):
        return first
    return base


def field_of(message: str) -> str:
    """The setting a one-line refusal names (``model.qk_layernorm=True: ...`` ->
    ``model.qk_layernorm``); '' when it names none."""
    for name in PRIMARY:  # a refusal naming several fields: the feature's own switch
        if f"{name}=" in message:
            return name
    m = _FIELD.search(message)
    return m.group(1) if m else ""


PRIMARY = ("model.num_moe_experts", "model.hybrid_layer_pattern",
           "model.experimental_attention_variant", "model.softmax_type",
           "model.multi_latent_attention", "model.mtp_num_layers")
"""The switches of the features refused until built, named first when present: a model
that is another kind of network (hybrid Mamba; DSA or gated delta net attention,
``experimental_attention_variant``; attention sinks, ``softmax_type``) before the parts of
one NUTP builds elsewhere (MLA, MTP)."""


def shrink(provider: Any) -> list[str]:
    """Bridge overrides that cut the recipe's model to a tiny one with every switch kept."""
    heads = int(provider.num_attention_heads) or 4  # the GPT template ships no dims
    groups = int(provider.num_query_groups or heads)
    ratio = max(heads // groups, 1)
    mla = bool(getattr(provider, "multi_latent_attention", False))  # kv_channels = v_head_dim
    kv = 16 if ratio <= 4 and not mla else 8  # 8-16 query heads per group: width <= 256 (fp32
    # rounding of the TP-split sums grows with width: 405B's ratio 16 at head dim 16, width 512,
    # gave grad norms 2.8e-6..8.5e-6 off, vs <= 1.1e-6 at width 128)
    g = 2  # a TP2 replica needs a query group per rank (megatron's rule too): MQA (Gemma 3
    # 1B's one group) is cut to 2 groups of the same query heads per group
    decoupled = bool(provider.kv_channels) and \
        int(provider.kv_channels) * heads != int(provider.hidden_size)
    hidden = g * ratio * kv // 2 if decoupled else g * ratio * kv
    hidden = max(hidden, 32)
    pattern = getattr(provider, "interleaved_attn_pattern", None)  # Gemma 3: (5, 1)
    layers = int(sum(pattern)) if pattern else 4 if provider.window_attn_skip_freq else 2
    out = [f"model.num_layers={layers}",  # a window pattern: every kind of layer present
           f"model.hidden_size={hidden}", f"model.num_attention_heads={g * ratio}",
           f"model.kv_channels={kv}", "model.ffn_hidden_size=128", "model.vocab_size=256",
           "model.seq_length=32", "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
    if provider.num_query_groups is not None:
        out.append(f"model.num_query_groups={g}")
    if getattr(provider, "num_moe_experts", None):  # MoE: 8 experts, top-2 at most, FFN 16
        out += [*MOE_SHRINK, f"model.moe_router_topk={min(int(provider.moe_router_topk), 2)}"]
        freq = getattr(provider, "moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)):  # one entry per layer: the recipe's leading dense
            # layers, at most layers - 1 of them, then MoE (DeepSeek, GLM: [0, 1])
            dense = min(next((i for i, f in enumerate(freq) if f), len(freq)), layers - 1)
            out.append(f"model.moe_layer_freq={[0] * dense + [1] * (layers - dense)}"
                       .replace(" ", ""))
        shared = getattr(provider, "moe_shared_expert_intermediate_size", None)
        if shared:  # its shared experts at 16 each (their count: the size / one expert's)
            per = int(provider.moe_ffn_hidden_size or provider.ffn_hidden_size)
            out.append(f"model.moe_shared_expert_intermediate_size="
                       f"{16 * max(int(shared) // per, 1)}")
    if mla:  # MLA: the latents and head dims cut (kv_channels = v_head_dim: MLA_SHRINK)
        out += [*MLA_SHRINK, *([] if provider.q_lora_rank is None else ["model.q_lora_rank=16"])]
    w = provider.window_size
    if isinstance(w, (tuple, list)):
        out.append(f"model.window_size=[8,{min(int(w[1]), 8)}]")
    elif w is not None:  # a provider's own per-layer scheme (Gemma 3): the same type
        out.append("model.window_size=8")
    return out


MLA_SHRINK = ["model.kv_lora_rank=12", "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4",
              "model.v_head_dim=8"]
"""A multi-latent attention recipe's latents and head dims, shrunk (its query latent, if any, to
16; ``kv_channels`` is ``v_head_dim``'s 8); its RoPE and YaRN kept."""

MOE_SHRINK = ["model.num_moe_experts=8", "model.moe_ffn_hidden_size=16"]
"""A MoE recipe's experts, shrunk (with top-k cut to 2 at most): every MoE switch kept."""

MOE_RUNTIME = ["model.sequence_parallel=true", "model.moe_token_dispatcher_type=alltoall",
               "model.moe_grouped_gemm=false", "model.moe_permute_fusion=false",
               "model.moe_router_fusion=false", "model.expert_tensor_parallel_size=1",
               "model.cuda_graph_impl=none", "model.persist_layer_norm=false",
               "model.recompute_granularity=null", "model.recompute_method=null",
               "model.recompute_num_layers=null"]
"""A MoE recipe's run around the shrunk model, after ``RUNTIME``: sequence parallelism on
(megatron's MoE layer needs it at TP2, where NUTP's expert parallelism runs), the CPU MoE
kernels (NUTP's all-to-all dispatcher for the flex one, ``SequentialMLP`` experts for grouped
GEMM, the permute and router fusions off; ``bridge_fields.SUBSTITUTED``), expert TP 1, no
CUDA graphs (a substitution too: the stock reference asserts TE for them), torch's norm for
the persistent (TE) one (DeepSeek, GLM-4.5: megatron's local layers assert it off), no
recompute (not
math; the stock reference's recomputed forwards would route twice)."""

STOCK_MOE = ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
             "model.moe_shared_expert_overlap=false", "nutp.replicas=[1]"]
"""The MoE reference: Bridge's own stock run of the same shrunk recipe in one process, its
shared expert not overlapped with the dispatcher (megatron's overlap runs on CUDA streams; the
NUTP run keeps the recipe's value, a substitution: ``bridge_fields.SUBSTITUTED``)."""


RUNTIME = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=1",
           "model.pipeline_model_parallel_layout=null",
           "model.virtual_pipeline_model_parallel_size=null",
           "model.context_parallel_size=1", "model.sequence_parallel=false",
           "model.fp8=null", "model.bf16=false", "model.fp16=false",
           "model.params_dtype=torch.float32", "model.cross_entropy_fusion_impl=native",
           "comm_overlap=null",
           "model.apply_rope_fusion=false", "model.gradient_accumulation_fusion=false",
           "model.bias_activation_fusion=false", "model.masked_softmax_fusion=false",
           "model.bias_dropout_fusion=false", "model.deterministic_mode=false",
           "optimizer.use_precision_aware_optimizer=false",
           "optimizer.exp_avg_dtype=float32", "optimizer.exp_avg_sq_dtype=float32",
           "optimizer.main_grads_dtype=float32", "optimizer.main_params_dtype=float32",
           "ddp.use_distributed_optimizer=false",
           "ddp.overlap_param_gather=false", "ddp.data_parallel_sharding_strategy=no_shard",
           "checkpoint.load=null", "ddp.use_megatron_fsdp=false", "dist.use_megatron_fsdp=false",
           "model.expert_model_parallel_size=1",
           "tokenizer.use_tokenizer_vocab_size=false",
           "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null",
           "tokenizer.vocab_size=256", "dataset.num_workers=0", "validation.eval_iters=0",
           "train.train_iters=3", "train.global_batch_size=6", "train.micro_batch_size=1",
           f"nutp.replicas={json.dumps(LAYOUT)}"]
"""The run around the shrunk model: TP2 beside TP1, 3 steps, 6 micro-batches, no PP / CP /
comm overlap / FP8 / FSDP / resume from ``checkpoint.load`` / the tokenizer's vocabulary size
(``as_shipped``'s business), Bridge's NullTokenizer, mock data; the fused
cross entropy's kernel ``te`` substituted by megatron's ``native`` one and the fusions off
(kernels, not the model: issue #32's field audit classes them as CPU substitutions; RoPE
fusion needs Transformer Engine, which Bridge's ``validate()`` asserts); deterministic mode
off (it asserts NCCL settings; CPU fp32 runs are deterministic) and the precision-aware
optimizer off (it needs the distributed optimizer, which the parity runs turn off)."""


SHIPPED_RUNTIME = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=1",
                   "model.virtual_pipeline_model_parallel_size=null",
                   "model.context_parallel_size=1", "model.cross_entropy_fusion_impl=native",
                   "comm_overlap=null", "model.apply_rope_fusion=false",
                   "model.gradient_accumulation_fusion=false",
                   "model.bias_activation_fusion=false", "model.masked_softmax_fusion=false",
                   "model.bias_dropout_fusion=false", "model.persist_layer_norm=false",
                   "model.deterministic_mode=false", "checkpoint.load=null",
                   "checkpoint.save=null", "logger.tensorboard_dir=null",
                   "tokenizer.use_tokenizer_vocab_size=false",
                   "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null",
                   "tokenizer.vocab_size=256", "dataset.num_workers=0", "dataset.seq_length=32",
                   "train.train_iters=3", "train.global_batch_size=6", "train.micro_batch_size=1",
                   "scheduler.lr_warmup_iters=1", "scheduler.lr_decay_iters=3",
                   "validation.eval_interval=2", "validation.eval_iters=1",
                   f"nutp.replicas={json.dumps(LAYOUT)}"]
"""The as-shipped training run around the shrunk model (issue #33's "shrinking for CPU"): the
layout replaced by a CPU one (TP2 beside TP1, no PP / VPP / CP), 3 steps of 6 micro-batches
with the schedule's warmup and decay cut to them and an evaluation every 2 steps, Bridge's
NullTokenizer and mock data, and the CPU substitutions (the fused cross entropy's kernel
``native`` for ``te``, the fusions and TP comm overlap off, deterministic mode off). Every
other switch is the recipe's own: its mixed precision by name, its distributed optimizer, its
sequence parallelism and recompute, its optimizer, clipping, weight decay and decay style."""


def shipped_overrides(spec: str) -> list[str]:
    from nemo_nutp.integrations.bridge_config import load_recipe

    return [*shrink(load_recipe(spec).model), *SHIPPED_RUNTIME]


def model_overrides(spec: str) -> list[str]:
    from nemo_nutp.integrations.bridge_config import load_recipe
    from tests.helpers.bridge_jobs import PARITY

    provider = load_recipe(spec).model
    moe = MOE_RUNTIME if getattr(provider, "num_moe_experts", None) else []
    return [*shrink(provider), *RUNTIME, *moe, *PARITY]


def classify(exc: BaseException) -> tuple[str, str, str]:
    """(status, field, one-line message) of a failure: a by-name refusal, a recipe that cannot
    be loaded here (its HF config absent, or remote code), or an ``error`` (anything else: a
    bug)."""
    full = " ".join(str(exc).split())
    msg = full[:300]
    if "trust_remote_code" in msg:
        return "refused", "remote_code", msg
    if msg.startswith("hf_config=") or "couldn't connect to 'https://huggingface.co'" in msg \
            or "Failed to load configuration" in msg:
        return "refused", "hf_config", msg
    if isinstance(exc, ValueError) and field_of(full):
        return "refused", field_of(full), msg
    return "error", "", f"{type(exc).__name__}: {msg}"


def config_half(spec: str) -> tuple[dict[str, Any], Any]:
    """``{model, model_field}`` of the shrunk recipe, and its job when accepted."""
    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from nemo_nutp.integrations.bridge_run import check_moe, validate_as_uniform
    from nemo_nutp.layout import build_plan

    offline_hf()
    try:
        overrides = model_overrides(spec)
        job = load_bridge_job(spec, None, overrides)
        plan = build_plan(plan_request(job.nutp))
        check_moe(job.bridge, plan)  # what train_rank runs first
        validate_as_uniform(job.bridge, plan)
    except Exception as e:
        status, field, msg = classify(e)
        return {"model": status, "model_field": field.removeprefix("model."),
                "model_reason": msg, "overrides": None}, None
    return {"model": "accepted", "model_field": "", "model_reason": "",
            "overrides": overrides}, job


PRECISION_AWARE_DTYPES = ("optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype",
                          "optimizer.main_grads_dtype", "optimizer.main_params_dtype")
"""The precision-aware optimizer's dtypes: NUTP runs it at fp32 only (set aside together)."""

UNBLOCK: dict[str, str | tuple[str, ...]] = {"validation.eval_interval": "validation.eval_iters=0",
           "model.pipeline_model_parallel_size": "model.pipeline_model_parallel_size=1",
           "model.virtual_pipeline_model_parallel_size":
               "model.virtual_pipeline_model_parallel_size=null",
           "model.context_parallel_size": "model.context_parallel_size=1",
           "model.fp8": "model.fp8=null",
           "optimizer.bf16": "mixed_precision=bf16_mixed",
           # both switches: either one turns NUTP's ZeRO-1 on (refused with bf16/fp16 for now)
           "optimizer.use_distributed_optimizer": ("optimizer.use_distributed_optimizer=false",
                                                   "ddp.use_distributed_optimizer=false"),
           "ddp.use_distributed_optimizer": "ddp.use_distributed_optimizer=false",
           "ddp.data_parallel_sharding_strategy": "ddp.data_parallel_sharding_strategy=no_shard",
           "checkpoint.load": "checkpoint.load=null",
           "ddp.use_megatron_fsdp": "ddp.use_megatron_fsdp=false",
           "dist.use_megatron_fsdp": "dist.use_megatron_fsdp=false",
           "model.expert_model_parallel_size": "model.expert_model_parallel_size=1",
           "tokenizer.use_tokenizer_vocab_size": "tokenizer.use_tokenizer_vocab_size=false",
           **dict.fromkeys(PRECISION_AWARE_DTYPES, tuple(f"{k}=float32"
                                                         for k in PRECISION_AWARE_DTYPES))}
"""Run settings (not the model's) that ``as_shipped`` sets aside to find the next refusal (an
override, or several)."""


SET_ASIDE: dict[str, tuple[str, str]] = {
    "memory": (r"needs [0-9.]+ GiB per GPU", "cluster.hardware=null"),
    "tokenizer": (r"tokenizer.use_tokenizer_vocab_size=True: .*could not be built here",
                  "tokenizer.use_tokenizer_vocab_size=false"),
    "template": (r"^model.num_layers=0: must be a positive integer", "<the shrunk sizes>"),
}
"""Refusals that are facts of the recipe's size or of this machine, not NUTP features, as
(pattern of the one-line refusal, override that sets it aside): ``memory``, the planner's
memory model on the recipe's named GPU count (the message has the per-GPU breakdown; set aside
by planning without a hardware memory figure); ``tokenizer``, an HF tokenizer whose files
cannot be fetched offline (the training half uses Bridge's NullTokenizer anyway); ``template``,
a recipe that ships without a model (the vanilla GPT one: ``num_layers``, ``hidden_size`` and
the heads at megatron's 0, to be given on the command line), checked at the shrunk model's
sizes, which the training half uses for every recipe. Recorded in ``as_shipped_notes``; they
leave ``as_shipped`` as the rest decides."""

SIZES = ("num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size")
"""A template's size fields (``SET_ASIDE``'s ``template``; its vocabulary stays the
tokenizer's, as shipped)."""


def as_shipped(spec: str) -> dict[str, Any]:
    """The recipe as shipped through the same checks and the planner, then
    ``RUNTIME_PENDING``: the first setting that refuses it (``as_shipped_field``) and, setting
    run settings aside (``UNBLOCK``), every further one (``as_shipped_all``). A refusal in
    ``SET_ASIDE`` is noted (``as_shipped_notes``) and set aside without refusing."""
    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from nemo_nutp.layout import build_plan

    offline_hf()
    gpus = re.search(r"_(\d+)gpu_", spec)  # the GPU count a recipe is named for
    found: list[str] = []
    notes: list[str] = []
    status, reason = "accepted", ""
    extra = ["cluster=dgx_h100", f"cluster.num_gpus={max(int(gpus[1]) if gpus else 8, 8)}"]
    while True:
        try:
            job = load_bridge_job(spec, None, extra)
            build_plan(plan_request(job.nutp))
            key = next((k for k, want in RUNTIME_PENDING.items()
                        if getattr(getattr(job.bridge, k.split(".")[0]), k.split(".")[1])
                        != want), None)
            if key is None:
                break
            st, field, msg = "refused", key, f"{key}: not run on NUTP's Bridge path yet (#33)"
        except Exception as e:
            st, field, msg = classify(e)
        aside = next((k for k, (pat, _) in SET_ASIDE.items()
                      if st == "refused" and re.search(pat, msg)), None)
        if aside is not None and len(notes) < len(SET_ASIDE):
            notes.append(f"{aside}: {msg}")
            if aside == "template":
                from nemo_nutp.integrations.bridge_config import load_recipe

                extra.extend(o for o in shrink(load_recipe(spec).model)
                             if o.split("=")[0].removeprefix("model.") in SIZES)
            else:
                extra.append(SET_ASIDE[aside][1])
            continue
        if status == "accepted":
            status, reason = st, msg
        found.append(field or msg)
        if st != "refused" or field not in UNBLOCK or len(found) > len(UNBLOCK):
            break
        unblock = UNBLOCK[field]
        extra.extend([unblock] if isinstance(unblock, str) else unblock)
    return {"as_shipped": status, "as_shipped_field": found[0] if found else "",
            "as_shipped_reason": reason, "as_shipped_all": found, "as_shipped_notes": notes}


def reference_batches(spec: str, overrides: list[str], path: Path) -> Path:
    """The recipe's mock dataset as one process trains it (``bridge_jobs.reference_batches``
    for any recipe)."""
    import torch

    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from nemo_nutp.integrations.bridge_data import stock_loader, train_dataset
    from nemo_nutp.integrations.bridge_run import validate_as_uniform

    job = load_bridge_job(spec, None, overrides)
    cfg = job.bridge
    validate_as_uniform(cfg, None)
    loader = iter(stock_loader(cfg, train_dataset(cfg, None), 0))
    m = job.nutp.train.num_microbatches
    torch.save([[dict(next(loader)) for _ in range(m)] for _ in range(cfg.train.train_iters)],
               path)
    return path


NORM_WEIGHT = re.compile(r"(layernorm|final_layernorm|post_layernorm)\.weight$")
"""A norm's weight: with ``layernorm_zero_centered_gamma`` the forward scales by 1 + w."""


def compare(nutp: dict[str, Any], ref: dict[str, Any], *,
            zero_centered: bool = False) -> dict[str, Any]:
    """Per recipe: the largest relative difference of the losses, grad norms and final
    parameters (per tensor) between the NUTP run and the stock reference. A zero-centred norm's
    weight (``zero_centered``) is compared as the scale the forward uses, 1 + w: w starts at 0,
    so after 3 Adam steps its own norm is ~3 x lr and Adam's sign-like update on near-zero
    gradients makes rounding differences look large relative to it (Gemma 3 1B: 7.8e-5 of
    a pre-MLP norm's w, 1e-9 of its 1 + w)."""
    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    losses = [rel(s["loss"], r) for s, r in zip(nutp["steps"], ref["losses"], strict=True)]
    norms = [rel(s["grad_norm"], r)
             for s, r in zip(nutp["steps"], ref["grad_norms"], strict=True)]

    def scale(k: str) -> float:
        return 1.0 if zero_centered and NORM_WEIGHT.search(k) else 0.0

    params = max(float((v - ref["params"][k]).norm() / (ref["params"][k] + scale(k)).norm())
                 for k, v in nutp["params"].items())
    return {"max_rel_loss": max(losses), "max_rel_grad_norm": max(norms),
            "rel_grad_norm_per_step": norms, "max_rel_param": params,
            "replicas_bitwise_equal": nutp["equal"], "clipped": min(ref["grad_norms"]) > 0.05}


def train_half(rows: list[dict[str, Any]], jobs: dict[str, Any], tmp: Path) -> None:
    """Fills ``model`` (``trains`` / ``mismatch`` / ``error``) of every accepted row."""
    import torch

    from tests.helpers.bridge_jobs import recipe_worker, reference_case
    from tests.helpers.dist import spawn
    from tests.helpers.parity import TENSOR_TOL, run_references

    todo = [r for r in rows if r["model"] == "accepted"]
    cases, runs, moe = [], [], []
    for r in todo:
        runs.append((r["name"], r["spec"], r["overrides"]))
        if jobs[r["name"]].bridge.model.num_moe_experts:  # Bridge's own stock run, below
            moe.append((r["name"], r["spec"], [*r["overrides"], *STOCK_MOE]))
            continue
        data = reference_batches(r["spec"], r["overrides"], tmp / f"batches_{r['name']}.pt")
        case = reference_case(jobs[r["name"]], data)
        cases.append(type(case)(**{**case.__dict__, "name": r["name"]}))
    run_references(cases, tmp)
    if moe:  # MoE: Bridge's stock run of the same shrunk recipe in one process, from NUTP's
        # initial weights (tests/helpers/bridge_moe_jobs.py), for want of a MoE checkpoint
        from tests.helpers.bridge_moe_jobs import recipe_stock_worker

        try:
            spawn(recipe_stock_worker, 1, (moe,), tmp)
        except Exception as e:  # the rows without a reference are errors below
            print(f"MoE reference world failed: {type(e).__name__}: {e}")
    shipped = [r for r in todo if r["as_shipped"] == "accepted"]
    for r in shipped:  # the same world, after the model runs
        runs.append((f"shipped_{r['name']}", r["spec"], shipped_overrides(r["spec"])))
    try:
        spawn(recipe_worker, sum(LAYOUT), (runs,), tmp)
    except Exception as e:  # the rows not written below are errors
        print(f"train world failed: {type(e).__name__}: {e}")
    for r in shipped:
        path = tmp / f"nutp_shipped_{r['name']}.pt"
        if not path.exists():
            err = path.with_suffix(".err")
            why = " ".join(err.read_text().split())[:300] if err.exists() else \
                "train world failed before it"
            r.update(as_shipped="error", as_shipped_reason=why)
            continue
        got = torch.load(path)
        values = [v for st in got["steps"] for v in (st["loss"], st["grad_norm"])]
        finite = all(math.isfinite(v) for v in values)
        r["as_shipped_steps"] = got["steps"]
        r["as_shipped"] = "trains" if finite and got["equal"] else "mismatch"
    for r in todo:
        path = tmp / f"nutp_{r['name']}.pt"
        if not path.exists():
            r.update(model="error", model_field="train world failed before this recipe")
            continue
        ref = tmp / f"ref_{r['name']}.pt"
        if not ref.exists():
            err = ref.with_suffix(".err")
            why = " ".join(err.read_text().split())[:300] if err.exists() else "failed"
            r.update(model="error", model_field=f"its reference run: {why}")
            continue
        zc = bool(jobs[r["name"]].nutp.model.layernorm_zero_centered_gamma)
        got = compare(torch.load(path), torch.load(ref),
                      zero_centered=zc)
        r.update(got)
        ok = got["max_rel_loss"] <= TOL and got["max_rel_grad_norm"] <= TOL and \
            got["max_rel_param"] <= TENSOR_TOL and got["replicas_bitwise_equal"]
        r["model"] = "trains" if ok else "mismatch"


def run(*, train: bool, only: str | None = None, progress: bool = True,
        shipped: bool = True) -> dict[str, Any]:
    """The coverage of every recipe (``only``: names matching a regex; ``shipped=False``:
    without the ``as_shipped`` checks)."""
    import logging
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    # megatron's fused cross entropy is torch.compile'd: a cache of our own, not the machine's
    # shared /tmp one (seen holding another job's broken precompiled header: C++ errors)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "runs" / "inductor_cache"))
    t0 = time.perf_counter()
    rows = [r for r in recipes() if only is None or re.search(only, r["name"])]
    jobs: dict[str, Any] = {}
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("recipes (config half)", total=len(rows))
        for r in rows:
            bar.update(task, description=r["name"])
            got, job = config_half(r["spec"])
            r.update(got)
            r.update(as_shipped(r["spec"]) if shipped else
                     {"as_shipped": "not checked", "as_shipped_field": ""})
            r["max_rel_loss"] = None
            if job is not None:
                jobs[r["name"]] = job
            bar.advance(task)
    config_s = time.perf_counter() - t0
    if train:
        with tempfile.TemporaryDirectory(prefix="recipe_coverage_") as tmp:
            train_half(rows, jobs, Path(tmp))
    for r in rows:
        r.pop("overrides", None)
    return {"layout": LAYOUT, "steps": 3, "tol": TOL, "trained": train,
            "counts": counts(rows), "by_family": by_family(rows), "recipes": rows,
            "config_half_s": round(config_s, 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {"recipes": len(rows)}
    for r in rows:
        out[f"model_{r['model']}"] = out.get(f"model_{r['model']}", 0) + 1
        out[f"as_shipped_{r['as_shipped']}"] = out.get(f"as_shipped_{r['as_shipped']}", 0) + 1
    return out


def by_family(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        f = out.setdefault(r["family"], {"recipes": 0, "model": {}, "fields": {}})
        f["recipes"] += 1
        f["model"][r["model"]] = f["model"].get(r["model"], 0) + 1
        if r["model_field"]:
            f["fields"][r["model_field"]] = f["fields"].get(r["model_field"], 0) + 1
    return out


def show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Bridge recipes under NUTP, layout {result['layout']} "
                    f"({result['counts']['recipes']} text-LLM pretraining recipes)")
    for col in ("family", "recipes", "model", "refused by (model)",
                "as shipped: refused by (every setting found)"):
        t.add_column(col, overflow="fold")
    for fam, f in sorted(result["by_family"].items()):
        rows = [r for r in result["recipes"] if r["family"] == fam]
        shipped: dict[str, int] = {}
        for r in rows:
            for key in r.get("as_shipped_all") or [r["as_shipped_field"]]:
                shipped[key] = shipped.get(key, 0) + 1
        t.add_row(fam, str(f["recipes"]),
                  ", ".join(f"{k} {v}" for k, v in sorted(f["model"].items())),
                  ", ".join(f"{k} {v}" for k, v in sorted(f["fields"].items())
                            if not k.startswith(("ValueError", "TypeError"))) or "-",
                  ", ".join(f"{k or 'accepted'} {v}" for k, v in sorted(shipped.items())))
    c = Console(width=200)
    c.print(t)
    c.print(" ".join(f"{k}={v}" for k, v in result["counts"].items()),
            f"config half {result['config_half_s']} s, total {result['wall_s']} s")
    for r in result["recipes"]:
        if r["model"] in ("error", "mismatch"):
            c.print(f"[red]{r['model']}[/red] {r['name']}: {r['model_field']} "
                    f"{ {k: r[k] for k in r if k.startswith('max_rel')} }")


def write(result: dict[str, Any], path: Path = OUT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", action="store_true", help="also the training half (slow)")
    ap.add_argument("--only", default=None, help="recipe names matching this regex")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    result = run(train=args.train, only=args.only)
    write(result, Path(args.out))
    show(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
