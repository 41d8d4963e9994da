"""DeepSeek-V3 routing through ``nutp-bridge`` (issue #34): Bridge's Qwen3-30B-A3B pretraining
recipe shrunk as ``test_bridge_moe.py`` does (``data/bridge_qwen3_moe_tiny.yaml``), with
DeepSeek-V3's routing set on it (``DSV3``): sigmoid scores, the aux-loss-free expert bias
(update rate 1e-3), group-limited top-k (2 groups of 4 experts, the best 1: with top-2, 4
groups with the best 2 would always hold the plain top-2), top-k scaling 2.5, the
sequence aux loss, the z-loss, one shared expert of the dense FFN's size, and a dense first
layer (``moe_layer_freq=[0,1,1]``). It trains through Bridge's own ``train()`` with NUTP's MoE
layers at replicas [2,1] with sequence parallelism, fp32 and clipping on, against Bridge's own
stock run of the same configuration in one process (megatron's ``GPTModel`` from megatron's
decoder block spec, megatron's DDP and ``finalize_model_grads``, which updates the bias): every
step's loss and grad norm within 1e-5, every rank the same grad-norm bits, the replicas bitwise
equal, the expert biases equal to the stock run's bits, router flips counted.

Negative control (in the test): the expert-bias update counting each replica's tokens only
(``bridge_moe_jobs.bias_per_replica``) leaves the bounds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5
DSV3 = ["model.num_layers=3", "model.moe_layer_freq=[0,1,1]",
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.001", "model.moe_router_num_groups=2",
        "model.moe_router_group_topk=1", "model.moe_router_topk_scaling_factor=2.5",
        "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_z_loss_coeff=0.001",
        "model.moe_shared_expert_intermediate_size=64"]
"""DeepSeek-V3's routing on the shrunk recipe (its ``ffn_hidden_size`` is 64: the shared
expert's size)."""



@pytest.mark.timeout(1500)
def test_bridge_deepseek_routing_nutp_2_1_matches_bridge_stock_run(tmp_path: Path) -> None:
    from tests.helpers.bridge_fork import spawn_bridge
    from tests.helpers.bridge_moe_jobs import check_bridge_parity, nutp_worker, stock_worker
    from tests.helpers.bridge_worlds import spawn_runs

    spawn_bridge(stock_worker, 1, (DSV3,), tmp_path)
    stock = json.loads((tmp_path / "stock_rank0.json").read_text())
    spawn_runs(3, [(nutp_worker, (DSV3, control)) for control in (None, "bias_per_replica")],
               tmp_path)  # the run and its control in one world
    got = json.loads((tmp_path / "nutp_None.json").read_text())
    bad = json.loads((tmp_path / "nutp_bias_per_replica.json").read_text())

    bad_errs = check_bridge_parity(got, stock, bad, tol=TOL)
    assert len(got["expert_bias"]) == 2 and got["bias_equal"], got["bias_max_diff"]
    assert any(b != 0.0 for row in got["expert_bias"] for b in row)  # the bias moved
    # the negative control: each replica's own counts give other biases, other routing (flips)
    # and grad norms outside the bound (the parameters stay equal over the replicas: their
    # gradients are still synchronised)
    assert not bad["bias_equal"] and sum(bad["flips"]) > 0, bad
    assert max(bad_errs["grad_norm"]) > TOL, bad_errs
