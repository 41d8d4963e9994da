"""megatron-core integration: NUTP layer specs, GPT builder, global-consistent init."""

from .build import (
    LAYER_SPECS,
    ModelChunks,
    build_gpt_chunks,
    build_gpt_model,
    load_global_init,
    nutp_block_spec,
    nutp_layer_spec,
    param_kind,
    transformer_config,
)
from .layers import NUTPMLP, NUTPGPTModel, NUTPNorm, NUTPSelfAttention

__all__ = [
    "LAYER_SPECS",
    "NUTPMLP",
    "ModelChunks",
    "NUTPGPTModel",
    "NUTPNorm",
    "NUTPSelfAttention",
    "build_gpt_chunks",
    "build_gpt_model",
    "load_global_init",
    "nutp_block_spec",
    "nutp_layer_spec",
    "param_kind",
    "transformer_config",
]
