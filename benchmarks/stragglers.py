"""Straggler benchmark on CPU/gloo: live micro-batch rebalancing vs static shares.

Two equal replicas; one rank is slowed ``--factor`` x by fault injection (the ``slow`` fault of
``common/faults.py``: it sleeps ``factor - 1`` times each micro-batch's measured
forward/backward). One spawned world builds two sessions of the same plan — (a) static shares
(the plan's), (b) live rebalancing (``train/rebalance.py``: the controller and share updates
``nutp.rebalance=true`` uses) — and alternates their steps, so both see the same machine noise.
Step time is the slowest rank's wall time of the step; medians over the steps after
``--warmup`` are reported.

Usage: python benchmarks/stragglers.py [--replicas 2,2] [--slow-rank 1] [--factor 3]
           [--microbatches 24] [--steps 24] [--warmup 8] [--out PATH]
Writes runs/bench/stragglers.json (``step_time_rebalance``, ``step_time_static``, ``ratio``)
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _plan(replicas: tuple[int, ...], gb: int) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(replicas)
    return build_plan(PlanRequest(
        cluster=ClusterSpec(tb * len(replicas), tb, tb), model=ModelConfig(),
        parallel=ParallelSpec(tp_base=tb), replicas=replicas, global_batch=gb))


def _compute_times(session: Any, compute_s: float, n: int) -> list[float]:
    """Per replica: the slowest rank's compute seconds (all-gathered: same on every rank)."""
    import torch.distributed as dist

    mine = torch.tensor([float(session.groups.ctx.replica), compute_s], dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [max(float(r[1]) for r in rows if int(r[0]) == i) for i in range(n)]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.train.rebalance import ShareController, apply_shares
    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import StepOptions

    init_cpu_rank(rank, world, port)
    replicas = tuple(int(x) for x in args.replicas.split(","))
    plan = _plan(replicas, args.microbatches)
    slow = args.factor if rank == args.slow_rank else 1.0
    sessions = {m: build_session(plan, plan.request.model, lr=1e-3, seed=1,
                                 micro_batch_size=2, opts=StepOptions(slow_factor=slow))
                for m in ("static", "rebalance")}
    ctl = ShareController([r.microbatches for r in plan.replicas], smoothing=0.5,
                          hysteresis=0.05, max_shift=2, warmup=1)
    times: dict[str, list[float]] = {"static": [], "rebalance": []}
    shares: dict[str, list[list[int]]] = {"static": [], "rebalance": []}
    for step in range(args.steps):
        for mode, session in sessions.items():
            dist.barrier()
            used = list(ctl.shares) if mode == "rebalance" else \
                [r.microbatches for r in plan.replicas]
            t0 = time.perf_counter()
            res = session.step(step)
            step_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
            times[mode].append(float(step_s))
            shares[mode].append(used)
            if mode == "rebalance":
                new = ctl.observe(_compute_times(session, res.times["compute_s"], len(replicas)))
                if new is not None:
                    apply_shares(session, new)
    if rank == 0:
        Path(out, "raw.json").write_text(json.dumps({"times": times, "shares": shares}))


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Stragglers: replicas {result['replicas']}, rank {result['slow_rank']} "
                    f"slowed {result['factor']}x, {result['microbatches']} micro-batches")
    for c in ("mode", "median step s", "final shares"):
        t.add_column(c, justify="right")
    t.add_row("static", f"{result['step_time_static']:.4f}", str(result["shares_static"]))
    t.add_row("rebalance", f"{result['step_time_rebalance']:.4f}",
              str(result["shares_rebalance"]))
    Console().print(t)
    print(f"ratio rebalance/static: {result['ratio']:.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="2,2", help="TP degree per replica (equal: 2,2)")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--microbatches", type=int, default=24)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8, help="steps left out of the medians")
    p.add_argument("--out", default="runs/bench/stragglers.json")
    args = p.parse_args(argv)
    world = sum(int(x) for x in args.replicas.split(","))
    if not 0 <= args.slow_rank < world:
        raise SystemExit(f"--slow-rank={args.slow_rank}: the world has {world} ranks")
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup={args.warmup}: must be below --steps={args.steps}")
    import tempfile

    from nemo_nutp.common.ports import free_port
    from nemo_nutp.layout.serialize import write_json_atomic

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, free_port(), args, tmp), nprocs=world)
        raw = json.loads(Path(tmp, "raw.json").read_text())
    med = {m: statistics.median(v[args.warmup:]) for m, v in raw["times"].items()}
    result = {**vars(args), "step_time_static": med["static"],
              "step_time_rebalance": med["rebalance"],
              "ratio": med["rebalance"] / med["static"],
              "shares_static": raw["shares"]["static"][-1],
              "shares_rebalance": raw["shares"]["rebalance"][-1],
              "per_step": raw}
    write_json_atomic(result, Path(args.out))
    _table(result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
