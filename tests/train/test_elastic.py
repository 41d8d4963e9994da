"""Recovery under an external launcher (``train/elastic.py``).

Pure decisions are tested on files in a temporary directory (no processes). The end-to-end
test runs ``torchrun --max-restarts`` on CPU with one worker per GPU slot of the default cluster
(8 slots, GPU 7 failed → TP4+TP3 on 7 workers, 1 idle), SIGKILLs plan rank 1 at step 5 and
checks that the next attempt blames GPU 1 (no exit record), re-plans TP3+TP3, resumes from the
step-4 checkpoint and ends with the losses of an uninterrupted single-process run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_nutp.config import load_config, plan_request
from nemo_nutp.health.decisions import Failure
from nemo_nutp.layout import build_plan
from nemo_nutp.train import elastic
from tests.helpers.launch import run_train, start_train

TOL = 1e-5
COMMON = ("train.steps=6", "train.seed=7", "train.global_batch_size=12",
          "train.micro_batch_size=2")


def test_attempt_number_prefers_the_launcher() -> None:
    assert elastic.attempt_number({}) == 0
    assert elastic.attempt_number({"TORCHELASTIC_RESTART_COUNT": "2", "NUTP_ATTEMPT": "5"}) == 2
    assert elastic.attempt_number({"SLURM_RESTART_COUNT": "1"}) == 0  # requeue: new allocation
    assert elastic.attempt_number({"NUTP_ATTEMPT": "3"}) == 3


def test_world_must_cover_every_gpu_slot() -> None:
    cfg = load_config(["recovery.enabled=true", "checkpoint.interval=2"])
    elastic.check_world(cfg, cfg.cluster.num_gpus)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=7.*cluster.num_gpus=8"):
        elastic.check_world(cfg, 7)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=16.*at most 1 nodes"):
        elastic.check_world(cfg, 16)
    # whole nodes fewer than the cluster's: a lost node (its GPUs failed by decide)
    elastic.check_world(load_config(["recovery.enabled=true", "checkpoint.interval=2",
                                     "cluster.gpus_per_node=4"]), 4)


def test_decide_keys_gpus_by_host_when_a_node_is_lost(tmp_path: Path) -> None:
    """Issue 35: attempt 1 runs on the second host only, which Slurm now numbers node 0. The
    node table keeps its GPUs 4-7; the first host's GPUs are failed and blamed as a lost node
    (not the survivors whose collectives failed), and GPU 5's failure stays on GPU 5."""
    cfg, rdir, ok = _decide_setup(tmp_path, "cluster.gpus_per_node=4")
    d0 = elastic.decide(cfg, rdir, 0, _posts(ok, 4))
    assert d0["slots"] == list(range(8)) and d0["failed_gpus"] == [7]
    # Attempt 0 ends: h1 lost (its workers left no record), h2's raised (peers gone).
    _exit_records(rdir, 0, [4, 5, 6], "error")
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": [5, 7]}))
    only_h2 = [{"slot": s, "host": "h2", "local": s, "probe": None} for s in range(4)]
    d1 = elastic.decide(cfg, rdir, 1, only_h2)
    assert d1["slots"] == [4, 5, 6, 7]  # by host name, not by Slurm's node id 0
    assert d1["failed_gpus"] == [0, 1, 2, 3, 5, 7] and d1["rank_to_gpu"] == [4, 6]
    (fail,) = [e for e in (json.loads(x) for x in (rdir / "events.jsonl").read_text()
                           .splitlines()) if e["event"] == "failure"]
    assert fail["gpus"] == [0, 1, 2, 3] and fail["reason"] == \
        "node h1 lost (not in this attempt's allocation)"
    # A new host in h1's place (attempt 2): it takes node 0, its GPUs are a new machine's.
    _exit_records(rdir, 1, [4, 6], "terminated")
    d2 = elastic.decide(cfg, rdir, 2, _posts(ok, 4, ("h3", "h2")))
    assert d2["slots"] == list(range(8)) and d2["failed_gpus"] == [5, 7]
    assert json.loads((rdir / "nodes.json").read_text())["hosts"] == ["h3", "h2"]
    # Two workers on one GPU: one line, no plan.
    bad = elastic.decide(cfg, rdir, 3, [*_posts(ok, 4, ("h3", "h2")),
                                        {"slot": 9, "host": "h2", "local": 0, "probe": None}])
    assert "two workers drive GPU slot 4" in bad["error"]


def test_blame_previous_attempt() -> None:
    record = {"rank_to_gpu": [0, 1, 2, 4]}
    exits = {g: {"status": "terminated"} for g in (0, 2, 4, 3)}
    assert elastic.blame_previous(record, exits, None) == Failure(
        (1,), "died without an exit record (killed, crashed or lost its GPU)")
    exits[1] = {"status": "terminated", "t": 5.0}
    assert elastic.blame_previous(record, exits, None) is None  # same layout restarts
    hang = {"ranks": [3], "reason": "no progress"}
    assert elastic.blame_previous(record, exits, hang) == Failure((3,), "no progress")
    # An idle worker (GPU 3: not in the plan) without a record is not blamed.
    del exits[3]
    assert elastic.blame_previous(record, exits, None) is None
    # Every plan rank silent (the whole group SIGKILLed): nothing tells them apart.
    assert elastic.blame_previous(record, {3: {"status": "ok"}}, None) is None
    # The rank that raised first is the cause; peers that errored after it are not.
    exits.update({1: {"status": "error", "t": 3.0, "detail": "CUDA error: ECC"},
                  2: {"status": "error", "t": 3.4}, 4: {"status": "aborted", "t": 3.9}})
    f = elastic.blame_previous(record, exits, None)
    assert f is not None and f.ranks == (1,) and "ECC" in f.reason


def _exit_records(rdir: Path, attempt: int, gpus: list[int], status: str) -> None:
    d = rdir / f"exits.{attempt}"
    d.mkdir(parents=True, exist_ok=True)
    for g in gpus:
        (d / f"gpu{g}").write_text(json.dumps({"status": status, "t": time.time()}))


def _decide_setup(tmp_path: Path, *over: str) -> tuple[Any, Path, dict[int, str | None]]:
    """(job config with recovery, its empty recovery dir, every device probe healthy)."""
    cfg = load_config([f"output.dir={tmp_path}", "recovery.enabled=true",
                       "checkpoint.interval=2", *over])
    rdir = tmp_path / "recovery"
    rdir.mkdir()
    return cfg, rdir, dict.fromkeys(range(8))


def _posts(probes: dict[int, str | None], gpn: int = 8, hosts: tuple[str, ...] = ("h1", "h2")
           ) -> list[dict[str, Any]]:
    """The workers' posts (launcher rank = Slurm's slot order) for ``probes`` (slot -> probe):
    slot ``s`` on host ``hosts[s // gpn]``, local GPU ``s % gpn``."""
    return [{"slot": g, "host": hosts[g // gpn], "local": g % gpn, "probe": why}
            for g, why in sorted(probes.items())]


def test_decide_across_attempts(tmp_path: Path) -> None:
    cfg, rdir, ok = _decide_setup(tmp_path)
    d0 = elastic.decide(cfg, rdir, 0, _posts(ok))
    assert d0["failed_gpus"] == [7] and sorted(d0["rank_to_gpu"]) == list(range(7))
    # Attempt 0 ends: GPU 1's worker left no record (SIGKILL); the others were terminated.
    _exit_records(rdir, 0, [0, 2, 3, 4, 5, 6, 7], "terminated")
    d1 = elastic.decide(cfg, rdir, 1, _posts(ok))
    assert d1["failed_gpus"] == [1, 7]
    assert len(d1["rank_to_gpu"]) == 6 and 1 not in d1["rank_to_gpu"]
    fail = [e for e in (json.loads(x) for x in (rdir / "events.jsonl").read_text().splitlines())
            if e["event"] == "failure"]
    assert [f["gpus"] for f in fail] == [[1]]
    assert json.loads((rdir / "health.json").read_text())["failed_gpus"] == [1, 7]
    # The operator reports both GPUs back; attempt 1 ended with every worker terminated.
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": []}))
    _exit_records(rdir, 1, list(range(8)), "terminated")
    d2 = elastic.decide(cfg, rdir, 2, _posts(ok))
    assert d2["failed_gpus"] == [] and sorted(d2["rank_to_gpu"]) == list(range(8))
    # A hang found by the watchdog blames the ranks it names (plan rank 2 = GPU 3 here).
    _exit_records(rdir, 2, [g for g in range(8) if g != 0], "terminated")
    (rdir / "hang.2.json").write_text(json.dumps(
        {"ranks": [2], "reason": "hung", "detected_at": time.time(), "where": {"2": "x.py:1"}}))
    assert d2["rank_to_gpu"][2] == 2
    d3 = elastic.decide(cfg, rdir, 3, _posts(ok))
    assert d3["failed_gpus"] == [2]
    # The operator reports GPU 2 back; the watchdog stopped attempt 3 for it after a checkpoint.
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": []}))
    _exit_records(rdir, 3, list(range(8)), "terminated")
    (rdir / "scaleup.3.json").write_text(json.dumps(
        {"gpus": [2], "requested_at": time.time() - 1, "step": 4, "detected_at": time.time()}))
    d4 = elastic.decide(cfg, rdir, 4, _posts(ok))
    assert d4["failed_gpus"] == [] and len(d4["rank_to_gpu"]) == 8
    ev = [json.loads(x) for x in (rdir / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e.get("cause")) for e in ev if e["event"] in ("failure", "scale_up")]
    assert kinds == [("failure", "exit"), ("failure", "exit"), ("failure", "hang"),
                     ("scale_up", None)]
    assert ev[-2]["event"] == "scale_up" and ev[-2]["gpus"] == [2]
    # A device probe that fails marks that GPU failed.
    _exit_records(rdir, 4, list(range(8)), "terminated")
    d5 = elastic.decide(cfg, rdir, 5, _posts({**ok, 5: "CUDA error: unspecified launch "
                                                                "failure"}))
    assert d5["failed_gpus"] == [5] and 5 not in d5["rank_to_gpu"]


def test_exit_record_written_when_terminated_inside_a_blocking_call(tmp_path: Path) -> None:
    """SIGTERM while the main thread is blocked in C++ (a store wait that never returns)."""
    code = textwrap.dedent(f"""
        from datetime import timedelta
        from pathlib import Path
        import torch.distributed as dist
        from nemo_nutp.train.elastic import ExitRecorder
        rec = ExitRecorder(Path({str(tmp_path)!r}), 3)
        rec.install()
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
        print("ready", flush=True)
        store.wait(["never"])
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    rec = json.loads((tmp_path / "gpu3").read_text())
    assert rec["status"] == "terminated" and rec["pid"] == p.pid


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    ref = tmp_path_factory.mktemp("ref")
    r = run_train([f"output.dir={ref}", *COMMON, "nutp.replicas=[1]", "health=none"],
                  timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return _losses(ref)


def _layout(*overrides: str) -> tuple[list[int], list[list[int]]]:
    """(rank_to_gpu, replica TP degrees) the planner gives the default job with overrides."""
    plan = build_plan(plan_request(load_config(list(overrides))))
    return list(plan.rank_to_gpu), [list(r.tp) for r in plan.replicas]


def _check_recovered(out: Path, stdout: str, reference: list[float]) -> dict:
    """Plan rank 1 was SIGKILLed at step 5 of the default job (TP4+TP3, GPU 7 failed)."""
    first, _ = _layout()
    failed = sorted({first[1], *load_config([]).health.failed_gpus})
    _, degraded = _layout(f"health.failed_gpus=[{','.join(map(str, failed))}]")
    losses = _losses(out)
    assert len(losses) == len(reference)
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) <= TOL * abs(b), (losses, reference)
    rdir = out / "recovery"
    (s,) = json.loads((rdir / "summary.json").read_text())
    assert s["gpus"] == [first[1]] and "without an exit record" in s["reason"]
    assert s["resume_step"] == 4 and s["replica_tp"] == degraded
    assert s["lost_steps"] <= 2  # at most the checkpoint interval is recomputed
    assert json.loads((rdir / "health.json").read_text())["failed_gpus"] == failed
    # Attempt 1: the failed GPUs' workers sat idle and left on the 'finished' key.
    idle = {g: json.loads((rdir / "exits.1" / f"gpu{g}").read_text()) for g in failed}
    assert all(v["status"] == "ok" and v["detail"] == "idle" for v in idle.values())
    good = json.loads((out / "goodput.json").read_text())
    assert good["restart_gpu_s"] > 0 and good["checkpoint_gpu_s"] > 0
    # The goodput report shows the restart: lost steps and time from failure to resumed.
    assert [g["gpus"] for g in good["restarts"]] == [[first[1]]]
    assert good["lost_steps"] == s["lost_steps"]
    assert f"1 restart(s): {s['lost_steps']} step(s) recomputed" in stdout
    return s


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_torchrun_kill_recovers_at_reduced_tp(tmp_path: Path, reference: list[float]) -> None:
    out = tmp_path / "torchrun"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                "--max-restarts", "2", "--monitor-interval", "0.1")
    r = run_train([f"output.dir={out}", *COMMON, "checkpoint.interval=2",
                   "recovery.enabled=true"], launcher=torchrun,
                  env={"NUTP_FAULT": "kill:rank=1:step=5"}, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = _check_recovered(out, r.stdout, reference)
    print(f"torchrun kill test: detect {s['detect_s']:.2f} s, restart {s['restart_s']:.2f} s, "
          f"lost steps {s['lost_steps']}")


def test_gpu_slot_follows_the_node_not_the_launcher_rank() -> None:
    # torchrun's c10d rendezvous may give node 1 the global ranks 0..7 after a restart, and its
    # GROUP_RANK is join order too: only a node index from the environment is trusted.
    assert elastic.gpu_slot({"SLURM_NODEID": "1"}, world=16, local_rank=3, gpus_per_node=8) == 11
    assert elastic.gpu_slot({"NUTP_NODE_INDEX": "2", "SLURM_NODEID": "0"}, 12, 1, 4) == 9
    assert elastic.gpu_slot({"GROUP_RANK": "1"}, 8, 5, 8) == 5  # single node: node 0
    with pytest.raises(ValueError, match=r"WORLD_SIZE=16 spans several nodes.*NUTP_NODE_INDEX"):
        elastic.gpu_slot({"GROUP_RANK": "1"}, 16, 2, 8)
    with pytest.raises(ValueError, match=r"NUTP_NODE_INDEX='x'"):
        elastic.gpu_slot({"NUTP_NODE_INDEX": "x"}, 16, 2, 8)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=8.*gpus_per_node=8"):
        elastic.gpu_slot({}, 8, 8, 8)


def _wait_for(pred, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout_s
    while not pred():
        assert proc.poll() is None, "launcher exited early"
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def _events(rdir: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (rdir / "events.jsonl").read_text().splitlines() if x]
    except OSError:
        return []


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is None,
                    reason="nvidia-resiliency-ext (ft_launcher) not installed")
def test_ft_launcher_hang_then_gpu_back(tmp_path: Path, reference: list[float]) -> None:
    """ft_launcher, 8 workers: plan rank 5 hangs at step 3; the watchdog blames it (its peers
    wait in collectives), attempt 1 runs without GPU 5; the operator then reports GPUs 5 and 7
    back, and attempt 2 resumes on the full TP4xDP2 layout at the next checkpoint."""
    out = tmp_path / "ft"
    rdir = out / "recovery"
    log = tmp_path / "ft.log"
    ft_launcher = ("-m", "nvidia_resiliency_ext.fault_tolerance.launcher",
                   "--standalone", "--nproc-per-node", "8", "--max-restarts", "3",
                   "--monitor-interval", "0.1", "--ft-rank-heartbeat-timeout", "60",
                   "--ft-initial-rank-heartbeat-timeout", "300")
    proc = start_train([f"output.dir={out}", *COMMON, "checkpoint.interval=2",
                        "recovery.enabled=true", "recovery.heartbeat_timeout_s=6"],
                       log=log, launcher=ft_launcher, env={"NUTP_FAULT": "hang:rank=5:step=3"})
    try:
        # Attempt 1 decided (health report written without GPU 5): report GPUs 5, 7 back.
        _wait_for(lambda: any(e["event"] == "start" and e["attempt"] == 1
                              for e in _events(rdir)), 600, proc)
        (rdir / "health.json").write_text(json.dumps({"failed_gpus": []}))
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    losses = _losses(out)
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) <= TOL * abs(b), (losses, reference)
    first, _ = _layout()
    failed = sorted({first[5], *load_config([]).health.failed_gpus})
    _, degraded = _layout(f"health.failed_gpus=[{','.join(map(str, failed))}]")
    _, full = _layout("health=none")
    hang, back = json.loads((rdir / "summary.json").read_text())
    assert hang["cause"] == "hang" and hang["gpus"] == [first[5]] and hang["resume_step"] == 2
    assert "faults.py" in json.dumps([e for e in _events(rdir) if e["event"] == "failure"])
    assert hang["replica_tp"] == degraded
    assert back["cause"] == "gpu_back" and back["gpus"] == failed
    assert back["resume_step"] == 4 and back["replica_tp"] == full
    assert hang["lost_steps"] <= 2 and back["lost_steps"] <= 1
    assert json.loads((rdir / "health.json").read_text())["failed_gpus"] == []
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["replica_tp"] for r in rows][-1] == full
    print(f"ft_launcher: hang detect {hang['detect_s']:.2f} s, restart {hang['restart_s']:.2f} s;"
          f" GPU back: report->stop {back['detect_s']:.2f} s, restart {back['restart_s']:.2f} s, "
          f"lost steps {hang['lost_steps']}/{back['lost_steps']}")


def test_decide_ignores_an_earlier_run_and_stays_given_up(tmp_path: Path) -> None:
    cfg, rdir, ok = _decide_setup(tmp_path)
    # An earlier run in the same output dir left a hang record and exit records behind.
    (rdir / "hang.0.json").write_text(json.dumps({"ranks": [3], "reason": "old", "where": {},
                                                  "detected_at": 0.0}))
    _exit_records(rdir, 0, [0, 1], "terminated")
    (rdir / "events.jsonl").write_text(json.dumps({"t": 0, "event": "failure"}) + "\n")
    elastic.decide(cfg, rdir, 0, _posts(ok))
    (archive,) = rdir.glob("prev-*")
    assert (archive / "hang.0.json").exists() and not (rdir / "hang.0.json").exists()
    assert [e["event"] for e in _events(rdir)] == ["start"]
    # This run's attempt 0 ends with GPU 2's worker silent: only GPU 2 is blamed.
    _exit_records(rdir, 0, [g for g in range(8) if g != 2], "terminated")
    assert elastic.decide(cfg, rdir, 1, _posts(ok))["failed_gpus"] == [2, 7]
    # If attempt 1's worker 0 had died before deciding (no attempt.1.json), attempt 2 decides
    # from the newest record there is (attempt 0's) and its evidence.
    (rdir / "attempt.1.json").unlink()
    assert elastic.decide(cfg, rdir, 2, _posts(ok))["failed_gpus"] == [2, 7]
    # Every GPU reported failed: no plan; later attempts stay given up (no silent recovery).
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": list(range(8))}))
    _exit_records(rdir, 2, list(range(8)), "terminated")
    gave_up = elastic.decide(cfg, rdir, 3, _posts(ok))
    assert "error" in gave_up and gave_up["failed_gpus"] == list(range(8))
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": [7]}))
    assert elastic.decide(cfg, rdir, 4, _posts(ok)) == gave_up


CONTROL_CHILD = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    from nemo_nutp.train import elastic
    rec = elastic.ExitRecorder(Path(sys.argv[1]), 4)
    rec.install()
    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False,
                          timeout=timedelta(seconds=30))
    elastic.Control(store, rec, world=2, host=False).start()
    print("ready", flush=True)
    time.sleep(120)
""")


def test_abort_key_ends_every_worker(tmp_path: Path) -> None:
    """A worker blocked for good (srun would wait on it) leaves when another sets ``abort``."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    p = subprocess.Popen([sys.executable, "-c", CONTROL_CHILD, str(tmp_path), str(server.port)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    assert p.poll() is None  # no abort yet: keeps running
    server.set("abort", "test")
    assert p.wait(timeout=30) == elastic.EXIT_ABORT
    assert json.loads((tmp_path / "gpu4").read_text())["status"] == "aborted"


def test_a_requeued_run_carries_health_and_nodes_and_fires_no_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35 item 5: Slurm requeued the job (``SLURM_RESTART_COUNT``): attempt 0 of the new
    run keeps the run before's health report and node table (everything else is archived), so
    its failed GPU stays failed on the same host, whatever Slurm's order now; the injected
    faults fired in the first run and do not fire again."""
    from nemo_nutp.common.faults import Faults

    cfg, rdir, ok = _decide_setup(tmp_path, "cluster.gpus_per_node=4")
    d0 = elastic.decide(cfg, rdir, 0, _posts(ok, 4))
    assert d0["failed_gpus"] == [7]
    (rdir / "health.json").write_text(json.dumps({"failed_gpus": [2, 7]}))  # found later
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("NUTP_FAULT", "kill:rank=1:step=1")
    assert Faults.from_env_or_config(cfg) is None
    d = elastic.decide(cfg, rdir, 0, _posts(ok, 4, ("h2", "h1")))  # Slurm's order changed
    assert d["slots"] == [4, 5, 6, 7, 0, 1, 2, 3] and d["failed_gpus"] == [2, 7]
    assert (rdir / "events.jsonl").exists() and list(rdir.glob("prev-*"))
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert Faults.from_env_or_config(cfg) is not None
