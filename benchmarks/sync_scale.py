"""Gradient sync at scale (issue #13): descriptor cost, collectives per step, step-time ratios.

* ``descriptors[model]``: for every model in ``configs/model/``, replicas TP8+TP7 (a model too
  small for TP8 — the CPU ``tiny`` — at its largest degree and one less, said in ``replicas``):
  per rank, the time to build the sync descriptors and the bucket plan from the plan alone (no
  model, no process group; best of 3, imports excluded) and their serialized size; the worst
  rank is reported, next to what one int64 index per local element (the previous engine) would
  hold, and the collectives per step the worst rank launches (from the same descriptors) with
  the ``refine`` and the ``base`` sync layout.
* ``collectives_per_step``: collectives one rank launches for gradient sync in a steady step
  (counted by wrapping ``torch.distributed``'s calls while the DDP's sync or megatron's
  grad-norm code runs), worst rank: NUTP TP4+TP3 vs megatron DDP TP4xDP2, 16-layer narrow model
  (the CPU tiny shape with 16 layers), default bucket sizes on both sides.
* ``step_ratio_uniform``: NUTP DDP / megatron DDP step time, uniform TP2xDP2, same model, steps
  alternating in one world (same machine noise), the median of the per-step ratios (the ratio
  of the medians is kept in ``ratio_of_medians``); ``step_ratio_nutp``: NUTP TP4+TP3 / the same
  replicas training without cross-replica sync; ``exposed_sync_s``: median time from the end of
  backward to the end of the gradient sync (slowest rank), per layout. CPU/gloo on a shared
  2-core machine: ratios are indicative, not GPU numbers.
* ``optimizer_state_ratio``: optimizer-state bytes per rank with ``train.distributed_optimizer``
  (``sync/zero.py``: fp32 masters where kept + Adam moments) over megatron's non-distributed
  optimizer's (Adam moments, + fp32 masters for bf16), measured on the real optimizer objects
  after one step of the tiny model in one spawned world, worst rank, for TP4+TP3 (R=2) and
  TP3+TP2+TP2 (R=3) in fp32 and bf16; the target is 1/R + 0.05. ``optimizer_step_s``: the
  median optimizer step (incl. the parameter all-gather and reshard) of both, same world.
* ``optimizer_state_ratio_redundant``: the same ratio with ``recovery.live_redundancy`` (a
  copy of every slice on the next member of its group; fp32 models keep their masters too),
  same world; expected 2 x 12 B / (R x megatron's bytes per element: 8 fp32, 12 bf16), i.e.
  3/R (fp32) and 2/R (bf16), within the sync layout's imbalance.

Usage: python benchmarks/sync_scale.py [--steps 8] [--descriptors-only] [--optimizer-only]
       [--out PATH]
Writes runs/bench/sync_scale.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
COUNTED = ("all_reduce", "broadcast", "isend", "irecv", "send", "recv", "all_gather",
           "all_gather_into_tensor", "reduce_scatter_tensor", "_reduce_scatter_base",
           "_all_gather_base", "all_reduce_coalesced", "batch_isend_irecv", "reduce_scatter")


# ---------------------------------------------------------------- descriptors (no processes)
def _plan(model: Any, replicas: tuple[int, ...], mode: str = "refine", gb: int = 64) -> Any:
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(replicas)
    return build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=tb * len(replicas), domain_size=tb, gpus_per_node=tb),
        model=model, parallel=ParallelSpec(tp_base=tb, sync_layout=mode), replicas=replicas,
        global_batch=gb))


def _rank_descriptors(plan: Any, rank: int, bucket_size: int) -> tuple[Any, Any, Any]:
    """What the engine builds for a rank, from the plan alone (replicated params reduced by
    TP rank 0, as without sequence parallelism): (descriptors, (buckets, outgoing and incoming
    reshard messages), parameter list)."""
    from nemo_nutp.layout import PARAM_KINDS
    from nemo_nutp.sync.descriptors import (
        plan_buckets,
        plan_messages,
        rank_bucket_items,
        rank_sync,
        stage_params,
        sync_key,
    )

    rs = rank_sync(plan, rank)
    params = stage_params(plan.request.model, rs.degree,
                          {k: v.units for k, v in rs.kinds.items()})[::-1]
    leaders = tuple(rep.ranks[rs.stage][0] for rep in plan.replicas)
    key = sync_key(rs.stage, leaders) if rs.tp_rank == 0 else None
    items = rank_bucket_items(rs, [(k, int(np.prod(s))) for k, s in params], key)
    outs, ins = [], []
    for i, (kind, _) in enumerate(params):
        if kind is not None:
            sp, u = rs.spaces[PARAM_KINDS[kind].space], rs.kinds[kind].unit_numel
            outs += [(d, i, lo, hi, (hi - lo) * u) for d, lo, hi in sp.sends]
            ins += [(r, i, lo, hi, (hi - lo) * u) for sh in sp.owned for r, lo, hi in sh.recvs]
    comm = (plan_buckets(items, bucket_size), plan_messages(outs, bucket_size),
            plan_messages(ins, bucket_size))
    return rs, comm, params


def _launches(comm: Any) -> int:
    """Collectives a rank launches per step: one all-reduce per bucket, the TP all-reduce (grad
    norm + shared replicated grads), and each reshard message there and back."""
    buckets, outs, ins = comm
    return len(buckets) + 1 + 2 * (len(outs) + len(ins))


def descriptors(bucket_size: int) -> dict[str, Any]:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout.units import max_degree
    from nemo_nutp.sync.descriptors import index_bytes, nbytes  # imports torch: not timed

    out: dict[str, Any] = {}
    for path in sorted((ROOT / "configs" / "model").glob("*.yaml")):
        import yaml

        model = ModelConfig(**yaml.safe_load(path.read_text()))
        top = min(8, max_degree(model))
        replicas = (top, top - 1) if top > 1 else (1, 1)
        plan = _plan(model, replicas)
        setup, size, before, launches = [], [], [], []
        for rank in sorted(plan.rank_index):
            best = float("inf")
            for _ in range(3):  # best of 3: the machine is shared, noise only adds
                t0 = time.perf_counter()
                rs, comm, params = _rank_descriptors(plan, rank, bucket_size)
                best = min(best, time.perf_counter() - t0)
            setup.append(best)
            size.append(nbytes((rs, comm)))
            before.append(index_bytes(params))
            launches.append(_launches(comm))
        base = _plan(model, replicas, mode="base")
        out[path.stem] = {
            "replicas": list(replicas), "setup_s": max(setup), "bytes": max(size),
            "index_bytes_before": max(before), "collectives_refine": max(launches),
            "collectives_base": max(_launches(_rank_descriptors(base, r, bucket_size)[1])
                                    for r in base.rank_index)}
    return out


# ---------------------------------------------------------------- collective counting
class Counter:
    """Counts ``torch.distributed`` calls made while a watched method runs (nesting-safe)."""

    def __init__(self) -> None:
        self.depth = 0
        self.count = 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._counted(fn))

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            if self.depth:
                self.count += 1
            return fn(*a, **k)
        return wrapper

    def watch(self, cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(obj: Any, *a: Any, **k: Any) -> Any:
            self.depth += 1
            try:
                return fn(obj, *a, **k)
            finally:
                self.depth -= 1
        setattr(cls, name, wrapper)


def _install_counter() -> Counter:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from nemo_nutp.sync.engine import GradSyncEngine

    c = Counter()
    c.install()
    for cls, name in ((_ParamAndGradBucketGroup, "start_grad_sync"),
                      (_ParamAndGradBucketGroup, "finish_grad_sync"),
                      (MegatronOptimizer, "get_grad_norm"),
                      (GradSyncEngine, "mark_ready"), (GradSyncEngine, "finish")):
        c.watch(cls, name)
    return c


# ---------------------------------------------------------------- runtime worlds
def _narrow() -> Any:
    from nemo_nutp.config import ModelConfig

    return ModelConfig(num_layers=16)


def _megatron(session: Any, dp_group: Any) -> tuple[Any, Any]:
    """Plain megatron-core DDP of this rank's replica shard over ``dp_group``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_nutp.model import build_gpt_model, transformer_config
    from nemo_nutp.train.step import build_optimizer

    g = session.groups
    pgs = copy.copy(g.pgs)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = pgs.expt_dp = dp_group
    cfg = session.model_cfg
    module = build_gpt_model(session.plan, g.ctx.rank, cfg, pgs, seed=1)
    ddp = DistributedDataParallel(
        transformer_config(cfg, degree=g.ctx.degree),
        DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True),
        module, pg_collection=pgs)
    return ddp, build_optimizer(ddp, pgs, lr=1e-3)


def _dp_group(session: Any) -> Any:
    """Uniform refine layouts: the sync groups are the same-TP-position DP groups."""
    return next(g for key, g in session.groups.sync.items() if key[1] == "qg")


def _record_sync(ddp: Any, marks: dict[str, float]) -> None:
    """Record when backward ends (``finish_grad_sync`` is entered) and when the sync ends."""
    finish = ddp.finish_grad_sync

    def wrapper(*a: Any, **k: Any) -> Any:
        marks["backward_end"] = time.perf_counter()
        try:
            return finish(*a, **k)
        finally:
            marks["sync_end"] = time.perf_counter()
    ddp.finish_grad_sync = wrapper


def _timed(fn: Callable[[], Any], counter: Counter, marks: dict[str, float]
           ) -> tuple[float, float, int, float]:
    """(step s, exposed sync s, this rank's collectives, CPU s of all ranks). Step: the slowest
    rank's. Exposed sync: from the end of the last rank's backward to the end of the last
    rank's sync (one machine: ``perf_counter`` is one monotonic clock for all ranks), so a
    replica waiting for a slower one inside the sync is not counted as sync. CPU: process time
    (gloo's threads included) summed over ranks — the work, without time a rank spent
    descheduled on an oversubscribed machine."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    counter.count = 0
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    n = counter.count
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    t = torch.tensor([time.perf_counter() - t0, marks["backward_end"], marks["sync_end"]],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(t[0]), float(t[2] - t[1]), n, float(cpu)


def _run_world(kind: str, steps: int, counter: Counter) -> dict[str, Any]:
    """Alternate steps of the world's contestants (the same ``train_step`` harness for all);
    medians after 2 warm-up steps."""
    import torch.distributed as dist

    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import train_step

    replicas = {"nutp": (4, 3), "megatron": (4, 4), "uniform": (2, 2)}[kind]
    plan = _plan(_narrow(), replicas, gb=4 * len(replicas))
    s = build_session(plan, plan.request.model, lr=1e-3, seed=1, micro_batch_size=2)
    other_group = s.groups.single if kind == "nutp" else _dp_group(s)
    names = ("nutp", "independent" if kind == "nutp" else "megatron")
    models = {"nutp": (s.model, s.optimizer), names[1]: _megatron(s, other_group)}
    marks: dict[str, dict[str, float]] = {n: {} for n in names}
    for name in names:
        _record_sync(models[name][0], marks[name])
    runs: dict[str, Any] = {n: {"step": [], "sync": [], "calls": [], "cpu": []} for n in names}
    for step in range(steps):
        order = names if step % 2 == 0 else names[::-1]
        for name in order:
            ddp, opt = models[name]
            fn = functools.partial(train_step, ddp, opt, s.batches(step), s.mask)
            dt, sync, calls, cpu = _timed(fn, counter, marks[name])
            if step >= 2:
                runs[name]["step"].append(dt)
                runs[name]["sync"].append(sync)
                runs[name]["calls"].append(calls)
                runs[name]["cpu"].append(cpu)
    out: dict[str, Any] = {"replicas": list(replicas)}
    # Each step runs both contestants back to back (order alternating): the median of the
    # per-step ratios cancels the machine's slow drifts that a ratio of medians keeps.
    a, b = runs[names[0]]["step"], runs[names[1]]["step"]
    out["paired_ratio"] = statistics.median(x / y for x, y in zip(a, b, strict=True))
    ca, cb = runs[names[0]]["cpu"], runs[names[1]]["cpu"]
    out["paired_cpu_ratio"] = statistics.median(x / y for x, y in zip(ca, cb, strict=True))
    for name, r in runs.items():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, max(r["calls"]))
        out[name] = {"median_step_s": statistics.median(r["step"]),
                     "exposed_sync_s": statistics.median(r["sync"]),
                     "collectives_by_rank": every}
    return out


def _worker(rank: int, world: int, port: int, kind: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    counter = init_cpu_rank(rank, world, port, before_init=_install_counter)
    res = _run_world(kind, steps, counter)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


# ---------------------------------------------------------------- optimizer state
def megatron_state_bytes(opt: Any) -> int:
    """Bytes megatron's non-distributed optimizer keeps between steps: its torch optimizer's
    state tensors (``step`` excluded) and the fp32 masters of half-precision params."""
    n = 0
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for st in inner.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for k, t in st.items()
                     if k != "step" and hasattr(t, "numel"))
        for group in getattr(inner, "fp32_from_float16_groups", []):
            n += sum(p.numel() * p.element_size() for p in group)
    return n


def _optimizer_world(steps: int) -> dict[str, Any]:
    """Per layout and precision: state bytes by rank and optimizer step times, both kinds."""
    import torch.distributed as dist

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.train.session import Precision, build_session

    out: dict[str, Any] = {}
    for replicas in ((4, 3), (3, 2, 2)):
        for prec in ("fp32", "bf16"):
            plan = _plan(ModelConfig(), replicas, gb=7)
            row: dict[str, Any] = {"replicas": list(replicas), "precision": prec}
            for key in ("megatron", "distributed", "redundant"):
                s = build_session(plan, plan.request.model, lr=1e-3, seed=1,
                                  micro_batch_size=2, precision=Precision(prec),
                                  distributed_optimizer=key != "megatron",
                                  live_redundancy=key == "redundant")
                opt_s = [s.step(k).times["optimizer_s"] for k in range(steps)]
                size = (megatron_state_bytes(s.optimizer) if key == "megatron" else
                        s.optimizer.state_bytes())
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, size)
                row[f"{key}_bytes_by_rank"] = every
                row[f"{key}_optimizer_step_s"] = statistics.median(opt_s)
            for key, name in (("distributed", "ratio"), ("redundant", "ratio_redundant")):
                row[f"{name}_by_rank"] = [a / b for a, b in zip(row[f"{key}_bytes_by_rank"],
                                                                row["megatron_bytes_by_rank"],
                                                                strict=True)]
                row[name] = max(row[f"{name}_by_rank"])
            row["target"] = 1 / len(replicas) + 0.05
            out["+".join(f"tp{r}" for r in replicas) + f"_{prec}"] = row
    return out


def _optimizer_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    init_cpu_rank(rank, world, port)
    res = _optimizer_world(steps)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def optimizer_state(steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from nemo_nutp.common.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimizer.json"
        mp.spawn(_optimizer_worker, args=(7, free_port(), steps, str(path)), nprocs=7)
        return json.loads(path.read_text())


def runtime(steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from nemo_nutp.common.ports import free_port

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, world in (("nutp", 7), ("megatron", 8), ("uniform", 4)):
            path = Path(tmp) / f"{kind}.json"
            mp.spawn(_worker, args=(world, free_port(), kind, steps, str(path)), nprocs=world)
            res[kind] = json.loads(path.read_text())
    return res


# ---------------------------------------------------------------- report
def summarize(desc: dict[str, Any], rt: dict[str, Any] | None, bucket_size: int,
              opt: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"bucket_size": bucket_size, "descriptors": desc,
                           "optimizer_state_ratio": None}
    targets = {"setup_s<1": all(d["setup_s"] < 1 for d in desc.values()),
               "bytes<1MiB": all(d["bytes"] < 2 ** 20 for d in desc.values())}
    if opt is not None:
        out["optimizer_state_ratio"] = {k: r["ratio"] for k, r in opt.items()}
        out["optimizer_state_ratio_redundant"] = {k: r["ratio_redundant"]
                                                  for k, r in opt.items()}
        out["optimizer_state"] = opt
        out["optimizer_step_s"] = {k: {"megatron": r["megatron_optimizer_step_s"],
                                       "distributed": r["distributed_optimizer_step_s"],
                                       "redundant": r["redundant_optimizer_step_s"]}
                                   for k, r in opt.items()}
        targets["optimizer_state_ratio<=1/R+0.05"] = all(r["ratio"] <= r["target"]
                                                         for r in opt.values())
    if rt is not None:
        n, m, u = rt["nutp"], rt["megatron"], rt["uniform"]
        out["collectives_per_step"] = {
            "nutp": max(n["nutp"]["collectives_by_rank"]),
            "megatron": max(m["megatron"]["collectives_by_rank"]),
            "nutp_by_rank": n["nutp"]["collectives_by_rank"],
            "megatron_by_rank": m["megatron"]["collectives_by_rank"],
            "nutp_uniform_tp4_dp2_by_rank": m["nutp"]["collectives_by_rank"],
            "layouts": {"nutp": "TP4+TP3", "megatron": "TP4xDP2"}, "num_layers": 16}
        out["step_ratio_uniform"] = u["paired_ratio"]
        out["step_ratio_nutp"] = n["paired_ratio"]
        out["ratio_of_medians"] = {
            "uniform": u["nutp"]["median_step_s"] / u["megatron"]["median_step_s"],
            "nutp": n["nutp"]["median_step_s"] / n["independent"]["median_step_s"]}
        out["cpu_ratio"] = {"uniform": u["paired_cpu_ratio"], "nutp": n["paired_cpu_ratio"]}
        out["exposed_sync_s"] = {
            "nutp_tp4+tp3": n["nutp"]["exposed_sync_s"],
            "independent_tp4+tp3": n["independent"]["exposed_sync_s"],
            "nutp_tp2xdp2": u["nutp"]["exposed_sync_s"],
            "megatron_tp2xdp2": u["megatron"]["exposed_sync_s"]}
        out["median_step_s"] = {"nutp_tp4+tp3": n["nutp"]["median_step_s"],
                                "independent_tp4+tp3": n["independent"]["median_step_s"],
                                "nutp_tp2xdp2": u["nutp"]["median_step_s"],
                                "megatron_tp2xdp2": u["megatron"]["median_step_s"]}
        c = out["collectives_per_step"]
        targets.update({"collectives<=2x": c["nutp"] <= 2 * c["megatron"],
                        "step_ratio_uniform<=1.05": out["step_ratio_uniform"] <= 1.05,
                        "step_ratio_nutp<=1.10": out["step_ratio_nutp"] <= 1.10})
    out["targets"] = targets
    return out


def show(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Sync descriptors per rank, no model built "
                    f"(bucket_size={res['bucket_size']:,})")
    for col in ("model", "replicas", "setup ms", "bytes", "int64 index (before)",
                "coll./step refine", "coll./step base"):
        t.add_column(col, justify="right")
    for name, d in res["descriptors"].items():
        t.add_row(name, "+".join(f"TP{x}" for x in d["replicas"]), f"{d['setup_s'] * 1e3:.1f}",
                  f"{d['bytes']:,}", f"{d['index_bytes_before'] / 2 ** 30:.2f} GiB",
                  str(d["collectives_refine"]), str(d["collectives_base"]))
    Console().print(t)
    if "collectives_per_step" in res:
        r = Table(title="16-layer narrow model, CPU/gloo (medians; slowest rank)")
        for col in ("metric", "value"):
            r.add_column(col, justify="right")
        c = res["collectives_per_step"]
        r.add_row("collectives/step NUTP TP4+TP3 (worst rank)", str(c["nutp"]))
        r.add_row("collectives/step megatron TP4xDP2 (worst rank)", str(c["megatron"]))
        r.add_row("step_ratio_uniform (NUTP/megatron, TP2xDP2)",
                  f"{res['step_ratio_uniform']:.3f}")
        r.add_row("step_ratio_nutp (TP4+TP3 / no sync)", f"{res['step_ratio_nutp']:.3f}")
        for k, v in res["ratio_of_medians"].items():
            r.add_row(f"ratio of median step times, {k}", f"{v:.3f}")
        for k, v in res["cpu_ratio"].items():
            r.add_row(f"CPU-time ratio (all ranks), {k}", f"{v:.3f}")
        for k, v in res["exposed_sync_s"].items():
            r.add_row(f"exposed sync s, {k}", f"{v:.4f}")
        Console().print(r)
    if res.get("optimizer_state"):
        o = Table(title="Optimizer state per rank: distributed / megatron non-distributed "
                        "(worst rank, tiny model)")
        for col in ("layout", "megatron bytes", "distributed bytes", "ratio", "target",
                    "redundant bytes", "ratio redundant", "opt. step s megatron",
                    "opt. step s distributed", "opt. step s redundant"):
            o.add_column(col, justify="right")
        for k, r in res["optimizer_state"].items():
            o.add_row(k, f"{max(r['megatron_bytes_by_rank']):,}",
                      f"{max(r['distributed_bytes_by_rank']):,}", f"{r['ratio']:.3f}",
                      f"{r['target']:.3f}", f"{max(r['redundant_bytes_by_rank']):,}",
                      f"{r['ratio_redundant']:.3f}", f"{r['megatron_optimizer_step_s']:.4f}",
                      f"{r['distributed_optimizer_step_s']:.4f}",
                      f"{r['redundant_optimizer_step_s']:.4f}")
        Console().print(o)
    print("targets:", res["targets"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bucket-size", type=int, default=None)
    ap.add_argument("--descriptors-only", action="store_true")
    ap.add_argument("--optimizer-only", action="store_true",
                    help="descriptors and the optimizer-state world only (no step ratios)")
    ap.add_argument("--out", default="runs/bench/sync_scale.json")
    args = ap.parse_args()
    from nemo_nutp.layout.serialize import write_json_atomic
    from nemo_nutp.sync.engine import DEFAULT_BUCKET_SIZE

    bucket = args.bucket_size or DEFAULT_BUCKET_SIZE
    desc = descriptors(bucket)
    rt = None if args.descriptors_only or args.optimizer_only else runtime(args.steps)
    opt = None if args.descriptors_only else optimizer_state(min(args.steps, 4))
    res = summarize(desc, rt, bucket, opt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(res, out)
    show(res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
