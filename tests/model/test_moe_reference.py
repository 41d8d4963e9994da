"""The MoE parity reference (``tests/helpers/moe_reference.py``): stock megatron-core 0.19's
``GPTModel`` with MoE layers trains on CPU in one process, its aux loss is live, and resetting
megatron's process-global MoE state between cases makes a case's numbers independent of what
ran before it. megatron-core 0.16's MoE needs Transformer Engine: skipped there (the Python
3.12 / megatron-core 0.19 leg runs it)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.moe_reference import MoECase, reset_check_worker


@pytest.mark.timeout(240)
def test_moe_reference_trains_and_resets(tmp_path: Path) -> None:
    case = MoECase(name="qwen3_moe")
    spawn(reset_check_worker, 1, (case,), tmp_path)
    res = torch.load(tmp_path / "reset_check.pt", weights_only=False)
    first, second = res["first"], res["second"]
    assert len(first["losses"]) == case.steps
    assert all(math.isfinite(x) for x in first["losses"] + first["grad_norms"])
    # every step clips (the bound is below the tiny model's grad norms)
    assert all(g > case.clip_grad for g in first["grad_norms"]), first["grad_norms"]
    # the load-balancing loss is live: about 1 for near-uniform routing, never 0
    assert all(0.5 < a < 4.0 for a in first["aux_losses"]), first["aux_losses"]
    assert first["losses"][-1] < first["losses"][0], first["losses"]
    # the router got the aux loss's gradient too (not only through the token loss)
    assert any(".router." in k and float(g.abs().sum()) > 0 for k, g in first["grads"].items())
    # each token picked exactly top-k experts in every layer and micro-batch
    for maps in first["routing"]:
        assert len(maps) == case.global_batch * case.model["num_layers"]
        for m in maps:
            assert m.shape[1] == case.moe.num_moe_experts
            assert bool((m.sum(dim=1) == case.moe.moe_router_topk).all())
    # a stray forward left tracker entries; the second run reset them and is bitwise the first
    assert res["stray"] > 0
    for key in ("losses", "grad_norms", "aux_losses"):
        assert first[key] == second[key], key
    for k, p in first["params"].items():
        assert torch.equal(p, second["params"][k]), k
