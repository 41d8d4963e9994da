"""Layer-spec registry and the Transformer-Engine variant (skipped without TE / CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nemo_nutp.compat.megatron import nutp_mlp_of
from nemo_nutp.layout import ModelDims
from nemo_nutp.model import LAYER_SPECS, NUTPMLP, NUTPSelfAttention


def test_local_spec_swaps_in_nutp_modules_with_rank_units() -> None:
    dims = ModelDims(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96)
    spec = LAYER_SPECS["nutp_local"](dims, degree=3, tp_rank=2)
    sa, mlp = spec.submodules.self_attention, spec.submodules.mlp
    assert sa.module is NUTPSelfAttention and sa.params["nutp_local_groups"] == 2
    cls, local_ffn = nutp_mlp_of(mlp)  # a ModuleSpec (0.16) or a builder (0.19)
    assert cls is NUTPMLP and 1 <= local_ffn < 32  # work-balanced


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None
                    or not torch.cuda.is_available(), reason="needs Transformer Engine + CUDA")
def test_te_spec_builds() -> None:  # pragma: no cover - GPU only
    dims = ModelDims()
    spec = LAYER_SPECS["nutp_te"](dims, degree=1, tp_rank=0)
    assert spec.submodules.self_attention.module is NUTPSelfAttention


def test_te_spec_without_te_says_so() -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed")
    with pytest.raises(ImportError, match="transformer_engine"):
        LAYER_SPECS["nutp_te"](ModelDims(), degree=1, tp_rank=0)
