"""The recipe's distributed optimizer under ``nutp-bridge``: the shrunk vanilla GPT recipe with
``optimizer.use_distributed_optimizer=true`` (and ``ddp.use_distributed_optimizer=true``) runs
NUTP's ZeRO-1 (``integrations/bridge_zero.py``) through Bridge's own ``train()`` with replicas
[2,1], fp32, clipping on and active; every step's loss and grad norm equal a stock
single-process megatron-core run of the same model and data within 1e-5, the final parameters
are within the project's Adam tolerance, the replicas are bitwise equal, the recipe's scheduler
drives the ZeRO groups' lr and weight decay, the optimizer state is sharded (each element kept
once in the world, not once per replica), and the checkpoint Bridge's loop saved reloads the
sharded state bitwise; ``ddp.overlap_param_gather`` is honoured (each step's parameter
all-gather completes in the next forward's pre-hook, or at the checkpoint save). A ZeRO
checkpoint of [2,1] resumes in [1,1,1] through ``checkpoint.load`` as the uninterrupted run
continues; half precision with it is refused by name (fp32 only)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge needs Python 3.12", allow_module_level=True)
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(900)
def test_bridge_distributed_optimizer_is_nutp_zero_and_matches_stock_megatron(
        tmp_path: Path) -> None:
    from tests.helpers.bridge_jobs import load, reference_batches, reference_case
    from tests.helpers.bridge_zero_jobs import zero_worker
    from tests.helpers.dist import spawn
    from tests.helpers.parity import TENSOR_TOL, run_references

    t0 = time.perf_counter()
    root = tmp_path / "ckpt"
    overrides = ["model.tensor_model_parallel_size=2", "nutp.replicas=[2,1]",
                 "optimizer.use_distributed_optimizer=true",
                 "ddp.use_distributed_optimizer=true", "ddp.overlap_param_gather=true",
                 # substituted: NUTP's ZeRO-1 at the recipe's fp32 dtypes (the defaults)
                 "optimizer.use_precision_aware_optimizer=true", f"checkpoint.save={root}"]
    job = load(overrides)
    assert job.nutp.train.distributed_optimizer  # the plan counts ZeRO's memory
    assert job.bridge.optimizer.weight_decay != job.nutp.train.weight_decay == 0.033
    data = reference_batches(overrides, tmp_path / "ref_batches.pt")
    base = reference_case(job, data)  # stock megatron-core, its non-distributed optimizer
    run_references([base, replace(base, name="bridge_no_wd", weight_decay=0.0)], tmp_path)
    t1 = time.perf_counter()
    spawn(zero_worker, 3, (overrides,), tmp_path)
    print(f"reference {t1 - t0:.1f} s, NUTP world {time.perf_counter() - t1:.1f} s")
    r = json.loads((tmp_path / "zero_result.json").read_text())
    print(json.dumps({k: v for k, v in r.items() if k not in ("param_rel", "param_rel_no_wd")}))
    print("max param rel", max(r["param_rel"].values()),
          "no-wd control", max(r["param_rel_no_wd"].values()))
    assert len(r["steps"]) == job.bridge.train.train_iters == len(r["ref_losses"])
    for got, loss, norm in zip(r["steps"], r["ref_losses"], r["ref_grad_norms"], strict=True):
        assert _rel(got["loss"], loss) <= TOL, (got, loss)
        assert _rel(got["grad_norm"], norm) <= TOL, (got, norm)
        assert norm > 0.05  # optimizer.clip_grad=0.05: clipping active at every step
        assert got["lr"] == 0.001
    assert r["replicas_bitwise_equal"]
    assert max(r["param_rel"].values()) <= TENSOR_TOL, r["param_rel"]
    # The scheduler drove the ZeRO groups' weight decay (0.033 x wd_mult; the optimizer's own
    # 0.1 never applied): without it the reference ends outside the tolerance.
    assert max(r["param_rel_no_wd"].values()) > TENSOR_TOL, r["param_rel_no_wd"]
    for rank in r["ranks"]:
        assert rank["zero"] and not rank["ddp_distributed"], rank
        assert rank["group_wd"] == [0.0, 0.033] and rank["group_lr"] == [0.001], rank
        # Sharded: each rank keeps the Adam state of its slices only, far less than the
        # non-distributed optimizer's (one per local parameter element) ...
        assert 0 < rank["state_numel"] < 0.6 * rank["local_numel"], rank
        assert rank["reload_bitwise"], rank
        # ddp.overlap_param_gather honoured: every step's parameter all-gather was left in
        # flight by step() and completed by the next forward's pre-hook, the last one by
        # the checkpoint save that followed it
        assert rank["overlap"], rank
        assert rank["settled"] == {"forward": len(r["steps"]) - 1, "checkpoint": 1}, rank
    # ... and the world keeps every element's state once (the non-distributed optimizer:
    # once per replica, and the TP2 replica's replicated norms/biases on both of its ranks).
    assert sum(x["state_numel"] for x in r["ranks"]) == r["global_numel"]
    assert sum(x["local_numel"] for x in r["ranks"]) > 2 * r["global_numel"]
    assert r["saved"] == [str(root / f"iter_{len(r['steps']):07d}")]


@pytest.mark.timeout(900)
def test_bridge_zero_checkpoint_resumes_in_another_layout(tmp_path: Path) -> None:
    """``tests/integrations/test_bridge_resume.py``'s case with the distributed optimizer on in
    both runs: [2,1] (ZeRO slices over owner groups of 2) trains a warmup + cosine schedule to
    END, saving at S; [1,1,1] (groups of 3, other slices) resumes ``iter_S`` through Bridge's
    checkpoint manager and continues as the uninterrupted run did (loss, grad norm, lr)."""
    from tests.helpers.bridge_jobs import resume_worker
    from tests.helpers.dist import spawn

    s, end = 2, 4
    schedule = ["scheduler.lr_warmup_iters=1", "scheduler.lr_decay_style=cosine",
                f"scheduler.lr_decay_iters={end}", "optimizer.lr=0.01", "optimizer.min_lr=0.001",
                f"train.train_iters={end}", "optimizer.use_distributed_optimizer=true",
                "ddp.use_distributed_optimizer=true", "ddp.overlap_param_gather=true"]
    root = tmp_path / "ckpt"
    first = [*schedule, "model.tensor_model_parallel_size=2", "nutp.replicas=[2,1]",
             f"checkpoint.save={root}", f"checkpoint.save_interval={s}"]
    second = [*schedule, "model.tensor_model_parallel_size=1", "nutp.replicas=[1,1,1]",
              f"checkpoint.load={root}", f"checkpoint.ckpt_step={s}"]
    t0 = time.perf_counter()
    spawn(resume_worker, 3, (first, second), tmp_path)
    print(f"world {time.perf_counter() - t0:.1f} s")
    u, r = json.loads((tmp_path / "resume_result.json").read_text())
    print(json.dumps(u), json.dumps(r))
    assert r["loaded"] == str(root / f"iter_{s:07d}") and r["replica_tp"] == [[1], [1], [1]]
    assert [row["step"] for row in r["steps"]] == list(range(s, end))
    lrs = [row["lr"] for row in u["steps"]]
    assert len(set(lrs)) == end  # the scheduler set every step's own lr in the ZeRO groups
    worst = 0.0
    for got, want in zip(r["steps"], u["steps"][s:], strict=True):
        assert _rel(got["lr"], want["lr"]) <= 1e-12, (got, want)
        assert _rel(got["loss"], want["loss"]) <= TOL, (got, want)
        assert _rel(got["grad_norm"], want["grad_norm"]) <= TOL, (got, want)
        worst = max(worst, _rel(got["loss"], want["loss"]), _rel(got["grad_norm"],
                                                                 want["grad_norm"]))
    print("resumed vs uninterrupted, worst rel", worst)
    assert r["consumed"] == u["consumed"]


def test_half_precision_with_the_distributed_optimizer() -> None:
    """bf16 (the model's flags, or ``mixed_precision`` by name) trains with NUTP's ZeRO-1: the
    model sits in Bridge's ``Float16Module``, one parameter dtype, fp32 masters in the slices
    (``test_bridge_uniform``'s bf16 case compares it with Bridge's stock distributed
    optimizer). fp16 is refused by name: NUTP's ZeRO-1 keeps no loss scaler."""
    from tests.helpers.bridge_jobs import load

    zero = ["optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"]
    for half in (["model.bf16=true", "optimizer.bf16=true"], ["mixed_precision=bf16_mixed"]):
        job = load([*zero, *half])
        assert job.nutp.train.distributed_optimizer and job.nutp.train.precision == "bf16"
    with pytest.raises(ValueError, match=r"^optimizer.use_distributed_optimizer=True: not with "
                                         r"fp16 under NUTP"):
        load([*zero, "model.fp16=true", "optimizer.fp16=true"])


def test_the_precision_aware_optimizer_is_substituted_only_at_fp32() -> None:
    """``optimizer.use_precision_aware_optimizer=true`` (TE's fused Adam keeping the masters
    and moments in the dtypes given) runs as NUTP's ZeRO-1 with a notice when every dtype is
    fp32 (the same Adam; the training case above runs it); any other dtype is refused by name,
    and so is the switch without the distributed optimizer (megatron's own rule)."""
    import torch

    from nemo_nutp.integrations.bridge_fields import notices
    from tests.helpers.bridge_jobs import load

    zero = ["optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"]
    job = load([*zero, "optimizer.use_precision_aware_optimizer=true"])
    assert any(n.startswith("optimizer.use_precision_aware_optimizer=True: NUTP's distributed")
               for n in notices(job.bridge)), notices(job.bridge)
    with pytest.raises(ValueError, match=r"^optimizer.use_precision_aware_optimizer=True: needs "
                                         r"the distributed optimizer"):
        load(["optimizer.use_precision_aware_optimizer=true"])
    job = load(zero)
    job.bridge.optimizer.exp_avg_dtype = torch.bfloat16
    from nemo_nutp.integrations.bridge_fields import check_container

    with pytest.raises(ValueError, match=r"optimizer.exp_avg_dtype=torch.bfloat16"):
        check_container(job.bridge)
