"""NUTP subclasses of megatron-core layers: same forward math, rank-specific (uneven) shards.

megatron-core sizes a TP shard as ``global / tp_size``. A NUTP rank holds its own unit count, so
each subclass hands megatron a *rank-local view of the config* in which ``global = local x degree``
(e.g. 4 query groups over 3 ranks: the rank holding 2 groups sees ``num_query_groups = 6``).
Everything megatron then derives per partition (heads, groups, FFN width, vocab rows) is exactly
this rank's units, and the forward math — including the TP collectives — is megatron's own.
Where a *global* index matters (vocabulary ranges of the embedding and of the loss), the true
range from the plan is set explicitly.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as _VPCE
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import is_layer_window_attention

# megatron's TransformerLayer passes the TP group only to the exact MLP class and logs a warning
# for any subclass; NUTPMLP receives its group through the spec instead, so the warning is noise.
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda record: "Unknown MLP type" not in record.getMessage())


def local_config(config: TransformerConfig, *, degree: int, local_groups: int | None = None,
                 local_ffn: int | None = None) -> TransformerConfig:
    """Copy of ``config`` whose global sizes are ``local x degree`` for this rank."""
    c = copy.copy(config)
    if local_groups is not None:
        heads_per_group = config.num_attention_heads // config.num_query_groups
        c.num_query_groups = local_groups * degree
        c.num_attention_heads = local_groups * heads_per_group * degree
    if local_ffn is not None:
        c.ffn_hidden_size = local_ffn * degree
    return c


class NUTPSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` over this rank's query groups (GQA units).

    With per-layer RoPE bases (``rotary_base_local``: ``PerLayerRotaryEmbedding`` hands
    ``[local, global]``), a sliding-window layer takes the local one, a full layer the
    global one (Bridge's ``Gemma3SelfAttention``)."""

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int,
                 attn_mask_type: Any, *, nutp_local_groups: int, **kwargs: Any) -> None:
        pgs = kwargs["pg_collection"]
        cfg = local_config(config, degree=pgs.tp.size(), local_groups=nutp_local_groups)
        super().__init__(cfg, submodules, layer_number, attn_mask_type, **kwargs)
        self.nutp_rope_index: int | None = None
        if getattr(config, "rotary_base_local", None) is not None:
            local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                              self.layer_number)
            self.nutp_rope_index = 0 if local else 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        emb = kwargs.get("rotary_pos_emb")
        if self.nutp_rope_index is not None and emb is not None:
            kwargs["rotary_pos_emb"] = emb[self.nutp_rope_index]
        return super().forward(*args, **kwargs)


class PerLayerRotaryEmbedding(RotaryEmbedding):
    """Gemma 3's two RoPE tables, stacked ``[local, global]``: the global one is megatron's
    ``RotaryEmbedding`` at ``rotary_base`` with its inverse frequencies divided by
    ``global_factor`` (linear scaling), the local one at ``rotary_base_local`` unscaled
    (Bridge's ``Gemma3RotaryEmbedding``). Elementwise per head: no unit changes."""

    def __init__(self, *, rotary_base_local: int, global_factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inv_freq /= global_factor
        self.rope_local = RotaryEmbedding(**{**kwargs, "rotary_base": rotary_base_local})

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.stack([self.rope_local(*args, **kwargs), super().forward(*args, **kwargs)])


class PostNormRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` followed by a norm of its output (Gemma 2/3's post
    attention / post MLP norms; Bridge's ``TERowParallelLinearLayerNorm``, the same
    ``post_layernorm`` key). The output is whole after the TP all-reduce, so the norm is
    replicated (``NUTPNorm``; under sequence parallelism its gradient is partial, as the
    other norms'). Without a bias: it would have to come before the norm."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = NUTPNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        output, bias = super().forward(*args, **kwargs)
        if bias is not None:
            raise ValueError("post_layernorm with a linear bias (model.add_bias_linear)")
        return self.post_layernorm(output), bias


def logit_softcapping(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's softcapping); ``x`` unchanged for a null cap."""
    return x if not cap else cap * torch.tanh(x / cap)


class _SoftcapThenSoftmax(torch.nn.Module):
    """Softcaps the scaled scores, then megatron's masked softmax (no parameters)."""

    def __init__(self, softmax: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.softmax, self.cap = softmax, cap

    def forward(self, scores: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.softmax(logit_softcapping(scores, self.cap), *args)


class SoftcapDotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with Gemma 2's attention-logit softcapping: the
    scaled scores ``q.k * softmax_scale`` become ``cap * tanh(scores / cap)`` before the mask
    and softmax (Bridge's ``Gemma2DotProductAttention``). Per head: no unit changes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cap = self.config.attn_logit_softcapping  # type: ignore[attr-defined]
        inner = self.scale_mask_softmax  # type: ignore[has-type]
        self.scale_mask_softmax = _SoftcapThenSoftmax(inner, float(cap))


class NUTPMLP(MLP):
    """megatron ``MLP`` over this rank's FFN columns (gate and up rows move together)."""

    def __init__(self, config: TransformerConfig, submodules: Any, *, nutp_local_ffn: int,
                 tp_group: dist.ProcessGroup | None, **kwargs: Any) -> None:
        if tp_group is None:
            raise ValueError("tp_group=None: NUTPMLP needs this rank's TP group (spec params)")
        cfg = local_config(config, degree=tp_group.size(), local_ffn=nutp_local_ffn)
        super().__init__(cfg, submodules, ffn_hidden_size=cfg.ffn_hidden_size,
                         tp_group=tp_group, **kwargs)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm scaling by ``1 + weight`` (megatron ``layernorm_zero_centered_gamma``,
    as TE's and megatron's fused norms apply it; HF Gemma's ``Gemma2RMSNorm``); the same
    parameter (``weight``) and state-dict key as ``torch.nn.RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None  # fp32 math, as TE and HF Gemma do it
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float() + 1,
                          self.eps).type_as(x)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm scaling by ``1 + weight`` (``layernorm_zero_centered_gamma``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float() + 1,
                            self.bias.float(), self.eps).type_as(x)


def _torch_norm(config: TransformerConfig, hidden_size: int, eps: float,
                **kwargs: Any) -> torch.nn.Module:
    """megatron's ``WrappedTorchNorm`` (which refuses sequence parallelism and zero-centred
    gamma; both change no forward math of the norm itself), or with
    ``layernorm_zero_centered_gamma`` its zero-centred twin."""
    c = copy.copy(config)
    c.sequence_parallel = False
    if not config.layernorm_zero_centered_gamma:
        return WrappedTorchNorm(c, hidden_size, eps, **kwargs)
    cls = ZeroCenteredRMSNorm if config.normalization == "RMSNorm" else ZeroCenteredLayerNorm
    if config.normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"normalization={config.normalization}: zero-centred gamma needs "
                         "RMSNorm or LayerNorm")
    return cls(hidden_size, eps=eps)


class NUTPNorm:
    """megatron's torch norm (``WrappedTorchNorm``), usable under sequence parallelism and
    with zero-centred gamma (``_torch_norm``).

    The math of a norm does not change with sequence parallelism, only its gradient becomes a
    partial sum per sequence shard. The parameters are marked ``sequence_parallel`` so the
    gradient sync sums them over the TP group (as megatron does).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                **kwargs: Any) -> torch.nn.Module:
        norm = _torch_norm(config, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


class NUTPHeadNorm:
    """megatron's torch norm over each query or key head (``qk_layernorm``). Every TP rank
    holds the same weights but applies them to its own heads, so its gradient is a partial
    sum: the parameters are marked ``sequence_parallel`` (partial) and the gradient sync sums
    them over the TP group, sequence parallelism or not (``sync/engine.py``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                **kwargs: Any) -> torch.nn.Module:
        norm = _torch_norm(config, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True  # type: ignore[attr-defined]
        return norm


class _VocabRangeCrossEntropy(torch.autograd.Function):
    """megatron's vocab-parallel cross entropy with an explicit (possibly uneven) vocab range.

    ``bf16_grad_weight`` (``model.cross_entropy_loss_fusion``): the logits gradient rounded to
    bf16, as megatron's fused cross entropy (native impl, ``calculate_gradients``) returns it,
    at the scale one process training the whole global batch rounds it: this replica's loss
    is scaled by ``1/m_r`` (its micro-batches), the single process's by ``1/M``, so the
    gradient is scaled by the replica weight ``m_r/M`` for the rounding and back after it
    (bf16 rounding commutes only with powers of two: without this, replicas [2,1] of a
    6-micro-batch step differ from one process by 3e-5 in the grad norm)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, end: int,
                group: dist.ProcessGroup, bf16_grad_weight: float | None = None
                ) -> torch.Tensor:
        logits, logits_max = _VPCE.calculate_logits_max(logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        mask, masked_target, predicted, sum_exp, exp_logits = _VPCE.calculate_predicted_logits(
            logits, target, logits_max, start, end)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        exp_logits, loss = _VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(exp_logits, mask, masked_target)
        ctx.bf16_grad_weight = bf16_grad_weight
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        softmax, mask, masked_target = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = _VPCE.prepare_gradient_calculation_operands(
            softmax, mask)
        grad = _VPCE.calculate_gradients(grad_2d, arange_1d, masked_target, update, grad_input,
                                         grad_output)
        w = ctx.bf16_grad_weight
        if w is not None:  # megatron returns bf16; autograd casts it to the logits' dtype
            grad = (grad * w).to(torch.bfloat16).to(grad.dtype) / w
        return grad, None, None, None, None, None


def _scale_embeddings(module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
    """Gemma's embedding scaling: times sqrt(hidden_size), rounded to the embeddings' dtype
    (Bridge's ``EmbeddingScalingMixin``) or not (``embedding_scale_rounded=False``: Bridge's
    ``Gemma3LanguageModelEmbedding``); elementwise, after the sequence-parallel scatter."""
    scale = module.config.hidden_size ** 0.5
    if not module.config.embedding_scale_rounded:
        return out * scale
    return out * torch.tensor(scale, dtype=out.dtype, device=out.device)


class NUTPGPTModel(GPTModel):
    """megatron ``GPTModel`` whose embedding and output layer hold vocab rows [start, end).

    Gemma's settings, read from ``config`` (attributes ``transformer_config`` sets, as
    Bridge's providers carry them): ``apply_embedding_scaling``, ``final_logit_softcapping``
    (on this rank's logits before the vocab-parallel loss: elementwise, exact per shard) and
    per-layer RoPE bases (``rotary_base_local``: ``PerLayerRotaryEmbedding``)."""

    def __init__(self, config: TransformerConfig, transformer_layer_spec: Any, *,
                 vocab_range: tuple[int, int], bf16_loss_grad: float | None = None,
                 **kwargs: Any) -> None:
        pgs = kwargs["pg_collection"]
        start, end = vocab_range
        super().__init__(config, transformer_layer_spec,
                         vocab_size=(end - start) * pgs.tp.size(), **kwargs)
        self.vocab_start, self.vocab_end = start, end
        # model.cross_entropy_loss_fusion: this replica's weight m_r/M (train/rebalance.py
        # updates it with the shares), or None
        self.bf16_loss_grad = bf16_loss_grad
        if self.pre_process:
            emb = self.embedding.word_embeddings
            emb.vocab_start_index, emb.vocab_end_index = start, end
            if getattr(config, "apply_embedding_scaling", False):
                self.embedding.register_forward_hook(_scale_embeddings)
        cap = getattr(config, "final_logit_softcapping", None)
        if self.post_process and cap:
            self.output_layer.register_forward_hook(
                lambda _m, _a, out: (logit_softcapping(out[0], cap), *out[1:]))
        local = getattr(config, "rotary_base_local", None)
        if local is not None and self.position_embedding_type == "rope":
            rope = self.rotary_pos_emb  # type: ignore[has-type]
            self.rotary_pos_emb = PerLayerRotaryEmbedding(
                rotary_base_local=local, global_factor=config.rope_scaling_factor_global,  # type: ignore[attr-defined]
                kv_channels=config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=kwargs.get("seq_len_interpolation_factor"),
                rotary_base=kwargs.get("rotary_base", 10000), rope_scaling=False,
                use_cpu_initialization=config.use_cpu_initialization, cp_group=rope.cp_group)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor
                                    ) -> torch.Tensor:
        labels = labels.transpose(0, 1).contiguous()  # [b s] -> [s b], like megatron
        loss = _VocabRangeCrossEntropy.apply(logits, labels, self.vocab_start, self.vocab_end,
                                             self.pg_collection.tp, self.bf16_loss_grad)
        return loss.transpose(0, 1).contiguous()
