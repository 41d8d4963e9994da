"""NUTP sync overhead on CPU/gloo: reshard bytes vs the planner's bound, and step time of the
NUTP layout vs the same replicas training independently (no cross-replica sync).

Spawns the layout's world once; in it builds (a) NUTP DDP with the ``refine`` sync layout,
(b) NUTP DDP with the ``base`` sync layout (degraded replicas reshard), (c) the same replicas
with plain megatron-core DDP on 1-rank DP groups (independent training). Steps of (a), (b), (c)
alternate, so all three see the same machine noise; medians are reported.

Usage: python benchmarks/sync_overhead.py [--replicas 4,3] [--steps 12] [--out PATH]
Writes runs/bench/sync_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _plan(replicas: tuple[int, ...], mode: str, gb: int) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(replicas)
    return build_plan(PlanRequest(
        cluster=ClusterSpec(tb * len(replicas), tb, tb), model=ModelConfig(),
        parallel=ParallelSpec(tp_base=tb, sync_layout=mode), replicas=replicas, global_batch=gb))


def _independent(session: Any) -> Any:
    """Same replica, plain megatron-core DDP over a 1-rank DP group: no cross-replica sync."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_nutp.model import build_gpt_model, transformer_config
    from nemo_nutp.train.step import build_optimizer

    g = session.groups
    pgs = copy.copy(g.pgs)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = pgs.expt_dp = g.single
    cfg = session.model_cfg
    module = build_gpt_model(session.plan, g.ctx.rank, cfg, pgs, seed=1)
    ddp = DistributedDataParallel(transformer_config(cfg, degree=g.ctx.degree),
                                  DistributedDataParallelConfig(overlap_grad_reduce=True),
                                  module, pg_collection=pgs)
    return ddp, build_optimizer(ddp, pgs, lr=1e-3)


def _worker(rank: int, world: int, port: int, replicas: tuple[int, ...], steps: int,
            out: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import train_step

    init_cpu_rank(rank, world, port)
    gb = 2 * len(replicas) * 4
    sessions = {m: build_session(_plan(replicas, m, gb), _plan(replicas, m, gb).request.model,
                                 lr=1e-3, seed=1, micro_batch_size=2) for m in ("refine", "base")}
    ind_model, ind_opt = _independent(sessions["refine"])
    times: dict[str, list[float]] = {"refine": [], "base": [], "independent": []}
    sent: dict[str, int] = {}
    for step in range(steps):
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "independent":
                s = sessions["refine"]
                train_step(ind_model, ind_opt, s.batches(step), s.mask)
            else:
                sessions[name].step(step)
                sent[name] = sessions[name].model.nutp_engine.sent_bytes
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank does
            if step >= 2:  # warm-up
                times[name].append(float(dt))
    measured = [None] * world
    dist.all_gather_object(measured, sent)
    if rank == 0:
        res: dict[str, Any] = {"replicas": list(replicas), "steps_timed": steps - 2}
        for m in ("refine", "base"):
            plan = sessions[m].plan
            by_rank = plan.reshard_bytes_by_rank()
            res[m] = {"measured_bytes_by_rank": [d[m] for d in measured],  # type: ignore[index]
                      "planned_bytes_by_rank": [by_rank.get(r, 0) for r in range(world)],
                      "median_step_s": statistics.median(times[m])}
        res["independent"] = {"median_step_s": statistics.median(times["independent"])}
        Path(out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", default="4,3")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="runs/bench/sync_overhead.json")
    args = ap.parse_args()
    replicas = tuple(int(x) for x in args.replicas.split(","))
    from rich.console import Console
    from rich.table import Table

    from nemo_nutp.common.ports import free_port

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    mp.spawn(_worker, args=(sum(replicas), free_port(), replicas, args.steps, str(tmp)),
             nprocs=sum(replicas))
    os.replace(tmp, out)
    res = json.loads(out.read_text())
    ind = res["independent"]["median_step_s"]
    t = Table(title=f"NUTP sync overhead, replicas TP{'+TP'.join(map(str, replicas))} "
                    f"(median of {res['steps_timed']} steps)")
    for col in ("layout", "reshard bytes/step (all ranks)", "= planner bound",
                "per-rank bytes", "step s", "vs independent"):
        t.add_column(col, justify="right")
    for m in ("refine", "base"):
        r = res[m]
        ok = r["measured_bytes_by_rank"] == r["planned_bytes_by_rank"]
        t.add_row(m, f"{sum(r['measured_bytes_by_rank']):,}", "yes" if ok else "NO",
                  " ".join(str(b) for b in r["measured_bytes_by_rank"]),
                  f"{r['median_step_s']:.3f}", f"{r['median_step_s'] / ind:.2f}x")
    t.add_row("independent", "-", "-", "-", f"{ind:.3f}", "1.00x")
    Console().print(t)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
