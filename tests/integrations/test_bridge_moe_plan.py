"""``nutp-bridge``'s launcher plans a MoE recipe with its experts counted (issue #34): the
planner's ``PlanRequest.moe`` comes from the provider's own fields (``bridge_run.moe_spec_of``:
``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, shared expert width,
``moe_layer_freq``), and the memory model's per-rank count on that plan is the experts' one
(the shrunk Qwen3-30B-A3B recipe, ``data/bridge_qwen3_moe_tiny.yaml``: 8 experts of width 16,
replicas [2,1]). Descriptors only: no process group."""

from __future__ import annotations

import importlib.util
import types

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)


def test_the_launcher_plans_with_the_recipes_experts() -> None:
    from nemo_nutp.integrations.bridge_run import moe_spec_of
    from nemo_nutp.launch.bridge_cli import _load
    from nemo_nutp.layout.memory import rank_param_counts
    from nemo_nutp.layout.specs import MoESpec
    from tests.helpers.bridge_jobs import PARITY
    from tests.helpers.bridge_moe_jobs import CPU, NUTP, RECIPE, TINY
    from tests.helpers.hf_offline import offline_hf

    offline_hf()
    _, _, plan = _load(["--recipe", RECIPE, "--config-file", str(TINY), *PARITY, *CPU, *NUTP])
    moe = plan.request.moe
    assert moe == MoESpec(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16)
    # the TP2 replica's ranks hold 4 experts (fc1 32 x 32 + fc2 32 x 16 each) in each of the 2
    # layers where the dense model counted half of a 64-wide FFN
    dims = plan.request.model
    with_experts = rank_param_counts(dims, 2, stage=0, pp=1, moe=moe)
    dense = rank_param_counts(dims, 2, stage=0, pp=1)
    expert, router, half_ffn = 32 * 32 + 32 * 16, 8 * 32, 32 * 3 * 32
    assert list(with_experts - dense) == [2 * (4 * expert + router - half_ffn)] * 2
    # the provider's shared expert (of its own size here: replicated) and layer pattern
    freq = [0, 1]
    shared = types.SimpleNamespace(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=None,
                                   ffn_hidden_size=64, moe_shared_expert_intermediate_size=24,
                                   moe_layer_freq=freq)
    assert moe_spec_of(shared) == MoESpec(8, 2, 64, moe_shared_expert_intermediate_size=24,
                                          moe_layer_freq=(0, 1))
