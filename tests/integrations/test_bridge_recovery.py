"""``nutp-bridge recovery.enabled=true``: a killed rank is recovered by restart, inside Bridge.

The shrunk vanilla GPT recipe (fp32, warmup then cosine: every step has its own lr) runs as
``python -m nemo_nutp.launch.bridge_cli`` on a 4-GPU CPU cluster with GPU 3 failed: replicas
[2,1]. Bridge's ``train()`` saves every 2 steps into ``checkpoint.save``; ``checkpoint.load`` is
not set. Rank 1 (of the TP2 replica) is SIGKILLed at the start of step 3. The supervisor marks
GPU 1 failed, re-plans ([1,1]) and relaunches; the new world resumes inside Bridge's ``train()``
from ``iter_0000002`` and runs steps 2 and 3. Each of those steps' lr, loss and grad norm equal
the uninterrupted run's (one process, the same recipe) within 1e-5 (lr: 1e-12); the recovery
events and summary say what happened (one failure, 1 lost step, resumed at 2 in the new layout).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

TOL = 1e-5
END, SAVE, KILL = 4, 2, 3  # train_iters; checkpoint.save_interval; the killed step
SCHEDULE = ["scheduler.lr_warmup_iters=1", "scheduler.lr_decay_style=cosine",
            f"scheduler.lr_decay_iters={END}", "optimizer.lr=0.01", "optimizer.min_lr=0.001",
            f"train.train_iters={END}"]
CLUSTER = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
           "health.failed_gpus=[3]", "model.tensor_model_parallel_size=2"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


class _BridgeCli:
    """``nutp-bridge`` as a process in a session of its own, output in ``<out>.log``; every
    process it started is killed when the test leaves the ``with``."""

    def __init__(self, out: Path, overrides: list[str], env: dict[str, str]) -> None:
        import os

        from tests.helpers.bridge_jobs import PARITY, RECIPE, TINY

        self.log = out.with_suffix(".log")
        cmd = [sys.executable, "-m", "nemo_nutp.launch.bridge_cli", "--recipe", RECIPE,
               "--config-file", str(TINY), "--output-dir", str(out), *PARITY, *overrides]
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True, env={**os.environ, **env})

    def __enter__(self) -> _BridgeCli:
        return self

    def __exit__(self, *exc: object) -> None:
        from nemo_nutp.common.procs import kill_session

        kill_session(self.proc.pid)
        self.proc.wait()

    def wait(self) -> tuple[int, str]:
        return self.proc.wait(timeout=600), self.log.read_text()


@pytest.mark.timeout(900)
def test_a_killed_rank_restarts_inside_bridge_and_the_schedule_continues(tmp_path: Path
                                                                         ) -> None:
    from tests.helpers.bridge_jobs import run_worker
    from tests.helpers.dist import spawn

    out, ckpt, ref_dir = tmp_path / "run", tmp_path / "ckpt", tmp_path / "ref"
    ref_dir.mkdir()
    with _BridgeCli(out, [*SCHEDULE, *CLUSTER, "recovery.enabled=true",
                          f"checkpoint.save={ckpt}", f"checkpoint.save_interval={SAVE}"],
                    {"NUTP_FAULT": f"kill:rank=1:step={KILL}"}) as job:
        # the uninterrupted run (one process) while the supervised job runs
        spawn(run_worker, 1, ([*SCHEDULE, "model.tensor_model_parallel_size=1",
                               "nutp.replicas=[1]"],), ref_dir)
        rc, log = job.wait()
    want = json.loads((ref_dir / "run_result.json").read_text())
    lrs = [row["lr"] for row in want]
    assert len(set(lrs)) == END and lrs[SAVE] != lrs[0]  # a restart from scratch differs
    assert rc == 0, log[-3000:]
    for rank in (0, 1):  # the relaunched world's records: steps SAVE.. of the same schedule
        got = json.loads((out / f"bridge_rank{rank}.json").read_text())["steps"]
        assert [row["step"] for row in got] == list(range(SAVE, END)), got
        for g, w in zip(got, want[SAVE:], strict=True):
            assert _rel(g["lr"], w["lr"]) <= 1e-12, (g, w)
            assert _rel(g["loss"], w["loss"]) <= TOL, (g, w)
            assert _rel(g["grad_norm"], w["grad_norm"]) <= TOL, (g, w)
    rdir = out / "recovery"
    events = [json.loads(line) for line in (rdir / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "fault", "failure", "start", "resumed", "finished"], kinds
    failure, resumed = events[2], events[4]
    assert failure["ranks"] == [1] and failure["gpus"] == [1], failure
    assert failure["resume_step"] == SAVE and failure["lost_steps"] == KILL - SAVE, failure
    assert events[3]["replica_tp"] == [[1], [1]] and events[3]["failed_gpus"] == [1, 3]
    assert resumed["step"] == SAVE and resumed["checkpoint"] == str(ckpt / f"iter_{SAVE:07d}")
    summary = json.loads((rdir / "summary.json").read_text())
    assert len(summary) == 1 and summary[0]["resume_step"] == SAVE, summary
    assert "Recovery" in log and "killed by signal 9" in log
    assert (ckpt / f"iter_{END:07d}").is_dir()


def test_recovery_keys_are_nutp_keys_and_what_is_not_read_is_refused(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """``recovery.*`` is NUTP's (Bridge's ``ConfigContainer`` has no such field); Bridge's
    ``checkpoint.save`` / ``save_interval`` are the job's checkpoint dir and interval under
    recovery (live mode too: its fallback restarts); recovery without them, ``recovery.*``
    and ``nutp.*`` keys nutp-bridge does not read, and recovery under a launcher whose world
    is not one worker per GPU slot are one line naming the field, before any process group."""
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist

    from nemo_nutp.compat.bridge_cpu import install_import_shim
    from nemo_nutp.config.schema import NutpConfig, RecoveryConfig
    from nemo_nutp.integrations.bridge_config import check_nutp_unused, recovery_keys
    from nemo_nutp.launch.bridge_cli import main
    from tests.helpers.bridge_jobs import RECIPE, TINY, load

    install_import_shim()
    from megatron.bridge.training.config import ConfigContainer

    assert "recovery" not in {f.name for f in dataclasses.fields(ConfigContainer)}
    job = load(["recovery.enabled=true", "checkpoint.save=/tmp/x", "checkpoint.save_interval=3",
                "recovery.max_restarts=5", "model.tensor_model_parallel_size=2"])
    assert job.nutp.recovery.enabled and job.nutp.recovery.max_restarts == 5
    assert job.nutp.checkpoint_dir == "/tmp/x" and job.nutp.checkpoint.interval == 3
    with pytest.raises(ValueError, match=r"^checkpoint\.save=None: recovery\.enabled=true"):
        load(["recovery.enabled=true", "model.tensor_model_parallel_size=2"])

    def ck(save: str | None, interval: int | None) -> SimpleNamespace:
        return SimpleNamespace(checkpoint=SimpleNamespace(save=save, save_interval=interval))

    on = RecoveryConfig(enabled=True)
    assert recovery_keys(ck(None, None), RecoveryConfig()) == []  # recovery off: not mapped
    assert recovery_keys(ck("/c", 2), on) == ["checkpoint.dir=/c", "checkpoint.interval=2"]
    live = RecoveryConfig(enabled=True, mode="live")  # its fallback is the restart path
    assert recovery_keys(ck("/c", 2), live) == recovery_keys(ck("/c", 2), on)
    with pytest.raises(ValueError, match=r"^checkpoint\.save=None: recovery\.enabled=true"):
        recovery_keys(ck(None, None), live)
    bad = {"checkpoint.save_interval=None": (ck("/c", None), on),
           "checkpoint.save_interval=0": (ck("/c", 0), on),
           "recovery.rate_per_gpu_day=1.0": (ck("/c", 2), RecoveryConfig(rate_per_gpu_day=1.0)),
           "recovery.probe_timeout_s=5.0": (ck("/c", 2), RecoveryConfig(probe_timeout_s=5.0))}
    for field, (cfg, rec) in bad.items():
        with pytest.raises(ValueError) as e:
            recovery_keys(cfg, rec)
        assert str(e.value).startswith(field + ":") and "\n" not in str(e.value), e.value
    # straggler exclusion under Bridge: by a live re-layout only
    with pytest.raises(ValueError, match=r"^nutp\.exclude_stragglers=True: nutp-bridge "):
        load(["nutp.exclude_stragglers=true", "nutp.straggler_probe_interval=1",
              "model.tensor_model_parallel_size=2"])
    check_nutp_unused(NutpConfig(), RecoveryConfig())
    check_nutp_unused(NutpConfig(exclude_stragglers=True, straggler_probe_interval=1),
                      RecoveryConfig(enabled=True, mode="live"))
    assert load(["nutp.rebalance=true", "model.tensor_model_parallel_size=2"]).nutp.nutp.rebalance
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--recipe", RECIPE, "--config-file", str(TINY), "recovery.enabled=true",
                 "checkpoint.save=/tmp/x", "checkpoint.save_interval=3",
                 "model.tensor_model_parallel_size=2"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "recovery.enabled=true under a launcher needs one worker per " \
        "GPU slot: the launcher's WORLD_SIZE=3" in err[0], err
    assert not dist.is_initialized()
