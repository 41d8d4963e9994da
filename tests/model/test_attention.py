"""SDPA core attention (``model/attention.py``) against megatron's own ``DotProductAttention``
on CPU: forward and input gradients within fp32 rounding for GQA and MHA, causal without a mask
tensor, and no ``[s, s]`` tensor saved for backward (megatron's saves several: the control).
The spec substitution and the mask resolution (SDPA / TE: no explicit mask) are checked too;
the same comparison on CUDA (bf16 / fp32) is ``tests/gpu/test_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from nemo_nutp.layout import ModelDims
from tests.helpers.attention import attention_pair, run_pair, setup


@pytest.mark.parametrize("heads, groups", [(8, 2), (4, 4), (6, 1)])
def test_sdpa_equals_megatron_dot_product_attention(heads: int, groups: int) -> None:
    setup()
    ref, got = run_pair(heads, groups)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got, strict=True):
        rel = float((a - b).norm() / a.norm())
        assert rel < 1e-6, (name, rel)


def test_sdpa_saves_no_quadratic_tensor() -> None:
    setup()
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
