"""Multi-token prediction (megatron-core 0.19's MTP, DeepSeek-V3) on the NUTP MoE model.

megatron's ``MultiTokenPredictionBlock`` and ``MultiTokenPredictionLayer`` are built unchanged
on the (one) last stage, each MTP layer with:

* ``enorm``, ``hnorm``, ``final_layernorm``: NUTP's replicated norms (``NUTPNorm``: marked
  ``sequence_parallel``, so the sync sums their partial gradients over the replica's TP group);
* ``eh_proj`` (``[h, 2h]``, the projection of the concatenated ``[embedding, hidden]``):
  megatron shards its *output* columns (hidden units) over TP, all-gathers them and scatters
  the sequence again. Hidden units are not an NUTP unit space (a degree need not divide
  ``hidden_size``: 32 over 3 ranks), so NUTP **replicates** it (:class:`NUTPEhProj`) and applies
  it to the rank's own sequence shard: the same per-token product, no collective; its gradient
  is each rank's tokens' part, summed over the TP group by the sync like the norms;
* the transformer layer: this rank's NUTP layer (attention heads as units, experts as units:
  ``moe.nutp_moe_layer_spec``), built by megatron with ``is_mtp_layer=True``.

The embedding and the output layer are the main model's own modules (vocab units), so their
gradients from the MTP loss land in the same tensors as in one process. The MTP loss is
megatron's (``process_mtp_loss``: NUTP's vocab-range cross entropy via
``NUTPGPTModel.compute_language_model_loss``): every TP rank of a replica computes the replica's
whole-sequence loss once, as for the main loss, and ``MTPLossAutoScaler`` scales its gradient by
the main loss's scale (``train.step.set_moe_loss_scale``: loss scale / the replica's
micro-batches, the sync then weights the replica by ``m_r/M``: the global micro-batch count).

megatron's MTP code reads its global ``parallel_state`` (the pipeline rank at build time, the
data-parallel group its loss tracker averages over), which NUTP does not initialise (it builds its
own groups). :func:`install_stage_state` gives that one module a view of ``parallel_state`` that,
while megatron's global state is not initialised, answers "one pipeline stage, this rank the
last" and "no data-parallel averaging group" (the tracker then holds this replica's loss; NUTP
weights replicas itself: ``train.step.reduce_replica_loss``); with megatron's state initialised it
is megatron's own. megatron's MTP acceptance counts (a logging metric, no gradient) assume even
vocab shards and are wrong for uneven vocab units.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import make_viewless_tensor


class NUTPEhProj(torch.nn.Module):
    """MTP's ``eh_proj`` replicated: ``y = x W^T`` on this rank's tokens (``[h, 2h]`` weight,
    no bias), megatron's linear signature (``(output, bias)``)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, bias: bool = False,
                 **_kwargs: Any) -> None:
        super().__init__()
        if bias:
            raise ValueError("model.add_bias_linear=True: NUTP's MTP eh_proj is built "
                             "without a bias (megatron builds it bias=False)")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size,
                                                     dtype=config.params_dtype))
        # each rank's gradient is its own tokens' part: summed over the TP group by the sync
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class NUTPMultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer with the replicated ``eh_proj`` applied to the rank's sequence
    shard (megatron: column-parallel, gather the columns, scatter the sequence; the same
    per-token product). Training and evaluation only (megatron's inference path gathers)."""

    def _concat_embeddings(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor
                           ) -> torch.Tensor:
        decoder_input = self.enorm(decoder_input)
        decoder_input = make_viewless_tensor(inp=decoder_input, requires_grad=True,
                                             keep_graph=True)
        hidden_states = self.hnorm(hidden_states)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                             keep_graph=True)
        hidden_states = torch.cat((decoder_input, hidden_states), -1)
        hidden_states, _ = self.eh_proj(hidden_states)
        return hidden_states


class _StageState(types.ModuleType):
    """megatron's ``parallel_state`` as MTP code sees it under NUTP (see the module doc)."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__["_real"]
        if real.model_parallel_is_initialized():
            return getattr(real, name)
        one_stage = {"get_pipeline_model_parallel_rank": lambda: 0,
                     "get_virtual_pipeline_model_parallel_world_size": lambda: None,
                     "is_pipeline_last_stage": lambda **_kw: True,
                     "get_data_parallel_group": lambda **_kw: None}
        return one_stage.get(name, getattr(real, name))


def install_stage_state() -> None:
    """Give megatron's MTP module the NUTP view of ``parallel_state`` (idempotent)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    if not isinstance(mtp.parallel_state, _StageState):
        mtp.parallel_state = _StageState(mtp.parallel_state)  # type: ignore[assignment]


def check_mtp(moe: Any, *, pp: int, recompute: str | None = None) -> None:
    """``ValueError`` naming the field for an MTP setting NUTP does not build."""
    n = getattr(moe, "mtp_num_layers", None)
    if n is None:
        return
    if n < 1:
        raise ValueError(f"model.mtp_num_layers={n}: must be >= 1 (or unset)")
    if pp != 1:
        raise ValueError(f"model.mtp_num_layers={n}: NUTP builds MTP on one pipeline stage "
                         f"so far (parallel.pp={pp})")
    if recompute == "full":  # megatron's MTP recompute reads its global TP group
        raise ValueError("model.recompute_granularity='full': not built with NUTP's MTP "
                         f"(model.mtp_num_layers={n}) yet")


def nutp_mtp_block_spec(layer_spec: Any, num_layers: int) -> ModuleSpec:
    """megatron's MTP block of ``num_layers`` NUTP MTP layers around ``layer_spec`` (this
    rank's NUTP transformer layer spec, the decoder's last)."""
    from .layers import NUTPNorm

    install_stage_state()
    layer = ModuleSpec(module=NUTPMultiTokenPredictionLayer,
                       submodules=MultiTokenPredictionLayerSubmodules(
                           enorm=NUTPNorm, hnorm=NUTPNorm, eh_proj=NUTPEhProj,
                           mtp_model_layer=layer_spec, layer_norm=NUTPNorm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(
                          layer_specs=[layer] * num_layers))
