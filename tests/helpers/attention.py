"""megatron's ``DotProductAttention`` and ``SDPAttention`` side by side on one TP1 config: the
pair ``tests/model/test_attention.py`` (CPU) and ``tests/gpu/test_gpu.py`` (CUDA) compare."""

from __future__ import annotations

from typing import Any

import torch


class _Group:
    """A TP group of one: all ``DotProductAttention`` asks of its ``pg_collection``."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _PGs:
    tp = _Group()


def setup() -> None:
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
