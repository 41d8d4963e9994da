"""Issue 34: MoE checkpoints both ways with *stock* megatron-core 0.19.2 (its one-process
``GPTModel`` with MoE layers, ``SequentialMLP`` experts, EP1: ``tests/helpers/moe_reference.py``).

The tiny Qwen3-MoE shape (8 experts top-2, aux loss, clipping on every step, fp32):

* NUTP at [3,2] (experts 2/3/3 and 4/4) trains 2 steps and saves; stock megatron-core loads the
  checkpoint with plain ``dist_checkpointing.load(model.sharded_state_dict())`` (and its
  optimizer's) into fresh weights and trains 2 more steps: losses and grad norms within 1e-5
  of NUTP continuing, the parameters after within ``TENSOR_TOL``;
* stock trains 2 steps and saves like Megatron-LM; NUTP resumes it at [2,2,1] and at [3,2]
  (model and Adam state): the same bounds against stock continuing, replicas bitwise equal.

Negative control, run here: the same NUTP state saved with the experts mislabelled (expert ``e``
at index ``E-1-e`` of megatron's expert axis) loads into stock megatron-core and trains off.
(Experts under their local indices, the other obvious mistake, megatron's own save refuses:
duplicate keys.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt_jobs import RESUME, SAVE_FROM, worker

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after Adam steps (as test_moe_parity / tests/helpers/parity.py)


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Worst relative errors of a record (losses, grad norms, final parameters per tensor)
    against another."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    assert set(got["params"]) == set(want["params"]), sorted(
        set(got["params"]) ^ set(want["params"]))
    return {"loss": _rel(got["losses"], want["losses"]),
            "grad_norm": _rel(got["norms"], want["norms"]),
            "params": max(rel(got["params"][k], want["params"][k]) for k in want["params"])}


def _within(err: dict[str, float]) -> bool:
    return err["loss"] <= TOL and err["grad_norm"] <= TOL and err["params"] <= TENSOR_TOL


def _run(world: int, task: str, args: tuple[Any, ...], out: Path) -> None:
    spawn(worker, world, (task, args), out)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_moe_checkpoints_both_ways_with_stock(tmp_path: Path) -> None:
    _run(1, "stock_first", (), tmp_path)
    worlds = sorted({sum(SAVE_FROM), *(sum(r) for r in RESUME)})
    for world in worlds:
        _run(world, "nutp", (True,), tmp_path)
    _run(1, "stock_loads", (["nutp", "nutp_mislabelled"],), tmp_path)
    stock = torch.load(tmp_path / "stock_first.pt", weights_only=False)
    res: dict[str, Any] = {}
    for world in worlds:
        res.update(torch.load(tmp_path / f"nutp_w{world}.pt", weights_only=False))
    loads = torch.load(tmp_path / "stock_loads.pt", weights_only=False)
    # the two runs agree before the save (the MoE parity, tests/train/test_moe_parity.py)
    err = _errors(res["nutp_fresh"], stock["stock_fresh"])
    print(f"before the save: NUTP {SAVE_FROM} vs stock {err}")
    assert _within(err) and res["nutp_fresh"]["replicas_equal"], err
    # NUTP saves -> stock loads (model and Adam state)
    assert isinstance(loads["nutp"], dict), loads["nutp"]
    err = _errors(loads["nutp"], res["nutp_continue"])
    print(f"NUTP {SAVE_FROM} saves -> stock loads, vs NUTP continuing: {err}")
    assert _within(err), err
    # stock saves -> NUTP resumes in each layout
    for replicas in RESUME:
        got = res[f"from_stock_{'_'.join(map(str, replicas))}"]
        err = _errors(got, stock["stock_continue"])
        print(f"stock saves -> NUTP {replicas} resumes, vs stock continuing: {err}")
        assert _within(err), (replicas, err)
        assert got["replicas_equal"] is True, replicas
    # negative control: experts mislabelled
    bad = loads["nutp_mislabelled"]
    assert isinstance(bad, dict), bad
    err = _errors(bad, res["nutp_continue"])
    print(f"control (experts mislabelled) -> stock, vs NUTP continuing: {err}")
    assert err["loss"] > 10 * TOL and not _within(err), err
