"""The planner's memory model against NUTP's MoE model as built (issue #34): the tiny
Qwen3-MoE case (``moe_reference.QWEN3_MOE``, 8 experts) built at the layout ``[3,2]``
(``moe_memory_jobs.count_worker``, no training), its parameters counted on every rank, equal
exactly to ``layout.memory.rank_param_counts`` with the case's ``MoESpec`` at that rank's degree
and TP rank (the degree-3 ranks hold 2/3/3 experts, not 8/3). The pure checks are
``tests/layout/test_moe_memory.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from nemo_nutp.config import ModelConfig
from nemo_nutp.layout.memory import rank_param_counts
from nemo_nutp.layout.specs import MoESpec
from tests.helpers.dist import spawn
from tests.helpers.moe_memory_jobs import count_worker
from tests.helpers.moe_reference import MoECase


@pytest.mark.timeout(300)
def test_rank_parameters_of_the_built_moe_model_match_the_memory_model(tmp_path: Path) -> None:
    case = MoECase(name="qwen3_moe", steps=1)
    spawn(count_worker, 5, (case, (3, 2)), tmp_path)
    got = torch.load(tmp_path / "moe_counts.pt", weights_only=False)
    dims = ModelConfig(**case.model)
    moe = MoESpec(num_moe_experts=case.moe.num_moe_experts,
                  moe_router_topk=case.moe.moe_router_topk,
                  moe_ffn_hidden_size=case.moe.moe_ffn_hidden_size)
    measured = [(r["degree"], r["tp_rank"], r["params"]) for r in got]
    predicted = [(t, j, int(rank_param_counts(dims, t, stage=0, pp=1, moe=moe)[j]))
                 for t, j, _ in measured]
    assert measured == predicted
    assert [(r["degree"], r["experts"]) for r in got] == [(3, 2), (3, 3), (3, 3), (2, 4), (2, 4)]
    # the dense model's count (what the planner used before) is not what a rank holds
    dense = [int(rank_param_counts(dims, t, stage=0, pp=1)[j]) for t, j, _ in measured]
    assert all(d != m for d, (_, _, m) in zip(dense, measured, strict=True))
