"""NUTP multi-latent attention (``nemo_nutp/model/mla.py``: heads as units, down-projections and
latent norms replicated, up-projections and ``linear_proj`` sharded by head) in a MoE model (the
DeepSeek-V3 shape in miniature: ``DSV3_MLA`` + ``MLAShape``: q/kv LoRA ranks, decoupled RoPE with
YaRN, latent RMSNorms; 8 experts top-2 with the aux loss), against *stock* megatron-core 0.19.2's
``MLASelfAttention`` + ``MoELayer`` GPTModel in one process (``moe_reference.py`` with
``MoECase.mla``; its only non-stock piece is the core-attention adapter
``mla_reference.MLACoreAttention``).

One TP3 replica (heads 2/3/3, experts 2/3/3), sequence parallel, fp32, step 0 of the whole
global batch (4 micro-batches of 2), two shapes in one world: the DeepSeek-V3 one and
DeepSeek-V2-Lite's form (no query latent: ``linear_q_proj``; no latent norms). TP2 passes too
(5.0e-7), left to the layout test's [2,2,1] for CI time. Loss and load-balancing loss within
1e-5, every gradient (MLA ones by name; the replicated ones summed over the TP group as the
sync sums them) within 1e-5, 0 router flips.

Negative controls, run here at TP3: the down-projections' gradients not summed over the TP group
(``down_once``) or summed twice (``down_twice``) fail the bound on exactly those gradients.

Layouts of several replicas: tests/train/test_mla_parity.py."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE/MLA on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.mla_jobs import mla_errors, mla_replica_worker
from tests.helpers.mla_reference import DSV3_MLA, MLAShape
from tests.helpers.moe_reference import MoECase
from tests.helpers.shared_refs import moe_references

TOL = 1e-5
MLA_NAMES = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
             "linear_kv_up_proj", "q_layernorm", "kv_layernorm", "linear_proj")
PLAIN_NAMES = ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


CASES = [MoECase(name="dsv3_mla", model=dict(DSV3_MLA), mla=MLAShape()),
         # DeepSeek-V2-Lite's form: no query latent (linear_q_proj), no latent norms
         MoECase(name="no_q_latent", model=dict(DSV3_MLA, q_lora_rank=None, qk_layernorm=False),
                 mla=MLAShape(q_lora_rank=None))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    paths = moe_references(CASES, tmp_path_factory)  # dsv3_mla: test_mla_parity's too
    return {name: torch.load(p, weights_only=False) for name, p in paths.items()}


def test_stock_core_attention_needs_the_adapter() -> None:
    """Why the reference has an adapter: megatron's MLA passes k_channels/v_channels, which the
    local DotProductAttention does not take."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = inspect.signature(DotProductAttention.__init__).parameters
    assert "k_channels" not in params and "v_channels" not in params


@pytest.mark.timeout(600)
def test_mla_moe_replica_matches_stock(reference: dict[str, dict], tmp_path: Path) -> None:
    degree, controls = 3, ["down_once", "down_twice"]
    main, plain = CASES
    runs = [(main, None), (plain, None)] + [(main, c) for c in controls]
    spawn(mla_replica_worker, degree, (runs,), tmp_path)
    for case in CASES:
        ref = reference[case.name]
        assert all(a > 0.5 for a in ref["aux_losses"])  # the aux loss is live
        err = mla_errors(ref, torch.load(tmp_path / f"mla_tp{degree}_{case.name}_None.pt",
                                         weights_only=False))
        print(f"{case.name} TP{degree}: loss {err['loss']:.1e} aux {err['aux']:.1e} "
              f"worst {err['worst']} flips {err['flips']}")
        assert not err["missing"], err["missing"]
        names = MLA_NAMES if case is main else PLAIN_NAMES
        for name in names:  # every layer's MLA parameters are there, by name
            assert sum(f".self_attention.{name}.weight" in k for k in err["grads"]) == 2, name
        assert err["flips"] == 0
        assert err["loss"] <= TOL and err["aux"] <= TOL and err["worst"][0] <= TOL, err["worst"]
    for control in controls:
        bad = mla_errors(reference[main.name], torch.load(
            tmp_path / f"mla_tp{degree}_{main.name}_{control}.pt", weights_only=False))
        off = {k for k, v in bad["grads"].items() if v > TOL}
        print(f"TP{degree} control {control}: worst {bad['worst']}")
        assert off and all("_down_proj." in k for k in off), off
        assert bad["worst"][0] > 0.1
