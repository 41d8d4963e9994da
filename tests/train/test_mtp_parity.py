"""Multi-token prediction (one MTP layer, megatron-core 0.19's ``MultiTokenPredictionBlock``,
``mtp_loss_scaling_factor`` 0.1) on the NUTP MoE model against stock megatron-core 0.19's own
GPTModel with MTP in one process (``tests/helpers/moe_reference.py``, ``MoECase.mtp_num_layers``:
its local MTP block spec, shared embedding and output layer, ``MTPLossAutoScaler`` set to 1/n per
micro-batch as megatron's schedule does). The Qwen3-MoE-shaped tiny model (8 experts, top-2, aux
loss), layouts [3,2] and [2,2,1], sequence parallel, clipping on every step, fp32, 4 steps:

* loss, grad norm, load-balancing loss (the MTP layer's router included) and the MTP loss as
  megatron's tracker holds it, per step within 1e-5 (relative);
* step 0's synchronised gradients within 1e-5, every MTP parameter by name (``mtp.layers.0.*``:
  enorm, hnorm, eh_proj, the MTP layer's attention, router and experts, final_layernorm);
* the final parameters within ``TENSOR_TOL``; replicas bitwise equal; router flips counted
  (decoder and MTP routers): 0 asserted.

Negative controls, run here (one step, [3,2]) and asserted to fail the bounds: the MTP loss counted
once per TP rank (``mtp_per_rank``: its scaling factor times the degree) and the MTP loss's
gradient normalised by the replica's micro-batch count instead of the global one
(``mtp_replica_count``). Python 3.12 / megatron-core 0.19 leg only."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.moe_jobs import layout_errors, layout_worker
from tests.helpers.moe_reference import MoECase, moe_reference_worker

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as tests/helpers/parity.py)
CONTROLS = ["mtp_per_rank", "mtp_replica_count"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECase, dict, Path]:
    out = tmp_path_factory.mktemp("mtp_ref")
    case = MoECase(name="qwen3_moe_mtp", mtp_num_layers=1)
    spawn(moe_reference_worker, 1, ([case],), out)
    path = out / "moe_ref_qwen3_moe_mtp.pt"
    return case, torch.load(path, weights_only=False), path


def _mtp_grads(ref: dict, got: dict) -> tuple[float, str]:
    """Worst relative error of step 0's MTP gradients, by name (every one must be there)."""
    names = [k for k in ref["grads"] if k.startswith("mtp.")]
    assert names and all(k in got for k in names), sorted(set(names) - set(got))
    errs = {k: float((got[k] - ref["grads"][k]).abs().max()
                     / ref["grads"][k].abs().max().clamp_min(1e-30)) for k in names}
    k = max(errs, key=lambda n: errs[n])
    return errs[k], k


def _within(err: dict) -> bool:
    return (max(err["loss"] + err["grad_norm"] + err["aux"] + err["mtp"]) <= TOL
            and err["grads"][0] <= TOL and err["params"][0] <= TENSOR_TOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("replicas", [(3, 2), (2, 2, 1)])
def test_mtp_layout_matches_stock(reference: tuple[MoECase, dict, Path],
                                  replicas: tuple[int, ...], tmp_path: Path) -> None:
    case, ref, path = reference
    assert all(len(m) == 1 and m[0] > 1.0 for m in ref["mtp_losses"]), ref["mtp_losses"]
    assert all(g > case.clip_grad for g in ref["grad_norms"])  # every step clips
    spawn(layout_worker, sum(replicas), (case, replicas, [None], str(path)), tmp_path)
    name = "_".join(map(str, replicas))
    rec = torch.load(tmp_path / f"moe_{name}_None.pt", weights_only=False)
    err = layout_errors(ref, rec)
    mtp = _mtp_grads(ref, rec["grads"][0])
    print(f"{replicas}: {err} mtp grads {mtp}")
    assert len(err["mtp"]) == case.steps, err["mtp"]
    assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
    assert err["flips"] == [0] * case.steps, err["flips"]
    assert _within(err), err
    assert mtp[0] <= TOL, mtp


@pytest.mark.timeout(600)
def test_mtp_negative_controls_fail(reference: tuple[MoECase, dict, Path],
                                    tmp_path: Path) -> None:
    """One step of each control at [3,2]: step 0's gradients (MTP parameters and all) and grad
    norm off the stock run by far more than the bound."""
    case, ref, path = reference
    one = dataclasses.replace(case, steps=1)
    spawn(layout_worker, 5, (one, (3, 2), CONTROLS, str(path)), tmp_path)
    ref1 = {k: (v[:1] if isinstance(v, list) else v) for k, v in ref.items()}
    for control in CONTROLS:
        rec = torch.load(tmp_path / f"moe_3_2_{control}.pt", weights_only=False)
        bad = layout_errors(ref1, rec)
        mtp = _mtp_grads(ref, rec["grads"][0])
        print(f"control {control}: grad norm {bad['grad_norm']} grads {bad['grads']} "
              f"mtp grads {mtp}")
        assert bad["grad_norm"][0] > 100 * TOL and mtp[0] > 100 * TOL, (control, bad, mtp)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"moe": {"mtp_num_layers": 0}, "pp": 1}, "model.mtp_num_layers=0: must be >= 1"),
    ({"moe": {"mtp_num_layers": 1}, "pp": 2}, "model.mtp_num_layers=1: NUTP builds MTP on one "
                                              "pipeline stage so far (parallel.pp=2)"),
    ({"moe": {"mtp_num_layers": 1}, "pp": 1, "recompute": "full"},
     "model.recompute_granularity='full': not built"),
])
def test_mtp_refused_by_name(kwargs: dict, message: str) -> None:
    from nemo_nutp.model.moe import MoEDims
    from nemo_nutp.model.mtp import check_mtp

    moe = MoEDims(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, **kwargs["moe"])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_mtp(moe, pp=kwargs["pp"], recompute=kwargs.get("recompute"))
    check_mtp(MoEDims(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16), pp=2)
