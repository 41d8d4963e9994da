"""Multi-GPU checks under NCCL (``pytest -m gpu``; ``make gpu-check`` runs them), each skipped,
with the reason, when fewer GPUs are visible than it needs. NEVER RUN: no machine with 2 or
more GPUs was lent while they were written; they are the claims to check.

1. NCCL parity against stock megatron-core (``tests/helpers/reference.py``, one CPU process
   with CUDA hidden, exactly as CI runs it), with the checks and tolerances of
   ``tests/train/test_parity.py`` (``check_cases``), clipping on, fp32 with TF32 off:
   two TP1 replicas (2 GPUs: bucket all-reduces and the norm on NCCL communicators), TP2+TP1
   (3 GPUs: leaders' replicated buckets, the TP-group norm all-reduce) and TP3+TP2 in the
   ``base`` sync layout (5 GPUs: the reshard p2p, un-batched in the pair order from the
   backward hooks, and the batched return path; the only one of the three that moves units).
2. The live path's backend adapter (``live/backend.py``, 2 GPUs): a rank left inside an
   NCCL all-reduce its peer never joins is released by ``abandon()`` (``ProcessGroup.abort``),
   and both ranks then join a new NCCL world (ranks swapped) on the same store, where an
   all-reduce is correct.

Each world is one ``torch.multiprocessing`` spawn (``tests.helpers.dist.spawn``: spawn start method
under CUDA), one GPU per rank.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _need(gpus: int, what: str) -> None:
    have = torch.cuda.device_count()
    if have < gpus:
        pytest.skip(f"{what} needs {gpus} GPUs (one per rank), {have} visible")


def _cases(gpus: int) -> list[Any]:
    from tests.helpers.parity import CLIP, GQA_SWIGLU, Case

    if gpus == 2:
        return [Case("nccl_tp1_tp1_clip", (1, 1), GQA_SWIGLU, clip_grad=CLIP, global_batch=5)]
    if gpus == 3:
        return [Case("nccl_tp2_tp1_clip", (2, 1), dict(gated_linear_unit=False), clip_grad=CLIP,
                     global_batch=5)]
    return [Case("nccl_tp3_tp2_base_clip", (3, 2), GQA_SWIGLU, clip_grad=CLIP, global_batch=7,
                 sync_layout="base")]


def _error_file(outdir: str, rank: int) -> None:
    with open(os.path.join(outdir, f"error_rank{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())


def reference_worker(rank: int, world: int, port: int, cases: list[Any], outdir: str) -> None:
    """The stock-megatron reference as CI runs it: CUDA hidden before anything touches it, so
    it runs on CPU with the CPU patches."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from tests.helpers.reference import reference_worker as cpu_reference

    cpu_reference(rank, world, port, cases, outdir)


def parity_worker(rank: int, world: int, port: int, cases: list[Any], outdir: str) -> None:
    """One NCCL rank on GPU ``rank``: every case through the parity harness's ``run_case``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        import nemo_nutp.train.session as session_mod
        from tests.helpers.parity import run_case

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        # fp32 parity with a CPU reference: no TF32 (the session would turn it on for fp32)
        session_mod.enable_cuda_math = lambda precision: None  # type: ignore[assignment]
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        for case in cases:
            run_case(case, outdir, device=device)
        dist.destroy_process_group()
    except BaseException:
        _error_file(outdir, rank)
        raise


@pytest.mark.timeout(420)
@pytest.mark.parametrize("gpus", [2, 3, 5])
def test_nccl_parity_with_stock_megatron(gpus: int, tmp_path: Path,
                                         record_property: Any) -> None:
    _need(gpus, f"the NCCL parity run of {_cases(gpus)[0].name}")
    from tests.helpers.dist import spawn
    from tests.helpers.parity import check_cases

    cases = _cases(gpus)
    spawn(reference_worker, 1, (cases,), tmp_path)
    t0 = time.perf_counter()
    spawn(parity_worker, gpus, (cases,), tmp_path)
    record_property("nccl_world_s", time.perf_counter() - t0)
    res = {c.name: json.loads((tmp_path / f"{c.name}.json").read_text()) for c in cases}
    for name, r in res.items():
        record_property(f"{name}_loss_rel", max(r["loss_rel"]))
        record_property(f"{name}_grad_rel", r["grad_rel_max"])
        record_property(f"{name}_model_rel", r["model_rel"])
    check_cases(res, cases)


def adapter_worker(rank: int, world: int, port: int, outdir: str) -> None:
    """Old world (NCCL, ranks as spawned): one good all-reduce, then rank 0 alone enters a
    second one; ``abandon`` on both; new world (ranks swapped) on the same store."""
    from datetime import timedelta

    import torch.distributed as dist

    from nemo_nutp.live import backend

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=120))
        backend.install()
        backend.join(store, gen=0, rank=rank, world=world, backend="nccl", timeout_s=120)
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        ok_old = bool((t == world).all())
        stuck = None
        if rank == 0:  # the peer never joins this one: under NCCL it stays in flight
            stuck = dist.all_reduce(torch.ones(4, device=device), async_op=True)
        store.set(f"entered{rank}", "1")
        store.wait([f"entered{r}" for r in range(world)])
        t0 = time.perf_counter()
        groups = backend.abandon()
        abandon_s = time.perf_counter() - t0
        new_rank = world - 1 - rank
        backend.join(store, gen=1, rank=new_rank, world=world, backend="nccl", timeout_s=120)
        u = torch.full((4,), float(new_rank + 1), device=device)
        dist.all_reduce(u)
        ok_new = bool((u == world * (world + 1) / 2).all())
        torch.cuda.synchronize()
        dist.destroy_process_group()
        backend.uninstall()
        del stuck
        with open(os.path.join(outdir, f"adapter{rank}.json"), "w") as f:
            json.dump({"ok_old": ok_old, "ok_new": ok_new, "abandon_s": abandon_s,
                       "groups": groups}, f)
    except BaseException:
        _error_file(outdir, rank)
        raise


@pytest.mark.timeout(300)
def test_live_adapter_abandons_a_stuck_nccl_world_and_joins_a_new_one(
        tmp_path: Path, record_property: Any) -> None:
    _need(2, "the live re-layout adapter under NCCL")
    from tests.helpers.dist import spawn

    spawn(adapter_worker, 2, (), tmp_path)
    got = [json.loads((tmp_path / f"adapter{r}.json").read_text()) for r in range(2)]
    record_property("abandon_s_max", max(g["abandon_s"] for g in got))
    assert all(g["ok_old"] and g["ok_new"] for g in got), got
    assert all(g["groups"] >= 1 for g in got), got
    assert max(g["abandon_s"] for g in got) < 60, got  # released, not the group's timeout
