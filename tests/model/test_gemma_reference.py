"""The parity reference's Gemma modules (``tests/helpers/gemma_reference.py``) against HF
transformers' own Gemma 2 / Gemma 3 modules, numerically: the reference is checked against the
published implementation, not against this project's classes. Needs transformers (the Python
3.12 environment); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

if importlib.util.find_spec("transformers") is None and sys.version_info < (3, 12):
    # the Python 3.11 env never has it; in the 3.12 env a missing install fails
    pytest.skip("transformers is not installed (the Python 3.12 env has it)",
                allow_module_level=True)

from tests.helpers import gemma_reference as g


class _OneRank:
    """A TP group of one, for megatron modules built outside a process group."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _config(**kw: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    c = TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, kv_channels=16, use_cpu_initialization=True,
                          masked_softmax_fusion=False, **kw)
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rmsnorm_is_hf_gemma(dtype: torch.dtype) -> None:
    """RefGemmaRMSNorm == HF Gemma2RMSNorm and Gemma3RMSNorm (weights from zero; random
    weights; fp32 and bf16 inputs), bitwise."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 3, 64).to(dtype)
    for hf_cls in (Gemma2RMSNorm, Gemma3RMSNorm):
        ref, hf = g.RefGemmaRMSNorm(None, 64, 1e-6), hf_cls(64, eps=1e-6)
        assert torch.equal(ref.weight, hf.weight)  # both start at zero
        with torch.no_grad():
            ref.weight.normal_()
            hf.weight.copy_(ref.weight)
        assert torch.equal(ref(x), hf(x)), hf_cls.__name__


@pytest.mark.parametrize("window", [None, 4])
def test_softcap_attention_is_hf_gemma2_eager(window: int | None) -> None:
    """RefSoftcapAttention == HF Gemma 2's ``eager_attention_forward`` with ``softcap``
    (GQA, a softmax scale, causal or HF's sliding window of ``window`` keys, i.e. megatron's
    (window - 1, 0)), within fp32 rounding."""
    from megatron.core.transformer.enums import AttnMaskType
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    cfg = _config(softmax_scale=0.3, window_size=None if window is None else (window - 1, 0),
                  window_attn_skip_freq=None)
    cfg.attn_logit_softcapping = 2.0  # type: ignore[attr-defined]
    ref = g.RefSoftcapAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_type="self", softmax_scale=cfg.softmax_scale,
                                pg_collection=types.SimpleNamespace(tp=_OneRank()))
    s, b, n, ng, d = 10, 2, 4, 2, 16
    torch.manual_seed(1)
    q, k, v = torch.randn(s, b, n, d), torch.randn(s, b, ng, d), torch.randn(s, b, ng, d)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    got = ref(q, k, v, causal)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    t = torch.tensor
    keep = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(s)]
                         for i in range(s)])
    additive = torch.zeros(s, s).masked_fill(~keep, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=n // ng, training=False, head_dim=d)
    want, _ = eager_attention_forward(module, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                      v.permute(1, 2, 0, 3), additive, scaling=0.3, softcap=2.0)
    want = want.permute(1, 0, 2, 3).reshape(s, b, n * d)  # HF: [b, s, n, d]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_embedding_scaling_is_hf_gemma() -> None:
    """scale_embeddings == HF Gemma 3's ``Gemma3TextScaledWordEmbedding`` (the scale rounded to
    the weights' dtype: bf16 here, where the rounding matters), bitwise."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    hidden = 96  # sqrt(96) = 9.798 rounds to 9.8125 in bf16
    hf = Gemma3TextScaledWordEmbedding(50, hidden, 0, embed_scale=hidden ** 0.5).bfloat16()
    ids = torch.arange(12).view(3, 4)
    raw = torch.nn.functional.embedding(ids, hf.weight)
    module = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
    assert torch.equal(g.scale_embeddings(module, (), raw), hf(ids))


def test_final_softcap_is_hf_gemma2() -> None:
    """RefSoftcapOutputLayer (megatron's ColumnParallelLinear + the cap) == HF
    Gemma2ForCausalLM's capped logits, given HF's final hidden states and lm_head weight."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(2)
    hf = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        final_logit_softcapping=0.5)).eval()
    cfg = _config()
    cfg.final_logit_softcapping = 0.5  # type: ignore[attr-defined]
    ref = g.RefSoftcapOutputLayer(32, 64, config=cfg, init_method=torch.nn.init.zeros_,
                                  bias=False, gather_output=False, tp_group=_OneRank())
    with torch.no_grad():
        ref.weight.copy_(hf.lm_head.weight)
        out = hf(torch.arange(8).view(1, 8), output_hidden_states=True)
        got, _ = ref(out.hidden_states[-1].transpose(0, 1))  # megatron: [s, b, h]
    assert not torch.allclose(out.logits.abs().amax(), torch.tensor(0.5))  # the cap bends
    torch.testing.assert_close(got.transpose(0, 1), out.logits, rtol=1e-6, atol=1e-6)


def test_gemma3_rope_tables_are_hf_gemma3() -> None:
    """RefGemma3RotaryEmbedding's [local, global] tables == HF Gemma3RotaryEmbedding's
    sliding_attention (local base) and full_attention (global base, linear scaling 8) cos/sin,
    and RefGemma3SelfAttention's layer rule is HF's ``layer_types`` (every 6th layer full)."""
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from nemo_nutp.compat.cpu import apply_cpu_patches

    if not torch.cuda.is_available():
        apply_cpu_patches()  # megatron's RotaryEmbedding asks for the CUDA device
    d, s = 16, 40
    hf_cfg = Gemma3TextConfig(
        head_dim=d, num_hidden_layers=12, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}})
    hf = Gemma3RotaryEmbedding(hf_cfg)
    ref = g.RefGemma3RotaryEmbedding(kv_channels=d, rotary_base=1000000,
                                     rotary_base_local=10000, factor=8.0)
    tables = ref(s)  # [2, s, 1, 1, d]: megatron's angles
    x, pos = torch.zeros(1, s, d), torch.arange(s).view(1, -1)
    for i, kind in enumerate(("sliding_attention", "full_attention")):
        cos, sin = hf(x, pos, layer_type=kind)
        torch.testing.assert_close(tables[i].view(s, d).cos(), cos[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(tables[i].view(s, d).sin(), sin[0], rtol=0, atol=2e-6)
    cfg = types.SimpleNamespace(window_size=(7, 0), window_attn_skip_freq=6)
    assert [("sliding_attention" if g.window_layer(cfg, i + 1) else "full_attention")
            for i in range(12)] == hf_cfg.layer_types
