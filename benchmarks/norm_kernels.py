"""The grad norm's kernels per step, per piece vs fused per bucket (issue #22, finding 11).

One rank's real ``GradSyncEngine`` (torch's fake process-group backend, parameters of the
rank's real shard shapes on ``meta``: buckets, pieces and norm slots as a job builds them),
then every bucket once with real data on this CPU (one bucket buffer at a time, random
values), its pieces' sums of squares added into the norm slots two ways:

* ``per_piece``: what the engine did before — per piece a slice, ``norm.sumsq`` (square, fp64
  sum) and an add into its slot;
* ``fused``: what it does now — ``norm.add_bucket`` (foreach squares, one foreach fp64 L1
  norm per run of ``norm.SQUARES_ELEMENTS``, one ``index_add_`` into the slots).

Per step: aten operators dispatched (counted by a ``TorchDispatchMode``; each is one kernel
launch or, for a foreach operator, a few per ~100 tensors on CUDA), wall seconds on this CPU
(best of ``--reps``; a CPU's time is not a GPU's: there the launches, ~5 us each, dominate
for small pieces), and the largest relative difference between the two ways' slots.

Usage: python benchmarks/norm_kernels.py [--model llama3_8b] [--layers 4] [--reps 3]
Writes runs/bench/norm_kernels.json and a PNG beside it; prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench" / "norm_kernels.json"


def _engine(model: str, layers: int, kind: str) -> Any:
    import torch.distributed as dist
    import yaml
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, HealthReport, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.parallel.groups import build_groups
    from nemo_nutp.sync.engine import GradSyncEngine
    from nemo_nutp.sync.shapes import stage_parameters

    raw = yaml.safe_load((ROOT / "configs" / "model" / f"{model}.yaml").read_text())
    dims = ModelConfig(**{**raw, "num_layers": layers, "seq_length": 256})
    plan = build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=16, domain_size=8, gpus_per_node=8), model=dims,
        parallel=ParallelSpec(tp_base=8), health=HealthReport(failed_gpus=(7,)),
        global_batch=8))
    rank = next(int(r.ranks[0][0]) for r in plan.replicas
                if (len(r.ranks[0]) < 8) == (kind == "degraded"))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    return GradSyncEngine(plan, build_groups(plan), stage_parameters(plan, rank))


def _per_piece(b: Any, slots: Any) -> None:
    from nemo_nutp.sync import norm

    rows, where = b.norm
    for row, slot in where.pairs:
        pc = b.spec.pieces[rows[row]]
        slots[slot] += norm.sumsq(b.buf[pc.offset:pc.offset + pc.numel])


def _fused(b: Any, slots: Any) -> None:
    from nemo_nutp.sync import norm

    norm.add_bucket(b, b.norm, slots)


def _ops(fn: Any, eng: Any, bufs: list[Any], slots: Any) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        _step(fn, eng, bufs, slots)
    return Count.n


def _step(fn: Any, eng: Any, bufs: list[Any], slots: Any) -> float:
    t0 = time.perf_counter()
    for b, buf in zip(eng.buckets, bufs, strict=True):
        b.buf, b.alias = buf, False
        fn(b, slots)
        b.buf = None
    return time.perf_counter() - t0


def one(model: str, layers: int, kind: str, reps: int) -> dict[str, Any]:
    import torch

    eng = _engine(model, layers, kind)
    gen = torch.Generator().manual_seed(0)
    elements = sum(b.spec.numel for b in eng.buckets)
    # one buffer per bucket would be the rank's whole gradient: reuse one of the largest size
    big = torch.randn(max(b.spec.numel for b in eng.buckets), generator=gen)
    bufs = [big[:b.spec.numel] for b in eng.buckets]
    out: dict[str, Any] = {"model": model, "layers": layers, "rank_kind": kind,
                           "degree": eng.ctx.degree, "buckets": len(eng.buckets),
                           "pieces": sum(len(b.norm[0]) for b in eng.buckets),
                           "elements": elements}
    slots = {}
    for name, fn in (("per_piece", _per_piece), ("fused", _fused)):
        s = torch.zeros(eng.n_slots, dtype=torch.float64)
        _step(fn, eng, bufs, s)  # warm (index tensors, allocator)
        slots[name] = s
        out[f"{name}_ops_per_step"] = _ops(fn, eng, bufs, torch.zeros_like(s))
        out[f"{name}_s_per_step"] = min(
            _step(fn, eng, bufs, torch.zeros_like(s)) for _ in range(reps))
    a, b = slots["per_piece"], slots["fused"]
    out["max_rel_diff"] = float(((a - b).abs() / a.abs().clamp_min(1e-300)).max())
    out["bitwise_equal"] = bool(torch.equal(a, b))
    return out


def _table(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="grad-norm kernels per step: per piece (before) vs fused per bucket (now)")
    for c in ("model", "rank", "buckets", "pieces", "aten ops before", "aten ops now",
              "CPU ms before", "CPU ms now", "max rel diff"):
        t.add_column(c, justify="right")
    for r in runs:
        t.add_row(f"{r['model']} ({r['layers']} layers)", f"{r['rank_kind']} TP{r['degree']}",
                  str(r["buckets"]), f"{r['pieces']:,}", f"{r['per_piece_ops_per_step']:,}",
                  f"{r['fused_ops_per_step']:,}", f"{1e3 * r['per_piece_s_per_step']:.1f}",
                  f"{1e3 * r['fused_s_per_step']:.1f}", f"{r['max_rel_diff']:.1e}")
    Console(width=160).print(t)


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['rank_kind']} TP{r['degree']}" for r in runs]
    x = range(len(runs))
    for ax, key, title in ((axes[0], "ops_per_step", "aten ops per step (log)"),
                           (axes[1], "s_per_step", "CPU seconds per step")):
        ax.bar([i - 0.2 for i in x], [r[f"per_piece_{key}"] for r in runs], 0.4,
               label="per piece (before)")
        ax.bar([i + 0.2 for i in x], [r[f"fused_{key}"] for r in runs], 0.4,
               label="fused per bucket (now)")
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.legend()
    axes[0].set_yscale("log")
    fig.suptitle(f"{runs[0]['model']}, {runs[0]['layers']} layers, TP8+TP7, one rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import subprocess
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["healthy", "degraded"])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.model, a.layers, a.one, a.reps)))
        return
    runs = []
    for kind in a.kinds:  # a fresh fake world per rank
        print(f"{a.model} ({a.layers} layers) {kind} rank ...", flush=True)
        p = subprocess.run([sys.executable, __file__, "--one", kind, "--model", a.model,
                            "--layers", str(a.layers), "--reps", str(a.reps)],
                           capture_output=True, text=True, check=False)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            raise RuntimeError(f"{kind} failed:\n{p.stderr[-3000:]}")
        runs.append(json.loads(line[0][7:]))
    from nemo_nutp.layout.serialize import write_json_atomic

    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic({"runs": runs}, a.out)
    _table(runs)
    _plot(runs, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
