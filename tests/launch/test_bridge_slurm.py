"""``nutp-bridge sbatch``: a Megatron-Bridge recipe on Slurm with NUTP recovery.

The shrunk vanilla GPT recipe of the Bridge tests (``tests/helpers/bridge_jobs.py``: RECIPE,
TINY, PARITY; warmup then cosine, evaluation every 2 steps: ``bridge_live_jobs.schedule``) on
two nodes of the real Slurm test cluster (``tests/helpers/slurm_cluster.py``: four fake GPUs
per node; domains of 2 GPUs, GPUs 2, 3 and 5-7 failed: a TP2 replica on n1's GPUs 0-1, a TP1
replica on n2's GPU 4).

* The script ``nutp-bridge sbatch`` renders: the one ``nutp sbatch`` renders, with Bridge's
  ranks; the recipe, config file and overrides carried verbatim; bad input one line.
* Live mode on Slurm: after step ``DOWN_AT`` the second node is set DOWN through ``scontrol``
  (as an operator or a health checker would): Slurm kills that node's part of the agents' job
  step (its agent and its Bridge rank). The control process learns of the lost agent within a
  few beats, blames only that node's GPU ("node agent n2 lost"), and the survivors -- Bridge
  ranks started by n1's agent, inside Bridge's ``train()`` -- are re-laid out live to the TP2
  replica: one ``start``, no checkpoint read, no traceback, every step's loss, grad norm and lr
  and every validation loss equal to Bridge's uninterrupted one-process run of the same recipe
  (``bridge_live_jobs.check_job``).

Without the Bridge rank entry travelling to the agents (``hosts.AgentHost.entry``), the agents
start ``nutp-train``'s rank (``world.rank_main``) on the job's NUTP config: the job completes,
re-laid out live, but it trained ``nutp-train``'s own loop, not Bridge's ``train()`` -- step 0's
lr is 0.01, not the recipe's warmup 0.0 -- and the comparison fails at step 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

from nemo_nutp.common.ports import free_port
from tests.helpers.bridge_live_jobs import LIVE, check_job, job_args, reference
from tests.helpers.live import check_live
from tests.helpers.slurm_cluster import PARTITION, SlurmCluster
from tests.helpers.slurm_jobs import REPO, Watch, submit

CLUSTER = ["cluster.num_gpus=8", "cluster.gpus_per_node=4", "cluster.domain_size=2",
           "health.failed_gpus=[2,3,5,6,7]", "nutp.replicas=null",
           "model.tensor_model_parallel_size=2"]
END = 12  # steps (a step takes well under a second here: the loss lands inside the run)
DOWN_AT = 3  # n2 is set DOWN once its rank has done this step (Bridge counts from 0)
JOB_TIMEOUT_S = 300


def _render(tmp_path: Path, argv: list[str], *extra: str) -> tuple[int, str]:
    from nemo_nutp.launch.bridge_cli import main

    out = tmp_path / "job.sbatch"
    rc = main(["sbatch", *argv, "--out", str(out), "--image", "img", *extra])
    return rc, out.read_text() if out.exists() else ""


def test_nutp_bridge_sbatch_renders_the_job_and_refuses_bad_input(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The script carries the job's arguments word for word (a relative ``--config-file`` made
    absolute: the ranks run in the image's repo); bad input is one line naming the field,
    before any process group, and no script."""
    import shutil

    import torch.distributed as dist

    argv = job_args(tmp_path, [*CLUSTER, *LIVE])
    i = argv.index("--config-file")
    shutil.copy(argv[i + 1], tmp_path / "tiny.yaml")
    rel = ["--config-file", "tiny.yaml"]
    argv[i:i + 2] = rel
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        rc, text = _render(tmp_path, argv)
    finally:
        os.chdir(cwd)
    assert rc == 0, capfd.readouterr().err
    want = [*argv[:i], "--config-file", str(tmp_path / "tiny.yaml"), *argv[i + 2:]]
    line = next(x for x in text.splitlines() if x.startswith("NUTP_LIVE=("))
    words = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\0" "${{NUTP_LIVE[@]}}"'],
                           capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert words == ["nutp-bridge", "control", *want]
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --no-kill\n" in text
    restart = [a for a in want if a != "recovery.mode=live"]
    rc, text = _render(tmp_path, restart)
    assert rc == 0 and "for attempt in" in text and "nutp-bridge control" not in text
    capfd.readouterr()
    bad = {  # argv -> the start of the one line
        "--config-file": [*want[:i], "--config-file", str(tmp_path / "nope.yaml"),
                          *want[i + 2:]],
        "nutp-bridge argument": [*want, "train.train_iters=3\n#"],
        "recovery.mode='live': needs recovery.enabled=true": [
            a for a in want if a != "recovery.enabled=true"],
        "master_port=80": [*want, "--master-port", "80"],
        "recovery.max_restarts": [*want, "recovery.max_restarts=-1"],
    }
    (tmp_path / "job.sbatch").unlink()
    for field, args in bad.items():
        rc, text = _render(tmp_path, args)
        err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
        assert rc == 2 and not text, (field, text[:200])
        assert len(err) == 1 and err[0].startswith(f"error: {field}"), (field, err)
    assert not dist.is_initialized()


def _done(out: Path, rank: int, step: int):
    """Rank ``rank`` of the first world has done ``step`` (its heartbeat, ``done <step>``)."""
    beat = out / "recovery" / "heartbeats.0" / f"rank{rank}"

    def ok() -> bool:
        words = beat.read_text().split() if beat.exists() else []
        return len(words) >= 2 and words[0] == "done" and int(words[1]) >= step
    return ok


@pytest.mark.dist
@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_bridge_live_node_set_down_is_relaid_out_live(slurm: SlurmCluster,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    rc, _ = _render(tmp_path, job_args(tmp_path, [*CLUSTER, *LIVE], END),
                    "--master-port", str(free_port()), "--partition", PARTITION,
                    "--account", "nutp", "--repo", str(REPO), "--job-name", "nutp-bridge")
    assert rc == 0 and script.exists()
    job = submit(slurm, script, NUTP_LIVE_DIGEST="1")
    watch = Watch(slurm, job)
    lost = None
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        watch.until(_done(out, 2, DOWN_AT), deadline, f"rank 2's step {DOWN_AT}")
        hosts = slurm.run("scontrol", "show", "hostnames", slurm.job(job)["NodeList"]).split()
        lost = hosts[1]
        slurm.run("scontrol", "update", f"NodeName={lost}", "State=DOWN", "Reason=test")
        reference(tmp_path, END)  # Bridge's uninterrupted run, beside the job
        watch.finish(deadline)
    finally:
        slurm.run("scancel", job, check=False)
        if lost is not None:
            slurm.run("scontrol", "update", f"NodeName={lost}", "State=RESUME", check=False)
    text = (tmp_path / f"nutp-bridge-{job}.out").read_text()
    # no traceback (Bridge logs, at INFO, the traceback of each optional import it skips:
    # "Import of X from Y failed with: Traceback ...", as tests/integrations/test_bridge_readme)
    assert "Traceback" not in text.replace("failed with: Traceback", "failed with:"), \
        text[-6000:]
    assert (watch.state["JobState"], watch.state["ExitCode"]) == ("COMPLETED", "0:0"), \
        text[-6000:]
    assert slurm.job_steps(job) == [0, 1]  # the control process and the agents: no other
    rows, ev, _ = check_job(tmp_path, END)  # every step equal to the uninterrupted run
    (move,) = check_live(ev, relayouts=1)
    assert move["gpus"] == [4] and move["ranks"] == [2], move  # only the lost node's GPU
    assert move["reason"] == f"node agent {lost} lost", move  # by its Slurm name
    assert move["replica_tp"] == [[2]], move
    layouts = [row["replica_tp"] for row in rows]
    assert layouts[0] == [[2], [1]] and layouts[-1] == [[2]], layouts
    assert DOWN_AT < move["resume_step"] < END, move
    print(f"bridge: slurm node {lost} down after step {DOWN_AT}: live re-layout at step "
          f"{move['resume_step']}, relayout_s {move['relayout_s']:.2f}")
