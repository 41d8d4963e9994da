"""Link fail-slow events (slow scale-out NICs) and their policies in the goodput simulator
(issue #36, item 5). Expected losses are computed here from the model's definitions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nemo_nutp.goodput import load_sim_config, make_context
from nemo_nutp.goodput.config import CostConfig, HardwareSpec, LinkConfig, SimConfig
from nemo_nutp.goodput.cost import max_rank_params
from nemo_nutp.goodput.links import link_loss, link_step_times, run_links, sync_tables
from nemo_nutp.layout import ClusterSpec, ModelDims, ParallelSpec

HOURS = 24.0


def _ctx(tp: int = 8, mode: str = "full") -> object:
    dims = ModelDims(num_layers=4, hidden_size=48, num_attention_heads=16, num_query_groups=8,
                     ffn_hidden_size=40, vocab_size=101, seq_length=16)
    # a large gradient/step ratio: the DP sync is a visible part of the step
    cfg = SimConfig(name="t", cluster=ClusterSpec(num_gpus=64, domain_size=8, gpus_per_node=4,
                                                  hardware="b200_nvl32"),
                    parallel=ParallelSpec(tp_base=tp), trials=1, policies=["nutp-restart"],
                    days=HOURS / 24.0,
                    cost=CostConfig(mode=mode, dp_overlap=0.5), micro_batches_per_replica=1,
                    micro_batch_tokens=16)
    return make_context(cfg, dims=dims, hw=HardwareSpec())


def _one(gpu: int, slowdown: float, start: float, end: float) -> dict[str, np.ndarray]:
    return {"trial": np.zeros(1, np.int64), "start": np.array([start]), "end": np.array([end]),
            "gpu": np.array([gpu]), "slowdown": np.array([slowdown])}


def _run(ctx: object, ev: dict[str, np.ndarray], policy: str, detect_s: float
         ) -> tuple[float, float]:
    """(throughput loss, stall hours) of one trial."""
    c = ctx  # type: ignore[assignment]
    thr, changes = link_step_times(ev, slice_of=c.slice_of, n_use=c.clusters["nutp"].n_use,
                                   pp=1, tp_base=c.cfg.parallel.tp_base, time=c.tables.time,
                                   best=c.tables.best, dp_overlap=c.cfg.cost.dp_overlap,
                                   **sync_tables(c))
    loss, tr = link_loss(policy, ev, thr, changes, detect_h=detect_s / 3600.0, trials=1,
                         hours=HOURS, costs=c.costs)
    return float(loss[0]), float(tr.hold.sum())


def _sync_s(ctx: object) -> float:
    """The DP ring all-reduce of one rank's gradient shard, from its definition."""
    c = ctx  # type: ignore[assignment]
    n = c.cfg.cluster.num_gpus // c.cfg.parallel.tp_base
    grads = c.cfg.cost.grad_bytes * max_rank_params(c.dims, c.cfg.parallel.tp_base, 4, True)
    return 2 * (n - 1) / n * grads / (c.hw.network_gbps * 1e9)


def test_ignore_loses_slowdown_times_duration() -> None:
    """A NIC s times slower stretches the ring by (s - 1) x sync: every replica waits for it,
    for the episode's length; rebalance (micro-batch re-split) cannot fix a sync."""
    ctx = _ctx()
    step, sync = ctx.tables.parts_s["step_s"], _sync_s(ctx)  # type: ignore[attr-defined]
    assert sync > 0.05 * step
    s, d = 4.0, 2.0
    expected = d / HOURS * (1 - step / (step + (s - 1) * sync))
    for pol in ("ignore", "rebalance"):
        loss, hold = _run(ctx, _one(3, s, 5.0, 5.0 + d), pol, detect_s=30.0)
        assert loss == pytest.approx(expected, rel=1e-9)
        assert hold == 0.0
    # half of the episode outside the horizon: half the loss
    assert _run(ctx, _one(3, s, HOURS - d / 2, HOURS + d / 2), "ignore", 30.0)[0] == \
        pytest.approx(expected / 2, rel=1e-9)


def test_sync_relayout_beats_ignore_on_a_large_slowdown() -> None:
    """Once localised, the slow GPU's units go to its tp - 1 peers: their NICs carry
    tp/(tp - 1), so the sync is sync x tp/(tp - 1) instead of s x sync; two live re-layouts."""
    ctx = _ctx(tp=8)
    step, sync = ctx.tables.parts_s["step_s"], _sync_s(ctx)  # type: ignore[attr-defined]
    s, d, det = 8.0, 2.0, 60.0
    slow = 1 - step / (step + (s - 1) * sync)
    moved = 1 - step / (step + sync / 7)
    expected = (det / 3600 * slow + (d - det / 3600) * moved) / HOURS
    loss, hold = _run(ctx, _one(9, s, 1.0, 1.0 + d), "sync-relayout", detect_s=det)
    assert loss == pytest.approx(expected, rel=1e-9)
    assert hold == pytest.approx(2 * ctx.costs.planned_live_s / 3600)  # type: ignore[attr-defined]
    assert loss < _run(ctx, _one(9, s, 1.0, 1.0 + d), "ignore", detect_s=det)[0]
    # a NIC barely slower than tp/(tp-1): moving the units does not pay, nothing changes
    loss, hold = _run(ctx, _one(9, 1.1, 1.0, 1.0 + d), "sync-relayout", detect_s=det)
    assert hold == 0.0
    assert loss == pytest.approx(_run(ctx, _one(9, 1.1, 1.0, 1.0 + d), "ignore", det)[0])


def test_exclude_pays_the_relayout_sync_and_at_most_a_replica() -> None:
    """Excluding the GPU: its replica's tp - 1 NICs carry the same tp/(tp - 1) of the sync as
    the re-layout (every replica waits for it), and the replica's lost compute costs at most
    its 1/n share; nothing before the link is localised."""
    ctx = _ctx(tp=8)
    n = ctx.clusters["nutp"].n_use  # type: ignore[attr-defined]
    s, d = 8.0, 2.0
    rl = _run(ctx, _one(9, s, 1.0, 1.0 + d), "sync-relayout", detect_s=0.0)
    ex = _run(ctx, _one(9, s, 1.0, 1.0 + d), "exclude", detect_s=0.0)
    assert rl[0] <= ex[0] <= rl[0] + d / HOURS / n
    assert ex[1] == rl[1] > 0


def test_restart_loses_the_restart_cost() -> None:
    """Restart: one planned restart when localised, healthy links after it."""
    ctx = _ctx()
    loss, hold = _run(ctx, _one(3, 6.0, 2.0, 4.0), "restart", detect_s=0.0)
    assert loss == 0.0
    assert hold == pytest.approx(ctx.costs.straggler_restart_s / 3600)  # type: ignore[attr-defined]


def test_no_events_no_loss_and_compute_mode_has_no_sync() -> None:
    ctx = _ctx()
    c = ctx  # type: ignore[assignment]
    cfg = dataclasses.replace(c.cfg, links=LinkConfig(rate_per_gpu_day=0.0))
    res = run_links(make_context(cfg, dims=c.dims, hw=c.hw), np.random.default_rng(0))
    assert res["events"] == 0
    for row in res["policies"].values():
        assert row["loss"] == row["throughput_loss"] == row["transition_loss"] == 0.0
    flat = _ctx(mode="compute")
    for pol in ("ignore", "sync-relayout", "exclude", "restart"):
        assert _run(flat, _one(3, 10.0, 1.0, 3.0), pol, 30.0) == (0.0, 0.0)


def test_paper_scenario_link_rows() -> None:
    """``nutp simulate sim=paper_32k`` has the link policies; 'ignore' loses the most throughput,
    re-layout and exclude pay live re-layouts, restart pays restarts (computed, not copied)."""
    cfg = load_sim_config(["sim.trials=10", "sim.days=2"])
    assert cfg.links.rate_per_gpu_day > 0
    res = run_links(make_context(cfg), np.random.default_rng(0))
    pol = res["policies"]
    assert list(pol) == ["ignore", "rebalance", "sync-relayout", "exclude", "restart"]
    assert pol["ignore"] == pol["rebalance"]
    assert pol["sync-relayout"]["throughput_loss"] < pol["ignore"]["throughput_loss"]
    assert pol["sync-relayout"]["loss"] < pol["ignore"]["loss"]
    assert pol["restart"]["transition_loss"] > pol["sync-relayout"]["transition_loss"] > 0


def test_link_config_validated() -> None:
    with pytest.raises(ValueError, match=r"sim\.links\.policies"):
        load_sim_config(["sim.links.policies=[ignore,magic]"])  # through the config loader
    for kw, key in (({"min_slowdown": 0.5}, "sim.links.min_slowdown"),
                    ({"max_slowdown": 1.5, "min_slowdown": 2.0}, "sim.links.min_slowdown"),
                    ({"rate_per_gpu_day": -1.0}, "sim.links.rate_per_gpu_day"),
                    ({"detect_s": -1.0}, "sim.links.detect_s"),
                    ({"duration_hours": 0.0}, "sim.links.duration_hours"),
                    ({"duration_distribution": "weibull"}, "sim.links.duration_distribution")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            LinkConfig(**kw)  # type: ignore[arg-type]
