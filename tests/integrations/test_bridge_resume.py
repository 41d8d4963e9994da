"""``nutp-bridge`` resumes its own checkpoints (``checkpoint.load``), in another layout.

A shrunk Bridge recipe with a decaying schedule (warmup, then cosine) trains under NUTP replicas
[2,1] through Bridge's own ``train()``, with ``checkpoint.load`` and ``checkpoint.save`` the same
folder, as Bridge's recipes ship: nothing is there, so it starts at step 0. It saves at step S
and at its end. A second run resumes ``iter_S`` (``checkpoint.ckpt_step``) with replicas [1,1,1]
(another layout, TP1) and trains to the end. Every resumed step's loss and grad norm equal the
uninterrupted run's within 1e-5, its lr is the uninterrupted run's (the scheduler's state came
back: the lr at step S is not the schedule's start), the data continues at the consumed samples,
and the consumed-sample count ends where the uninterrupted run's does. Both evaluate at every
step (``validation.eval_interval=1``): the resumed evaluations equal the uninterrupted run's,
the validation stream continuing at the saved consumed validation samples. Both runs write
into one ``output.dir``: its ``metrics.jsonl`` continues across the resume.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

if sys.version_info < (3, 12):  # the 3.11 env has no Bridge
    pytest.skip("Megatron-Bridge: Python 3.12 env", allow_module_level=True)

TOL = 1e-5
S, END = 2, 4  # the resumed checkpoint's step; train_iters
SCHEDULE = ["scheduler.lr_warmup_iters=1", "scheduler.lr_decay_style=cosine",
            f"scheduler.lr_decay_iters={END}", "optimizer.lr=0.01", "optimizer.min_lr=0.001",
            f"train.train_iters={END}", "validation.eval_iters=1", "validation.eval_interval=1"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(900)
def test_nutp_bridge_resumes_in_another_layout_and_the_schedule_continues(
        tmp_path: Path) -> None:
    from tests.helpers.bridge_jobs import resume_worker
    from tests.helpers.dist import spawn

    root = tmp_path / "ckpt"
    first = [*SCHEDULE, "model.tensor_model_parallel_size=2", "nutp.replicas=[2,1]",
             f"checkpoint.load={root}", f"checkpoint.save={root}",
             f"checkpoint.save_interval={S}"]
    second = [*SCHEDULE, "model.tensor_model_parallel_size=1", "nutp.replicas=[1,1,1]",
              f"checkpoint.load={root}", f"checkpoint.ckpt_step={S}"]
    spawn(resume_worker, 3, (first, second), tmp_path)
    u, r = json.loads((tmp_path / "resume_result.json").read_text())
    print(json.dumps(u), json.dumps(r))
    assert u["loaded"] is None and [row["step"] for row in u["steps"]] == list(range(END))
    assert u["saved"] == [str(root / f"iter_{S:07d}"), str(root / f"iter_{END:07d}")]
    assert r["loaded"] == str(root / f"iter_{S:07d}") and r["replica_tp"] == [[1], [1], [1]]
    assert [row["step"] for row in r["steps"]] == list(range(S, END))
    lrs = [row["lr"] for row in u["steps"]]
    assert len(set(lrs)) == END and lrs[S] != lrs[0]  # warmup then cosine: every step's own lr
    for got, want in zip(r["steps"], u["steps"][S:], strict=True):
        assert _rel(got["lr"], want["lr"]) <= 1e-12, (got, want)
        assert _rel(got["loss"], want["loss"]) <= TOL, (got, want)
        assert _rel(got["grad_norm"], want["grad_norm"]) <= TOL, (got, want)
    assert r["consumed"] == u["consumed"]
    # evaluation at every step: the resumed run's validation stream continues at the saved
    # consumed validation samples, so its evaluations are the uninterrupted run's
    assert [e["step"] for e in u["evals"]] == list(range(1, END + 1))
    assert [e["step"] for e in r["evals"]] == list(range(S + 1, END + 1))
    for got, want in zip(r["evals"], u["evals"][S:], strict=True):
        assert _rel(got["val_loss"], want["val_loss"]) <= TOL, (got, want)
    assert r["consumed_valid"] == u["consumed_valid"] == END * 6  # global batch 6
    # output.dir (both runs'): metrics.jsonl keeps the first run's rows before the resumed step
    # and has the resumed run's own after it, as nutp-train's resumed runs do; each evaluation
    # on the row of the step before Bridge's iteration; the first run's checkpoint saves are
    # charged in its goodput.json, the resumed run (no saves) charges none
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "grad_norm", "lr")
    assert [{k: x[k] for k in keys} for x in rows] == \
        [{k: x[k] for k in keys} for x in [*u["steps"][:S], *r["steps"]]]
    assert [x["val_loss"] for x in rows] == \
        [e["val_loss"] for e in [*u["evals"][:S], *r["evals"]]]
    saves = [json.loads((tmp_path / f"goodput_run{k}.json").read_text())["checkpoint_gpu_s"]
             for k in (0, 1)]
    assert saves[0] > 0 and saves[1] == 0, saves


def test_a_missing_checkpoint_is_named(tmp_path: Path) -> None:
    """``checkpoint.ckpt_step`` that is not there, and an empty ``checkpoint.load`` with
    ``checkpoint.exit_on_missing_checkpoint``: one line naming the field; an empty folder
    otherwise: step 0 (no path)."""
    from nemo_nutp.integrations.bridge_ckpt import NUTPBridgeCheckpointManager

    def manager(**kw: object) -> NUTPBridgeCheckpointManager:
        cfg = SimpleNamespace(**{"load": str(tmp_path), "ckpt_step": None,
                                 "exit_on_missing_checkpoint": False, **kw})
        return NUTPBridgeCheckpointManager(cfg, plan=None, groups=None)

    assert manager().resume_path() is None
    assert manager(load=None).resume_path() is None
    with pytest.raises(ValueError, match=r"^checkpoint\.ckpt_step=3: no checkpoint .*iter_0000003"):
        manager(ckpt_step=3).resume_path()
    with pytest.raises(ValueError, match=r"^checkpoint\.load=.*exit_on_missing_checkpoint=true"):
        manager(exit_on_missing_checkpoint=True).resume_path()
