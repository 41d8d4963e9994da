"""NUTP's distributed optimizer with MoE experts against stock megatron-core 0.19 in one
process (``tests/helpers/moe_reference.py``: megatron's GPTModel with MoE layers, its DDP and
its non-distributed optimizer, plain Adam at one process), the Qwen3-MoE-shaped tiny model,
layouts [3,2] and [2,2,1] (one world of 5 ranks runs both), sequence parallel, clipping on
every step, fp32, 4 steps, with ``train.distributed_optimizer``: the dense state sliced over the
sync owner groups, each expert shard's state over its holders (``sync/zero.py``,
``sync/experts.py``):

* loss, grad norm and load-balancing loss per step within 1e-5 (relative);
* step 0's synchronised gradients (assembled from the optimizer's reduce-scattered slices,
  ``ZeroOptimizer.full_grads``) within 1e-5, the final parameters within ``TENSOR_TOL``;
* replicas bitwise equal (parameters; step 0's expert, router and norm gradients), every rank's
  grad norm the same bits; router flips counted (0);
* every rank keeps optimizer state for its slice of its experts only: the slices of a shard's
  holders partition it (sum of sliced elements = experts x replicas' share, each element once).

Negative control, run here and asserted to fail the bounds: the expert gradients not reduced
among the holders (each steps its slice from its own replica's share,
``moe_zero_jobs`` control ``expert_grad_not_reduced``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.moe_jobs import layout_errors
from tests.helpers.moe_reference import MoECase
from tests.helpers.moe_zero_jobs import zero_worker
from tests.helpers.shared_refs import moe_reference

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as tests/helpers/parity.py)
RUNS = [((3, 2), None), ((2, 2, 1), None), ((3, 2), "expert_grad_not_reduced")]


def _within(err: dict) -> bool:
    return (max(err["loss"] + err["grad_norm"] + err["aux"]) <= TOL and err["grads"][0] <= TOL
            and err["params"][0] <= TENSOR_TOL)


@pytest.mark.timeout(900)
def test_moe_distributed_optimizer_matches_stock(tmp_path: Path,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    case = MoECase(name="qwen3_moe")
    path = moe_reference(case, tmp_path_factory)  # the session's (test_moe_parity's)
    ref = torch.load(path, weights_only=False)
    assert all(g > case.clip_grad for g in ref["grad_norms"])  # every step clips
    spawn(zero_worker, 5, (case, RUNS, str(path)), tmp_path)
    n_expert = 0  # one layer's experts: elements of all expert tensors of the model
    for k, v in ref["params"].items():
        if ".experts." in k:
            n_expert += v.numel()
    for replicas, control in RUNS:
        name = "_".join(map(str, replicas))
        rec = torch.load(tmp_path / f"moe_zero_{name}_{control}.pt", weights_only=False)
        err = layout_errors(ref, rec)
        print(f"{replicas} {control}: {err}")
        stats = rec["expert_state"]
        print(f"{replicas} {control} expert state per rank: {stats}")
        if control is not None:
            assert not _within(err), err
            assert err["grads"][0] > 100 * TOL and ".experts." in err["grads"][1], err["grads"]
            continue
        assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
        assert err["flips"] == [0] * case.steps, err["flips"]
        assert _within(err), err
        # every expert element is held once per replica and sliced once over its holders
        assert sum(s["local_expert_numel"] for s in stats) == n_expert * len(replicas)
        assert sum(s["sliced_expert_numel"] for s in stats) == n_expert
        for s in stats:
            assert s["zero_expert_state_bytes"] <= s["plain_expert_state_bytes"]
