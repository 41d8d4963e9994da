"""A node agent resubmits its job when the batch host (the control process) is lost
(``recovery/agent.py: resubmit, cancel``), against stand-in ``scontrol``/``sbatch``/``scancel``
scripts on ``PATH`` that record what they were given. The real thing, on the Slurm test
cluster: ``tests/launch/test_slurm_nodes.py::test_live_batch_host_lost_the_resubmitted_job_
resumes_exactly``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_nutp.common.env import REQUEUED, SLURM_RESTART_COUNT, requeued
from nemo_nutp.recovery.agent import cancel, resubmit

SCRIPT = "#!/bin/bash\n#SBATCH --nodes=2\necho train\n"

FAKES = {
    "scontrol": f"""#!/bin/bash
[[ "$*" == "write batch_script 12 -" ]] || {{ echo "scontrol: bad args $*" >&2; exit 1; }}
printf '%s' '{SCRIPT}'
""",
    # the arguments, the script on stdin and the environment, as JSON; then the new job's id
    "sbatch": """#!/bin/bash
python3 -c 'import json, os, sys
json.dump({"args": sys.argv[1:], "stdin": sys.stdin.read(), "env": dict(os.environ)},
          open(os.environ["FAKE_LOG"] + ".sbatch", "a"))' "$@"
echo "77;cluster"
""",
    "scancel": """#!/bin/bash
echo "$*" >> "$FAKE_LOG.scancel"
""",
}


@pytest.fixture
def slurm_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-in Slurm commands first on PATH, and the environment of a job step of job 12."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log"))
    for k, v in {"SLURM_JOB_ID": "12", "SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "1",
                 "SLURMD_NODENAME": "n2", "SRUN_DEBUG": "3", "SLURM_CONF": "/etc/slurm.conf",
                 "SLURM_SUBMIT_DIR": str(tmp_path / "submit"), "SBATCH_ACCOUNT": "acct",
                 "KEEP_ME": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(REQUEUED, raising=False)
    monkeypatch.delenv(SLURM_RESTART_COUNT, raising=False)
    (tmp_path / "recovery").mkdir()
    return tmp_path


def test_the_first_agent_resubmits_the_script_after_the_old_job_and_the_others_leave_it(
        slurm_tools: Path) -> None:
    rdir = slurm_tools / "recovery"
    done = resubmit("12", 3, rdir)
    assert done.cancel == "12"
    assert done.line.startswith("resubmitted job 12's script as job 77 (run 2; it starts when "
                                "job 12 has ended and resumes from the newest checkpoint)"), done
    call = json.loads((slurm_tools / "log.sbatch").read_text())
    assert call["args"] == ["--parsable", "--dependency=afterany:12",
                            f"--chdir={slurm_tools / 'submit'}"]
    assert call["stdin"] == SCRIPT  # the job's own script, as Slurm kept it
    env = call["env"]
    assert env[REQUEUED] == "1" and env["KEEP_ME"] == "1" and env["SBATCH_ACCOUNT"] == "acct"
    assert env["SLURM_CONF"] == "/etc/slurm.conf"  # the cluster's, not the old job's
    assert not [k for k in env if k.startswith(("SLURM_", "SLURMD_", "SRUN_"))
                and k != "SLURM_CONF"], env
    assert (rdir / "resubmit.12").read_text() == "77\n"
    # another node's agent of the same job: no second job
    again = resubmit("12", 3, rdir)
    assert again.cancel is None and again.line == \
        f"another node's agent resubmits job 12 ({rdir / 'resubmit.12'})"
    assert len((slurm_tools / "log.sbatch").read_text().split('{"args"')) == 2
    assert cancel("12") == "cancelled job 12"
    assert (slurm_tools / "log.scancel").read_text() == "12\n"


def test_the_count_of_runs_bounds_it_and_carries_on(slurm_tools: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUEUED, "1")
    monkeypatch.setenv(SLURM_RESTART_COUNT, "1")  # Slurm requeued the resubmitted job once
    assert requeued() == 2
    done = resubmit("12", 2, slurm_tools / "recovery")
    assert (done.line, done.cancel) == ("job 12 is run 3 of this job already, the last one "
                                        "recovery.max_restarts=2 allows: not resubmitted again",
                                        None)
    assert not (slurm_tools / "log.sbatch").exists()
    done = resubmit("12", 3, slurm_tools / "recovery")
    assert "as job 77 (run 4;" in done.line, done
    env = json.loads((slurm_tools / "log.sbatch").read_text())["env"]
    assert env[REQUEUED] == "3" and SLURM_RESTART_COUNT not in env


def test_what_it_cannot_do_is_one_line(slurm_tools: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert resubmit(None, 3, slurm_tools).line == \
        "not under Slurm (no SLURM_JOB_ID): nothing to resubmit"
    assert resubmit("12", 3, slurm_tools / "gone").line.startswith(
        f"cannot create {slurm_tools / 'gone' / 'resubmit.12'} (No such file or directory): "
        "resubmit job 12 by hand")
    assert resubmit("13", 3, slurm_tools / "recovery").line == \
        "scontrol write batch_script 13: scontrol: bad args write batch_script 13 -: " \
        "resubmit the job by hand"
    (slurm_tools / "bin" / "scancel").write_text("#!/bin/bash\necho 'scancel: error: "
                                                  "Invalid job id 12' >&2\nexit 1\n")
    assert cancel("12") == ("scancel 12: scancel: error: Invalid job id 12: cancel it by hand "
                            "(its resubmission waits for its end)")
    monkeypatch.setenv("PATH", "/nonexistent")
    line = resubmit("12", 3, slurm_tools / "recovery").line
    assert line.startswith("scontrol, sbatch, scancel not in this container: resubmit job 12 "
                           "by hand (`scontrol write batch_script 12 - | NUTP_REQUEUED=1 "
                           "sbatch`"), line
