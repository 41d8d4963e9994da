"""Live re-layout at scale, on paper: what the in-memory state move costs vs a restart.

Descriptor-only (no model, no process): plans the layout before and after one GPU failure with
the real planner, builds the real move plan (``nemo_nutp.relayout.plan_move``) and reports per
new rank the bytes it receives against its lower bound (the units it did not hold), the busiest
sender, the process groups the new world creates, the time every rank spends planning the move,
and an estimate of ``relayout_s`` next to the restart path's estimate.

Estimates (stated assumptions, all CLI flags):
* move time: every piece from a source in the receiver's scale-up domain crosses NVLink
  (``--nvlink-gbps``, default 450 GB/s per GPU per direction, H100 NVL8), every other piece the
  scale-out network (``--network-gbps``, 50 GB/s per GPU: one 400 Gb/s NIC per GPU); a rank's
  time is max(its NVLink bytes / NVLink, its network bytes / network) over what it receives and
  sends; the move takes the slowest rank's time (latency and per-message cost ignored);
* both paths create the new world's communicators: ``--nccl-init-s`` (default 30 s at ~10K ranks;
  an assumption, not measured here — the same number on both sides, so it does not favour one);
* restart only: process start + imports + CUDA context (``--process-start-s``, default 60 s)
  and reading every rank's shard of the last checkpoint (model + fp32 masters + Adam, the same
  bytes the move carries for every rank) at an aggregate storage bandwidth
  (``--storage-gbps``, default 1000 GB/s); the steps since that checkpoint are recomputed on
  top (not counted here).

Writes ``runs/bench/relayout_scale.json``, a rich table and ``runs/bench/relayout_scale.png``.
Usage: python benchmarks/relayout_scale.py [--gpus 10240] [--fail-gpu 12345]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nemo_nutp.config import ModelConfig
from nemo_nutp.layout import ClusterSpec, HealthReport, ParallelSpec, PlanRequest, build_plan
from nemo_nutp.layout.units import SPACES
from nemo_nutp.relayout import plan_move, survivor_rank_map
from nemo_nutp.relayout.plan import holding, stable_replan, stage_spaces, unit_elems

LLAMA_70B = ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
                        seq_length=8192, gated_linear_unit=True)
"""configs/model/llama3_70b.yaml."""


def groups_of(plan: Any) -> int:
    """Process groups ``parallel.build_groups`` creates for a plan (its creation order)."""
    n = len(plan.tp_groups()) + len(plan.pp_groups()) + len(plan.stage_groups()) + plan.pp
    n += sum(len(plan.sync_groups(s, sp)) for s in range(plan.pp) for sp in SPACES)
    n += len(plan.replicas) if plan.pp > 1 else 0
    return n + plan.world_size  # singletons


def _domain(plan: Any, rank: int) -> int:
    return plan.rank_to_gpu[rank] // plan.request.cluster.domain_size


def _state_bytes(plan: Any, rank: int, bpe: int) -> int:
    s = plan.rank_index[rank][1]
    return sum((holding(plan, rank, sp)[3] - holding(plan, rank, sp)[2]) * unit_elems(plan, s, sp)
               for sp in stage_spaces(plan, s)) * bpe


def analyse(name: str, req: PlanRequest, fail_gpu: int, args: argparse.Namespace, *,
            stable: bool, estimates: bool) -> dict[str, Any]:
    old = build_plan(req)
    new = build_plan(dataclasses.replace(req, health=HealthReport(
        failed_gpus=tuple(sorted(set(req.health.failed_gpus) | {fail_gpu})))))
    if stable:
        kept = stable_replan(old, new)
        if kept is None:
            raise SystemExit(f"{name}: the old placement cannot be kept")
        new = kept
    rmap = survivor_rank_map(old, new)
    t0 = time.process_time()  # CPU time: what every rank spends (independent of machine load)
    move = plan_move(old, new, rmap, bytes_per_elem=args.bytes_per_elem)
    plan_s = time.process_time() - t0
    if not move.possible:
        raise SystemExit(f"{name}: {move.reason}")
    nvl: dict[int, int] = {}
    net: dict[int, int] = {}
    bpe = args.bytes_per_elem
    for p in move.pieces:
        if move.is_local(p):
            continue
        b = p.elems * bpe
        same = _domain(old, p.src) == _domain(new, p.dst)
        for key in (("r", p.dst), ("s", p.src)):
            book = nvl if same else net
            book[key] = book.get(key, 0) + b  # type: ignore[index]
    keys = set(nvl) | set(net)
    t_rank = {k: max(nvl.get(k, 0) / (args.nvlink_gbps * 1e9),
                     net.get(k, 0) / (args.network_gbps * 1e9)) for k in keys}
    move_s = max(t_rank.values(), default=0.0)
    recv = move.received_bytes
    lower = move.lower_bound_bytes
    movers = [n for n in recv if recv[n]]
    state = {n: _state_bytes(new, n, bpe) for n in movers}
    ckpt_bytes = sum(_state_bytes(new, n, bpe) for n in range(new.world_size))
    restart_s = (args.process_start_s + args.nccl_init_s
                 + ckpt_bytes / (args.storage_gbps * 1e9))
    ratio = max((recv[n] / lower[n] for n in movers), default=1.0)
    return {
        "case": name, "placement": "kept (stable_replan)" if stable else "planner re-packs",
        "world_old": old.world_size, "world_new": new.world_size,
        "replica_tp_changed": [list(r.tp) for r in new.replicas if r.tp != new.replicas[0].tp][:4],
        "ranks_receiving": len(movers),
        "recv_bytes_max": max(recv.values()), "recv_bytes_median_movers":
            statistics.median(recv[n] for n in movers) if movers else 0,
        "recv_bytes_median_all": statistics.median(recv.values()),
        "lower_bound_max": max(lower.values()), "recv_over_lower_bound_max": ratio,
        "senders": len(move.sent_bytes), "sent_bytes_max": max(move.sent_bytes.values(),
                                                              default=0),
        "network_bytes_max": max(net.values(), default=0),
        "nvlink_bytes_max": max(nvl.values(), default=0),
        "moved_over_state_max": max((recv[n] / state[n] for n in movers), default=0.0),
        "peak_memory_ratio_max": max(((_state_bytes(old, move.old_rank(n), bpe) + state[n]
                                       + args.bucket_bytes) / state[n] for n in movers),
                                     default=1.0),
        "groups_new_world": groups_of(new), "plan_move_cpu_s": plan_s,
        "move_s": move_s, "relayout_s_est": move_s + args.nccl_init_s if estimates else None,
        "restart_s_est": restart_s if estimates else None, "checkpoint_read_bytes": ckpt_bytes,
        "recv_by_rank": [recv[n] for n in sorted(movers)],
        "lower_by_rank": [lower[n] for n in sorted(movers)],
    }


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["placement"].startswith("kept")]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6))
    for ax, r in zip(axes if len(results) > 1 else [axes], results, strict=True):
        x = range(len(r["recv_by_rank"]))
        ax.bar(x, [b / 2**20 for b in r["recv_by_rank"]], label="received")
        ax.plot(x, [b / 2**20 for b in r["lower_by_rank"]], "k_", ms=14, mew=2,
                label="lower bound")
        ax.set_title(f"{r['case']}\n(placement kept): ranks that receive", fontsize=9)
        ax.set_xlabel("receiving new rank (sorted)")
        ax.set_ylabel("MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=10240)
    ap.add_argument("--fail-gpu", type=int, default=4099)
    ap.add_argument("--bytes-per-elem", type=int, default=14,
                    help="bf16 param + fp32 master + Adam exp_avg/exp_avg_sq")
    ap.add_argument("--bucket-bytes", type=int, default=32 << 20)
    ap.add_argument("--nvlink-gbps", type=float, default=450.0)
    ap.add_argument("--network-gbps", type=float, default=50.0)
    ap.add_argument("--storage-gbps", type=float, default=1000.0)
    ap.add_argument("--process-start-s", type=float, default=60.0)
    ap.add_argument("--nccl-init-s", type=float, default=30.0)
    ap.add_argument("--out", default="runs/bench/relayout_scale.json")
    args = ap.parse_args()
    # The tiny job's relayout_s / restart_s are measured (benchmarks/transition_cost.py); the
    # at-scale assumptions (NCCL init, process start, storage) do not apply to it.
    cases = [
        ("tiny (TP4+TP3 -> TP3+TP3)", PlanRequest(
            cluster=ClusterSpec(num_gpus=8, domain_size=4, gpus_per_node=4),
            model=ModelConfig(), parallel=ParallelSpec(tp_base=4),
            health=HealthReport(failed_gpus=(7,)), global_batch=8), 2, False),
        (f"llama3-70b TP8 PP4, {args.gpus} GPUs", PlanRequest(
            cluster=ClusterSpec(num_gpus=args.gpus, domain_size=8, gpus_per_node=8),
            model=LLAMA_70B, parallel=ParallelSpec(tp_base=8, pp=4, min_tp=6),
            global_batch=4096), args.fail_gpu, True),
    ]
    results = [analyse(name, req, gpu, args, stable=stable, estimates=est)
               for name, req, gpu, est in cases for stable in (True, False)]
    table = Table(title="Live re-layout after one GPU failure: in-memory move vs restart "
                        f"(estimates: NVLink {args.nvlink_gbps:g} GB/s, network "
                        f"{args.network_gbps:g} GB/s, storage {args.storage_gbps:g} GB/s)")
    cols = ("case", "placement", "ranks recv", "recv max", "recv median", "lower bound max",
            "recv/LB", "senders", "sent max", "groups (new world)", "plan_move CPU s", "move s",
            "relayout s (est)", "restart s (est)")
    for c in cols:
        table.add_column(c, justify="right")
    for r in results:
        est = [f"{r[k]:.1f}" if r[k] is not None else "measured*"
               for k in ("relayout_s_est", "restart_s_est")]
        table.add_row(r["case"], r["placement"], str(r["ranks_receiving"]),
                      _size(r["recv_bytes_max"]), _size(r["recv_bytes_median_movers"]),
                      _size(r["lower_bound_max"]), f"{r['recv_over_lower_bound_max']:.3f}",
                      str(r["senders"]), _size(r["sent_bytes_max"]), str(r["groups_new_world"]),
                      f"{r['plan_move_cpu_s']:.2f}", f"{r['move_s']:.3f}", *est)
    Console(width=240).print(table)
    print("* the tiny job's relayout_s and restart_s are measured by "
          "benchmarks/transition_cost.py, not estimated")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"assumptions": {k: v for k, v in vars(args).items()
                                               if k != "out"}, "results": results}, indent=1))
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
