"""Pure recovery decisions (no processes): blame, next health, job re-plan, lost steps, planned
restarts for GPUs reported back."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from nemo_nutp.common.events import read_events
from nemo_nutp.config import load_config, plan_request
from nemo_nutp.health.decisions import (
    Activity,
    Progress,
    blame_exits,
    blame_hang,
    exit_words,
    hang_roots,
    is_comm_wait,
    job_for,
    lost_code,
    lost_steps,
    next_failed,
    returned_gpus,
    scale_up_blocker,
    scale_up_due,
    waits_for,
)
from nemo_nutp.health.watch import HealthWatch as _HealthWatch
from nemo_nutp.health.watch import ScaleUp
from nemo_nutp.health.watch import summary as _summary
from nemo_nutp.layout import build_plan


def test_signal_killed_rank_is_blamed_not_its_peers() -> None:
    f = blame_exits({0: 1, 1: -9, 2: None, 3: 1})
    assert f is not None and f.ranks == (1,) and "signal 9" in f.reason
    f = blame_exits({0: None, 1: 1})
    assert f is not None and f.ranks == (1,)
    assert blame_exits({0: None, 1: 0}) is None
    assert not f.bad_input
    f = blame_exits({0: 2, 1: 2, 2: None})  # bad input (train/worker.py): stop, do not restart
    assert f is not None and f.bad_input and f.ranks == (0, 1)
    f = blame_exits({0: 2, 1: 1})
    assert f is not None and not f.bad_input


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


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def test_hang_with_equal_heartbeats_blames_the_rank_not_blocked_in_a_collective() -> None:
    # Real timing (seen in the spawned test): the hung rank writes "start 5" and then hangs;
    # its peers write the same "start 5" within milliseconds and block in its collectives.
    beats = {r: Progress("start", 5, 100.0 + 0.001 * r) for r in range(4)}
    kw: dict[str, Any] = dict(now=106.0, timeout_s=5, started_at=0, startup_timeout_s=50)
    f = blame_hang(beats, **kw)
    assert f is not None and f.ranks == ()  # step heartbeats alone cannot tell
    seen = {0: Activity(True, 100.1, 105.8), 1: Activity(False, 100.1, 105.9),
            2: Activity(True, 100.2, 105.7), 3: Activity(True, 100.0, 105.6)}
    f = blame_hang(beats, activity=seen, **kw)
    assert f is not None and f.ranks == (1,) and "hung" in f.reason
    # a watcher that fell silent for the timeout does not vouch for its rank
    silent = {**seen, 1: Activity(True, 100.1, 105.9), 3: Activity(True, 100.0, 100.5)}
    f = blame_hang(beats, activity=silent, **kw)
    assert f is not None and f.ranks == (3,)
    # all blocked in collectives: no rank to blame (restart the same layout)
    waiting = {r: Activity(True, 100.0, 105.9) for r in range(4)}
    f = blame_hang(beats, activity=waiting, **kw)
    assert f is not None and f.ranks == ()


def test_collective_counts_blame_the_root_of_a_chain_not_its_victims() -> None:
    # TP {0,1} {2,3}, DP {0,2} {1,3}; rank 0 hangs before its TP collective of trial 5: rank 1
    # blocks in TP, rank 2 in DP with 0, rank 3 in DP with 1 (a victim of a victim).
    tp01, tp23, dp02, dp13 = "1:0,1", "2:2,3", "3:0,2", "4:1,3"
    counts = {0: {tp01: 5, dp02: 5}, 1: {tp01: 6, dp13: 5}, 2: {tp23: 6, dp02: 6},
              3: {tp23: 6, dp13: 6}}
    assert waits_for(counts) == {0: set(), 1: {0}, 2: {0}, 3: {1}}
    assert hang_roots(counts) == (0,)
    beats = {r: Progress("start", 5, 100.0) for r in range(4)}
    # the activity rule alone would blame 2 and 3 (waiting in threading, not in a collective)
    acts = {0: Activity(False, 100.0, 105.9), 1: Activity(True, 100.0, 105.9),
            2: Activity(False, 100.0, 105.9), 3: Activity(False, 100.0, 105.9)}
    kw: dict[str, Any] = dict(now=106.0, timeout_s=5, started_at=0, startup_timeout_s=50)
    assert blame_hang(beats, activity=acts, **kw).ranks == (0, 2, 3)  # type: ignore[union-attr]
    f = blame_hang(beats, activity=acts, collectives=counts, **kw)
    assert f is not None and f.ranks == (0,) and "behind" in f.reason
    # a group never entered by a member counts as 0 for it; a silent reporter is not judged
    assert hang_roots({0: {}, 1: {tp01: 1}, 2: None}) == (0,)
    # all inside one collective, or a cycle: no root (the activity rule decides)
    assert hang_roots({r: {tp01: 3} for r in (0, 1)}) == ()
    assert hang_roots({0: {tp01: 2, "9:0,1": 1}, 1: {tp01: 1, "9:0,1": 2}}) == ()


def test_recent_activity_is_progress_so_a_long_save_is_not_a_hang() -> None:
    beats = {r: Progress("done", 3, 100.0) for r in range(3)}
    busy = {0: Activity(False, 108.0, 108.2), 1: Activity(True, 100.3, 108.1),
            2: Activity(True, 100.3, 108.1)}
    kw: dict[str, Any] = dict(timeout_s=5, started_at=0, startup_timeout_s=50)
    assert blame_hang(beats, now=108.5, activity=busy, **kw) is None
    later = {r: Activity(a.waiting, a.changed_t, 113.3) for r, a in busy.items()}
    f = blame_hang(beats, now=113.5, activity=later, **kw)  # rank 0 stopped changing too
    assert f is not None and f.ranks == (0,)
    # inside a step activity is no excuse: a rank spinning without finishing its step hangs
    spinning = {r: Progress("start", 4, 100.0) for r in range(3)}
    f = blame_hang(spinning, now=108.5, activity=busy, **kw)
    assert f is not None and f.ranks == (0,)


def test_comm_wait_is_a_collective_or_a_work_wait() -> None:
    assert is_comm_wait(C10D, "        work.wait()")
    assert is_comm_wait("/x/nemo_nutp/sync/engine.py", "                sh.reduce_work.wait()")
    assert not is_comm_wait("/x/nemo_nutp/checkpoint/faults.py", "        time.sleep(3600)")
    assert not is_comm_wait("/x/multiprocessing/connection.py", "        buf = self._recv(4)")


def test_gpus_back_only_when_the_report_lists_a_strict_subset() -> None:
    assert returned_gpus(frozenset({1, 7}), frozenset({7})) == {1}
    assert returned_gpus(frozenset({7}), frozenset()) == {7}
    assert returned_gpus(frozenset({7}), frozenset({7})) == frozenset()
    assert returned_gpus(frozenset({7}), frozenset({2})) == frozenset()  # also a new failure
    assert returned_gpus(frozenset({7}), frozenset({2, 7})) == frozenset()
    assert returned_gpus(frozenset({7}), None) == frozenset()  # unreadable report


def test_planned_restart_waits_for_a_newer_checkpoint_before_the_end() -> None:
    assert not scale_up_due(base_step=2, latest_step=2, total_steps=10)
    assert scale_up_due(base_step=2, latest_step=4, total_steps=10)
    assert not scale_up_due(base_step=None, latest_step=None, total_steps=10)
    assert scale_up_due(base_step=None, latest_step=2, total_steps=10)
    assert not scale_up_due(base_step=8, latest_step=10, total_steps=10)  # training is over
    assert scale_up_blocker(load_config(["checkpoint.interval=2"])) is None
    assert "off" in (scale_up_blocker(load_config([])) or "")
    no_resume = load_config(["checkpoint.interval=2", "checkpoint.resume=false"])
    assert "resume" in (scale_up_blocker(no_resume) or "")


def test_summary_has_one_entry_per_restart_planned_ones_included() -> None:
    events = [
        {"t": 10.0, "event": "fault", "kind": "hang", "rank": 5, "step": 5},
        {"t": 16.0, "event": "failure", "cause": "hang", "ranks": [5], "gpus": [5],
         "reason": "hung", "lost_steps": 1, "resume_step": 4},
        {"t": 30.0, "event": "resumed", "step": 4, "replica_tp": [[4], [2]]},
        {"t": 40.0, "event": "scale_up_requested", "gpus": [5], "base_step": 6},
        {"t": 42.5, "event": "scale_up", "gpus": [5], "reason": "GPU back", "requested_at": 40.0,
         "step": 8, "lost_steps": 0, "resume_step": 8},
        {"t": 60.0, "event": "resumed", "step": 8, "replica_tp": [[4], [3]]},
    ]
    hang, back = _summary(events)
    assert (hang["cause"], hang["detect_s"], hang["restart_s"], hang["resume_step"]) == (
        "hang", 6.0, 14.0, 4)
    assert (back["cause"], back["gpus"], back["detect_s"], back["restart_s"]) == (
        "gpu_back", [5], 2.5, 17.5)
    assert back["replica_tp"] == [[4], [3]] and back["lost_steps"] == 0


def _fake_checkpoint(root: Path, step: int) -> None:
    d = root / f"iter_{step:07d}"
    d.mkdir(parents=True)
    for name in ("metadata.json", ".metadata"):  # what makes a megatron checkpoint complete
        (d / name).write_text("{}")
    (d / "nutp_checkpoint.json").write_text(json.dumps({"step": step}))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")


def test_health_watch_restarts_only_after_a_newer_checkpoint(tmp_path: Path) -> None:
    cfg = load_config([f"output.dir={tmp_path}", "checkpoint.interval=2", "train.steps=10"])
    failed = frozenset(cfg.health.as_report().failed_gpus)
    plan = build_plan(plan_request(cfg))
    rdir, root = tmp_path / "recovery", Path(str(cfg.checkpoint_dir))
    rdir.mkdir()
    health = rdir / "health.json"
    health.write_text(json.dumps({"failed_gpus": sorted(failed)}))
    console = Console(file=io.StringIO(), width=200)
    watch = _HealthWatch(cfg, cfg, plan, failed, rdir, console)
    _fake_checkpoint(root, 2)
    assert watch.poll(0.0) is None  # nothing reported back
    health.write_text(json.dumps({"failed_gpus": []}))
    assert watch.poll(1.0) is None  # reported back; checkpoint 2 already existed
    assert watch.poll(1.5) is None
    _fake_checkpoint(root, 4)
    assert watch.poll(1.6) == ScaleUp(tuple(sorted(failed)), 1.0, 4)
    (req,) = [e for e in read_events(rdir / "events.jsonl") if e["event"] == "scale_up_requested"]
    assert req["base_step"] == 2 and req["world_size"] == plan.world_size + len(failed)
    # reported failed again before the restart: cancelled
    health.write_text(json.dumps({"failed_gpus": sorted(failed)}))
    assert watch.poll(3.0) is None
    _fake_checkpoint(root, 6)
    assert watch.poll(3.1) is None


def test_health_watch_without_resume_uses_the_gpus_at_the_next_restart(tmp_path: Path) -> None:
    cfg = load_config([f"output.dir={tmp_path}", "checkpoint.interval=2",
                       "checkpoint.resume=false"])
    failed = frozenset(cfg.health.as_report().failed_gpus)
    rdir = tmp_path / "recovery"
    rdir.mkdir()
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": []}))
    out = io.StringIO()
    watch = _HealthWatch(cfg, cfg, build_plan(plan_request(cfg)), failed, rdir,
                         Console(file=out, width=200))
    _fake_checkpoint(Path(str(cfg.checkpoint_dir)), 2)
    assert watch.poll(0.0) is None
    _fake_checkpoint(Path(str(cfg.checkpoint_dir)), 4)
    assert watch.poll(1.0) is None and watch.poll(2.0) is None
    (ev,) = [e for e in read_events(rdir / "events.jsonl") if e["event"] == "gpu_back"]
    assert "resume" in ev["deferred"] and "next restart" in out.getvalue()


def test_slow_start_with_activity_is_not_a_hang() -> None:
    """Loading a large checkpoint before the first step: busy ranks keep the world alive past
    ``startup_timeout_s``; a start-up with no activity for ``timeout_s`` still fails."""
    none = {0: None, 1: None}
    busy = {0: Activity(False, 395.0, 399.0), 1: Activity(True, 100.0, 399.0)}
    kw = dict(now=400.0, timeout_s=30.0, started_at=0.0, startup_timeout_s=300.0)
    assert blame_hang(none, **kw, activity=busy) is None
    idle = {0: Activity(True, 100.0, 399.0), 1: Activity(True, 100.0, 399.0)}
    f = blame_hang(none, **kw, activity=idle)
    assert f is not None and f.ranks == () and "no heartbeat" in f.reason
    assert blame_hang(none, **kw) is not None  # without watcher reports: the limit alone


def test_straggler_relayout_and_job_for_keep_the_health_report() -> None:
    from nemo_nutp.health.decisions import straggler_relayout

    ev = [{"t": 5.0, "event": "relayout_requested", "slow_gpus": {"1": 0.25}},
          {"t": 9.0, "event": "checkpoint"}]
    assert straggler_relayout(ev, since=6.0) is None  # an earlier attempt's request
    assert straggler_relayout(ev, since=1.0) == {1: 0.25}
    cfg = load_config(["health.failed_gpus=[7]", "health.slow_gpus={2: 0.5}",
                       "nutp.replicas=[4,3]"])
    assert job_for(cfg, frozenset({7})) is cfg and job_for(cfg, frozenset({7}), {}) is cfg
    job = job_for(cfg, frozenset({7}), {1: 0.25})
    assert dict(job.health.as_report().slow_gpus) == {1: 0.25, 2: 0.5}
    assert job.health.as_report().failed_gpus == (7,) and job.nutp.replicas is None


def test_exit_reasons_are_words_and_a_lost_agent_is_not_a_signal() -> None:
    """Issue 35: every rank of a lost node was reported "killed by signal 32768" (the lost
    sentinel printed as a signal)."""
    f = blame_exits({0: None, 1: lost_code(2), 2: lost_code(2), 3: 1})
    assert f is not None and f.ranks == (1, 2) and f.reason == "node agent 2 lost"
    assert "signal" not in f.reason
    f = blame_exits({0: -9, 1: lost_code(0)})
    assert f is not None and f.ranks == (0, 1)
    assert f.reason == "rank 0: killed by signal 9 (SIGKILL); rank 1: node agent 0 lost"
    f = blame_exits({0: 1, 1: 3, 2: None})
    assert f is not None and f.reason == "rank 0: exit code 1; rank 1: exit code 3"
    assert exit_words(-15) == "killed by signal 15 (SIGTERM)" and exit_words(7) == "exit code 7"
    # with the host's node names (the agents' Slurm names), the node is named
    f = blame_exits({0: None, 1: lost_code(1), 2: lost_code(1)}, ("n1", "n2"))
    assert f is not None and f.reason == "node agent n2 lost"
    assert exit_words(lost_code(3), ("n1", "n2")) == "node agent 3 lost"  # unnamed: its index
