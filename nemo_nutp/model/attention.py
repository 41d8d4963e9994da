"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (no ``[s, s]`` scores).

megatron's local ``DotProductAttention`` materialises ``[b * heads, s, s]`` scores and needs an
explicit mask; at seq 8192 that is GiBs per layer per rank. ``SDPAttention`` keeps megatron's
interface (it *is* a ``DotProductAttention``: same constructor, partition sizes, softmax scale,
dropout, ``sharded_state_dict``) and replaces only ``forward`` by torch's fused kernel:

* causal masking by ``is_causal=True`` (the ``attention_mask`` argument is then not read, as
  megatron's TE attention does for a causal mask type): no mask tensor, no host->device copy;
* GQA: on CUDA in half precision torch's flash kernel reads the grouped K/V directly
  (``enable_gqa``); elsewhere K/V are repeated per head first, like megatron does (O(s) memory);
* the kernel (flash / memory-efficient on GPU, fused or math on CPU) is torch's choice.

Contract: equal to megatron's ``DotProductAttention`` within fp32 rounding on CPU
(``tests/model/test_attention.py``), and in training parity (a parity case runs it).
* a sliding window (``window_size``, per layer by ``window_attn_skip_freq``) as megatron's
  softmax builds it: the window replaces the causal mask.

Not supported (a clear error): packed sequences, attention bias, softmax offsets, an explicit
non-causal mask without a mask tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

_HALF = (torch.float16, torch.bfloat16)


class SDPAttention(DotProductAttention):
    """megatron ``DotProductAttention`` whose forward is torch's scaled-dot-product attention."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``[s, b, heads, d]`` query, ``[s, b, groups, d]`` key/value -> ``[s, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention bias need "
                                      "model.transformer_impl=transformer_engine")
        if getattr(self, "softmax_offset", None) is not None:
            raise NotImplementedError("SDPAttention: softmax_type other than 'vanilla'")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if not causal and attention_mask is None and mask_type != AttnMaskType.no_mask:
            raise ValueError(f"SDPAttention: attn_mask_type={mask_type} needs an attention_mask")
        sq, b = query.shape[0], query.shape[1]
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        gqa = rep > 1 and q.is_cuda and q.dtype in _HALF
        if rep > 1 and not gqa:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = None if causal or attention_mask is None else ~attention_mask  # True = attend
        window = self.config.window_size
        if is_layer_window_attention(window, self.config.window_attn_skip_freq,
                                     self.layer_number):
            # megatron's sliding window (fused_softmax: get_sliding_window_causal_mask)
            # replaces the mask: keys i - left .. i + right of query i
            assert window is not None
            sk = key.shape[0]
            i = torch.arange(sq, device=q.device).view(-1, 1) + (sk - sq)
            j = torch.arange(sk, device=q.device).view(1, -1)
            mask, causal = (j >= i - window[0]) & (j <= i + window[1]), False
        p = self.attention_dropout.p if self.training else 0.0
        scale = self.softmax_scale  # megatron's layer scaling divides it and multiplies back
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        kw: dict[str, Any] = {"enable_gqa": True} if gqa else {}
        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                     is_causal=causal, scale=scale,
                                                     **kw)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=causal, scale=scale, **kw)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
