"""Live re-layout of a MoE job, in-process (``tests/helpers/moe_live_jobs.py``): layout [3, 2]
(8 experts: 2/3/3 and 4/4) trains 2 steps, a TP3 rank holding experts 2-4 dies, the 4
survivors move every expert whole with its Adam state in memory (``plan_move(experts=...)``,
``move_state``) into the layout [2, 2] and train 2 more steps. Against stock megatron-core
0.19 in one process (``moe_reference``), the Qwen3-MoE-shaped tiny model, sequence parallel,
clipping on every step, fp32:

* loss, grad norm and load-balancing loss of every step (before and after the move) within
  1e-5, every rank's grad norm the same bits, 0 router flips;
* the final parameters (every replica bitwise equal) within ``TENSOR_TOL``;
* each survivor receives exactly its lower bound (the plan's and the bytes on the wire), the
  experts only from survivors that held them; the posted p2p ops match per round (NCCL's rule);
  a move plan without the experts is refused by name before any collective; the live path's
  move (``live/link.move``, the experts read off the model) gives the same bits.

Negative control, run here: the experts that cross the wire left out of the move (their new
holders keep the fresh init and zero Adam state) leaves the parameter bounds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
    pytest.skip("MoE on CPU needs megatron-core 0.19 (the Python 3.12 leg)",
                allow_module_level=True)

from tests.helpers.dist import free_port, spawn
from tests.helpers.moe_live_jobs import BEFORE, OLD, worker
from tests.helpers.moe_reference import MoECase
from tests.helpers.shared_refs import moe_reference

TOL = 1e-5
TENSOR_TOL = 5e-5  # parameters after 4 Adam steps (as test_moe_parity.py)


@pytest.mark.timeout(600)
def test_kill_an_expert_holder_survivors_continue_exact(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = MoECase(name="qwen3_moe")
    path = moe_reference(case, tmp_path_factory)  # the session's (test_moe_parity's)
    ref = torch.load(path, weights_only=False)
    assert all(g > case.clip_grad for g in ref["grad_norms"])  # every step clips
    spawn(worker, sum(OLD), (free_port(), case, True, str(path)), tmp_path)
    res = json.loads((tmp_path / "moe_live.json").read_text())
    got = {k: res["before"][k] + res["after"][k] for k in res["before"]}
    rel = {k: [abs(a - b) / abs(b) for a, b in zip(got[n], ref[k], strict=True)]
           for k, n in (("losses", "losses"), ("grad_norms", "grad_norms"),
                        ("aux_losses", "aux"))}
    params = torch.load(tmp_path / "params.pt", weights_only=False)
    perr = max(float((params[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
               for k, v in ref["params"].items())
    control_loss = abs(res["control"][0] - ref["losses"][BEFORE]) / abs(ref["losses"][BEFORE])
    control = res["control"][1]  # the control's final parameters' worst relative error
    print(f"relative errors {rel}; params {perr:.2e}; flips {got['flips']}; control loss "
          f"{control_loss:.2e} params {control:.2e}"
          f"; received {res['plan_received']} lower bound {res['plan_lower_bound']}; experts in "
          f"{res['expert_received']}; wire {[r['report']['received_bytes'] for r in res['ranks']]}")
    assert all(got["norms_equal"]) and res["replicas_equal"], res
    assert got["flips"] == [0] * case.steps, got["flips"]
    assert max(max(v) for v in rel.values()) <= TOL, rel
    assert perr <= TENSOR_TOL, perr
    assert not res["unmatched"], res["unmatched"][:4]
    assert res["refused"].startswith("model.num_moe_experts: "), res["refused"]
    assert res["plan_received"] == res["plan_lower_bound"]
    for r in res["ranks"]:
        rep = r["report"]
        assert rep["received_bytes"] == rep["lower_bound_bytes"], rep
        assert not r["live_bad"], r  # live/link.move: the same bits as the move checked here
        assert r["link"]["received_bytes"] == rep["received_bytes"], r
    # as built (the init), every rank's experts differ from the moved (trained) ones
    assert all(r["fresh_differs"] for r in res["ranks"]), res["ranks"]
    n_in = {int(k): v for k, v in res["expert_received"].items()}
    assert sum(v > 0 for v in n_in.values()) == 2, n_in  # the degraded replica's survivors
    assert control > 100 * TENSOR_TOL, control  # negative control: experts not moved
