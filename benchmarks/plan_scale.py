"""Plan 131,072 GPUs in NVL72 domains with 1% failed GPUs; print wall time per phase.

Target (issue 2): build_plan < 2 s on a 2-core machine. Writes runs/bench/plan_scale.json.
``--slow-links K`` adds a row ``nutp+links``: the ``nutp`` plan with K random GPUs' NICs at a
quarter rate (``health.slow_links``: NIC-aware sync owners, issue #36), its time and sync groups
beside the plain one.
Usage: python benchmarks/plan_scale.py [--gpus N] [--fail-frac F] [--repeat R] [--slow-links K]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from nemo_nutp.layout import (
    POLICIES,
    ClusterSpec,
    HealthReport,
    ModelDims,
    ParallelSpec,
    PlanRequest,
    build_plan,
)
from nemo_nutp.layout.units import SPACES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=131072)
    ap.add_argument("--fail-frac", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--slow-links", type=int, default=16)
    ap.add_argument("--out", default="runs/bench/plan_scale.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    failed = tuple(int(g) for g in rng.choice(args.gpus, int(args.gpus * args.fail_frac),
                                              replace=False))
    # A 72-way TP needs >= 72 query groups: an MHA-style 144-head model (GQA 2:1).
    dims = ModelDims(num_layers=96, hidden_size=18432, num_attention_heads=144,
                     num_query_groups=72, ffn_hidden_size=73728, vocab_size=128256,
                     seq_length=8192)
    table = Table(title=f"build_plan: {args.gpus} GPUs, NVL72, TP72, {len(failed)} failed "
                        f"(best of {args.repeat})")
    for col in ("policy", "plan s", "groups s", "world", "replicas", "sync groups",
                "throughput", "capacity"):
        table.add_column(col, justify="right")
    results = {}
    healthy = sorted(set(range(args.gpus)) - set(failed))
    links = tuple((int(g), 0.25) for g in rng.choice(healthy, args.slow_links, replace=False))
    rows = [(pol, HealthReport(failed)) for pol in POLICIES]
    if args.slow_links:
        rows.append(("nutp+links", HealthReport(failed, slow_links=links)))
    for name, health in rows:
        pol = name.split("+")[0]
        req = PlanRequest(cluster=ClusterSpec(args.gpus, 72, 4), model=dims,
                          parallel=ParallelSpec(tp_base=72), health=health,
                          policy=pol, global_batch=4096)
        t_plan, t_groups = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = build_plan(req)
            t1 = time.perf_counter()
            n_groups = len(plan.tp_groups()) + len(plan.pp_groups()) + len(plan.stage_groups())
            n_sync = sum(len(plan.sync_groups(0, s)) for s in SPACES)
            t_plan.append(t1 - t0)
            t_groups.append(time.perf_counter() - t1)
        results[name] = {"plan_s": min(t_plan), "groups_s": min(t_groups),
                        "world_size": plan.world_size, "replicas": len(plan.replicas),
                        "groups": n_groups, "sync_groups": n_sync,
                        "predicted_throughput": plan.predicted_throughput,
                        "capacity": plan.capacity}
        table.add_row(name, f"{min(t_plan):.3f}", f"{min(t_groups):.3f}", str(plan.world_size),
                      str(len(plan.replicas)), str(n_sync), f"{plan.predicted_throughput:.4f}",
                      f"{plan.capacity:.4f}")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpus": args.gpus, "failed": len(failed),
                               "slow_links": args.slow_links, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
