"""Minimal named reference modules for Gemma 2/3's features stock megatron-core cannot build.

Stock megatron-core's local GPT spec has no zero-centred norm (its ``WrappedTorchNorm`` asserts
against it), no logit softcapping, no post-attention / post-MLP norm, no embedding scaling and
one RoPE table for every layer. ``reference.py`` plugs these modules into *stock* megatron's
spec and ``GPTModel`` for its TP1 reference; none of them is this project's code. Each is
written from the published formula (HF transformers' Gemma 2 / Gemma 3 modules; Bridge's
Gemma providers) and checked numerically against transformers' own modules in
``tests/model/test_gemma_reference.py`` (Python 3.12 env, where transformers is installed):

* ``RefGemmaRMSNorm``: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` in fp32, weights from zero
  (HF ``Gemma2RMSNorm``).
* ``RefSoftcapAttention``: eager attention ``softmax(mask(cap * tanh(q.k * scale / cap))) v``
  (HF ``eager_attention_forward`` with ``softcap``), GQA by repeating K/V per head.
* ``RefPostNormRowParallelLinear``: megatron's ``RowParallelLinear`` whose output goes through
  a norm at ``post_layernorm`` (HF ``post_attention_layernorm`` / ``post_feedforward_layernorm``,
  Bridge's key).
* ``scale_embeddings`` / ``softcap_output``: HF's ``normalizer`` (sqrt(hidden) in the
  embeddings' dtype) and HF's final-logit softcapping.
* ``RefGemma3RotaryEmbedding`` + ``RefGemma3SelfAttention``: two RoPE tables, the sliding
  layers' at the local base, the full layers' at the global base with linear scaling written
  as megatron's position interpolation (HF ``rope_type: linear``: positions / factor), chosen
  per layer by HF's rule (layer i+1 is full when divisible by the pattern length).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention


class RefGemmaRMSNorm(torch.nn.Module):
    """HF ``Gemma2RMSNorm``: fp32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, ``w`` from 0.
    Takes megatron's norm arguments (config, hidden_size, eps)."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6,
                 **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class RefZeroCenteredLayerNorm(torch.nn.Module):
    """LayerNorm with a zero-centred gamma (megatron's ``layernorm_zero_centered_gamma`` as TE's
    ``LayerNorm(zero_centered_gamma=True)`` computes it; GPT-3's ``apply_layernorm_1p``): fp32
    ``(x - mean) * rsqrt(var + eps) * (1 + w) + b``, ``w`` and ``b`` from 0."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-5,
                 **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True)
                                                         + self.eps)
        return (h * (1.0 + self.weight.float()) + self.bias.float()).type_as(x)


def window_layer(config: Any, layer_number: int) -> bool:
    """Whether 1-based ``layer_number`` attends by the sliding window: every layer, or all but
    every ``window_attn_skip_freq``-th (HF Gemma 2/3 ``layer_types``)."""
    if config.window_size is None:
        return False
    freq = config.window_attn_skip_freq
    return freq is None or layer_number % freq != 0


class RefSoftcapAttention(DotProductAttention):
    """Eager core attention with attention-logit softcapping (HF ``eager_attention_forward``):
    scores ``q.k * softmax_scale``, then ``cap * tanh(scores / cap)``, then the mask (the
    causal one given, or the sliding window ``i - left <= j <= i + right``), fp32 softmax."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any
                ) -> torch.Tensor:
        sq, b, n, d = query.shape
        rep = n // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, n, s, d]
        k = key.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.softmax_scale
        cap = self.config.attn_logit_softcapping
        scores = torch.tanh(scores / cap) * cap
        masked = attention_mask
        if window_layer(self.config, self.layer_number):
            left, right = self.config.window_size
            i = torch.arange(sq).view(-1, 1)
            j = torch.arange(key.shape[0]).view(1, -1)
            masked = (j < i - left) | (j > i + right)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * d)


def ref_norm(config: Any, hidden_size: int, eps: float) -> torch.nn.Module:
    """The reference's norm: Gemma's zero-centred RMSNorm, a zero-centred LayerNorm, or
    torch's own RMSNorm/LayerNorm."""
    if config.layernorm_zero_centered_gamma:
        if config.normalization == "LayerNorm":
            return RefZeroCenteredLayerNorm(config, hidden_size, eps)
        return RefGemmaRMSNorm(config, hidden_size, eps)
    cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    return cls(hidden_size, eps=eps)


class RefNorm:
    """Spec entry building ``ref_norm`` (megatron's norm arguments)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                **_: Any) -> torch.nn.Module:
        return ref_norm(config, hidden_size, eps)


class RefPostNormRowParallelLinear(RowParallelLinear):
    """Row-parallel linear (TP1 here) whose output is normed: HF Gemma 2/3's
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``, at Bridge's key
    ``post_layernorm``."""

    def __init__(self, input_size: int, output_size: int, *, config: Any,
                 **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = ref_norm(config, output_size, config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        out, bias = super().forward(*args, **kwargs)
        assert bias is None
        return self.post_layernorm(out), bias


def scale_embeddings(module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
    """HF Gemma's ``normalizer``: sqrt(hidden_size) as a tensor of the embeddings' dtype."""
    return out * torch.tensor(module.config.hidden_size ** 0.5, dtype=out.dtype)


class RefSoftcapOutputLayer(ColumnParallelLinear):
    """HF Gemma 2's final-logit softcapping on the output layer's logits."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        logits, bias = super().forward(*args, **kwargs)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap, bias


class RefGemma3RotaryEmbedding(RotaryEmbedding):
    """``[local, global]`` RoPE tables: local at ``rotary_base_local``; global at
    ``rotary_base`` with linear scaling as position interpolation by ``factor``."""

    def __init__(self, *, kv_channels: int, rotary_base: int, rotary_base_local: int,
                 factor: float) -> None:
        super().__init__(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=rotary_base,
                         seq_len_interpolation_factor=None if factor == 1.0 else factor,
                         use_cpu_initialization=True)
        self.local = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=1.0,
                                     rotary_base=rotary_base_local,
                                     use_cpu_initialization=True)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.stack([self.local(*args, **kwargs), super().forward(*args, **kwargs)])


class RefGemma3SelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` taking the local RoPE table on sliding layers and the
    global one on full layers (HF Gemma 3's per-``layer_type`` rotary embeddings)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        emb = kwargs["rotary_pos_emb"]
        kwargs["rotary_pos_emb"] = emb[0 if window_layer(self.config, self.layer_number) else 1]
        return super().forward(*args, **kwargs)
