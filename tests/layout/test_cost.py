"""The stage cost model (``layout.cost``) and how the planner uses it (issue #14 item 4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

from nemo_nutp.layout import (
    ClusterSpec,
    HealthReport,
    ModelDims,
    ParallelSpec,
    PlanRequest,
    apportion,
    build_plan,
)
from nemo_nutp.layout.cost import CostSpec, boundary_bytes, stage_layers, stage_time, tp_bytes
from nemo_nutp.layout.plan import _Speed, _valid_degrees, best_degree_table
from nemo_nutp.layout.units import rank_work
from tests.helpers.strategies import plan_requests

H100 = CostSpec.from_hardware(peak_tflops=989, nvlink_gbps=450, network_gbps=50, name="h100")
DIMS = ModelDims(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                 ffn_hidden_size=768, vocab_size=1000, seq_length=64)


def test_stage_layers_is_the_even_split() -> None:
    assert stage_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layers(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match=r"parallel\.pp=3"):
        stage_layers(8, 3)


@settings(max_examples=200, deadline=None)
@given(req=plan_requests())
def test_compute_only_model_keeps_the_largest_valid_degree(req: PlanRequest) -> None:
    """Without a hardware the planner's degree choice is the largest valid degree, as before
    the cost model (so plans without ``cluster.hardware`` are unchanged)."""
    valid = _valid_degrees(req)
    if not valid.any():
        return
    table = _Speed(req).choice_table(valid)
    assert (table == best_degree_table(valid)[None, :]).all()


def test_communication_bound_stage_runs_at_a_lower_degree() -> None:
    """One GPU down in a TP4 slice: with compute dominant the stage runs at TP3; with a slow TP
    link (TP comm dominant) the cost model moves it to TP1, the replica is faster for it, and
    the micro-batch shares follow the predicted speeds."""
    base = PlanRequest(cluster=ClusterSpec(8, 4, 4), model=DIMS,
                       parallel=ParallelSpec(tp_base=4, pp=2), global_batch=16,
                       health=HealthReport((5,)), micro_batch_size=2)
    fast_links = dataclasses.replace(H100, flops=1e9, tp_gbps=1e6, p2p_gbps=1e6)
    slow_links = dataclasses.replace(H100, flops=1e15, tp_gbps=1e-3, p2p_gbps=1e6)
    comp = build_plan(dataclasses.replace(base, cost=fast_links))
    comm = build_plan(dataclasses.replace(base, cost=slow_links))
    assert sorted(r.tp for r in comp.replicas) == [(4, 3)]
    assert sorted(r.tp for r in comm.replicas) == [(4, 1)]
    # the chosen degree is the fastest valid one on the same model, checked exhaustively
    for plan in (comp, comm):
        sp = _Speed(plan.request)
        (rep,) = plan.replicas
        times = {d: sp.time(1, d, 1.0, (4, d)) for d in (1, 2, 3)}
        assert rep.tp[1] == min(times, key=lambda d: (times[d], -d))
    # several replicas: the shares are the optimal apportionment of the predicted speeds
    two = dataclasses.replace(base, cluster=ClusterSpec(16, 4, 4), cost=slow_links)
    plan = build_plan(two)
    speeds = np.array([r.speed for r in plan.replicas])
    assert [r.microbatches for r in plan.replicas] == apportion(speeds, 16).tolist()
    for r in plan.replicas:
        assert r.speed == pytest.approx(1.0 / max(r.stage_times), rel=1e-12)


@pytest.mark.parametrize("cost", [None, H100])
def test_stage_times_are_relative_to_a_healthy_replica(cost: CostSpec | None) -> None:
    req = PlanRequest(cluster=ClusterSpec(24, 4, 4), model=DIMS, micro_batch_size=2,
                      parallel=ParallelSpec(tp_base=4, pp=2), global_batch=16, cost=cost,
                      replicas=((4, 4), (4, 3), (2, 4)))
    plan = build_plan(req)
    by_tp = {r.tp: r for r in plan.replicas}
    assert max(by_tp[(4, 4)].stage_times) == pytest.approx(1.0, rel=1e-12)
    assert by_tp[(4, 3)].stage_times[1] > by_tp[(4, 4)].stage_times[1]
    assert by_tp[(2, 4)].stage_times[0] > by_tp[(4, 4)].stage_times[0]
    for r in plan.replicas:
        assert r.speed == pytest.approx(1.0 / max(r.stage_times), rel=1e-12)
    assert (plan.unit_time_s is None) == (cost is None)
    if cost is None:  # compute only: the slowest rank's work from the unit assignment
        w = {t: rank_work(DIMS, t, 2, with_vocab=True).max() for t in (3, 4)}
        assert by_tp[(4, 3)].stage_times[1] == pytest.approx(w[3] / w[4], rel=1e-12)


def test_communication_terms() -> None:
    tokens, h, ab = 128, DIMS.hidden_size, 2
    a = tokens * h * ab
    assert tp_bytes(DIMS, 1, 2, tokens=tokens) == 0.0
    assert tp_bytes(DIMS, 4, 2, tokens=tokens) == pytest.approx(2 * 4 * 2 * 0.75 * a)
    # without SP every receiver gets the whole activation; the t senders serve u receivers
    for t, u in ((2, 3), (4, 1), (3, 3)):
        send = boundary_bytes(DIMS, t, t_prev=None, t_next=u, tokens=tokens) / 2
        recv = boundary_bytes(DIMS, u, t_prev=t, t_next=None, tokens=tokens) / 2
        assert send * t == pytest.approx(u * a) and recv == pytest.approx(a)
        # with SP only the pieces move: the whole activation once in total
        send = boundary_bytes(DIMS, t, t_prev=None, t_next=u, tokens=tokens,
                              sequence_parallel=True) / 2
        recv = boundary_bytes(DIMS, u, t_prev=t, t_next=None, tokens=tokens,
                              sequence_parallel=True) / 2
        assert send * t == pytest.approx(a) and recv * u == pytest.approx(a)
    st = stage_time(DIMS, H100, t=4, stage=0, pp=2, tokens=tokens, t_next=4)
    assert st.compute > 0 and st.tp > 0 and st.boundary > 0
    alone = stage_time(DIMS, H100, t=1, stage=0, pp=1, tokens=tokens)
    assert alone.tp == 0.0 and alone.boundary == 0.0


def test_fixed_costs() -> None:
    """A per-layer cost on every stage whatever its degree; the dense embedding gradient on the
    first stage only, per row of its largest local table (1000 rows over 3 ranks: 334)."""
    spec = dataclasses.replace(H100, layer_overhead_s=1e-3, table_elem_s=1e-9)
    for stage, t in ((0, 3), (1, 3), (1, 1)):
        a = stage_time(DIMS, H100, t=t, stage=stage, pp=2, tokens=64)
        b = stage_time(DIMS, spec, t=t, stage=stage, pp=2, tokens=64)
        table = 334 * DIMS.hidden_size * 1e-9 if (stage, t) == (0, 3) else 0.0
        assert b.compute - a.compute == pytest.approx(2 * 1e-3 + table, rel=1e-9)


@pytest.mark.parametrize("kw, field", [
    ({"flops": 0.0}, "cost.flops"), ({"tp_gbps": -1.0}, "cost.tp_gbps"),
    ({"p2p_gbps": 0.0}, "cost.p2p_gbps"), ({"tp_overlap": 1.5}, "cost.tp_overlap"),
    ({"latency_s": -1e-6}, "cost.latency_s"), ({"layer_overhead_s": -1.0}, "cost.layer_overhead_s"),
    ({"table_elem_s": -1.0}, "cost.table_elem_s"),
])
def test_cost_spec_validation_names_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        dataclasses.replace(H100, **kw)
