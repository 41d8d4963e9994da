"""The DeepSeek-V3 shape under NUTP, every piece together, against stock megatron-core 0.19 in
one process (``tests/helpers/moe_reference.py``: its own GPTModel, local spec, SequentialMLP
experts, EP1; the only non-stock piece is the named MLA adapter ``MLACoreAttention`` of
``tests/helpers/mla_reference.py``).

The model (issue #34's second shape, in miniature): multi-latent attention (q/kv LoRA ranks,
decoupled RoPE with YaRN, latent RMSNorms) in every layer; 3 layers, the first dense
(``moe_layer_freq=[0,1,1]``); 8 experts, sigmoid routing with the aux-loss-free expert bias,
group-limited top-k (2 groups, the best 1), top-2 scaled by 2.5, one shared expert, the sequence
aux loss and the z-loss; one MTP layer (itself MLA + MoE). Layouts [3,2] and [2,2,1], sequence
parallel, clipping on every step, fp32, 4 steps:

* loss, grad norm, the sequence aux loss and the MTP loss per step within 1e-5 (relative);
* step 0's synchronised gradients (every parameter: MLA projections, dense layer, shared and
  routed experts, routers, MTP) within 1e-5; the final parameters within ``TENSOR_TOL``;
* every router's expert bias after every step the same bits on every rank and within 1e-5 of
  the reference's;
* replicas bitwise equal, every rank's grad norm the same bits, router flips (the MTP layer's
  router too) 0.

Each feature's own test carries its negative controls (``test_mla_parity.py``,
``test_moe_routing.py``, ``test_mtp_parity.py``); this one shows they compose. Skipped on
megatron-core 0.16 (the Python 3.12 leg runs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.mla_reference import DSV3_MLA, MLAShape
from tests.helpers.moe_jobs import layout_errors, layout_worker
from tests.helpers.moe_reference import DEEPSEEK_V3_ROUTING, MoECase, moe_reference_worker

TOL = 1e-5
TENSOR_TOL = 1e-4  # as test_moe_routing.py (Adam's eps on the output layer's tiny gradients)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECase, dict, Path]:
    out = tmp_path_factory.mktemp("dsv3_ref")
    case = MoECase(name="dsv3", model=dict(DSV3_MLA, num_layers=3), moe=DEEPSEEK_V3_ROUTING,
                   mla=MLAShape(), mtp_num_layers=1)
    spawn(moe_reference_worker, 1, ([case],), out)
    path = out / "moe_ref_dsv3.pt"
    return case, torch.load(path, weights_only=False), path


def _bias_errors(ref: dict, rec: dict) -> list[float]:
    return [max(float((rank[k] - want[k]).abs().max()) for rank in every for k in want)
            for every, want in zip(rec["expert_bias"], ref["expert_bias"], strict=True)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("replicas", [(3, 2), (2, 2, 1)])
def test_deepseek_v3_shape_matches_stock(reference: tuple[MoECase, dict, Path],
                                         replicas: tuple[int, ...], tmp_path: Path) -> None:
    case, ref, path = reference
    grads = ref["grads"]
    # the reference really has every piece
    assert any("linear_kv_down_proj" in k for k in grads)  # MLA
    assert "decoder.layers.0.mlp.linear_fc1.weight" in grads  # the dense first layer
    assert any(".shared_experts." in k for k in grads)
    assert any(k.startswith("mtp.layers.0.") and ".experts." in k for k in grads)
    assert any("mtp.layers.0." in k and "linear_q_up_proj" in k for k in grads)
    assert all(float(b.abs().max()) > 0 for b in ref["expert_bias"][0].values())
    assert all(len(m) == 1 and m[0] > 1.0 for m in ref["mtp_losses"])
    assert all(g > case.clip_grad for g in ref["grad_norms"])  # every step clips
    spawn(layout_worker, sum(replicas), (case, replicas, [None], str(path)), tmp_path)
    name = "_".join(map(str, replicas))
    rec = torch.load(tmp_path / f"moe_{name}_None.pt", weights_only=False)
    err, bias = layout_errors(ref, rec), _bias_errors(ref, rec)
    print(f"{replicas}: {err} expert bias {bias}")
    assert len(err["mtp"]) == case.steps
    assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
    assert rec["bias_equal"]
    assert err["flips"] == [0] * case.steps, err["flips"]
    assert max(err["loss"] + err["grad_norm"] + err["aux"] + err["mtp"] + bias) <= TOL, err
    assert err["grads"][0] <= TOL and err["params"][0] <= TENSOR_TOL, err
