"""A shared expert of its own size and OLMoE's pre-softmax routing under NUTP against stock
megatron-core 0.19 in one process (``tests/helpers/moe_reference.py``): the Qwen3-MoE-shaped
tiny model (dense FFN 64, 8 experts of 16, top-2, aux loss) with one shared expert of 48
(``moe_shared_expert_intermediate_size != ffn_hidden_size``, as DeepSeek-V3's 2048 beside
18432) and ``moe_router_pre_softmax=True`` (softmax over all experts, then top-k). NUTP holds
that shared expert whole on every TP rank of a replica, each rank running it on its own
sequence shard (``model/moe.py``: ``NUTPSharedExpertMLP`` with ``nutp_local_ffn=None``), its
gradient summed over the TP group. Layouts [3,2] and [2,2,1], sequence parallel, clipping on
every step, fp32, 4 steps:

* loss, grad norm and the load-balancing loss per step within 1e-5 (relative);
* step 0's synchronised gradients (shared experts included) within 1e-5; the final parameters
  within ``TENSOR_TOL``;
* replicas bitwise equal, every rank's grad norm the same bits, the replicated shared expert's
  gradient the same bits on every TP rank (``assemble`` checks it), router flips 0.

Negative control, run here and asserted to fail: each rank's shared-expert gradient taken as a
full copy instead of its tokens' part (``moe_jobs`` control ``shared_not_summed``). Skipped on
megatron-core 0.16 (the Python 3.12 leg runs it)."""

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
from tests.helpers.moe_reference import MoECase, MoEShape, moe_reference_worker

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as tests/helpers/parity.py)
SHARED = 48  # != ffn_hidden_size (64), != 2 x moe_ffn_hidden_size (32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECase, dict, Path]:
    out = tmp_path_factory.mktemp("moe_shared_ref")
    case = MoECase(name="shared_size", moe=MoEShape(
        moe_shared_expert_intermediate_size=SHARED, moe_router_pre_softmax=True))
    spawn(moe_reference_worker, 1, ([case],), out)
    path = out / "moe_ref_shared_size.pt"
    return case, torch.load(path, weights_only=False), path


def _within(err: dict) -> bool:
    return (max(err["loss"] + err["grad_norm"] + err["aux"]) <= TOL and err["grads"][0] <= TOL
            and err["params"][0] <= TENSOR_TOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "controls"), [((3, 2), [None, "shared_not_summed"]),
                                                    ((2, 2, 1), [None])])
def test_shared_expert_of_its_own_size_matches_stock(
        reference: tuple[MoECase, dict, Path], replicas: tuple[int, ...],
        controls: list[str | None], tmp_path: Path) -> None:
    case, ref, path = reference
    fc1 = "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"
    assert tuple(ref["grads"][fc1].shape) == (2 * SHARED, 32)  # its own size, gated
    assert all(a > 0.5 for a in ref["aux_losses"]) and all(
        g > case.clip_grad for g in ref["grad_norms"])  # the aux loss is live; every step clips
    spawn(layout_worker, sum(replicas), (case, replicas, controls, str(path)), tmp_path)
    name = "_".join(map(str, replicas))
    err = layout_errors(ref, torch.load(tmp_path / f"moe_{name}_None.pt", weights_only=False))
    print(f"{replicas}: {err}")
    assert err["replicas_equal"] and err["replica_grads_equal"] and err["norms_equal"], err
    assert err["flips"] == [0] * case.steps, err["flips"]
    assert _within(err), err
    if "shared_not_summed" in controls:
        bad = layout_errors(ref, torch.load(tmp_path / f"moe_{name}_shared_not_summed.pt",
                                            weights_only=False))
        print(f"{replicas} control shared_not_summed: {bad}")
        assert not _within(bad), bad
        assert bad["grads"][0] > 100 * TOL and ".shared_experts." in bad["grads"][1], bad


def test_live_relayout_refuses_a_replicated_shared_expert() -> None:
    """The live re-layout does not plan a replicated shared expert yet: refused by name (one of
    the dense FFN's size is planned, as before)."""
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.model.moe import MoEDims
    from nemo_nutp.relayout.plan import move_experts

    d = ModelConfig(**MoECase(name="x").model)
    moe = MoEDims(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                  moe_shared_expert_intermediate_size=SHARED)
    with pytest.raises(ValueError, match=r"^model\.moe_shared_expert_intermediate_size=48: "):
        move_experts(d, moe)
    assert move_experts(d, dataclasses.replace(
        moe, moe_shared_expert_intermediate_size=64)).shared_ffn
