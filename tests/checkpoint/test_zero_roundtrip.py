"""Checkpoints of the distributed optimizer (``train.distributed_optimizer``, sync/zero.py) are
megatron's non-distributed optimizer form: they load into any layout with or without it, and
the run continues as if uninterrupted (clipping on). fp32: losses within 1e-5 of a single-process
TP1 run; bf16: dist <-> not in the same layout within 1e-5 of the saving run's own uninterrupted
losses (the fp32 master weights and Adam state come back exactly)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import spawn
from tests.helpers.roundtrip import Job

TOL = 1e-5
C = {"clip_grad": 0.05}
Z = {**C, "distributed_optimizer": True}
PHASES: list[tuple[int, list[Job]]] = [
    (1, [Job("tp1", (1,), save=True, reference=True, extra=C)]),
    (7, [Job("tp4_tp3_zero", (4, 3), load=("tp1",), save=True, extra={**Z, "async_save": True}),
         Job("tp3_tp2_tp2", (3, 2, 2), load=("tp4_tp3_zero",), save=True, extra=C),
         Job("tp3_tp2_tp2_zero", (3, 2, 2), load=("tp4_tp3_zero",), extra=Z),
         Job("tp4_tp3_zero", (4, 3), load=("tp3_tp2_tp2",), extra=Z)]),
    (1, [Job("tp1_stock_opt", (1,), load=("tp4_tp3_zero",), extra=C)]),
]
"""TP4+TP3 with the distributed optimizer saves asynchronously (a step runs during the write).
not -> dist (TP1 -> TP4+TP3, TP3+TP2+TP2 -> TP4+TP3), dist -> not (TP4+TP3 -> TP3+TP2+TP2,
-> TP1), dist -> dist (same layout, and TP4+TP3 -> TP3+TP2+TP2)."""
BF16 = {"precision": "bf16", "clip_grad": 0.05, "model": {"add_bias_linear": True}}


def _results(tmp_path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in tmp_path.glob("*.json"):
        out.setdefault(f.stem.split("@")[0], {}).update(json.loads(f.read_text()))
    return out


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_zero_checkpoints_load_with_and_without_it(tmp_path: Path) -> None:
    from tests.helpers.roundtrip import worker

    for world, jobs in PHASES:
        spawn(worker, world, (jobs,), tmp_path)
    res = _results(tmp_path)
    ref = res["tp1"]["reference"]
    pairs = 0
    for dst, r in res.items():
        assert _rel(r.get("fresh", ref[:3])[:3], ref[:3]) <= TOL, (dst, r.get("fresh"))
        for key, losses in r.items():
            if key.startswith("from_") or key == "self":
                rel = _rel(losses, ref[3:])
                print(f"{key.removeprefix('from_'):>18} -> {dst:<18} loss_rel={rel:.1e}")
                assert rel <= TOL, (key, dst, losses, ref[3:])
                pairs += 1
    assert pairs == 8, pairs
    z = res["tp4_tp3_zero"]
    assert z["async_invisible_in_flight"] is True and z["async_complete"] is True, z


def _bf16_worker(rank: int, world: int, port: int, outdir: str) -> None:
    """bf16, TP2+TP1, the same plan: save after 3 steps with one optimizer, load with the other
    (fresh session), 2 more steps; and each optimizer's uninterrupted 5 steps."""
    from tests.helpers.dist import gloo_rank
    from tests.helpers.roundtrip import AFTER, SAVE_AT, _session

    def body() -> None:
        import torch.distributed as dist

        from nemo_nutp.checkpoint import load_checkpoint, save_checkpoint

        out: dict[str, Any] = {}
        for zero in (True, False):
            job = Job("bf16", (2, 1), extra={**BF16, "distributed_optimizer": zero})
            s = _session(job)
            out[f"ref_{zero}"] = [s.step(k).loss for k in range(SAVE_AT + AFTER)]
            s = _session(job)
            for k in range(SAVE_AT):
                s.step(k)
            save_checkpoint(s, f"{outdir}/ckpt_{zero}", step=SAVE_AT)
        for zero in (True, False):
            s = _session(Job("bf16", (2, 1), extra={**BF16, "distributed_optimizer": zero}))
            load_checkpoint(s, f"{outdir}/ckpt_{not zero}/iter_{SAVE_AT:07d}")
            out[f"from_{not zero}_into_{zero}"] = [s.step(k).loss
                                                   for k in range(SAVE_AT, SAVE_AT + AFTER)]
        # Control: the same load without the optimizer state must not continue the run.
        s = _session(Job("bf16", (2, 1), extra={**BF16, "distributed_optimizer": True}))
        load_checkpoint(s, f"{outdir}/ckpt_True/iter_{SAVE_AT:07d}", load_optimizer=False)
        out["weights_only"] = [s.step(k).loss for k in range(SAVE_AT, SAVE_AT + AFTER)]
        if dist.get_rank() == 0:
            Path(outdir, "bf16.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_zero_bf16_checkpoint_both_ways(tmp_path: Path) -> None:
    spawn(_bf16_worker, 3, (), tmp_path)
    r = json.loads((tmp_path / "bf16.json").read_text())
    print("bf16 zero vs not, uninterrupted:", _rel(r["ref_True"], r["ref_False"]))
    for src in (True, False):
        got, want = r[f"from_{src}_into_{not src}"], r[f"ref_{src}"][3:]
        print(f"bf16 distributed={src} -> distributed={not src}: loss_rel={_rel(got, want):.1e}")
        assert _rel(got, want) <= TOL, (src, got, want)
    control = _rel(r["weights_only"], r["ref_True"][3:])
    print(f"control, weights only (fresh Adam state): loss_rel={control:.1e}")
    assert control > 100 * TOL, control
