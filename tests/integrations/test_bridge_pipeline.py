"""Pipeline parallelism under Bridge's own ``train()``: stages of different TP degree.

Bridge's Llama 3 8B recipe, shrunk to 4 layers for CPU (``bridge_pipeline_jobs.SHRUNK``) with
its training switches kept: the distributed optimizer, warmup then cosine decay, evaluation
during training, and (NUTP side) sequence parallelism. ``nutp-bridge`` trains it at PP=2 with
replicas ``[[2,1],[2,2]]`` (7 ranks: replica 0 has its second stage at TP1) from the initial
weights of Bridge's own stock uniform run of the same recipe (TP2 x PP2 x DP2, 8 ranks,
``bridge_stock.py``: Bridge's process groups, stock ``GPTModel``, megatron's DDP and
distributed optimizer, megatron's ``P2PCommunicator``, Bridge's ``train()``). In fp32, every
step's loss, grad norm and learning rate and every validation loss agree within 1e-5.

The stock side runs without sequence parallelism: megatron's ``WrappedTorchNorm`` refuses it
on CPU; the math is the same."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge runs on Python 3.12 (.venv312)", allow_module_level=True)
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5
# bf16 (measured, make bench): worst 1.0e-4 over every loss, grad norm and validation loss: a
# parameter whose fp32 master lands next to a bf16 rounding boundary may round the other way on
# one side (the sides sum the same gradients in another order). 1e-3 is ~10x that and far below
# a missing update (the loss moves ~5e-3 a step here).
BF16_TOL = 1e-3


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_stage_communicator_substitution_is_pinned() -> None:
    """The pinned Bridge builds its communicator where ``bridge_pipeline.SUBSTITUTED`` says (by
    the module-global name the substitution replaces); inside ``stage_communicator`` that name
    builds NUTP's, and the stock class is back after."""
    import importlib

    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from nemo_nutp.compat.bridge_cpu import install_import_shim
    from nemo_nutp.integrations.bridge_pipeline import SUBSTITUTED, stage_communicator

    install_import_shim()
    modules = {name: importlib.import_module(name) for name in SUBSTITUTED}
    for name, line in SUBSTITUTED.items():
        assert line in inspect.getsource(modules[name]), (name, line)
        assert modules[name].P2PCommunicator is P2PCommunicator

    class Plan:
        pp = 2

    class Groups:
        class ctx:
            rank = 0

    with stage_communicator(Plan(), Groups()):
        for m in modules.values():
            assert m.P2PCommunicator is not P2PCommunicator
    for m in modules.values():
        assert m.P2PCommunicator is P2PCommunicator


def _stock_then_nutp(precision: list[str], tmp_path: Path, nutp_only: tuple[str, ...] = ()
                     ) -> tuple[Any, Any, list[Any]]:
    """Bridge's stock TP2xPP2xDP2 run (8 ranks), then ``nutp-bridge`` at [[2,1],[2,2]] (7 ranks)
    from its initial weights (``nutp_only``: its own further overrides): (a last-stage stock
    rank's steps, its evaluations, every NUTP rank's record)."""
    from tests.helpers.bridge_pipeline_jobs import nutp_worker, stock_worker
    from tests.helpers.dist import spawn

    spawn(stock_worker, 8, (precision,), tmp_path)
    stock_ranks = [json.loads((tmp_path / f"stock_rank{r}.json").read_text()) for r in range(8)]
    stock = next(r for r in stock_ranks if not math.isnan(r[0]["loss"]))  # a last-stage rank
    evals = [json.loads((tmp_path / f"stock_evals_rank{r}.json").read_text()) for r in range(8)]
    stock_evals = next(e for e in evals if e and not math.isnan(e[0]["val_loss"]))
    init = str(tmp_path / "stock_init" / "iter_0000000")
    nutp_overrides = [*precision, "model.sequence_parallel=true", "nutp.replicas=[[2,1],[2,2]]",
                      "health=none", *nutp_only]
    spawn(nutp_worker, 7, (nutp_overrides, init), tmp_path)
    ranks = [json.loads((tmp_path / f"pipeline_rank{r}.json").read_text()) for r in range(7)]
    print(json.dumps({"stock": stock, "stock_evals": stock_evals, "nutp": ranks[0]}))
    assert len(stock) == 4
    assert [e["step"] for e in stock_evals] == [2, 4]
    assert {(r["replica"], r["stage"]) for r in ranks} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # the NUTP model runs it (honoured) on every stage above TP1 (megatron's SP needs TP > 1)
    assert all(r["sequence_parallel"] == (r["degree"] > 1) for r in ranks)
    return stock, stock_evals, ranks


def _check(stock: Any, stock_evals: Any, ranks: list[Any], tol: float) -> None:
    """Every rank, every stage: each step's loss, grad norm and lr, and every validation loss,
    the stock run's within ``tol``."""
    worst = 0.0
    for r in ranks:
        assert len(r["steps"]) == len(stock)
        for got, ref in zip(r["steps"], stock, strict=True):
            assert _rel(got["lr"], ref["lr"]) <= 1e-12, (got, ref)
            for key in ("loss", "grad_norm"):
                worst = max(worst, _rel(got[key], ref[key]))
                assert _rel(got[key], ref[key]) <= tol, (key, got, ref)
        assert [e["step"] for e in r["evals"]] == [2, 4]
        for got, ref in zip(r["evals"], stock_evals, strict=True):
            worst = max(worst, _rel(got["val_loss"], ref["val_loss"]))
            assert _rel(got["val_loss"], ref["val_loss"]) <= tol, (got, ref)
    print("worst rel", worst)


@pytest.mark.timeout(1500)
def test_bridge_pipeline_matches_bridge_stock_run(tmp_path: Path) -> None:
    from tests.helpers.bridge_pipeline_jobs import FP32

    stock, stock_evals, ranks = _stock_then_nutp(FP32, tmp_path)
    lrs = [s["lr"] for s in stock]
    assert lrs[0] < lrs[1] and lrs[2] > lrs[3]  # warmup, then decay
    _check(stock, stock_evals, ranks, TOL)


@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 3 min on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(1500)
def test_bridge_pipeline_bf16_matches_bridge_stock_run(tmp_path: Path) -> None:
    """The recipe's own precision, ``mixed_precision="bf16_mixed"`` by name: bf16 parameters in
    Bridge's ``Float16Module``, fp32 masters (NUTP's ZeRO-1 slices / megatron's distributed
    optimizer)."""
    stock, stock_evals, ranks = _stock_then_nutp([], tmp_path)
    _check(stock, stock_evals, ranks, BF16_TOL)


@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 3 min on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(1500)
def test_bridge_virtual_stages_match_bridge_stock_run(tmp_path: Path) -> None:
    """Virtual pipeline stages (``model.virtual_pipeline_model_parallel_size=2``: one layer per
    chunk, megatron's interleaved schedule), fp32: every rank's chunks are one NUTP DDP seen by
    Bridge as ``bridge_pipeline.ChunkView``s, and the stage communicator carries the
    interleaved exchanges between stages of different degree. The reference is Bridge's stock
    run without virtual stages (the same math: the same layers per stage, another order of
    micro-batches). Bridge's stock run *with* virtual stages was tried as the reference and
    is not one on CPU/gloo: from its own initial weights (checked: each chunk's layers at the
    global index megatron's checkpoint gives them) its step 0 differs from NUTP's (loss 5e-4,
    grad norm 14%), while NUTP's runs with and without virtual stages from those weights agree
    to the last printed digit, and NUTP without them equals Bridge's stock run without them
    (the test above). Not investigated further."""
    from tests.helpers.bridge_pipeline_jobs import FP32

    stock, stock_evals, ranks = _stock_then_nutp(
        FP32, tmp_path, nutp_only=("model.virtual_pipeline_model_parallel_size=2",))
    _check(stock, stock_evals, ranks, TOL)


@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 3 min on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(1500)
def test_bridge_virtual_stages_bf16_match_bridge_stock_run(tmp_path: Path) -> None:
    """The same with the recipe's own ``bf16_mixed``: within the pipeline bf16 case's
    tolerance."""
    stock, stock_evals, ranks = _stock_then_nutp(
        [], tmp_path, nutp_only=("model.virtual_pipeline_model_parallel_size=2",))
    _check(stock, stock_evals, ranks, BF16_TOL)
