"""MoE checkpoints through ``nutp-bridge`` (issue #34): Bridge's Qwen3-30B-A3B recipe shrunk
(``bridge_moe_jobs``: 8 experts top-2, aux loss, fp32, clipping) trains 4 steps at replicas
[2,1] (experts 4/4 and 8) with ``checkpoint.save`` every 2 steps through Bridge's own
``train()``; a second run resumes ``iter_2`` at [1,1,1] (TP1 replicas, 8 experts each: every
expert moves) and trains to the end. Every resumed step's loss and grad norm equal the
uninterrupted run's within 1e-5 (model, Adam state, the schedule and the data position came
back); the replicas end bitwise equal. (Stock megatron-core loading NUTP's MoE checkpoints and
NUTP resuming stock's: ``tests/checkpoint/test_moe_checkpoint.py``.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5
S, END = 2, 4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(900)
def test_nutp_bridge_moe_resumes_its_checkpoint_in_another_layout(tmp_path: Path) -> None:
    from tests.helpers.bridge_fork import spawn_bridge
    from tests.helpers.bridge_moe_ckpt_jobs import resume_worker
    from tests.helpers.bridge_moe_jobs import NUTP

    root = tmp_path / "ckpt"
    first = [*NUTP, f"train.train_iters={END}", f"checkpoint.load={root}",
             f"checkpoint.save={root}", f"checkpoint.save_interval={S}"]
    second = ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
              "nutp.replicas=[1,1,1]", f"train.train_iters={END}", f"checkpoint.load={root}",
              f"checkpoint.ckpt_step={S}"]
    spawn_bridge(resume_worker, 3, (first, second), tmp_path)
    u, r = json.loads((tmp_path / "moe_resume.json").read_text())
    print(json.dumps(u), json.dumps(r))
    assert u["loaded"] is None and [row["step"] for row in u["steps"]] == list(range(END))
    assert str(root / f"iter_{S:07d}") in u["saved"]
    assert r["loaded"] == str(root / f"iter_{S:07d}") and r["replica_tp"] == [[1], [1], [1]]
    assert [row["step"] for row in r["steps"]] == list(range(S, END))
    errs = {k: [_rel(a[k], b[k]) for a, b in zip(r["steps"], u["steps"][S:], strict=True)]
            for k in ("loss", "grad_norm")}
    print(f"resumed at [1,1,1] vs uninterrupted [2,1]: {errs}")
    for k in ("loss", "grad_norm"):
        assert max(errs[k]) <= TOL, errs
    assert u["replicas_bitwise_equal"] and r["replicas_bitwise_equal"]
