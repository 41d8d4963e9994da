"""SDPA core attention (``model/attention.py``) against megatron's own ``DotProductAttention``
on CPU: forward and input gradients within fp32 rounding for GQA and MHA, causal without a mask
tensor, and no ``[s, s]`` tensor saved for backward (megatron's saves several: the control).
The spec substitution and the mask resolution (SDPA / TE: no explicit mask) are checked too;
the same comparison on CUDA (bf16 / fp32) is ``tests/gpu/test_gpu.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_nutp.layout import ModelDims


class _Group:
    """A TP group of one: all ``DotProductAttention`` asks of its ``pg_collection``."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _PGs:
    tp = _Group()


def _setup() -> None:
    from megatron.core import parallel_state, tensor_parallel

    from nemo_nutp.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)


def attention_pair(heads: int, groups: int, d: int, *, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(megatron DotProductAttention, SDPAttention) over the same config (TP1, causal)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_nutp.model.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=d, use_cpu_initialization=True,
                            masked_softmax_fusion=False, bf16=dtype == torch.bfloat16,
                            params_dtype=dtype, attention_softmax_in_fp32=True,
                            attention_dropout=0.0, hidden_dropout=0.0)
    kw: dict[str, Any] = dict(layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", pg_collection=_PGs())
    return (DotProductAttention(cfg, **kw).to(device), SDPAttention(cfg, **kw).to(device))


def run_pair(heads: int, groups: int, *, s: int = 24, b: int = 3, d: int = 16,
             device: str = "cpu", dtype: torch.dtype = torch.float32
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and q/k/v gradients of both attentions on the same random inputs."""
    ref, sdpa = attention_pair(heads, groups, d, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(heads * 100 + groups)
    shapes = [(s, b, heads, d), (s, b, groups, d), (s, b, groups, d)]
    base = [torch.randn(*sh, generator=gen).to(device, dtype) for sh in shapes]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]
    grad = torch.randn(s, b, heads * d, generator=gen).to(device, dtype)
    out = []
    for module, m in ((ref, mask), (sdpa, None)):
        qkv = [t.clone().requires_grad_() for t in base]
        y = module(*qkv, attention_mask=m)
        y.backward(grad)
        out.append([y.detach(), *(t.grad for t in qkv)])
    return out[0], out[1]


@pytest.mark.parametrize("heads, groups", [(8, 2), (4, 4), (6, 1)])
def test_sdpa_equals_megatron_dot_product_attention(heads: int, groups: int) -> None:
    _setup()
    ref, got = run_pair(heads, groups)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got, strict=True):
        rel = float((a - b).norm() / a.norm())
        assert rel < 1e-6, (name, rel)


def test_sdpa_saves_no_quadratic_tensor() -> None:
    _setup()
    s = 40
    saved: dict[str, list[tuple[int, ...]]] = {}
    for module, name in zip(attention_pair(4, 2, 8), ("megatron", "sdpa"), strict=True):
        shapes: list[tuple[int, ...]] = []
        q = torch.randn(s, 2, 4, 8, requires_grad=True)
        k, v = (torch.randn(s, 2, 2, 8, requires_grad=True) for _ in range(2))
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
        def pack(t: torch.Tensor, shapes: list[tuple[int, ...]] = shapes) -> torch.Tensor:
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(q, k, v, attention_mask=mask if name == "megatron" else None)
        saved[name] = shapes
    quadratic = {n: [sh for sh in v if sh.count(s) >= 2] for n, v in saved.items()}
    assert quadratic["megatron"], saved["megatron"]  # the control: [b*n, s, s] probabilities
    assert not quadratic["sdpa"], saved["sdpa"]


def test_spec_and_mask_follow_the_config() -> None:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.model.attention import SDPAttention
    from nemo_nutp.model.build import needs_attention_mask, nutp_layer_spec, resolve_impl

    dims = ModelDims()
    spec = nutp_layer_spec(dims, degree=2, tp_rank=0, core_attention="sdpa")
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    auto = ModelConfig()
    assert resolve_impl(auto, cuda=False) == ("local", "megatron")
    assert resolve_impl(auto, cuda=True)[1] in ("sdpa", "te")  # TE when it is installed
    assert resolve_impl(ModelConfig(transformer_impl="transformer_engine")) == (
        "transformer_engine", "te")
    assert not needs_attention_mask(ModelConfig(core_attention="sdpa"), cuda=False)
    assert needs_attention_mask(ModelConfig(core_attention="megatron"), cuda=True)
    with pytest.raises(ValueError, match=r"model\.core_attention='flash'"):
        ModelConfig(core_attention="flash")
    with pytest.raises(ValueError, match=r"model\.recompute_granularity='full': needs"):
        ModelConfig(recompute_granularity="full")
