"""Issue 12 acceptance: checkpoints in megatron-core's own format, both ways.

Out: NUTP layouts TP4+TP3 and TP3+TP2+TP2 save; a *stock* megatron-core ``GPTModel`` (local
spec) at TP1 (one process) and TP2 (two processes, megatron's ``parallel_state``) loads them with
plain ``dist_checkpointing.load(model.sharded_state_dict(), dir)``; its logits equal the NUTP
run's within 1e-6 (max-abs relative), and the checkpoint's keys, global shapes and dtypes
(optimizer state included) are exactly those of the stock model's own checkpoint.

In: stock TP1 and TP2 checkpoints (Megatron-LM layout, megatron's optimizer state) resume in
TP4+TP3: full (optimizer and step) and weights-only (fresh optimizer, step 0); the losses equal
the stock model's own continuation within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import spawn
from tests.helpers.stock import AFTER, SAVE_AT

LAYOUTS = {"tp4_tp3": (4, 3), "tp3_tp2_tp2": (3, 2, 2)}
LOGITS_TOL, LOSS_TOL = 1e-6, 1e-5


def _run(world: int, task: str, args: tuple[Any, ...], out: Path) -> None:
    from tests.helpers.stock import worker

    spawn(worker, world, (task, args), out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _loss_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_megatron_format_both_ways(tmp_path: Path) -> None:
    _run(7, "nutp_save", (LAYOUTS,), tmp_path)
    _run(1, "stock", (1, list(LAYOUTS)), tmp_path)
    _run(2, "stock", (2, list(LAYOUTS)), tmp_path)
    _run(7, "nutp_resume", ((4, 3), ["stock_tp1", "stock_tp2", "nutp_tp3_tp2_tp2"]), tmp_path)
    stock = {tp: torch.load(tmp_path / f"stock_tp{tp}.pt", weights_only=False) for tp in (1, 2)}
    # Out: same keys, global shapes, dtypes as stock's own checkpoint (optimizer included);
    # NUTP adds only its per-rank RNG object.
    ref_meta = stock[1]["meta/stock"]
    for name in LAYOUTS:
        meta = {k: v for k, v in stock[1][f"meta/{name}"].items()
                if not k.startswith("nutp_rng_state")}
        assert meta == ref_meta, (name, set(meta) ^ set(ref_meta))
    model_keys = stock[1]["stock_model_keys"]
    assert all(ref_meta[k][0] == shape for k, shape in model_keys.items()), model_keys
    # Out: stock TP1 / TP2 logits equal the NUTP run's.
    for name in LAYOUTS:
        nutp = torch.load(tmp_path / f"nutp_{name}.pt", weights_only=False)["logits"]
        for tp in (1, 2):
            rel = _rel(stock[tp][f"logits/{name}"], nutp)
            print(f"NUTP {name} -> stock TP{tp}: logits max rel {rel:.1e}")
            assert rel <= LOGITS_TOL, (name, tp, rel)
    # In: stock TP1 / TP2 -> NUTP TP4+TP3, full and weights-only.
    res = torch.load(tmp_path / "nutp_resume.pt", weights_only=False)
    assert _loss_rel(stock[2]["fresh"], stock[1]["fresh"]) <= LOSS_TOL  # stock TP2 sanity
    for tp in (1, 2):
        full, weights = res[f"stock_tp{tp}/full"], res[f"stock_tp{tp}/weights"]
        assert (full["start"], full["optimizer"]) == (SAVE_AT, True), full
        assert (weights["start"], weights["optimizer"]) == (0, False), weights
        assert len(full["losses"]) == len(weights["losses"]) == AFTER
        rf, rw = (_loss_rel(full["losses"], stock[tp]["full"]),
                  _loss_rel(weights["losses"], stock[tp]["weights"]))
        print(f"stock TP{tp} -> NUTP TP4+TP3: full loss rel {rf:.1e}, weights-only {rw:.1e}")
        assert rf <= LOSS_TOL and rw <= LOSS_TOL, (tp, full, weights, stock[tp])
    # An asynchronously saved NUTP TP3+TP2+TP2 checkpoint (a step ran during its write) resumes
    # in TP4+TP3 like the uninterrupted stock TP1 run continues (full) / restarts (weights).
    saved = torch.load(tmp_path / "nutp_tp3_tp2_tp2.pt", weights_only=False)
    assert saved["async_invisible_in_flight"] is True and saved["async_complete"] is True
    full, weights = res["nutp_tp3_tp2_tp2/full"], res["nutp_tp3_tp2_tp2/weights"]
    assert (full["start"], weights["start"]) == (SAVE_AT, 0), (full, weights)
    rf, rw = (_loss_rel(full["losses"], stock[1]["full"]),
              _loss_rel(weights["losses"], stock[1]["weights"]))
    print(f"async NUTP TP3+TP2+TP2 -> NUTP TP4+TP3 vs uninterrupted stock TP1: full loss rel "
          f"{rf:.1e}, weights-only {rw:.1e}")
    assert rf <= LOSS_TOL and rw <= LOSS_TOL, (full, weights, stock[1])
    # the optimizer state matters: weights-only continues differently from a full resume
    assert stock[1]["weights"][1] != stock[1]["full"][1]
    _check_preflight_dims(tmp_path / "stock_tp2" / f"iter_{SAVE_AT:07d}")


def _check_preflight_dims(path: Path) -> None:
    """nutp-train's preflight on a stock checkpoint: model dims checked from its metadata."""
    from dataclasses import replace

    from nemo_nutp.checkpoint.store import check_dims_of_megatron_checkpoint
    from tests.helpers.stock import dims

    check_dims_of_megatron_checkpoint(path, dims())
    for field, value in (("vocab_size", 96), ("num_layers", 3), ("ffn_hidden_size", 64)):
        with pytest.raises(ValueError, match=rf"model\.{field}={value}: .* saved with"):
            check_dims_of_megatron_checkpoint(path, replace(dims(), **{field: value}))
