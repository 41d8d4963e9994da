"""The HF config stand-ins of Bridge's MoE / MLA recipes (``configs/hf/hub``, issue #34's recipe
coverage) and the refusal each recipe gets from them: every stand-in reaches the recipe's
provider with the published sizes (not a default), and the config half of
``benchmarks/recipe_coverage.py`` refuses Qwen3-Next and gpt-oss by the field of the
architecture NUTP does not build (gated delta net, attention sinks), in one line naming every
refused model field, before any run setting (``bridge_config.bridge_keys`` checks the model
first; ``check_moe_recovery`` reads only the expert count). Descriptors only: no process
group."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

PUBLISHED = {
    # recipe -> provider fields the stand-in's published values give
    "deepseek_v2_lite_pretrain_8gpu_h100_bf16_config": dict(
        num_layers=27, hidden_size=2048, num_attention_heads=16, num_moe_experts=64,
        moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
        q_lora_rank=None, kv_lora_rank=512, qk_pos_emb_head_dim=64, vocab_size=102400,
        mscale=0.707, rotary_scaling_factor=40),
    "deepseek_v2_pretrain_128gpu_h100_bf16_config": dict(
        num_layers=60, hidden_size=5120, num_attention_heads=128, num_moe_experts=160,
        moe_router_topk=6, q_lora_rank=1536, moe_router_num_groups=8, moe_router_group_topk=3,
        moe_router_topk_scaling_factor=16.0),
    "glm45_355b_pretrain_128gpu_h100_bf16_config": dict(
        num_layers=92, hidden_size=5120, num_attention_heads=96, num_query_groups=8,
        kv_channels=128, num_moe_experts=160, moe_router_topk=8, moe_ffn_hidden_size=1536,
        qk_layernorm=True, add_qkv_bias=True, rotary_percent=0.5, mtp_num_layers=1,
        moe_router_topk_scaling_factor=2.5, vocab_size=151552),
    "glm45_air_106b_pretrain_32gpu_h100_bf16_config": dict(
        num_layers=46, hidden_size=4096, num_moe_experts=128, moe_ffn_hidden_size=1408,
        qk_layernorm=False),
    "gpt_oss_20b_pretrain_16gpu_h100_bf16_config": dict(
        num_layers=24, hidden_size=2880, num_attention_heads=64, num_query_groups=8,
        kv_channels=64, num_moe_experts=32, moe_router_topk=4, moe_ffn_hidden_size=2880,
        window_size=(127, 0), vocab_size=201088, rotary_base=150000),
    "gpt_oss_120b_pretrain_64gpu_h100_bf16_config": dict(num_layers=36, num_moe_experts=128),
    "qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config": dict(
        num_layers=48, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
        kv_channels=256, num_moe_experts=512, moe_router_topk=10, moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512, rotary_percent=0.25, linear_num_value_heads=32),
}
"""Published values (the public ``config.json`` of each recipe's repository, through Bridge's
own model bridge) that a default could not give."""


@functools.cache
def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "recipe_coverage", ROOT / "benchmarks" / "recipe_coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULES = {"deepseek_v2": "deepseek.h100.deepseek_v2", "glm45": "glm.h100.glm45",
           "gpt_oss": "gpt_oss.h100.gpt_oss", "qwen3_next": "qwen.h100.qwen3_next",
           "qwen3_30b": "qwen.h100.qwen3_moe"}
"""Each recipe's module under ``megatron.bridge.recipes`` (Bridge 0.6.2), by name prefix."""


def _spec(rc: Any, name: str) -> str:
    module = next(m for prefix, m in MODULES.items() if name.startswith(prefix))
    return f"megatron.bridge.recipes.{module}:{name}"


def test_every_standin_reaches_its_recipe_with_the_published_sizes() -> None:
    from nemo_nutp.integrations.bridge_config import load_recipe
    from tests.helpers.hf_offline import offline_hf

    rc = _bench()
    offline_hf()
    for name, want in PUBLISHED.items():
        provider = load_recipe(_spec(rc, name)).model
        got = {k: getattr(provider, k) for k in want}
        got = {k: tuple(v) if isinstance(v, list) else v for k, v in got.items()}
        assert got == want, name


def test_the_architecture_refuses_before_the_moe_and_run_settings() -> None:
    """Qwen3-Next was refused by its ``global_aux_loss`` (``moe_of`` through
    ``check_moe_recovery``, before the field audit), then by ``optimizer.apply_wd_to_qk_layernorm``
    (the container's fields before the model's); gpt-oss by the first of its four refused
    fields in alphabetical order, not the attention sinks."""
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from tests.helpers.hf_offline import offline_hf

    rc = _bench()
    offline_hf()
    cases = {"qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config":
             ("model.experimental_attention_variant=gated_delta_net",
              "model.attention_output_gate=True", "model.moe_shared_expert_gate=True"),
             "gpt_oss_20b_pretrain_16gpu_h100_bf16_config":
             ("model.softmax_type=learnable", "model.activation_func_clamp_value=7.0",
              "model.glu_linear_offset=1.0")}
    for name, fields in cases.items():
        spec = _spec(rc, name)
        with pytest.raises(ValueError) as e:
            load_bridge_job(spec, None, rc.model_overrides(spec))
        msg = str(e.value)
        assert "\n" not in msg and all(f in msg for f in fields), msg
        assert rc.classify(e.value)[:2] == ("refused", fields[0].split("=")[0]), msg


def test_fused_quick_gelu_and_a_per_layer_moe_pattern_shrunk() -> None:
    """gpt-oss's bridge sets megatron's fused-GEGLU ``quick_gelu`` (the same math as
    ``activations.quick_gelu``): it was refused as "quick_gelu: not one of (..., 'quick_gelu',
    ...)". A per-layer ``moe_layer_freq`` (DeepSeek, GLM: one entry per recipe layer) is cut to
    the shrunk model's 2 layers, its leading dense layer kept: it was refused as "must be 2
    entries"."""
    from megatron.core import activations
    from megatron.core.fusions import fused_bias_geglu

    from nemo_nutp.integrations.bridge_config import load_recipe
    from nemo_nutp.integrations.bridge_run import _activation_name
    from tests.helpers.hf_offline import offline_hf

    assert _activation_name(fused_bias_geglu.quick_gelu) == "quick_gelu"
    assert _activation_name(activations.quick_gelu) == "quick_gelu"
    rc = _bench()
    offline_hf()
    for name, want in (("glm45_355b_pretrain_128gpu_h100_bf16_config", "[0,1]"),
                       ("deepseek_v2_lite_pretrain_8gpu_h100_bf16_config", "[0,1]"),
                       ("qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config", None)):
        out = rc.shrink(load_recipe(_spec(rc, name)).model)
        freq = [o.split("=", 1)[1] for o in out if o.startswith("model.moe_layer_freq=")]
        assert freq == ([want] if want else []), (name, out)
