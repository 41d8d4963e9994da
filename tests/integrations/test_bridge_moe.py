"""MoE through ``nutp-bridge`` (issue #34): Bridge's Qwen3-30B-A3B pretraining recipe, shrunk to
CPU size (``data/bridge_qwen3_moe_tiny.yaml``: 8 experts top-2, qk-layernorm, the recipe's
load-balancing aux loss), trains through Bridge's own ``train()`` with NUTP's MoE layers (experts
as units inside each replica, ``model/moe.py``) at replicas [2,1] with sequence parallelism,
fp32 and clipping on. Every step's loss and grad norm equal Bridge's own stock run of the same
shrunk recipe in one process (its provider's stock ``GPTModel`` with megatron's MoE layers, EP1,
megatron's DDP and ``finalize_model_grads``, Bridge's ``train()``) within 1e-5, started from
the same weights (NUTP's global initialisation, set in the stock model); every rank reports the
same grad-norm bits; the replicas end bitwise equal; router flips are counted against the stock
run's routing of the same tokens.

Negative control (in the test): each TP rank counting its replica's aux loss once per TP rank
(the coefficient times the degree) leaves the bounds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5



@pytest.mark.timeout(1500)
def test_bridge_qwen3_moe_nutp_2_1_matches_bridge_stock_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.helpers.bridge_moe_jobs import check_bridge_parity, nutp_worker, stock_worker
    from tests.helpers.bridge_worlds import spawn_runs
    from tests.helpers.shared_refs import bridge_stock

    bridge_stock(stock_worker, [], tmp_path_factory, tmp_path)  # shared with _zero's test
    stock = json.loads((tmp_path / "stock_rank0.json").read_text())
    spawn_runs(3, [(nutp_worker, ([], control)) for control in (None, "aux_per_rank")],
               tmp_path)  # the run and its control in one world
    got = json.loads((tmp_path / "nutp_None.json").read_text())
    bad = json.loads((tmp_path / "nutp_aux_per_rank.json").read_text())
    bad_errs = check_bridge_parity(got, stock, bad, tol=TOL)
    # the negative control: the aux loss counted once per TP rank leaves the bound
    assert max(bad_errs["grad_norm"]) > TOL, bad_errs


REFUSED = [
    # what NUTP's MoE layers do not build yet, one line naming the setting
    # (DeepSeek-V3's routing runs: test_bridge_moe_routing.py; a shared expert of its own size
    # and pre-softmax: tests/train/test_moe_shared_size.py)
    ("model.moe_shared_expert_intermediate_size=64 model.moe_shared_expert_gate=true",
     "model.moe_shared_expert_gate="),
    ("model.moe_expert_capacity_factor=1.0", "model.moe_expert_capacity_factor="),
    ("model.moe_mlp_glu_interleave_size=32", "model.moe_mlp_glu_interleave_size=32: "),
    ("model.moe_router_load_balancing_type=global_aux_loss",
     "model.moe_router_load_balancing_type="),
    ("model.moe_layer_freq=0", "model.moe_layer_freq="),
    ("model.expert_model_parallel_size=2", "model.expert_model_parallel_size="),
    ("mixed_precision=bf16_mixed", "model.bf16=True"),
    ("recovery.enabled=true", "recovery.mode=restart"),
    ("optimizer.use_distributed_optimizer=true checkpoint.save=/tmp/nutp_moe_ckpt",
     "checkpoint.save=/tmp/nutp_moe_ckpt"),
    ("model.pipeline_model_parallel_size=2 checkpoint.save=/tmp/nutp_moe_ckpt",
     "checkpoint.save=/tmp/nutp_moe_ckpt"),
    ("model.pipeline_model_parallel_size=2 model.moe_router_score_function=sigmoid "
     "model.moe_router_enable_expert_bias=true", "model.moe_router_enable_expert_bias=True"),
]


def test_moe_settings_nutp_does_not_build_are_refused_by_name() -> None:
    """The MoE settings NUTP's MoE does not build (the shared-expert gate, capacity factor, the
    grouped-GEMM experts' GLU interleaving, the global aux loss, a bad MoE
    layer frequency, expert parallelism outside the replica) and what NUTP's MoE does not run
    yet (bf16, recovery, checkpoints with the distributed optimizer or over stages, the expert
    bias over stages; the distributed optimizer runs: ``test_bridge_moe_zero.py``; checkpoints:
    ``test_bridge_moe_checkpoint.py``; stages: ``test_bridge_moe_pipeline.py``), each set on
    the shrunk recipe: one line naming it, before any process group; at a layout, sequence
    parallelism off at TP2 is named too. The recipe itself passes."""
    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations.bridge_run import check_moe
    from nemo_nutp.layout import build_plan
    from tests.helpers.bridge_moe_jobs import NUTP, load

    job = load(NUTP)
    check_moe(job.bridge, build_plan(plan_request(job.nutp)))
    for override, named in REFUSED:
        with pytest.raises(ValueError) as e:
            load([*NUTP, *override.split()])
        msg = str(e.value)
        assert named in msg and "\n" not in msg, (override, msg)
    job = load([*NUTP, "model.sequence_parallel=false"])
    with pytest.raises(ValueError, match=r"^model\.sequence_parallel=False: .*degree 2"):
        check_moe(job.bridge, build_plan(plan_request(job.nutp)))
