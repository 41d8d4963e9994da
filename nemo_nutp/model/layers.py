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
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as _VPCE
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm

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
    """megatron ``SelfAttention`` over this rank's query groups (GQA units)."""

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int,
                 attn_mask_type: Any, *, nutp_local_groups: int, **kwargs: Any) -> None:
        pgs = kwargs["pg_collection"]
        cfg = local_config(config, degree=pgs.tp.size(), local_groups=nutp_local_groups)
        super().__init__(cfg, submodules, layer_number, attn_mask_type, **kwargs)


class NUTPMLP(MLP):
    """megatron ``MLP`` over this rank's FFN columns (gate and up rows move together)."""

    def __init__(self, config: TransformerConfig, submodules: Any, *, nutp_local_ffn: int,
                 tp_group: dist.ProcessGroup | None, **kwargs: Any) -> None:
        if tp_group is None:
            raise ValueError("tp_group=None: NUTPMLP needs this rank's TP group (spec params)")
        cfg = local_config(config, degree=tp_group.size(), local_ffn=nutp_local_ffn)
        super().__init__(cfg, submodules, ffn_hidden_size=cfg.ffn_hidden_size,
                         tp_group=tp_group, **kwargs)


class NUTPNorm:
    """megatron's torch norm (``WrappedTorchNorm``), usable under sequence parallelism.

    WrappedTorchNorm refuses ``sequence_parallel``; the math of a norm does not change with it,
    only its gradient becomes a partial sum per sequence shard. The parameters are marked
    ``sequence_parallel`` so the gradient sync sums them over the TP group (as megatron does).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                **kwargs: Any) -> torch.nn.Module:
        c = copy.copy(config)
        c.sequence_parallel = False
        norm = WrappedTorchNorm(c, hidden_size, eps, **kwargs)
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
        c = copy.copy(config)
        c.sequence_parallel = False
        norm = WrappedTorchNorm(c, hidden_size, eps, **kwargs)
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


class NUTPGPTModel(GPTModel):
    """megatron ``GPTModel`` whose embedding and output layer hold vocab rows [start, end)."""

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

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor
                                    ) -> torch.Tensor:
        labels = labels.transpose(0, 1).contiguous()  # [b s] -> [s b], like megatron
        loss = _VocabRangeCrossEntropy.apply(logits, labels, self.vocab_start, self.vocab_end,
                                             self.pg_collection.tp, self.bf16_loss_grad)
        return loss.transpose(0, 1).contiguous()
