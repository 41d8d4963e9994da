"""Pure recovery decisions (no processes): blame, next health, job re-plan, lost steps."""

from __future__ import annotations

from nemo_nutp.config import load_config, plan_request
from nemo_nutp.launch.recovery import (
    Progress,
    blame_exits,
    blame_hang,
    job_for,
    lost_steps,
    next_failed,
)
from nemo_nutp.layout import build_plan


def test_signal_killed_rank_is_blamed_not_its_peers() -> None:
    f = blame_exits({0: 1, 1: -9, 2: None, 3: 1})
    assert f is not None and f.ranks == (1,) and "signal 9" in f.reason
    f = blame_exits({0: None, 1: 1})
    assert f is not None and f.ranks == (1,)
    assert blame_exits({0: None, 1: 0}) is None


def test_hung_rank_is_the_one_that_progressed_least() -> None:
    p = {0: Progress("start", 5, 100.0), 1: Progress("done", 4, 99.0),
         2: Progress("start", 5, 100.0)}
    assert blame_hang(p, now=105.0, timeout_s=10, started_at=0, startup_timeout_s=50) is None
    f = blame_hang(p, now=111.0, timeout_s=10, started_at=0, startup_timeout_s=50)
    assert f is not None and f.ranks == (1,)
    same = {r: Progress("start", 5, 100.0) for r in range(3)}
    f = blame_hang(same, now=111.0, timeout_s=10, started_at=0, startup_timeout_s=50)
    assert f is not None and f.ranks == ()
    none = {0: None, 1: None}
    assert blame_hang(none, now=10, timeout_s=1, started_at=0, startup_timeout_s=50) is None
    f = blame_hang(none, now=60, timeout_s=1, started_at=0, startup_timeout_s=50)
    assert f is not None and f.ranks == ()


def test_health_report_returns_gpus_and_failures_add_them() -> None:
    assert next_failed(frozenset({7}), (1,), None) == {1, 7}
    assert next_failed(frozenset({1, 7}), (), frozenset({7})) == {7}  # GPU 1 reported back
    assert next_failed(frozenset({1, 7}), (2,), frozenset({1, 7})) == {1, 2, 7}


def test_replan_drops_affected_replica_degree_and_returns_to_full_layout() -> None:
    cfg = load_config([])  # 8 GPUs in two domains of 4, GPU 7 failed: TP4 + TP3
    assert [r.tp for r in build_plan(plan_request(cfg)).replicas] == [(4,), (3,)]
    degraded = job_for(cfg, frozenset({1, 7}))
    assert [r.tp for r in build_plan(plan_request(degraded)).replicas] == [(3,), (3,)]
    full = job_for(cfg, frozenset())
    assert [r.tp for r in build_plan(plan_request(full)).replicas] == [(4,), (4,)]
    assert job_for(cfg, frozenset({7})) is cfg
    pinned = load_config(["nutp.replicas=[4,3]"])
    assert job_for(pinned, frozenset({0, 7})).nutp.replicas is None


def test_lost_steps_at_most_the_interval() -> None:
    assert lost_steps(4, 4) == 1  # step 4 completed, checkpoint after 4 steps: redo step 4
    assert lost_steps(3, 4) == 0
    assert lost_steps(None, 0) == 0
