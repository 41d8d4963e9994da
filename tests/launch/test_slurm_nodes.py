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

import time
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
from tests.helpers.slurm_jobs import LIVE, REPO, Watch, has_event, render, saved, submit

DOWN_AT = 4  # after the checkpoint of this step (checkpoint.interval=2)
STEPS = 40  # ~0.4 s each here: the loss lands well inside the run


def _hosts(slurm: SlurmCluster, job: str) -> list[str]:
    """The job's nodes in Slurm's order (node id 0 first)."""
    return slurm.run("scontrol", "show", "hostnames", slurm.job(job)["NodeList"]).split()


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_node_set_down_is_relaid_out_live(slurm: SlurmCluster, tmp_path: Path) -> None:
    steps = STEPS
    out = tmp_path / "out"
    over = (*BASE, *LIVE, f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(render(over, master_port=free_port(), partition=PARTITION,
                             account="nutp", repo=str(REPO), job_name="nutp-down"))
    job = submit(slurm, script, NUTP_LIVE_DIGEST="1")
    watch = Watch(slurm, job)
    down = None
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(saved(out, DOWN_AT), deadline, f"the checkpoint of step {DOWN_AT}")
        down = _hosts(slurm, job)[1]
        slurm.run("scontrol", "update", f"NodeName={down}", "State=DOWN", "Reason=nutp-test")
        watch.until(has_event(out, "live_relayout"), deadline, "live_relayout")
        watch.finish(deadline)
    finally:
        slurm.run("scancel", job, check=False)
        if down is not None:
            slurm.run("scontrol", "update", f"NodeName={down}", "State=RESUME", check=False)
    text = (tmp_path / f"nutp-down-{job}.out").read_text()
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
        text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    ev = read_events(out)
    (move,) = check_live(ev, relayouts=1)
    assert move["gpus"] == [4, 5, 6], move  # only the lost node's GPUs are blamed
    assert move["reason"] == f"node agent {down} lost", move  # in words, by its Slurm name
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    layouts = [r["replica_tp"] for r in rows]
    assert layouts[0] == [[4], [3]] and layouts[-1] == [[4]], layouts
    print(f"slurm node down after step {DOWN_AT}: relayout_s {move['relayout_s']:.2f}, "
          f"detected {move.get('detect_s')}")


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
    steps = STEPS
    out = tmp_path / "out"
    over = (*BASE, *LIVE, "cluster.num_gpus=12", "health.failed_gpus=[0,1,2,3]",
            f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(render(over, master_port=free_port(), partition=PARTITION,
                             account="nutp", repo=str(REPO), job_name="nutp-crash"))
    job = submit(slurm, script, NUTP_LIVE_DIGEST="1")
    watch = Watch(slurm, job)
    crashed = None
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(saved(out, DOWN_AT), deadline, f"the checkpoint of step {DOWN_AT}")
        crashed = _hosts(slurm, job)[1]
        assert slurm.crash_node(crashed, job), f"no process of the job on {crashed}"
        watch.until(has_event(out, "live_relayout"), deadline, "live_relayout")
        watch.finish(deadline)
    finally:
        slurm.run("scancel", job, check=False)
        if crashed is not None:
            slurm.restart_node(crashed)
    text = (tmp_path / f"nutp-crash-{job}.out").read_text()
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
        text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    ev = read_events(out)
    (start,) = [e for e in ev if e["event"] == "start"]
    assert start["replica_tp"] == [[4], [4]] and start["failed_gpus"] == [0, 1, 2, 3], start
    (move,) = check_live(ev, relayouts=1)
    assert move["ranks"] == [0, 1, 2, 3] and move["gpus"] == [4, 5, 6, 7], move
    assert move["reason"] == f"node agent {crashed} lost", move
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    layouts = [r["replica_tp"] for r in rows]
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
    steps = STEPS
    out = tmp_path / "out"
    over = ("train.seed=7", "train.global_batch_size=12", "train.micro_batch_size=2",
            "train.clip_grad=0.5", "recovery.enabled=true", *LIVE,
            f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(render(over, master_port=free_port(), partition=PARTITION,
                             account="nutp", repo=str(REPO), job_name="nutp-rdown"))
    job = submit(slurm, script, NUTP_FAULT="kill:rank=1:step=1")
    watch = Watch(slurm, job)
    down = None
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(saved(out, DOWN_AT), deadline, f"the checkpoint of step {DOWN_AT}")
        down = _hosts(slurm, job)[1]
        slurm.run("scontrol", "update", f"NodeName={down}", "State=DOWN", "Reason=nutp-test")
        watch.finish(deadline)
    finally:
        slurm.run("scancel", job, check=False)
        if down is not None:
            slurm.run("scontrol", "update", f"NodeName={down}", "State=RESUME", check=False)
    text = (tmp_path / f"nutp-rdown-{job}.out").read_text()
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
        text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    ev = read_events(out)
    starts = [e for e in ev if e["event"] == "start"]
    assert [s["replica_tp"] for s in starts] == [[[4], [3]], [[3], [3]], [[3]]], starts
    assert starts[2]["failed_gpus"] == [1, 4, 5, 6, 7], starts
    kill, lost = [e for e in ev if e["event"] == "failure"]
    assert kill["gpus"] == [1], kill
    assert lost["gpus"] == [4, 5, 6], lost  # rank 3 on GPU 4 ... : only the lost node's
    assert lost["reason"] == f"node {down} lost (not in this attempt's allocation)", lost
    assert "attempt 1 failed" in text and "attempt 2 failed" not in text, text[-3000:]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)
    assert rows[-1]["replica_tp"] == [[3]], rows[-1]


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_live_batch_host_lost_is_requeued_by_the_agents_left(slurm: SlurmCluster,
                                                            tmp_path: Path) -> None:
    """The batch host (it runs the control process) crashes after step ``DOWN_AT``. Slurm
    neither ends nor requeues a ``--no-kill`` job whose batch host fails (22.05: it kills the
    batch step and the job sits allocated), so the other node's agent, finding the control
    store gone, stops its ranks and asks Slurm to requeue the job (``nutp sbatch --requeue``:
    ``scontrol requeue``). The job is requeued onto the nodes Slurm has (the crashed one is
    DOWN), with the first run's output kept (``--open-mode=append``) and its newest checkpoint
    intact.

    Not here: the requeued run training to the end. On Slurm 22.05 a requeued job that lost a
    node cannot create GPU job steps ("Invalid generic resource (gres) specification";
    slurmctld: ``_step_get_gres_cnt ... node offset invalid``), a Slurm bug; the carry-over
    of the health report and node table is tested without Slurm
    (``tests/train/test_elastic.py``, ``tests/health/test_nodes.py``)."""
    steps = STEPS
    out = tmp_path / "out"
    over = (*BASE, *LIVE, f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(render(over, master_port=free_port(), partition=PARTITION,
                             account="nutp", repo=str(REPO), job_name="nutp-requeue",
                             requeue=True))
    job = submit(slurm, script)
    watch = Watch(slurm, job)
    crashed = None
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(saved(out, DOWN_AT), deadline, f"the checkpoint of step {DOWN_AT}")
        hosts = _hosts(slurm, job)
        crashed = hosts[0]
        assert slurm.crash_node(crashed, job)
        watch.until(lambda: int(slurm.job(job).get("Restarts", 0)) >= 1, deadline, "a requeue")
        watch.until(has_event(out, "control_lost"), deadline, "the agent's control_lost")
        state = slurm.job(job)
        text = (tmp_path / f"nutp-requeue-{job}.out").read_text()
    finally:
        slurm.run("scancel", job, check=False)
        if crashed is not None:
            slurm.restart_node(crashed)
    # the agent's own lines went out through the srun on the batch host: its event says it
    (lost,) = [e for e in read_events(out) if e["event"] == "control_lost"]
    assert (lost["node"], lost["host"]) == (1, hosts[1]), lost
    assert lost["requeue"].startswith(f"asked Slurm to requeue job {job}"), lost
    assert "Traceback" not in text, text[-3000:]
    assert state["Requeue"] == "1" and int(state["Restarts"]) == 1, state
    newest = max((out / "checkpoints").glob("iter_*"))
    assert int(newest.name.split("_")[1]) >= DOWN_AT and not list(
        (out / "checkpoints").glob("*.tmp*")), list((out / "checkpoints").iterdir())
