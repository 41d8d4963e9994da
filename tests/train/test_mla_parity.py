"""NUTP multi-latent attention + MoE (the DeepSeek-V3 shape in miniature: ``DSV3_MLA`` +
``MLAShape``: q/kv LoRA ranks, decoupled RoPE with YaRN, latent RMSNorms, 8 experts top-2 with
the aux loss) against *stock* megatron-core 0.19.2's ``MLASelfAttention`` + ``MoELayer``
GPTModel in one process (``moe_reference.py`` with ``MoECase.mla``; its only non-stock piece is
the core-attention adapter ``mla_reference.MLACoreAttention``), layouts [3,2] and [2,2,1]
(heads 2/3/3, 4/4 and 8 per rank; experts likewise), sequence parallel, clipping on every step,
fp32, 4 steps:

* loss, grad norm and the load-balancing loss per step within 1e-5 (relative);
* step 0's synchronised gradients (every parameter; the MLA ones checked by name) within 1e-5;
* the final parameters within ``TENSOR_TOL`` (as test_moe_parity.py);
* replicas bitwise equal, every rank's grad norm the same bits, router flips counted (0).

Negative control, run here at [3,2]: the down-projections' gradients not summed over the TP
group (their weights not marked partial: ``mla_jobs`` control ``down_unsummed``) fails the
bounds on exactly those gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE/MLA on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.mla_jobs import mla_layout_worker
from tests.helpers.mla_reference import DSV3_MLA, MLAShape
from tests.helpers.moe_jobs import layout_errors
from tests.helpers.moe_reference import MoECase
from tests.helpers.shared_refs import moe_reference

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as tests/helpers/parity.py)
MLA_NAMES = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
             "linear_kv_up_proj", "q_layernorm", "kv_layernorm", "linear_proj")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECase, dict, Path]:
    case = MoECase(name="dsv3_mla", model=dict(DSV3_MLA), mla=MLAShape())
    path = moe_reference(case, tmp_path_factory)  # the session's, shared with test_mla_replica
    return case, torch.load(path, weights_only=False), path


def _within(err: dict) -> bool:
    return (max(err["loss"] + err["grad_norm"] + err["aux"]) <= TOL and err["grads"][0] <= TOL
            and err["params"][0] <= TENSOR_TOL)


def _mla_grad_errors(ref: dict, rec: dict) -> dict[str, float]:
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    got = rec["grads"][0]
    return {k: rel(got[k], v) for k, v in ref["grads"].items()
            if any(f".self_attention.{n}." in k for n in MLA_NAMES)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "controls"), [((3, 2), [None, "down_unsummed"]),
                                                    ((2, 2, 1), [None])])
def test_mla_moe_layout_matches_stock(reference: tuple[MoECase, dict, Path],
                                      replicas: tuple[int, ...], controls: list[str | None],
                                      tmp_path: Path) -> None:
    case, ref, path = reference
    assert all(a > 0.5 for a in ref["aux_losses"]) and all(
        g > case.clip_grad for g in ref["grad_norms"])  # the aux loss is live; every step clips
    spawn(mla_layout_worker, sum(replicas), (case, replicas, controls, str(path)), tmp_path)
    name = "_".join(map(str, replicas))
    rec = torch.load(tmp_path / f"moe_{name}_None.pt", weights_only=False)
    err = layout_errors(ref, rec)
    mla = _mla_grad_errors(ref, rec)
    print(f"{replicas}: {err}\n  MLA step-0 grads: max {max(mla.values()):.1e}")
    assert len(mla) == 2 * len(MLA_NAMES), sorted(mla)
    assert max(mla.values()) <= TOL, mla
    assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
    assert err["flips"] == [0] * case.steps, err["flips"]
    assert _within(err), err
    if "down_unsummed" in controls:
        bad_rec = torch.load(tmp_path / f"moe_{name}_down_unsummed.pt", weights_only=False)
        bad = layout_errors(ref, bad_rec)
        off = {k: v for k, v in _mla_grad_errors(ref, bad_rec).items() if v > TOL}
        print(f"{replicas} control down_unsummed: {bad}\n  MLA grads off: {off}")
        assert not _within(bad), bad
        assert off and all("_down_proj." in k for k in off), off
