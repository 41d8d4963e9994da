"""Issue 35: a whole node lost under the scripts ``nutp sbatch`` renders, on the real Slurm test
cluster (``tests/helpers/slurm_cluster.py``: three slurmd with four fake GPUs each).

Live mode, the default tiny job on two nodes (GPU 7 failed: TP4 on n1's GPUs 0-3, TP3 on n2's
GPUs 4-6). After step ``DOWN_AT`` the test sets the second node DOWN through ``scontrol``, as an
operator or a health checker would: Slurm kills that node's part of the agents' job step (its
agent and, with it, its ranks). The job's and the agents' ``--no-kill`` keep the other node's
agent and ranks; the control process (on the batch host) learns of the lost agent within a few
beats, blames only that node's GPUs, and the survivors are re-laid out live to one TP4 replica:
one ``start`` event, no checkpoint read, every step equal to an uninterrupted single-process
run of stock megatron-core within 1e-5.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemo_nutp.common.ports import free_port
from tests.helpers.live import (
    BASE,
    JOB_TIMEOUT_S,
    TOL,
    check_live,
    check_steps,
    read_events,
    stock_reference,
)
from tests.helpers.slurm_cluster import PARTITION, SlurmCluster
from tests.helpers.slurm_jobs import LIVE, REPO, Watch, render, saved, submit

DOWN_AT = 4  # after the checkpoint of this step (checkpoint.interval=2)
STEPS = 40  # ~0.4 s each here: the loss lands well inside the run


def _hosts(slurm: SlurmCluster, job: str) -> list[str]:
    """The job's nodes in Slurm's order (node id 0 first)."""
    return slurm.run("scontrol", "show", "hostnames", slurm.job(job)["NodeList"]).split()


@dataclass
class Lost:
    """One job that lost node ``hosts[node]`` after the checkpoint of step ``DOWN_AT``."""

    job: str
    hosts: list[str]
    state: dict[str, str]
    text: str  # the job's output file
    new_job: str = ""  # ``resubmitted``: the job an agent resubmitted ``job``'s script as
    new_state: dict[str, str] = field(default_factory=dict)
    new_text: str = ""
    resubmit_s: float = 0.0  # from the crash to the agent's ``control_lost`` event


def _lose_a_node(slurm: SlurmCluster, tmp_path: Path, over: tuple[str, ...], *, node: int,
                 how: str,
                 until: Callable[[SlurmCluster, Path, str], Callable[[], bool]] | None = None,
                 requeue: bool = False, resubmitted: bool = False, **env: str) -> Lost:
    """Render the script for ``over`` (+ ``output.dir``), submit it, and after the checkpoint of
    step ``DOWN_AT`` lose node ``node`` of the job: ``how`` = ``"down"`` (``scontrol update
    State=DOWN``, as an operator or health checker does) or ``"crash"`` (``crash_node``: slurmd
    and the job's processes there SIGKILLed). Then wait until ``until(slurm, out, job)()``
    holds (default: the job ended). ``resubmitted``: then wait for the job an agent
    resubmitted the script as (named in its ``control_lost`` event) to end. The node is
    returned to service after all that, either way."""
    out = tmp_path / "out"
    script = tmp_path / "job.sbatch"
    script.write_text(render((*over, f"output.dir={out}"), master_port=free_port(),
                             partition=PARTITION, account="nutp", repo=str(REPO),
                             job_name="nutp-loss", requeue=requeue))
    job = submit(slurm, script, **env)
    watch = Watch(slurm, job)
    lost = new = None
    new_watch = None
    crashed = 0.0
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(saved(out, DOWN_AT), deadline, f"the checkpoint of step {DOWN_AT}")
        hosts = _hosts(slurm, job)
        lost = hosts[node]
        if how == "down":
            slurm.run("scontrol", "update", f"NodeName={lost}", "State=DOWN", "Reason=test")
        else:
            crashed = time.time()
            assert slurm.crash_node(lost, job), f"no process of the job on {lost}"
        if until is None:
            watch.finish(deadline)
        else:
            watch.until(until(slurm, out, job), deadline, "the end of the test's wait")
        watch.running()
        if resubmitted:  # the old job ends (its record is kept only MinJobAge s), then the new
            watch.finish(deadline)
            (said,) = [e for e in _all_events(out) if e["event"] == "control_lost"]
            m = re.search(r"as job (\d+)", said["requeue"])
            assert m, said
            new = m.group(1)
            new_watch = Watch(slurm, new)
            new_watch.finish(deadline)
    finally:
        slurm.run("scancel", job, *([new] if new else []), check=False)
        if lost is not None and how == "down":
            slurm.run("scontrol", "update", f"NodeName={lost}", "State=RESUME", check=False)
        elif lost is not None:
            slurm.restart_node(lost)
    text = (tmp_path / f"nutp-loss-{job}.out").read_text()
    assert "Traceback" not in text, text[-6000:]
    if until is None:
        assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
            text[-6000:]
    lost_at = Lost(job, hosts, dict(watch.state), text)
    if new_watch is not None:
        lost_at.new_job, lost_at.new_state = new, dict(new_watch.state)
        lost_at.new_text = (tmp_path / f"nutp-loss-{new}.out").read_text()
        assert "Traceback" not in lost_at.new_text, lost_at.new_text[-6000:]
        (said,) = [e for e in _all_events(out) if e["event"] == "control_lost"]
        lost_at.resubmit_s = said["t"] - crashed
    return lost_at


def _exact(over: tuple[str, ...], tmp_path: Path, steps: int = STEPS) -> list[dict]:
    """Every step of the job equal to an uninterrupted one-process run of stock megatron-core
    (within 1e-5; clipping on); the metric rows."""
    return check_steps(tmp_path / "out", stock_reference(over, steps, tmp_path), TOL)


LIVE_JOB = (*BASE, *LIVE, f"train.steps={STEPS}")
REQUEUE_STEPS = 20  # the resubmitted run trains 16 of them: the time goes to waiting for Slurm
REQUEUE_JOB = (*BASE, *LIVE, f"train.steps={REQUEUE_STEPS}")
FAULT_AT = DOWN_AT + 6  # the first run is lost before this step; a requeued run fires no fault
RESTART_JOB = ("train.seed=7", "train.global_batch_size=12", "train.micro_batch_size=2",
               "train.clip_grad=0.5", "recovery.enabled=true", *LIVE, f"train.steps={STEPS}")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_node_set_down_is_relaid_out_live(slurm: SlurmCluster, tmp_path: Path) -> None:
    r = _lose_a_node(slurm, tmp_path, LIVE_JOB, node=1, how="down", NUTP_LIVE_DIGEST="1")
    (move,) = check_live(read_events(tmp_path / "out"), relayouts=1)
    assert move["gpus"] == [4, 5, 6], move  # only the lost node's GPUs are blamed
    assert move["reason"] == f"node agent {r.hosts[1]} lost", move  # by its Slurm name
    layouts = [row["replica_tp"] for row in _exact(LIVE_JOB, tmp_path)]
    assert layouts[0] == [[4], [3]] and layouts[-1] == [[4]], layouts
    print(f"slurm node down after step {DOWN_AT}: relayout_s {move['relayout_s']:.2f}")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_node_of_rank_0_crashed_while_the_control_runs_elsewhere(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    """Three nodes, the first one's GPUs reported failed: the batch host (n1, node 0) runs the
    control process and an idle agent, rank 0 runs on the second node, the other replica on the
    third. After step ``DOWN_AT`` the second node crashes as a machine does: its slurmd and
    every process of the job on it are SIGKILLed (``SlurmCluster.crash_node``; slurmctld learns
    of it only after ``SlurmdTimeout``, the control process from the agent's silence). The
    survivors -- none of them rank 0 -- are re-laid out live to one TP4 replica, exactly."""
    over = (*LIVE_JOB, "cluster.num_gpus=12", "health.failed_gpus=[0,1,2,3]")
    r = _lose_a_node(slurm, tmp_path, over, node=1, how="crash", NUTP_LIVE_DIGEST="1")
    ev = read_events(tmp_path / "out")
    (start,) = [e for e in ev if e["event"] == "start"]
    assert start["replica_tp"] == [[4], [4]] and start["failed_gpus"] == [0, 1, 2, 3], start
    (move,) = check_live(ev, relayouts=1)
    assert move["ranks"] == [0, 1, 2, 3] and move["gpus"] == [4, 5, 6, 7], move
    assert move["reason"] == f"node agent {r.hosts[1]} lost", move
    layouts = [row["replica_tp"] for row in _exact(over, tmp_path)]
    assert layouts[0] == [[4], [4]] and layouts[-1] == [[4]], layouts
    print(f"slurm node of rank 0 crashed after step {DOWN_AT}: relayout_s "
          f"{move['relayout_s']:.2f}")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_restart_kill_then_node_set_down_continues_on_fewer_nodes(slurm: SlurmCluster,
                                                                  tmp_path: Path) -> None:
    """Restart mode (the script's srun loop), two nodes (GPU 7 failed: TP4+TP3). Attempt 0:
    rank 1 is killed at step 1 -> attempt 1 re-plans TP3+TP3. After attempt 1 saved step
    ``DOWN_AT``, the second node is set DOWN: Slurm removes it from the (``--no-kill``) job and
    ends the attempt's step; attempt 2 runs on the one node left -- Slurm now numbers it alone,
    but GPUs are keyed by host name, so GPU 1 stays the failed one, the lost node's GPUs are
    failed and blamed as "node <name> lost" -- and resumes from the newest checkpoint at TP3.
    Every step equals an uninterrupted single-process run of stock megatron-core."""
    r = _lose_a_node(slurm, tmp_path, RESTART_JOB, node=1, how="down",
                     NUTP_FAULT="kill:rank=1:step=1")
    ev = read_events(tmp_path / "out")
    starts = [e for e in ev if e["event"] == "start"]
    assert [s["replica_tp"] for s in starts] == [[[4], [3]], [[3], [3]], [[3]]], starts
    assert starts[2]["failed_gpus"] == [1, 4, 5, 6, 7], starts
    kill, lost = [e for e in ev if e["event"] == "failure"]
    assert kill["gpus"] == [1], kill
    assert lost["gpus"] == [4, 5, 6], lost  # rank 3 on GPU 4 ... : only the lost node's
    assert lost["reason"] == f"node {r.hosts[1]} lost (not in this attempt's allocation)", lost
    assert "attempt 1 failed" in r.text and "attempt 2 failed" not in r.text, r.text[-3000:]
    assert _exact(RESTART_JOB, tmp_path)[-1]["replica_tp"] == [[3]]


def _all_events(out: Path) -> list[dict]:
    """The events of every run in ``out``: the runs before (``recovery/prev-*/``, archived by
    the run after them), then this one."""
    files = [*sorted((out / "recovery").glob("prev-*/events.jsonl")),
             out / "recovery" / "events.jsonl"]
    return [json.loads(x) for f in files if f.exists() for x in f.read_text().splitlines()]


def _resubmitted(slurm: SlurmCluster, out: Path, job: str) -> Callable[[], bool]:
    """An agent logged that it resubmitted ``job``'s script (``control_lost``)."""
    return lambda: any(e["event"] == "control_lost" and "as job" in e["requeue"]
                       for e in _all_events(out))


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_batch_host_lost_the_resubmitted_job_resumes_exactly(slurm: SlurmCluster,
                                                                  tmp_path: Path) -> None:
    """The batch host (node 0: it runs the control process) crashes after step ``DOWN_AT``.
    Slurm neither ends nor requeues a ``--no-kill`` job whose batch host fails (22.05: it kills
    the batch step and the job sits allocated), and a job that ``scontrol requeue`` gives a new
    allocation after losing a node cannot start GPU job steps on 22.05 (``_step_get_gres_cnt
    ... node offset invalid``). So the other node's agent (``nutp sbatch --requeue``), finding
    the control store gone, stops its ranks, resubmits the job's script as a fresh job
    (``NUTP_REQUEUED=1``, after the old job has ended) and cancels the old job. The new job
    runs on the two nodes Slurm has left -- never the crashed one -- carries GPU 7's failure
    over with its host (now Slurm node 0's GPU 3), fires no fault again, resumes from the
    newest checkpoint, and every step equals an uninterrupted single-process run of stock
    megatron-core within 1e-5. A kill injected for step ``FAULT_AT`` (which the first run does
    not reach) does not fire in the new run. No traceback in either job's output."""
    r = _lose_a_node(slurm, tmp_path, REQUEUE_JOB, node=0, how="crash", until=_resubmitted,
                     requeue=True, resubmitted=True, NUTP_FAULT=f"kill:rank=1:step={FAULT_AT}")
    out = tmp_path / "out"
    ev = _all_events(out)
    # the agent's own lines went out through the srun on the batch host: its event says it
    (lost,) = [e for e in ev if e["event"] == "control_lost"]
    assert (lost["node"], lost["host"]) == (1, r.hosts[1]), lost
    assert lost["requeue"].startswith(f"resubmitted job {r.job}'s script as job {r.new_job} "
                                      "(run 2;"), lost
    assert r.state["JobState"] == "CANCELLED", r.state  # the old job, ended by the agent
    assert r.new_state["JobState"] == "COMPLETED" and r.new_state["ExitCode"] == "0:0", \
        r.new_text[-6000:]
    new_hosts = _hosts(slurm, r.new_job)
    assert r.hosts[0] not in new_hosts and r.hosts[1] in new_hosts, (r.hosts, new_hosts)
    # the first run's newest checkpoint (written before the crash) is where the new run resumed
    saves = [e["step"] for e in ev[:ev.index(lost)] if e["event"] == "checkpoint"]
    assert max(saves) >= DOWN_AT, saves
    now = read_events(out)  # the new run's own events
    (requeued,) = [e for e in now if e["event"] == "requeued"]
    assert requeued["run"] == 1 and requeued["hosts"] == new_hosts, requeued
    (start,) = [e for e in now if e["event"] == "start"]
    # GPU 7 (n2's GPU 3) is failed: n2 is Slurm node 0 of the new job, so GPU 3 -- no other
    assert requeued["failed_gpus"] == start["failed_gpus"] == [3], (requeued, start)
    (resumed,) = [e for e in now if e["event"] == "resumed"]
    assert resumed["step"] == max(saves) and Path(resumed["checkpoint"]).name == \
        f"iter_{max(saves):07d}", (resumed, saves)
    # the kill injected at step FAULT_AT (the first run did not get there) does not fire
    assert [e for e in ev if e["event"] in ("failure", "live_relayout", "fault")] == [], ev
    assert (f"requeued run 1 on {', '.join(new_hosts)}: failed GPUs [3] (carried over with "
            "their hosts)") in r.new_text, r.new_text[-3000:]
    rows = _exact(REQUEUE_JOB, tmp_path, REQUEUE_STEPS)
    assert rows[0]["replica_tp"] == [[4], [3]] and rows[-1]["replica_tp"] == [[4], [3]], rows
    print(f"slurm batch host crashed after step {DOWN_AT}: job {r.new_job} resumed at step "
          f"{resumed['step']} on {', '.join(new_hosts)} {r.resubmit_s:.1f} s after the crash")


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_spare_node_takes_a_failed_slice(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``recovery.spares=1`` on all three nodes: n1 and n2 train TP4+TP4, n3's agent starts the
    spare slice's four standby processes (imported, connected to the control process). Rank 1
    (n1) is killed in step 2's forward: one live re-layout swaps n1's slice for the spare node,
    the layout stays [[4],[4]], no process starts inside the transition (the new world's
    processes all existed before), every step equal to stock megatron-core within 1e-5."""
    steps = 8
    out = tmp_path / "out"
    over = (*BASE, *LIVE, "health=none", "cluster.num_gpus=12", "parallel.tp_base=4",
            "recovery.spares=1", f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(render(over, master_port=free_port(), partition=PARTITION,
                             account="nutp", repo=str(REPO), job_name="nutp-spare"))
    job = submit(slurm, script, NUTP_FAULT="kill:rank=1:step=2:phase=forward",
                 NUTP_LIVE_DIGEST="1")
    watch = Watch(slurm, job)
    try:
        watch.finish(time.monotonic() + JOB_TIMEOUT_S)
    finally:
        slurm.run("scancel", job, check=False)
    text = (tmp_path / f"nutp-spare-{job}.out").read_text()
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    assert _hosts(slurm, job) == ["n1", "n2", "n3"]
    rows = check_steps(out, stock_reference(over, steps, tmp_path), TOL)
    ev = read_events(out)
    standby = [e for e in ev if e["event"] == "agent_standby"]
    assert sorted((e["node"], e["gpu"]) for e in standby) == [(2, g) for g in range(8, 12)]
    (world,) = [e for e in ev if e["event"] == "live_world"]
    (swap,) = [e for e in ev if e["event"] == "live_relayout"]
    assert swap["spares_used"] == [[8, 9, 10, 11]] and swap["replica_tp"] == [[4], [4]], swap
    assert swap["processes_started"] == 0 and swap["gpus"] == [1], swap
    assert set(swap["pids"]) <= set(world["pids"]) | {e["pid"] for e in standby}, swap
    assert all(r["replica_tp"] == [[4], [4]] for r in rows)
    assert [e["event"] for e in ev].count("start") == 1
