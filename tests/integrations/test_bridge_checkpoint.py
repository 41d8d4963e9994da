"""A checkpoint written by Bridge's loop in an NUTP layout (replicas [2,1]; Bridge's ``train()``
calls the NUTP checkpoint manager at ``checkpoint.save_interval``) resumes in ``nutp-train`` in
another layout (one TP3 replica, uneven shards) and continues within 1e-5 of the uninterrupted
Bridge run: same loss and grad norm at every step after the resume. The format is
megatron-core's (``nemo_nutp.checkpoint``); that a stock megatron-core ``GPTModel`` loads it is
``tests/checkpoint/test_megatron_format.py`` (the same writer)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(1500)
def test_bridge_checkpoint_resumes_in_nutp_train_in_another_layout(tmp_path: Path) -> None:
    from nemo_nutp.integrations.bridge_config import bridge_keys
    from nemo_nutp.launch.nutp_train import main
    from tests._dist import spawn

    from .bridge_jobs import load, saving_worker

    ckpt = tmp_path / "ckpt"
    overrides = ["model.tensor_model_parallel_size=2", "nutp.replicas=[2,1]",
                 "train.train_iters=4", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2"]
    spawn(saving_worker, 3, (overrides,), tmp_path)
    bridge = json.loads((tmp_path / "saving_result.json").read_text())
    assert [Path(p).name for p in bridge["saved"]] == ["iter_0000002", "iter_0000004"]
    job = load(overrides)
    out = tmp_path / "resumed"
    rc = main([*bridge_keys(job.bridge), "parallel.tp_base=3", "nutp.replicas=[3]",
               f"checkpoint.load_dir={ckpt / 'iter_0000002'}", "checkpoint.resume=required",
               f"output.dir={out}", "cluster.gpus_per_node=8"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"bridge": bridge["steps"], "nutp_train": rows}))
    resumed = {r["step"]: r for r in rows}
    assert sorted(resumed) == [3, 4] or sorted(resumed) == [2, 3], sorted(resumed)
    after = bridge["steps"][2:]
    for got, ref in zip([resumed[k] for k in sorted(resumed)], after, strict=True):
        assert _rel(got["loss"], ref["loss"]) <= TOL, (got, ref)
        assert _rel(got["grad_norm"], ref["grad_norm"]) <= TOL, (got, ref)
