"""Rich tables describing a plan and comparing policies side by side."""

from __future__ import annotations

import dataclasses
from collections import Counter

from rich.console import Console
from rich.table import Table

from ..layout import POLICIES, Plan, PlanRequest, build_plan, reshard_plan
from ..layout.memory import GIB, stage_memory
from ..layout.units import SPACES
from .console import make_console


def replicas_table(plan: Plan) -> Table:
    """One row per distinct (degrees, micro-batches) pattern; thousands of replicas stay short."""
    t = Table(title=f"Plan ({plan.request.policy}): {plan.world_size} ranks, "
                    f"{len(plan.replicas)} replicas", caption=_time_caption(plan))
    stragglers = any(r.straggler for r in plan.replicas)
    for col in ("replicas", "TP per stage", "healthy GPUs", "time/micro-batch per stage",
                "speed", "micro-batches", "weight", "first ranks") + (
                    ("slow GPU: choice (speed keep / exclude)",) if stragglers else ()):
        t.add_column(col, justify="right")
    groups: dict[tuple, list] = {}
    for r in plan.replicas:
        groups.setdefault((r.tp, r.healthy, r.microbatches, r.straggler, r.speed_keep,
                           r.speed_exclude, r.stage_times), []).append(r)
    for (tp, healthy, mb, choice, keep, excl, times), reps in groups.items():
        first = reps[0].ranks[0]
        ranks = f"{first[0]}..{first[-1]}" if len(first) > 1 else str(first[0])
        extra = (f"{choice} ({keep:.3f} / {excl:.3f})" if choice else "-",) if stragglers else ()
        t.add_row(str(len(reps)), "/".join(map(str, tp)), "/".join(map(str, healthy)),
                  _stage_times(plan, times), f"{reps[0].speed:.3f}", str(mb),
                  f"{reps[0].weight:.4f}", ranks + (" ..." if len(reps) > 1 else ""), *extra)
    return t


def _stage_times(plan: Plan, times: tuple[float, ...]) -> str:
    """Predicted per-stage times: milliseconds with a cost spec, else relative to a healthy
    replica's slowest stage (1.00)."""
    if plan.unit_time_s is None:
        return "/".join(f"{x:.2f}" for x in times)
    return "/".join(f"{x * plan.unit_time_s * 1e3:.4g}" for x in times) + " ms"


def _time_caption(plan: Plan) -> str:
    cost = plan.request.cost
    if cost is None:
        return ("stage times: cost model compute only (cluster.hardware unset), relative to a "
                "healthy replica's slowest stage")
    return (f"stage times: cost model of {cost.name} (compute + TP comm + stage boundaries), "
            f"{plan.request.micro_batch_size} x {plan.request.model.seq_length} tokens per "
            "micro-batch")


def memory_table(plan: Plan) -> Table | None:
    """Estimated memory per GPU (most loaded rank) of every planned (stage, degree), from the
    planner's memory model (``layout.memory``); None without one (no ``gpu_memory_gib``)."""
    mem = plan.request.memory
    if mem is None:
        return None
    rec = mem.recompute_granularity or "none"
    if rec == "full":
        rec += f" ({mem.recompute_method}, {mem.recompute_num_layers} layers)"
    t = Table(title=f"Memory per GPU, GiB (of {mem.gpu_memory_gib:g}): "
                    f"{'bf16/fp16' if mem.param_bytes == 2 else 'fp32'} weights, "
                    f"{'distributed' if mem.distributed_optimizer else 'replicated'} optimizer, "
                    f"recompute {rec}, micro-batch {mem.micro_batch_size}",
              caption="activations: the 1F1B micro-batches in flight on the stage, one "
                      "recomputed chunk, the last stage's logits; reserve: CUDA context, NCCL, "
                      "fragmentation")
    for col in ("stage", "TP", "weights", "grads", "optimizer", "activations", "reserve",
                "total", "fits"):
        t.add_column(col, justify="right")
    p = plan.request.parallel
    for s in range(plan.pp):
        for d in sorted({r.tp[s] for r in plan.replicas}, reverse=True):
            m = stage_memory(plan.request.model, d, mem, stage=s, pp=plan.pp,
                             balance=p.unit_balance, moe=plan.request.moe)
            t.add_row(str(s), str(d), *(f"{x / GIB:.1f}" for x in (
                m.weights, m.grads, m.optimizer, m.activations, m.reserve, m.total)),
                "yes" if m.fits else "[red]NO[/]")
    return t


def sync_table(plan: Plan) -> Table:
    t = Table(title=f"Gradient sync layout ({plan.request.parallel.sync_layout})")
    for col in ("stage", "unit space", "units", "shards", "DP groups", "moved units/replica"):
        t.add_column(col, justify="right")
    for s in range(plan.pp):
        for space in SPACES:
            lay = plan.sync[(s, space)]
            moved = Counter(reshard_plan(lay, r.tp[s], i).moved_units
                            for i, r in enumerate(plan.replicas))
            t.add_row(str(s), space, str(lay.num_units), str(lay.num_shards),
                      str(len(plan.sync_groups(s, space))),
                      ", ".join(f"{m} x{c}" for m, c in sorted(moved.items())))
    return t


def compare_policies(req: PlanRequest) -> tuple[Table, dict[str, dict]]:
    """Build the plan under every policy and tabulate them side by side."""
    t = Table(title="Policies side by side (throughput vs fault-free cluster)")
    for col in ("policy", "ranks", "live replicas", "dropped", "idle healthy GPUs",
                "predicted throughput", "capacity", "reshard MB/step"):
        t.add_column(col, justify="right")
    out: dict[str, dict] = {}
    for pol in POLICIES:
        try:
            p = build_plan(dataclasses.replace(req, policy=pol))
        except ValueError as e:
            t.add_row(pol, "-", "-", "-", "-", "-", "-", str(e)[:40])
            out[pol] = {"error": str(e)}
            continue
        mb = p.reshard_bytes() / 1e6
        out[pol] = {"world_size": p.world_size, "replicas": len(p.replicas),
                    "dropped_replicas": p.dropped_replicas, "idle_healthy_gpus":
                    p.idle_healthy_gpus, "predicted_throughput": p.predicted_throughput,
                    "capacity": p.capacity, "reshard_mb_per_step": mb}
        t.add_row(pol, str(p.world_size), str(len(p.replicas)), str(p.dropped_replicas),
                  str(p.idle_healthy_gpus), f"{p.predicted_throughput:.4f}",
                  f"{p.capacity:.4f}", f"{mb:.2f}")
    return t, out


def print_plan(plan: Plan, console: Console | None = None) -> dict[str, dict]:
    console = console or make_console()
    c = plan.request.cluster
    console.print(f"[bold]{c.name}[/]: {c.num_gpus} GPUs, domains of {c.domain_size}, "
                  f"{len(plan.request.health.failed_gpus)} failed; model "
                  f"{plan.request.model.num_layers}L h{plan.request.model.hidden_size}")
    console.print(replicas_table(plan))
    mem = memory_table(plan)
    if mem is not None:
        console.print(mem)
    table, comparison = compare_policies(plan.request)
    console.print(table)
    console.print(sync_table(plan))
    return comparison
