"""``nutp-bridge recovery.mode=live`` on the shrunk Qwen3-MoE recipe (``bridge_moe_jobs``): the
supervised job, started as a user starts it (``python -m nemo_nutp.launch.bridge_cli``), beside
Bridge's own stock one-process run of the same steps from the same initial weights
(``bridge_moe_jobs.stock_worker``), for ``tests/integrations/test_bridge_moe_live.py``.

The job's ``--recipe`` is ``qwen3_moe_recipe`` below: every rank process loads the job from the
command line (the supervisor's fork server starts them), so this is where the test reaches
into them: the HF config read from the committed stand-in, and, switched by environment:

* ``NUTP_TEST_MOE_AUX=DIR``: every report of megatron's MoE metrics tracker (what Bridge's
  ``training_log`` logs) appends its load-balancing loss to ``DIR/aux_<pid>.jsonl``;
* ``NUTP_TEST_MOE_NO_EXPERT_MOVE=1`` (negative control): the live move leaves out the experts
  that cross the wire (their new holders keep the fresh init and zero Adam state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

STEPS = 4
"""train_iters of both runs."""
FAULT = "kill:rank=1:step=2:phase=forward"
"""Rank 1 (the TP2 replica's second rank: experts 4-7) is killed as step 2 starts (steps 0 and
1 committed at [2,1]); the survivors re-lay out to [1,1] (rank 0 takes experts 4-7 whole from
the TP1 replica) and run steps 2 and 3."""
CLUSTER = ["cluster.num_gpus=4", "cluster.domain_size=2", "cluster.gpus_per_node=4",
           "health.failed_gpus=[3]", "nutp.replicas=null", "model.tensor_model_parallel_size=2",
           "model.sequence_parallel=true"]
"""4 GPUs, GPU 3 failed: replicas [2,1] (8 experts: 4/4 and 8)."""
LIVE = ["recovery.enabled=true", "recovery.mode=live"]
JOB_TIMEOUT_S = 480
AUX = "NUTP_TEST_MOE_AUX"
NO_EXPERT_MOVE = "NUTP_TEST_MOE_NO_EXPERT_MOVE"


def qwen3_moe_recipe() -> Any:
    """Bridge's ``qwen3_30b_a3b_pretrain_config`` (HF config: the committed stand-in), with the
    module doc's switches installed in this process."""
    from tests.helpers.hf_offline import offline_hf

    offline_hf()
    if os.environ.get(AUX):
        _log_aux(Path(os.environ[AUX]))
    if os.environ.get(NO_EXPERT_MOVE) == "1":
        _drop_moved_experts()
    from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_30b_a3b_pretrain_config

    return qwen3_30b_a3b_pretrain_config()


def _log_aux(out: Path) -> None:
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    real = MoEMetricsTracker._aggregate
    if getattr(real, "_nutp_test", False):
        return

    def aggregate(self: Any, *args: Any, **kwargs: Any) -> Any:
        got = real(self, *args, **kwargs)
        if "load_balancing_loss" in got:
            with (out / f"aux_{os.getpid()}.jsonl").open("a") as f:
                f.write(json.dumps(float(got["load_balancing_loss"])) + "\n")
        return got

    aggregate._nutp_test = True  # type: ignore[attr-defined]
    MoEMetricsTracker._aggregate = aggregate  # type: ignore[method-assign]


def _drop_moved_experts() -> None:
    import dataclasses

    from nemo_nutp.relayout import move as relayout_move
    from nemo_nutp.relayout.plan import EXPERT

    real = relayout_move.move_state

    def move_state(mv: Any, **kwargs: Any) -> Any:
        cut = dataclasses.replace(mv, pieces=tuple(
            p for p in mv.pieces if p.space != EXPERT or mv.is_local(p)))
        return real(cut, **kwargs)

    relayout_move.move_state = move_state  # type: ignore[assignment]


def job_command(tmp_path: Path, steps: int) -> list[str]:
    """``nutp-bridge``'s command line: the shrunk recipe (``bridge_moe_jobs``' settings),
    ``CLUSTER``, ``LIVE``, ``steps`` steps, output in ``tmp_path/run``, Bridge's checkpoints
    (at the end only: recovery requires them) in ``tmp_path/ckpt``."""
    from tests.helpers.bridge_jobs import PARITY
    from tests.helpers.bridge_moe_jobs import CPU, TINY

    return [sys.executable, "-m", "nemo_nutp.launch.bridge_cli", "--recipe",
            f"{__name__}:qwen3_moe_recipe", "--config-file", str(TINY), "--output-dir",
            str(tmp_path / "run"), *PARITY, *CPU, *CLUSTER, *LIVE, f"train.train_iters={steps}",
            f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=1000"]


def stock_worker(rank: int, world: int, port: int, steps: int, outdir: str) -> None:
    """Bridge's stock one-process run (``bridge_moe_jobs.stock_worker``) of ``steps`` steps;
    also the load-balancing loss it logged (``stock_aux.json``)."""
    from tests.helpers.bridge_moe_jobs import stock_worker as stock
    from tests.helpers.bridge_moe_pipeline_jobs import logged_aux

    logged = logged_aux()
    stock(rank, world, port, [f"train.train_iters={steps}"], outdir)
    Path(outdir, "stock_aux.json").write_text(json.dumps(logged))


def live_job(tmp_path: Path, *, control: bool = False, fault: str = FAULT,
             grow: bool = False, steps: int = STEPS) -> dict[str, Any]:
    """The job (``fault``; ``control``: ``NO_EXPERT_MOVE``; ``grow``: GPU 3 reported back as the
    first world starts, ``bridge_live_jobs.report_back``) and, beside it, the stock run in
    ``tmp_path/stock``. Returns the job's metrics rows, events, every process's logged
    load-balancing losses (pid -> list), its checkpoints, and the stock run's per-step records
    and logged losses."""
    from nemo_nutp.common.procs import kill_session
    from tests.helpers.bridge_live_jobs import report_back
    from tests.helpers.dist import spawn
    from tests.helpers.live import metric_rows, read_events

    aux = tmp_path / "aux"
    aux.mkdir()
    env = {**os.environ, "NUTP_FAULT": fault, "NUTP_LIVE_DIGEST": "1", AUX: str(aux),
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                     os.environ.get("PYTHONPATH")) if p)}
    if control:
        env[NO_EXPERT_MOVE] = "1"
    log = tmp_path / "run.log"
    with log.open("w") as f:
        proc = subprocess.Popen(job_command(tmp_path, steps), stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=env)
    try:
        if grow:
            report_back(tmp_path / "run", proc, log)
        ref = tmp_path / "stock"  # beside the job
        ref.mkdir()
        spawn(stock_worker, 1, (steps,), ref)
        rc = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        kill_session(proc.pid)
        proc.wait()
    assert rc == 0, log.read_text()[-6000:]
    out = tmp_path / "run"
    got: dict[str, Any] = {
        "rows": metric_rows(out), "events": read_events(out),
        "aux": {int(p.stem[4:]): [json.loads(x) for x in p.read_text().splitlines()]
                for p in aux.glob("aux_*.jsonl")},
        "checkpoints": sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")),
        "stock": json.loads((ref / "stock_rank0.json").read_text()),
        "stock_aux": json.loads((ref / "stock_aux.json").read_text())}
    return got
