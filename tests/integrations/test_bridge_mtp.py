"""Multi-token prediction through ``nutp-bridge`` (issue #34): Bridge's Qwen3-30B-A3B recipe
shrunk as in ``test_bridge_moe.py`` plus one MTP layer (``model.mtp_num_layers=1``, its loss
scaling factor 0.3) trains through Bridge's own ``train()`` with NUTP's MoE model and MTP block
(``model/mtp.py``) at replicas [2,1], sequence parallel, fp32, clipping on, 3 steps, exactly
like Bridge's own stock run of the same recipe in one process (its provider's stock
``GPTModel`` with megatron's MTP block, megatron's DDP and ``finalize_model_grads``), from the
same weights: every step's loss, grad norm and the MTP loss Bridge's ``training_log`` reports
(megatron's ``track_mtp_metrics``, on every rank) within 1e-5, its acceptance rates too;
every rank the same grad-norm bits; replicas bitwise equal; router flips (decoder and MTP
routers) counted: 0.

Negative control (in the test, one world): each TP rank counting its replica's MTP loss once per
TP rank (the scaling factor times the degree) leaves the grad-norm bound, and the reported MTP
loss left per replica (without NUTP's reduction of megatron's tracker,
``bridge_run.mtp_log_callbacks``) leaves the MTP-loss bound at step 0 (where both runs
still have the same weights)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5
LOSS = "mtp_1 loss"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _read(path: Path) -> list:
    return json.loads(path.read_text())


@pytest.mark.timeout(1500)
def test_bridge_qwen3_moe_mtp_nutp_2_1_matches_bridge_stock_run(tmp_path: Path) -> None:
    from tests.helpers.bridge_fork import spawn_bridge
    from tests.helpers.bridge_mtp_jobs import nutp_mtp_worker, stock_mtp_worker
    from tests.helpers.bridge_worlds import spawn_runs

    spawn_bridge(stock_mtp_worker, 1, ([],), tmp_path)
    stock = _read(tmp_path / "stock_rank0.json")
    stock_logs = _read(tmp_path / "mtp_stock_rank0.json")
    stock_mtp = [s[LOSS] for s in stock_logs]
    spawn_runs(3, [(nutp_mtp_worker, ([], control)) for control in (None, "mtp_per_rank")],
               tmp_path)  # the run and its control in one world
    got = _read(tmp_path / "nutp_None.json")
    bad = _read(tmp_path / "nutp_mtp_per_rank.json")
    logs = {r: _read(tmp_path / f"mtp_nutp_None_rank{r}.json") for r in range(3)}
    mtp = {r: [s[LOSS] for s in rank_logs] for r, rank_logs in logs.items()}
    bad_mtp = [s[LOSS] for s in _read(tmp_path / "mtp_nutp_mtp_per_rank_rank0.json")]
    errs = {k: [_rel(s[k], r[k]) for s, r in zip(got["steps"], stock, strict=True)]
            for k in ("loss", "grad_norm")}
    errs["mtp"] = [max(_rel(m[i], v) for m in mtp.values()) for i, v in enumerate(stock_mtp)]
    # megatron's acceptance rates (even vocab shards at [2,1]: its argmax over shards holds)
    errs["acceptance"] = [max(abs(r[i][k] - s[k]) for r in logs.values() for k in s
                              if "acceptance" in k) for i, s in enumerate(stock_logs)]
    bad_errs = {"grad_norm": [_rel(s["grad_norm"], r["grad_norm"])
                              for s, r in zip(bad["steps"], stock, strict=True)],
                "mtp": [_rel(a, b) for a, b in zip(bad_mtp, stock_mtp, strict=True)]}
    print(json.dumps({"stock": stock, "stock_mtp": stock_logs, "nutp": got, "nutp_mtp": logs,
                      "errors": errs, "control": bad, "control_mtp": bad_mtp,
                      "control_errors": bad_errs}))
    assert len(stock) == len(got["steps"]) == len(stock_mtp) == 3
    assert all(len(m) == 3 for m in mtp.values()), mtp
    assert all(v > 1.0 for v in stock_mtp), stock_mtp  # an MTP loss is there
    assert stock_logs[-1]["mtp_1_acceptance_rate"] > 0, stock_logs  # some tokens accepted
    assert got["flips"] == [0, 0, 0]  # every token (MTP's too) routed as in the stock run
    for k, e in errs.items():
        assert max(e) <= TOL, (k, errs)
    assert min(r["grad_norm"] for r in stock) > 0.05  # clipping active at every step
    assert got["norms_same_bits"] and got["replicas_bitwise_equal"]
    # the negative control: the MTP loss counted once per TP rank leaves the grad-norm bound;
    # the reported MTP loss of replica 0 alone leaves the MTP-loss bound at step 0
    assert max(bad_errs["grad_norm"]) > 100 * TOL, bad_errs
    assert bad_errs["mtp"][0] > 10 * TOL, bad_errs


def test_mtp_without_moe_is_refused_by_name() -> None:
    """NUTP builds MTP on its MoE model only: a dense recipe with ``model.mtp_num_layers``
    is one line naming it, before any process group; MTP's other settings away from megatron's
    default are refused by name (``test_bridge_fields.py``)."""
    from nemo_nutp.integrations.bridge_run import moe_of
    from tests.helpers.bridge_moe_jobs import NUTP, load
    from tests.helpers.bridge_mtp_jobs import MTP

    job = load([*NUTP, *MTP])
    moe = moe_of(job.bridge.model)
    assert (moe.mtp_num_layers, moe.mtp_loss_scaling_factor) == (1, 0.3)
    dense = job.bridge.model
    dense.num_moe_experts = None
    with pytest.raises(ValueError, match=r"^model\.mtp_num_layers=1: NUTP builds multi-token "
                                         r"prediction on its MoE model only"):
        moe_of(dense)
