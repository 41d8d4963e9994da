"""NUTP MoE (experts as units, expert parallelism inside each replica) against stock
megatron-core 0.19 in one process (``tests/helpers/moe_reference.py``: its own GPTModel with
MoE layers, SequentialMLP experts, EP1), the Qwen3-MoE-shaped tiny model (qk-layernorm, 8
experts, top-2, load-balancing aux loss, fp32 routing), layouts [3,2] and [2,2,1] (experts
2/3/3, 4/4 and 8 per rank), sequence parallel, clipping on every step, fp32, 4 steps:

* loss, grad norm and the load-balancing loss per step within 1e-5 (relative);
* step 0's synchronised gradients (every parameter, experts by global index) within 1e-5;
* the final parameters within ``TENSOR_TOL`` (Adam's division amplifies the last bits of small
  gradients, as in the dense parity: tests/helpers/parity.py);
* replicas bitwise equal (parameters; step 0's expert, router and norm gradients), every rank's
  grad norm the same bits;
* router flips (each token's chosen experts vs the reference's) counted: 0 measured; a flip
  would void the bounds of its step, so the test asserts 0.

Negative controls, run here and asserted to fail the bounds: the aux loss counted once per TP
rank (``moe_jobs`` control ``aux_per_rank``); its gradient scaled by the replica's micro-batch
count instead of the global one (``aux_replica_count``). megatron-core 0.16's MoE needs Transformer
Engine: skipped there (the Python 3.12 leg runs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.moe_jobs import layout_errors, layout_worker
from tests.helpers.moe_reference import MoECase
from tests.helpers.shared_refs import moe_reference

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as tests/helpers/parity.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECase, dict, Path]:
    case = MoECase(name="qwen3_moe")
    path = moe_reference(case, tmp_path_factory)  # the session's, shared with test_moe_zero
    return case, torch.load(path, weights_only=False), path


def _within(err: dict) -> bool:
    return (max(err["loss"] + err["grad_norm"] + err["aux"]) <= TOL and err["grads"][0] <= TOL
            and err["params"][0] <= TENSOR_TOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "controls"), [((3, 2), [None, "aux_per_rank",
                                                                "aux_replica_count"]),
                                                    ((2, 2, 1), [None])])
def test_moe_layout_matches_stock(reference: tuple[MoECase, dict, Path],
                                  replicas: tuple[int, ...], controls: list[str | None],
                                  tmp_path: Path) -> None:
    case, ref, path = reference
    assert all(a > 0.5 for a in ref["aux_losses"]) and all(
        g > case.clip_grad for g in ref["grad_norms"])  # the aux loss is live; every step clips
    spawn(layout_worker, sum(replicas), (case, replicas, controls, str(path)), tmp_path)
    name = "_".join(map(str, replicas))
    err = layout_errors(ref, torch.load(tmp_path / f"moe_{name}_None.pt", weights_only=False))
    print(f"{replicas}: {err}")
    assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
    assert err["flips"] == [0] * case.steps, err["flips"]
    assert _within(err), err
    if "aux_per_rank" in controls:
        bad = layout_errors(ref, torch.load(tmp_path / f"moe_{name}_aux_per_rank.pt",
                                            weights_only=False))
        print(f"{replicas} control aux_per_rank: {bad}")
        assert not _within(bad), bad
        assert bad["grads"][0] > 100 * TOL and "router" in bad["grads"][1], bad["grads"]
    if "aux_replica_count" in controls:
        bad = layout_errors(ref, torch.load(tmp_path / f"moe_{name}_aux_replica_count.pt",
                                            weights_only=False))
        print(f"{replicas} control aux_replica_count: {bad}")
        assert not _within(bad), bad
        assert bad["grads"][0] > 100 * TOL and "router" in bad["grads"][1], bad["grads"]
