"""Issue 24 item 4 / issue 35: ``nutp sbatch ... recovery.mode=live`` run on a real Slurm.

The end-to-end test renders the live-mode script for the default tiny job on two nodes of four
GPUs (GPU 7 failed: TP4+TP3 on 7 ranks) and submits it with ``sbatch``, as rendered, to the
test cluster of ``tests/helpers/slurm_cluster.py`` (Debian's Slurm 22.05 on this machine: three
slurmd with four fake GPUs each, a SPANK plugin accepting pyxis's ``--container-*`` options).
The script starts two job steps: the control process and one node agent per node. Rank 1
(node 0) is SIGKILLed in its forward at step 1: a live re-layout to TP3+TP3 in the same
processes, no new job step; a failure inside the grow back that follows takes the restart
fallback inside the same two steps, and a second grow back succeeds (the returning GPU's
process started by its node's agent). Every step's loss and grad norm is compared with an
uninterrupted single-process run of *stock* megatron-core (clipping on), computed here;
replicas are bitwise equal after each move.

The restart-mode srun loop runs on the same cluster (``tests/launch/test_slurm_nodes.py``); the
CPU srun stand-in that ran it before is gone: nothing here needs it any more.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from nemo_nutp.common.ports import free_port
from nemo_nutp.launch import control as standalone
from tests.helpers.launch import run_train
from tests.helpers.live import (
    BASE,
    JOB_TIMEOUT_S,
    TOL,
    check_steps,
    read_events,
    replica_digests,
    stock_reference,
)
from tests.helpers.slurm_cluster import PARTITION, SlurmCluster
from tests.helpers.slurm_jobs import LIVE, REPO, Watch, gone, has_event, report_back, submit
from tests.helpers.slurm_jobs import render as _script


def test_live_script_keeps_peers_alive_and_runs_control_outside_the_ranks(tmp_path: Path
                                                                          ) -> None:
    text = _script((*BASE, *LIVE, "train.steps=4"))
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --no-kill\n" in text
    srun = [x for x in text.split("\n\n")[-1].replace("\\\n", " ").splitlines()
            if x.startswith("srun ")]
    assert len(srun) == 2, srun  # the control process and the agents: nothing per attempt
    assert "--overlap" in srun[0] and "--ntasks=1" in srun[0]
    # Real Slurm (22.05) refuses --gres=none inside a --gpus-per-node job ("Invalid Trackable
    # RESource (TRES) specification"); --gpus-per-node=0 is accepted.
    assert "--gpus-per-node=0" in srun[0] and not any("--gres" in x for x in srun)
    # The job's --no-kill does not keep a running step's other nodes: the agents' step has its
    # own, so a lost node ends only its own agent.
    assert "--kill-on-bad-exit=0 --wait=0 --no-kill" in srun[1]
    assert "nemo_nutp.recovery.agent" in srun[1]
    assert "nemo_nutp.launch.control" in text and "for attempt in" not in text


@pytest.mark.parametrize("launcher", ["torchrun", "ft_launcher"])
def test_live_under_torchrun_says_it_restarts(launcher: str, tmp_path: Path) -> None:
    text = _script((*BASE, *LIVE), launcher=launcher)
    assert "failures\n# take the restart path" in text and f"{launcher} --nnodes" in text


def test_live_under_a_launcher_prints_the_restart_reason(tmp_path: Path) -> None:
    """``nutp-train`` as torchrun starts it (RANK/WORLD_SIZE, restart count 0): worker 0 prints
    why live falls back to restart before anything else (the rendezvous then fails here: no
    MASTER_ADDR; one line, exit 2)."""
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
           "TORCHELASTIC_RESTART_COUNT": "0", "COLUMNS": "200"}
    r = run_train([f"output.dir={tmp_path}", *BASE, "checkpoint.interval=2"], env=env,
                  unset=("MASTER_ADDR",), timeout=300)
    assert "torchrun and ft_launcher restart every worker when one exits, so failures take " \
           "the restart path" in " ".join(r.stdout.split()), r.stdout + r.stderr
    assert r.returncode == 2 and "MASTER_ADDR" in r.stderr


def test_sbatch_live_needs_recovery_enabled(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from nemo_nutp.launch.nutp_cli import main

    out = tmp_path / "job.sbatch"
    assert main(["sbatch", "recovery.mode=live", "--out", str(out)]) == 2
    assert "recovery.mode='live': needs recovery.enabled=true" in capsys.readouterr().err
    assert not out.exists()


def test_standalone_control_rejects_restart_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert standalone.main(["--listen=30000", "recovery.enabled=true",
                            "checkpoint.interval=2"]) == 2
    err = capsys.readouterr()
    assert "recovery.mode='restart'" in err.err + err.out
    assert standalone.main(["--listen=80", *BASE]) == 2


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
def test_sbatch_live_on_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The rendered live-mode script, submitted with ``sbatch`` as rendered to the real Slurm
    test cluster (3 nodes x 4 fake GPUs; the job takes 2). Attempt 0: rank 1 (node 0) killed in
    its forward at step 1 -> live TP3+TP3; GPU 1 reported back -> node 0's agent starts its
    process, but slot 4 (node 1) dies inside that grow -> the restart fallback: the agents kill
    the new process and the world and start attempt 1 (GPU 4 failed, GPU 1 back) from the
    newest checkpoint -- still the same two job steps (counted from the slurmds' logs). Attempt
    1: GPU 4 reported back -> node 1's agent starts its process, live grow back to TP4+TP3."""
    steps = 12
    out = tmp_path / "out"
    over = (*BASE, *LIVE, f"train.steps={steps}", f"output.dir={out}")
    script = tmp_path / "job.sbatch"
    script.write_text(_script(over, master_port=free_port(), partition=PARTITION,
                              account="nutp", repo=str(REPO), job_name="nutp-live"))
    # sbatch passes this environment to the job (--export=ALL): the fault, the digests.
    job = submit(slurm, script, NUTP_FAULT="kill:rank=1:step=1:phase=forward,"
                                           "kill:rank=4:phase=relayout:gen=1",
                 NUTP_LIVE_DIGEST="1")
    watch = Watch(slurm, job)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(has_event(out, "live_relayout"), deadline, "live_relayout")
        report_back(out, [1, 7], [7])
        watch.until(has_event(out, "failure"), deadline, "failure")  # the grow fell back
        watch.until(lambda: [e["event"] for e in read_events(out)].count("live_world") >= 2,
                    deadline, "attempt 1")
        report_back(out, [4, 7], [7])
        watch.finish(deadline)
        ev = read_events(out)
        (first_join, second_join) = [e for e in ev if e["event"] == "agent_join"]
        assert gone(first_join["pid"]), "the fallback left the new process running"
    finally:
        slurm.run("scancel", job, check=False)
    state = watch.state
    text = (tmp_path / f"nutp-live-{job}.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-6000:]
    # Two job steps for the whole job: the control process (0) and the node agents (1).
    assert slurm.job_steps(job) == [0, 1]
    ref = stock_reference(over, steps, tmp_path)
    rows = check_steps(out, ref, TOL)  # every step, no gap
    layouts = [r["replica_tp"] for r in rows]
    assert layouts[0] == [[4], [3]] and layouts[-1] == [[4], [3]], layouts
    assert [[3], [3]] in layouts, layouts
    assert [e["event"] for e in ev].count("start") == 2  # attempt 0 and the fallback's
    kill, grow = [e for e in ev if e["event"] == "live_relayout"]
    assert kill["cause"] == "exit" and kill["gpus"] == [1] and kill["processes_started"] == 0
    assert kill["lost_steps"] == 0 and kill["recomputed_steps"] <= 1
    w0, w1 = [e for e in ev if e["event"] == "live_world"]
    assert set(kill["pids"]) < set(w0["pids"]), "a survivor changed its process"
    (fb,) = [e for e in ev if e["event"] == "live_fallback"]
    assert "rank" in fb["reason"] and "exited" in fb["reason"], fb
    (fail,) = [e for e in ev if e["event"] == "failure"]
    assert fail["gpus"] == [4], fail
    assert (first_join["node"], first_join["gpu"]) == (0, 1)  # each by its own node's agent
    assert (second_join["node"], second_join["gpu"]) == (1, 4)
    assert grow["cause"] == "gpu_back" and grow["returned_gpus"] == [4]
    assert grow["attempt"] == 1 and grow["lost_steps"] == 0
    assert set(grow["pids"]) == set(w1["pids"]) | {second_join["pid"]}
    digests = replica_digests(ev)
    assert sorted(digests) == sorted({kill["gen"], grow["gen"]}), digests
    summary = json.loads((out / "recovery" / "summary.json").read_text())
    assert [x["mode"] for x in summary] == ["live", "restart", "live"], summary
    print(f"slurm live: kill relayout_s {kill['relayout_s']:.2f} (unblock "
          f"{kill['unblock_s']:.3f}), gpu back relayout_s {grow['relayout_s']:.2f}, restart "
          f"resumed at step {fail['resume_step']}")
