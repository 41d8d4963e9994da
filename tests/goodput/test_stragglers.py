"""Straggler policies of the simulator against the planner (issue #15), config, report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.goodput import load_sim_config, make_context, simulate
from nemo_nutp.goodput.config import CostConfig, HardwareSpec, SimConfig, StragglerConfig
from nemo_nutp.goodput.stragglers import evaluate_stragglers
from nemo_nutp.layout import (
    ClusterSpec,
    HealthReport,
    ModelDims,
    ParallelSpec,
    PlanRequest,
    build_plan,
)


def _dims() -> ModelDims:
    return ModelDims(num_layers=4, hidden_size=48, num_attention_heads=16, num_query_groups=8,
                     ffn_hidden_size=40, vocab_size=101, seq_length=16)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([4, 6, 8]), pp=st.sampled_from([1, 2]), domains=st.integers(2, 5),
       seed=st.integers(0, 2**31 - 1), n_slow=st.integers(0, 10))
def test_straggler_policies_match_build_plan(tp: int, pp: int, domains: int, seed: int,
                                             n_slow: int) -> None:
    """One state with drawn slow GPUs: ``rebalance`` equals the capacity of the plan that keeps
    every straggler (policy drop: no choice), ``exclude`` the capacity of the nutp plan (keep or
    exclude per stage), ``ignore`` that plan's slowest replica, ``drop`` the unaffected share."""
    dims = _dims()
    cluster = ClusterSpec(num_gpus=8 * domains, domain_size=8, gpus_per_node=4,
                          hardware="b200_nvl32")
    cfg = SimConfig(name="t", cluster=cluster,
                    parallel=ParallelSpec(tp_base=tp, pp=pp, min_tp=2 if seed % 2 else 1),
                    trials=1, policies=["nutp-restart"], cost=CostConfig(mode="compute"))
    ctx = make_context(cfg, dims=dims, hw=HardwareSpec())
    rng = np.random.default_rng(seed)
    gpus = np.unique(rng.integers(0, cfg.cluster.num_gpus, size=n_slow))
    speeds = rng.uniform(0.05, 1.0, size=len(gpus))
    n_use = ctx.clusters["nutp"].n_use
    thr = evaluate_stragglers(np.zeros(len(gpus), np.int64), gpus, speeds, 1,
                              slice_of=ctx.slice_of, n_use=n_use, pp=pp, tp_base=tp,
                              time=ctx.tables.time, best=ctx.tables.best)
    req = PlanRequest(cluster=ClusterSpec(num_gpus=cfg.cluster.num_gpus, domain_size=8,
                                          gpus_per_node=4),
                      model=dims, parallel=dataclasses.replace(cfg.parallel, dp=n_use),
                      health=HealthReport((), {int(g): float(v) for g, v in zip(gpus, speeds)}),
                      global_batch=10**6)
    keep = build_plan(dataclasses.replace(req, policy="drop"))
    best = build_plan(req)
    assert len(keep.replicas) == len(best.replicas) == n_use  # nobody benched at this batch
    assert thr["rebalance"][0] == pytest.approx(keep.capacity, rel=1e-9)
    assert thr["exclude"][0] == pytest.approx(best.capacity, rel=1e-9)
    assert thr["ignore"][0] == pytest.approx(min(r.speed for r in keep.replicas), rel=1e-9)
    affected = sum(1 for r in keep.replicas if r.speed < 1.0 - 1e-12)
    assert thr["drop"][0] == pytest.approx((n_use - affected) / n_use, rel=1e-9)


def test_paper_scenario_straggler_policies() -> None:
    """``nutp simulate``'s paper scenario holds the straggler policies side by side; their
    throughput order follows from the definitions (exclude >= rebalance >= ignore), computed,
    not hard-coded; exclusions cost transitions, live ones less than restarts."""
    cfg = load_sim_config(["sim.trials=20", "sim.days=3"])
    assert cfg.stragglers.rate_per_gpu_day > 0
    res = simulate(cfg, sweep=False)
    pol = res["stragglers"]["policies"]
    assert list(pol) == ["ignore", "rebalance", "exclude", "exclude-live", "drop"]
    tl = [pol[p]["throughput_loss"] for p in ("exclude", "rebalance", "ignore")]
    assert tl[0] <= tl[1] <= tl[2]
    assert pol["ignore"]["transition_loss"] == pol["rebalance"]["transition_loss"] == 0.0
    assert 0 < pol["exclude-live"]["transition_loss"] < pol["exclude"]["transition_loss"]
    assert pol["exclude-live"]["throughput_loss"] == pol["exclude"]["throughput_loss"]
    assert res["stragglers"]["events"] > 0
    from rich.console import Console

    from nemo_nutp.goodput.report import print_result

    console = Console(record=True, width=200)
    print_result(res, console)
    text = console.export_text()
    assert "straggler policy" in text and "rebalance" in text
    assert "link policy" in text and "sync-relayout" in text  # slow NICs: test_links.py
    off = simulate(dataclasses.replace(cfg, stragglers=StragglerConfig()), sweep=False)
    assert "stragglers" not in off
    assert off["timeline"] == res["timeline"]  # the failure streams do not move
    assert off["links"] == res["links"]


def test_straggler_config_validated() -> None:
    for override, key in (("sim.stragglers.min_speed=0", "sim.stragglers.min_speed"),
                          ("sim.stragglers.max_speed=1.5", "sim.stragglers.min_speed"),
                          ("sim.stragglers.rate_per_gpu_day=-1",
                           "sim.stragglers.rate_per_gpu_day"),
                          ("sim.stragglers.policies=[ignore,magic]", "sim.stragglers.policies"),
                          ("sim.stragglers.duration_distribution=weibull",
                           "sim.stragglers.duration_distribution")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_sim_config([override])
