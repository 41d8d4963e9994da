"""Submitting the scripts ``nutp sbatch`` renders to the real Slurm test cluster
(``tests/helpers/slurm_cluster.py``) and watching them: the shared parts of
``tests/launch/test_sbatch_live.py`` and ``tests/launch/test_slurm_nodes.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nemo_nutp.launch.slurm import SbatchOptions, render_sbatch
from tests.helpers.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
LIVE = ("cluster.gpus_per_node=4", "checkpoint.interval=2")
"""A live-mode job on nodes of the test cluster's size (4 GPUs)."""


def render(over: tuple[str, ...], **opts) -> str:
    """The sbatch script ``nutp sbatch <over>`` renders (``SbatchOptions(**opts)``)."""
    from nemo_nutp.config import load_config, plan_request
    from nemo_nutp.layout import build_plan

    cfg = load_config(list(over))
    return render_sbatch(build_plan(plan_request(cfg)), SbatchOptions(image="img", **opts),
                         overrides=list(over), recovery=cfg.recovery)


def submit(slurm: SlurmCluster, script: Path, **env: str) -> str:
    """``sbatch --parsable script`` with this environment (sbatch exports it to the job), this
    interpreter first on PATH; the job id."""
    e = slurm.env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
                  **env)
    r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                       env=e, cwd=script.parent, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")
"""Slurm's job states of a job that ended (a requeued job passes through REQUEUED)."""


class Watch:
    """A submitted job's state, refreshed by ``running()`` (``scontrol show job``)."""

    def __init__(self, slurm: SlurmCluster, job: str) -> None:
        self.slurm, self.id = slurm, job
        self.state: dict[str, str] = {}

    def running(self) -> bool:
        """Not ended: pending, running, or on its way back to pending (a requeue)."""
        self.state.update(self.slurm.job(self.id))
        return self.state["JobState"] not in ENDED

    def until(self, ok: Callable[[], bool], deadline: float, what: str, *,
              poll: float = 0.1) -> None:
        """Wait for ``ok()`` while the job runs; fail naming ``what`` otherwise."""
        while not ok():
            assert self.running(), f"the job ended before {what}"
            assert time.monotonic() < deadline, f"no {what} within the job timeout"
            time.sleep(poll)

    def finish(self, deadline: float) -> None:
        while self.running():
            assert time.monotonic() < deadline, "the job did not end within the job timeout"
            time.sleep(0.2)


def has_event(out: Path, name: str) -> Callable[[], bool]:
    events = out / "recovery" / "events.jsonl"
    return lambda: f'"event": "{name}"' in (events.read_text() if events.exists() else "")


def saved(out: Path, step: int) -> Callable[[], bool]:
    """The checkpoint of ``step`` written (its ``checkpoint`` event; ``metrics.jsonl`` is
    written at the end of a run, the events as they happen)."""
    events = out / "recovery" / "events.jsonl"
    mark = f'"event": "checkpoint", "step": {step},'
    return lambda: events.exists() and mark in events.read_text()


def report_back(out: Path, failed: list[int], now: list[int]) -> None:
    """The operator rewrites the health report: GPUs of ``failed`` not in ``now`` are back."""
    health = out / "recovery" / "health.json"
    assert json.loads(health.read_text())["failed_gpus"] == failed
    tmp = health.with_suffix(".test-tmp")
    tmp.write_text(json.dumps({"failed_gpus": now}))
    os.replace(tmp, health)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
