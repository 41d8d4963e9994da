"""Planner properties over drawn clusters, failures and model shapes."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import (
    ClusterSpec,
    HealthReport,
    ModelDims,
    ParallelSpec,
    Plan,
    PlanRequest,
    apportion,
    build_plan,
    moved_lower_bound,
    reshard_plan,
)
from tests.helpers.strategies import plan_requests


def _plan_or_none(req: PlanRequest) -> Plan | None:
    try:
        return build_plan(req)
    except ValueError as e:  # a drawn cluster may hold no runnable replica: that must say so
        assert any(f in str(e) for f in ("health.failed_gpus", "cluster.num_gpus",
                                          "global_batch")), e
        return None


def _check_plan(plan: Plan) -> None:
    req = plan.request
    failed = set(req.health.failed_gpus)
    w = plan.world_size
    assert sorted(r for g in plan.tp_groups() for r in g) == list(range(w))
    assert sorted(r for g in plan.stage_groups() for r in g) == list(range(w))
    assert len(set(plan.rank_to_gpu)) == w and not failed & set(plan.rank_to_gpu)
    d = req.cluster.domain_size
    for rep in plan.replicas:
        for s, (ranks, gpus) in enumerate(zip(rep.ranks, rep.gpus)):
            assert len(ranks) == len(gpus) == rep.tp[s]
            assert [plan.rank_to_gpu[r] for r in ranks] == list(gpus)
            assert len({g // d for g in gpus}) == 1, "TP group leaves its domain"
            assert rep.tp[s] <= rep.healthy[s]
    assert sum(r.microbatches for r in plan.replicas) == req.global_batch
    assert all(r.microbatches >= 1 for r in plan.replicas)
    assert abs(sum(r.weight for r in plan.replicas) - 1.0) < 1e-9
    for (stage, space), lay in plan.sync.items():
        owners = plan.sync_owner_ranks(stage, space)
        for i, rep in enumerate(plan.replicas):
            assert set(owners[i]) <= set(rep.ranks[stage])  # owners are the replica's own ranks
            rp = reshard_plan(lay, rep.tp[stage])
            assert rp.moved_units == moved_lower_bound(lay.num_units, rep.tp[stage], lay.shards,
                                                       lay.bounds[rep.tp[stage]])
    for g in plan.pp_groups():
        assert len(g) == req.parallel.pp


@settings(max_examples=300, deadline=None)
@given(req=plan_requests())
def test_plan_invariants(req: PlanRequest) -> None:
    plan = _plan_or_none(req)
    if plan is not None:
        _check_plan(plan)
        # Degraded replicas are contiguous in rank order: healthy first within each stage.
        tb = req.parallel.tp_base
        kinds = [all(t == tb for t in r.tp) for r in plan.replicas]
        assert kinds == sorted(kinds, reverse=True)


@settings(max_examples=300, deadline=None)
@given(req=plan_requests(policy="nutp"))
def test_nutp_dominates_baselines(req: PlanRequest) -> None:
    nutp = _plan_or_none(req)
    drop = _plan_or_none(dataclasses.replace(req, policy="drop"))
    ur = _plan_or_none(dataclasses.replace(req, policy="uniform-reduce"))
    if drop is not None:
        assert nutp is not None
        assert nutp.predicted_throughput >= drop.predicted_throughput - 1e-12
        assert nutp.capacity >= drop.capacity - 1e-12
    if ur is not None:
        assert nutp is not None
        assert nutp.world_size >= ur.world_size  # never fewer healthy GPUs in use
        assert nutp.capacity >= ur.capacity - 1e-12


def test_apportion_is_optimal_on_small_cases() -> None:
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 4))
        speeds = rng.uniform(0.2, 1.0, n)
        total = int(rng.integers(n, 9))
        got = apportion(speeds, total)
        best = min(max(c / s for c, s in zip(combo, speeds))
                   for combo in itertools.product(range(1, total + 1), repeat=n)
                   if sum(combo) == total)
        assert got.sum() == total and (got >= 1).all()
        assert max(got / speeds) <= best + 1e-12


def test_node_pair_example() -> None:
    """One failed GPU in a 2x8 pair at TP8: nutp runs TP8+TP7, drop runs TP8 alone."""
    req = PlanRequest(cluster=ClusterSpec(16, 8),
                      model=ModelDims(num_attention_heads=16, num_query_groups=8,
                                      ffn_hidden_size=256),
                      parallel=ParallelSpec(tp_base=8), global_batch=16,
                      health=HealthReport((11,)))
    plan = build_plan(req)
    assert [r.tp for r in plan.replicas] == [(8,), (7,)]
    assert plan.world_size == 15 and 11 not in plan.rank_to_gpu
    assert plan.replicas[1].microbatches < plan.replicas[0].microbatches
    drop = build_plan(dataclasses.replace(req, policy="drop"))
    assert [r.tp for r in drop.replicas] == [(8,)] and drop.dropped_replicas == 1


# --- validation: one test per rule, the message names the field -------------------------------
BASE = PlanRequest(cluster=ClusterSpec(16, 8), model=ModelDims(),
                   parallel=ParallelSpec(tp_base=4), global_batch=8)


def _parallel(**kw: object) -> PlanRequest:
    return dataclasses.replace(BASE, parallel=dataclasses.replace(BASE.parallel, **kw))


def _pp2(replicas: tuple, **kw: object) -> Plan:
    kw.setdefault("parallel", ParallelSpec(tp_base=4, pp=2))
    return build_plan(dataclasses.replace(BASE, replicas=replicas, **kw))  # type: ignore[arg-type]


def test_explicit_per_stage_replicas() -> None:
    """``nutp.replicas`` entries: an int (every stage) or per-stage degrees; the plan runs
    exactly those degrees, replica i's stage s on slice i * pp + s, rank order stage-major."""
    plan = _pp2(((4, 3), 2, (1, 4)), cluster=ClusterSpec(24, 8))
    _check_plan(plan)
    assert plan.request.replicas == ((4, 3), (2, 2), (1, 4))
    assert sorted(r.tp for r in plan.replicas) == sorted([(4, 3), (2, 2), (1, 4)])
    for r in plan.replicas:
        k = plan.request.replicas.index(r.tp)
        for s in range(2):
            slice_start = (2 * k + s) * 4  # 24 GPUs: six 4-GPU slices
            assert all(slice_start <= g < slice_start + 4 for g in r.gpus[s])
    assert plan.world_size == 4 + 3 + 2 + 2 + 1 + 4
    # stage-major rank order: every stage-0 rank precedes every stage-1 rank
    assert max(x for r in plan.replicas for x in r.ranks[0]) < \
        min(x for r in plan.replicas for x in r.ranks[1])
    # pp=1: ints and one-element lists are the same request
    a = build_plan(dataclasses.replace(BASE, replicas=(4, 3)))
    b = build_plan(dataclasses.replace(BASE, replicas=([4], [3])))
    assert [r.tp for r in a.replicas] == [r.tp for r in b.replicas] == [(4,), (3,)]


@settings(max_examples=200, deadline=None)
@given(req=plan_requests(policy="nutp"), data=st.data())
def test_drawn_explicit_per_stage_layouts(req: PlanRequest, data: st.DataObject) -> None:
    """Any per-stage degrees the model allows plan exactly as given (in some replica order),
    on a cluster ``fit_cluster`` sized for them, with every plan invariant."""
    from nemo_nutp.layout import fit_cluster
    from nemo_nutp.layout.plan import _valid_degrees

    pp, valid = req.parallel.pp, np.nonzero(_valid_degrees(req))[0].tolist()
    if not valid:
        return
    reps = data.draw(st.lists(st.one_of(st.sampled_from(valid), st.tuples(
        *[st.sampled_from(valid)] * pp)), min_size=1, max_size=4))
    cluster = fit_cluster(req.cluster, req.parallel.tp_base, len(reps) * pp)
    req = dataclasses.replace(req, cluster=cluster, health=HealthReport(), replicas=tuple(reps),
                              global_batch=max(req.global_batch, len(reps)))
    plan = build_plan(req)
    _check_plan(plan)
    want = Counter(r if isinstance(r, tuple) else (r,) * pp for r in reps)
    got = Counter(r.tp for r in plan.replicas)
    assert not got - want  # exactly the given degrees; a replica too slow for even one
    assert plan.dropped_replicas == sum((want - got).values())  # micro-batch may be benched
    from nemo_nutp.layout.plan import _Speed

    for tp in (want - got).elements():  # only ever the slowest
        assert _Speed(req)(tp) <= min(r.speed for r in plan.replicas) + 1e-12
    for r in plan.replicas:
        assert r.speed == pytest.approx(1.0 / max(r.stage_times), rel=1e-9)


def test_explicit_replicas_too_many_name_the_cluster_size_that_fits() -> None:
    """The error names the cluster.num_gpus to set; with it the same request plans."""
    req = dataclasses.replace(BASE, cluster=ClusterSpec(8, 4, 4), replicas=((4, 3), (4, 4), (2, 2)),
                              parallel=ParallelSpec(tp_base=4, pp=2))
    with pytest.raises(ValueError, match=r"nutp\.replicas=.*cluster\.num_gpus=(\d+)") as e:
        build_plan(req)
    import re

    need = int(re.search(r"cluster\.num_gpus=(\d+)", str(e.value)).group(1))  # type: ignore
    assert need == 24  # six 4-GPU slices
    plan = build_plan(dataclasses.replace(req, cluster=ClusterSpec(need, 4, 4)))
    assert sorted(r.tp for r in plan.replicas) == [(2, 2), (4, 3), (4, 4)]
    with pytest.raises(ValueError, match=r"nutp\.replicas"):  # one GPU fewer does not fit
        build_plan(dataclasses.replace(req, cluster=ClusterSpec(need - 4, 4, 4)))


@pytest.mark.parametrize("make, field", [
    (lambda: ClusterSpec(0, 8), "cluster.num_gpus"),
    (lambda: ClusterSpec(16, 8, gpus_per_node=3), "cluster.gpus_per_node"),
    (lambda: HealthReport((-1,)), "health.failed_gpus"),
    (lambda: HealthReport.from_cli("3,x"), "health.failed_gpus"),
    (lambda: ModelDims(num_attention_heads=8, num_query_groups=3), "model.num_query_groups"),
    (lambda: ModelDims(hidden_size=60, num_attention_heads=8), "model.hidden_size"),
    (lambda: ModelDims(vocab_size=0), "model.vocab_size"),
    (lambda: ParallelSpec(tp_base=0), "parallel.tp_base"),
    (lambda: ParallelSpec(tp_base=2, min_tp=3), "parallel.min_tp"),
    (lambda: ParallelSpec(sync_layout="ring"), "parallel.sync_layout"),
    (lambda: build_plan(dataclasses.replace(BASE, policy="best")), "nutp.policy"),
    (lambda: build_plan(_parallel(pp=3)), "parallel.pp"),
    (lambda: build_plan(_parallel(tp_base=16)), "parallel.tp_base"),  # larger than a domain
    (lambda: build_plan(dataclasses.replace(BASE, cluster=ClusterSpec(64, 64),
                                            parallel=ParallelSpec(tp_base=8))),
     "parallel.tp_base"),  # more than 4 query groups
    (lambda: build_plan(_parallel(sequence_parallel=True, tp_base=8)), "parallel.tp_base"),
    (lambda: build_plan(dataclasses.replace(BASE, model=ModelDims(seq_length=10),
                                            parallel=ParallelSpec(tp_base=4,
                                                                  sequence_parallel=True))),
     "model.seq_length"),
    (lambda: build_plan(dataclasses.replace(BASE, health=HealthReport((16,)))),
     "health.failed_gpus"),  # id out of range
    (lambda: build_plan(dataclasses.replace(
        BASE, health=HealthReport(tuple(range(16))))), "health.failed_gpus"),  # nothing left
    (lambda: build_plan(dataclasses.replace(
        BASE, parallel=ParallelSpec(tp_base=4, min_tp=4),
        health=HealthReport(tuple(range(0, 16, 4))))), "health.failed_gpus"),  # below min_tp
    (lambda: build_plan(dataclasses.replace(BASE, global_batch=3)), "global_batch"),
    (lambda: build_plan(_parallel(dp=5)), "parallel.dp"),
    (lambda: build_plan(dataclasses.replace(BASE, world_size=12)), "world_size"),
    (lambda: PlanRequest(cluster=ClusterSpec(8, 8), global_batch=0), "global_batch"),
    (lambda: build_plan(dataclasses.replace(BASE, cluster=ClusterSpec(2, 2),
                                            parallel=ParallelSpec(tp_base=2, pp=2))),
     "cluster.num_gpus"),
    (lambda: build_plan(dataclasses.replace(BASE, replicas=(4, 5))), "nutp.replicas"),
    (lambda: build_plan(dataclasses.replace(BASE, replicas=(4, 3, 2, 1, 1))), "nutp.replicas"),
    (lambda: build_plan(dataclasses.replace(BASE, replicas=(4, 3), health=HealthReport((0, 1)))),
     "nutp.replicas"),  # degree exceeds healthy GPUs
    (lambda: build_plan(dataclasses.replace(BASE, replicas=(4, 3), parallel=ParallelSpec(
        tp_base=4, dp=3))), "parallel.dp"),
    # per-stage explicit replicas (pp=2)
    (lambda: _pp2(((4, 3, 2), (4, 4))), "nutp.replicas"),  # 3 degrees for 2 stages
    (lambda: _pp2(((4,), (4, 4))), "nutp.replicas"),
    (lambda: _pp2(((4, "3"), (4, 4))), "nutp.replicas"),
    (lambda: _pp2(((4, True), (4, 4))), "nutp.replicas"),
    (lambda: _pp2(()), "nutp.replicas"),
    (lambda: _pp2(((4, 0), (4, 4))), "nutp.replicas"),
    (lambda: _pp2(((4, 5), (4, 4))), "nutp.replicas"),  # above tp_base
    (lambda: _pp2(((4, 3), (4, 4)), health=HealthReport((2,))), "nutp.replicas"),  # > healthy
    (lambda: _pp2(((4, 4),) * 5), "nutp.replicas"),  # 10 slices, the cluster has 4
    (lambda: _pp2(((4, 3), (4, 4)), parallel=ParallelSpec(tp_base=4, pp=2, min_tp=4)),
     "nutp.replicas"),  # below min_tp
    (lambda: _pp2(((4, 3), (4, 4)), model=ModelDims(seq_length=16),
                  parallel=ParallelSpec(tp_base=4, pp=2, sequence_parallel=True)),
     "nutp.replicas"),  # 3 does not divide seq_length under sequence parallel
])
def test_validation_names_field(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


# ---------------------------------------------------------------- stragglers (issue #15)
@pytest.mark.parametrize("v", [0.3, 0.6, 0.74, 0.76, 0.9, 0.99])
def test_slow_gpu_keep_or_exclude(v: float) -> None:
    """One slow GPU (speed v) in a TP4 slice: keeping it runs the replica at v x a healthy one;
    excluding it runs it like a replica with that GPU failed (planned here with the GPU in
    ``failed_gpus``). The planner takes the faster and reports both predictions."""
    base = PlanRequest(cluster=ClusterSpec(16, 8), parallel=ParallelSpec(tp_base=4),
                       global_batch=64)
    healthy = build_plan(base)
    failed = build_plan(dataclasses.replace(base, health=HealthReport((1,))))
    s_keep = healthy.replicas[0].speed * v
    s_excl = min(r.speed for r in failed.replicas)
    plan = build_plan(dataclasses.replace(base, health=HealthReport((), {1: v})))
    _check_plan(plan)
    (rep,) = [r for r in plan.replicas if r.straggler]
    assert rep.speed_keep == pytest.approx(s_keep, rel=1e-12)
    assert rep.speed_exclude == pytest.approx(s_excl, rel=1e-12)
    assert rep.straggler == ("keep" if s_keep >= s_excl else "exclude")
    assert rep.speed == pytest.approx(max(s_keep, s_excl), rel=1e-12)
    assert (1 in plan.rank_to_gpu) == (rep.straggler == "keep")
    # Shares follow speed: the optimal apportionment of the batch over the replica speeds.
    speeds = np.array([r.speed for r in plan.replicas])
    assert [r.microbatches for r in plan.replicas] == apportion(speeds, 64).tolist()
    assert rep.microbatches < max(r.microbatches for r in plan.replicas) or v > 0.95
    # Other policies keep the straggler (no choice) but still plan with its speed.
    drop = build_plan(dataclasses.replace(plan.request, policy="drop"))
    assert not any(r.straggler for r in drop.replicas)
    assert min(r.speed for r in drop.replicas) == pytest.approx(s_keep, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(req=plan_requests(), data=st.data())
def test_slow_gpus_keep_invariants(req: PlanRequest, data: st.DataObject) -> None:
    n = req.cluster.num_gpus
    slow = data.draw(st.dictionaries(st.integers(0, n - 1), st.floats(0.05, 1.0), max_size=4))
    plan = _plan_or_none(dataclasses.replace(
        req, health=HealthReport(req.health.failed_gpus, slow)))
    ref = _plan_or_none(req)
    if plan is None or ref is None:
        return
    _check_plan(plan)
    speed = HealthReport(req.health.failed_gpus, slow).gpu_speed(n)
    for r in plan.replicas:
        slowest = min(min(speed[g] for g in gpus) for gpus in r.gpus)
        assert r.speed <= 1.0 + 1e-12
        if req.parallel.pp == 1:  # one stage: never faster than its slowest used GPU
            assert r.speed <= slowest + 1e-12
        if r.straggler:
            assert r.speed >= max(r.speed_keep, r.speed_exclude) - 1e-12
    # Slow GPUs never make the plan predict more than the same health without them.
    assert plan.predicted_throughput <= ref.predicted_throughput + 1e-12
    if req.policy == "nutp":
        drop = _plan_or_none(dataclasses.replace(plan.request, policy="drop"))
        if drop is not None:
            assert plan.predicted_throughput >= drop.predicted_throughput - 1e-12


def test_slow_gpus_validated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad, field in (({1: 0.0}, r"health\.slow_gpus\[1\]"), ({1: 1.5}, r"health\.slow_gpus"),
                       ({-1: 0.5}, r"health\.slow_gpus"), ({True: 0.5}, r"health\.slow_gpus")):
        with pytest.raises(ValueError, match=field):
            HealthReport((), bad)
    with pytest.raises(ValueError, match=r"health\.slow_gpus"):
        build_plan(PlanRequest(cluster=ClusterSpec(8, 8), parallel=ParallelSpec(tp_base=4),
                               health=HealthReport((), {8: 0.5})))
    path = tmp_path / "health.json"
    path.write_text('{"failed_gpus": [3], "slow_gpus": {"5": 0.5, "1": 0.25}}')
    rep = HealthReport.from_file(path)
    assert rep.failed_gpus == (3,) and rep.slow_gpus == ((1, 0.25), (5, 0.5))
    assert rep.gpu_speed(6) == [1.0, 0.25, 1.0, 1.0, 1.0, 0.5]
    path.write_text('{"slow_gpus": [5]}')
    with pytest.raises(ValueError, match=r"health\.slow_gpus"):
        HealthReport.from_file(path)
