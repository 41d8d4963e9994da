"""Spawned TP3+TP2 world (``base`` sync layout: the TP2 replica reshards), one session per
variant, the same weights and batches:

* bucket size does not change the numbers: many small buckets and reshard messages
  (``bucket_size`` = 50 elements) give the same synchronised gradients and grad-norm bits as one
  bucket per group and one message per peer (two replicas: every element is one commutative
  sum, so the packing cannot change a bit);
* ``grad_reduce_in_fp32=False`` really reduces in bf16
  (``main_grad`` and the buckets are bf16), replicas stay bitwise identical, and the gradients
  are within the bf16 tolerance of the fp32-reduced ones (which tests/train/test_parity.py
  checks against stock megatron).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import spawn


def _session(precision: str, in_fp32: bool, bucket_size: int | None) -> Any:
    from nemo_nutp.train.session import Precision, build_session
    from tests.helpers.parity import Case, make_plan

    plan = make_plan(Case("buckets", (3, 2), model=dict(add_bias_linear=True), global_batch=5,
                          sync_layout="base"))
    return build_session(plan, plan.request.model, lr=1e-3, seed=7, micro_batch_size=2,
                         bucket_size=bucket_size,
                         precision=Precision(precision, grad_reduce_in_fp32=in_fp32))


def _step0(s: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tests.helpers.parity import _gather_replicas

    got: dict[str, Any] = {}

    def at_sync() -> None:
        got["grads"] = _gather_replicas(s, grads=True)
        got["dtypes"] = sorted({str(p.main_grad.dtype) for p in s.model.parameters()})

    norm = s.step(0, after_sync=at_sync).grad_norm
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, repr(norm))
    reps = got["grads"]
    equal = all(torch.equal(r[k], reps[0][k]) for r in reps[1:] for k in reps[0])
    eng = s.model.nutp_engine
    transfers = sum(len(e.sends) for e in eng.order)
    return {"grads": reps[0] if reps else {}, "norms": every, "replicas_equal": equal,
            "dtypes": got["dtypes"], "buckets": len(eng.buckets),
            "messages": (len(eng.out_msgs), transfers), "sent": eng.sent_bytes}


def _body(outdir: str) -> None:
    import torch
    import torch.distributed as dist

    runs = {"one": _step0(_session("fp32", True, None)),
            "small": _step0(_session("fp32", True, 50)),
            "bf16_fp32": _step0(_session("bf16", True, None)),
            "bf16_bf16": _step0(_session("bf16", False, None))}
    buckets: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(buckets, [(runs[n]["buckets"], *runs[n]["messages"], runs[n]["sent"])
                                     for n in ("one", "small")])
    if dist.get_rank() == 0:
        def rel(a: dict[str, Any], b: dict[str, Any]) -> float:
            return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)

        res = {"small_bitwise": all(torch.equal(runs["small"]["grads"][k], v)
                                    for k, v in runs["one"]["grads"].items()),
               "small_norms": runs["small"]["norms"], "one_norms": runs["one"]["norms"],
               "buckets": buckets,
               "bf16_rel": rel(runs["bf16_bf16"]["grads"], runs["bf16_fp32"]["grads"]),
               **{f"{n}_{k}": runs[n][k] for n in runs for k in ("replicas_equal", "dtypes")}}
        Path(outdir, "res.json").write_text(json.dumps(res))
    dist.barrier()


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    gloo_rank(rank, world, port, outdir, lambda: _body(outdir))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_bucket_size_and_reduce_dtype(tmp_path: Path) -> None:
    from tests.helpers.parity import BF16_TOL

    spawn(worker, 5, (), tmp_path)
    r = json.loads((tmp_path / "res.json").read_text())
    per_rank = r["buckets"]  # [(buckets, messages sent, transfers, bytes sent)] one, small
    assert all(small[0] > one[0] for one, small in per_rank), per_rank  # really more buckets
    assert any(one[2] > one[1] > 0 for one, _ in per_rank), per_rank  # coalesced messages
    assert all(small[1] > one[1] for one, small in per_rank if one[1]), per_rank
    assert all(one[3] == small[3] for one, small in per_rank), per_rank  # same bytes moved
    assert any(one[3] > 0 for one, _ in per_rank), per_rank
    assert r["small_bitwise"]
    assert r["small_norms"] == r["one_norms"] and len(set(r["one_norms"])) == 1
    for name in ("one", "small", "bf16_fp32", "bf16_bf16"):
        assert r[f"{name}_replicas_equal"], name
    assert r["bf16_bf16_dtypes"] == ["torch.bfloat16"], r["bf16_bf16_dtypes"]
    assert r["bf16_fp32_dtypes"] == ["torch.float32"], r["bf16_fp32_dtypes"]
    assert 0.0 < r["bf16_rel"] <= BF16_TOL, r["bf16_rel"]
