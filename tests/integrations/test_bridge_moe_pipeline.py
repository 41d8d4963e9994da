"""MoE over pipeline stages through ``nutp-bridge`` (issue #34): Bridge's Qwen3-30B-A3B
pretraining recipe shrunk to CPU size (``data/bridge_qwen3_moe_tiny.yaml``) at 4 layers and
``model.pipeline_model_parallel_size=2``, trained by Bridge's own ``train()`` with NUTP's MoE
layers at replicas ``[[2,2],[2,1]]`` (7 ranks; replica 1's stage-1 rank faces both of its
stage-0 ranks; shares 4 and 2 of the 6 micro-batches), sequence parallel, fp32, clipping on.
Against Bridge's own stock run of the same recipe in one process (stock ``GPTModel``, megatron's
MoE layers, EP1, Bridge's ``train()``), from the same weights: every step's loss and grad norm
within 1e-5, every rank the same grad-norm bits, the replicas bitwise equal, router flips
counted (0), and the load-balancing loss Bridge logs (megatron's tracker ``report``) equal to
the stock run's on every rank.

Without NUTP's reduction of that metric (``integrations/bridge_moe_metrics.py``), megatron's
``_sync_metrics`` all-reduces over ``pgs.pp``, which does not pair up under per-stage degrees:
the first step's ``training_log`` hangs (run once, every rank's stack in megatron's
``_sync_metrics``).

Negative control (in the test, one run): stage 1 never setting megatron's aux-loss gradient
scale, and the logged aux loss not summed over the replica's stages; the grad norm and the
logged aux loss leave their bounds, and routers flip."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge runs on Python 3.12 (.venv312)", allow_module_level=True)
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(900)
def test_bridge_qwen3_moe_two_stages_matches_bridge_stock_run(tmp_path: Path) -> None:
    from tests.helpers.bridge_fork import spawn_bridge
    from tests.helpers.bridge_moe_pipeline_jobs import nutp_worker, stock_worker

    spawn_bridge(stock_worker, 1, ([],), tmp_path)
    stock = json.loads((tmp_path / "stock_rank0.json").read_text())
    stock_aux = json.loads((tmp_path / "stock_aux.json").read_text())
    spawn_bridge(nutp_worker, 7, ([], [None, "broken"]), tmp_path)
    got = json.loads((tmp_path / "nutp_pp_None.json").read_text())
    bad = json.loads((tmp_path / "nutp_pp_broken.json").read_text())

    def errors(run: dict) -> dict[str, list[float]]:
        out = {k: [_rel(s[k], r[k]) for s, r in zip(run["steps"], stock, strict=True)]
               for k in ("loss", "grad_norm")}
        out["aux"] = [max(_rel(a, b) for a, b in zip(mine, stock_aux, strict=True))
                      for mine in run["aux"]]  # per rank, worst step
        return out

    errs, bad_errs = errors(got), errors(bad)
    print(json.dumps({"stock": stock, "stock_aux": stock_aux, "nutp": got, "errors": errs,
                      "control": bad, "control_errors": bad_errs}))
    assert len(stock) == len(got["steps"]) == len(stock_aux) == 3
    assert got["shares"] == [4, 2]  # uneven replica weights
    assert got["flips"] == [0, 0, 0]  # every token routed to the stock run's experts
    for k in ("loss", "grad_norm"):
        assert max(errs[k]) <= TOL, errs
    assert len(got["aux"]) == 7 and max(errs["aux"]) <= TOL, errs  # every rank logs it
    assert min(r["grad_norm"] for r in stock) > 0.05  # clipping active at every step
    assert got["norms_same_bits"] and got["replicas_bitwise_equal"]
    # the negative control leaves the bounds
    assert max(bad_errs["grad_norm"]) > TOL, bad_errs
    assert min(bad_errs["aux"]) > 0.1, bad_errs
    assert sum(bad["flips"]) > 0, bad["flips"]


def test_moe_pipeline_settings_refused_by_name() -> None:
    """What MoE over stages does not run through ``nutp-bridge`` yet, one line naming it before
    any process group: virtual pipeline stages, the distributed optimizer; the layout itself
    passes."""
    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations.bridge_run import check_moe
    from nemo_nutp.layout import build_plan
    from tests.helpers.bridge_moe_jobs import load
    from tests.helpers.bridge_moe_pipeline_jobs import LAYERS, NUTP_PP

    job = load([*NUTP_PP, *LAYERS])
    check_moe(job.bridge, build_plan(plan_request(job.nutp)))
    for override, named in [
            ("model.virtual_pipeline_model_parallel_size=2",
             "model.virtual_pipeline_model_parallel_size=2: "),
            ("ddp.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=True: ")]:
        with pytest.raises(ValueError) as e:
            load([*NUTP_PP, *LAYERS, override])
        msg = str(e.value)
        assert msg.startswith(named) and "\n" not in msg, (override, msg)


def test_tracker_reduction_point_is_pinned() -> None:
    """NUTP's tracker replaces megatron's ``MoEMetricsTracker._sync_metrics`` (called by
    ``report`` with the metric names and the process groups) and reads ``_metrics``; the
    installed tracker is the process-global one ``track_moe_metrics`` reports from."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.transformer.moe import moe_logging

    from nemo_nutp.integrations.bridge_moe_metrics import nutp_moe_tracker, tracker_class

    real = moe_logging.MoEMetricsTracker
    assert list(inspect.signature(real._sync_metrics).parameters) == [
        "self", "metric_names", "pg_collection"]
    assert "self._sync_metrics(metric_names, pg_collection)" in inspect.getsource(real.report)
    assert "_metrics" in vars(real())
    old = moe_logging.get_moe_metrics_tracker()
    try:
        nutp_moe_tracker(SimpleNamespace(), 6)
        assert isinstance(moe_logging.get_moe_metrics_tracker(), tracker_class())
    finally:
        moe_logging.set_moe_metrics_tracker(old)
