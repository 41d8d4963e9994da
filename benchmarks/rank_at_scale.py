"""One rank of a huge job, on this machine (issue #22, What to build 4).

One process plays rank ``r`` of a ``W``-rank job on torch's fake process-group backend
(``torch.testing._internal.distributed.fake_pg``: collectives and p2p return at once, no data
moves; torchtitan's fake-backend dry run does the same): the plan (Llama-3-70B width, one layer
per pipeline stage, TP8 with one failed GPU so one replica stage runs TP7), every process group
of ``build_groups`` (``new_group`` calls counted), the sync descriptors, the real
``GradSyncEngine`` (its communicator warm-up included) over the rank's real shard shapes on the
``meta`` device (no memory, no arithmetic: the fake backend delivers no data anyway, so NaN /
large-grad checks do not apply), then ``--steps`` steps of the per-step control code itself:

* the engine's per-step bookkeeping (``reset``, ``mark_ready`` per parameter in backward order,
  ``finish``: descriptors walked, buffers sliced, collectives and p2p launched on the fake
  backend; the copies are free on ``meta``, the norm's fused reductions are counted, not
  timed — torch runs them as Python reference kernels on ``meta``), the step metrics
  reduction of ``train/loop.py``
  (``gather_times``: one O(replicas) all-reduce and its host read) and the rank's heartbeat
  write (``checkpoint/hooks.py``): ``control_s_per_step`` is their sum, median over steps;
* ``watchdog_poll_s``: one poll of the recovery watchdog on a training rank (``watchdog_poll``:
  the node watchdog of ``health/aggregate.py`` over its node's 8 ranks' heartbeat and stack
  files, one digest ``multi_set`` in a loopback TCPStore); ``aggregator_poll_s``: one poll of
  the job-level aggregator in a process of its own (as under a launcher, off the training
  ranks): every node's summary in one ``multi_get``; ``aggregator_blame_s``: its poll after a
  stall (every node's detail, merged, ``blame_hang`` over W ranks);
* ``extra_grad_bytes``: the engine's own accounting of its live buffers at their peak
  (``GradSyncEngine.peak_bytes``; megatron's DDP reduces its grad buffer in place, so that is
  all beyond it), beside ``fp32_grad_bytes`` (the rank's gradients in fp32). Fake works never
  report completion, so this is the worst case (no bucket retired before ``finish``);
  ``extra_grad_bytes_prompt`` is the other bound (every collective done by the next hook);
* ``setup_s``: plan + groups + engine; ``rss_bytes``: the process's peak RSS.

Each (W, pp, rank kind) runs in its own process (a fresh fake world). Usage:
    python benchmarks/rank_at_scale.py [--worlds 1024 8192 32768] [--pps 1 4] [--steps 5]
Writes runs/bench/rank_at_scale.json (``runs``: one entry per (W, pp) and rank kind) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench" / "rank_at_scale.json"


def _plan(world: int, pp: int, *, full: bool = False, layout: str = "refine") -> Any:
    """The job's plan: one layer per stage, or (``full``) llama3_70b's 80 layers."""
    import yaml

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, HealthReport, ParallelSpec, PlanRequest, build_plan

    raw = yaml.safe_load((ROOT / "configs" / "model" / "llama3_70b.yaml").read_text())
    layers = raw["num_layers"] if full else pp
    model = ModelConfig(**{**raw, "num_layers": layers, "seq_length": 256})
    return build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=world, domain_size=8, gpus_per_node=8), model=model,
        parallel=ParallelSpec(tp_base=8, pp=pp, sync_layout=layout),
        health=HealthReport(failed_gpus=(7,)),
        global_batch=world // 8 * 2))


def _rank(plan: Any, kind: str) -> int:
    """A healthy rank (TP8 replica) or one of a TP7 replica stage."""
    for rep in plan.replicas:
        for ranks in rep.ranks:
            if (len(ranks) < 8) == (kind == "degraded"):
                return int(ranks[0])
    raise ValueError(f"no {kind} rank in the plan")


def watchdog_poll(hb_dir: Path, world: int, started: float, rank: int
                  ) -> tuple[float, float, float]:
    """Seconds of one poll of the recovery watchdog on a training rank (the node watchdog of
    ``rank``'s node: its ranks' files -> one digest -> one store ``multi_set``), and of the
    job-level aggregator in its own process as under a launcher (``_aggregator``: every node's
    summary in one ``multi_get``; and the poll after a stall: details, merge, ``blame_hang``),
    over a real TCPStore on loopback (no network latency: a cluster adds a round trip to
    each). The one place to repoint when the watchdog changes."""
    from datetime import timedelta

    import torch.distributed as dist

    from nemo_nutp.health import aggregate

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    store = dist.PrefixStore("nutp/attempt0/", server)
    per = 8
    nodes = -(-world // per)
    aggregate.preset(store, nodes)
    for n in range(nodes):  # every node's digest published (not timed)
        aggregate.NodeWatch(hb_dir, range(n * per, min(world, (n + 1) * per)), n, store).poll()
    node = rank // per
    mine = aggregate.NodeWatch(hb_dir, range(node * per, min(world, (node + 1) * per)), node,
                               store)
    polls = []
    for _ in range(21):  # median: one poll is well under a millisecond, the machine is shared
        t0 = time.perf_counter()
        mine.poll()
        polls.append(time.perf_counter() - t0)
    poll = statistics.median(polls)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, __file__, "--aggregator", str(server.port), str(nodes),
                        str(world), str(started)], env=env, capture_output=True, text=True,
                       check=False)
    line = [x for x in p.stdout.splitlines() if x.startswith("AGG ")]
    if p.returncode or not line:
        raise RuntimeError(f"aggregator process failed:\n{p.stderr[-3000:]}")
    agg = json.loads(line[0][4:])
    return poll, agg["poll_s"], agg["blame_s"]


def _aggregator(port: int, nodes: int, world: int, started: float) -> dict[str, float]:
    """The job-level aggregator's polls in a process of its own (as ``aggregate.main``): the
    median of 5 polls while heartbeats are fresh, and one poll after a stall."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    from nemo_nutp.health import aggregate

    gc.freeze()
    store = dist.PrefixStore("nutp/attempt0/", dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False,
        timeout=timedelta(seconds=60)))
    # A heartbeat timeout far above this benchmark's own run time (writing W ranks' files and
    # starting this process take minutes on a busy machine): the polls see fresh heartbeats.
    agg = aggregate.Aggregator(aggregate.StoreSource(store, nodes), world, timeout_s=3600.0,
                               startup_timeout_s=7200.0, started_at=started)
    polls = []
    for _ in range(5):
        t = time.perf_counter()
        assert agg.poll(time.time()) is None
        polls.append(time.perf_counter() - t)
    t = time.perf_counter()
    assert agg.poll(time.time() + 7200) is not None  # stalled: the details name ranks
    return {"poll_s": statistics.median(polls), "blame_s": time.perf_counter() - t}


def _heartbeat_files(hb_dir: Path, world: int) -> None:
    """What W ranks' step heartbeats and stack watchers leave (their formats)."""
    now = time.time()
    for r in range(world):
        (hb_dir / f"rank{r}").write_text(f"step 3 {now}\n")
        (hb_dir / f"rank{r}.stack").write_text(
            f"0 {now} {now}\nloop.py:1 in train_rank\n"
            + json.dumps({"0": 3, f"tp{r // 8}": 120, f"pp{r % 8}": 2, f"dp{r % 8}": 40,
                          f"rep{r // 8}": 1, f"one{r}": 0, f"sync{r % 8}a": 6,
                          f"sync{r % 8}b": 6})  # group names, as CollectiveLog keys them
            + "\n")


def one(world: int, pp: int, kind: str, steps: int, staging: float | None = None,
        layout: str = "refine") -> dict[str, Any]:
    """One (W, pp, rank kind) in this process."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import nemo_nutp.parallel.groups as groups_mod
    import nemo_nutp.sync.engine as engine_mod
    import nemo_nutp.sync.norm as norm_mod
    from nemo_nutp.sync.engine import DEFAULT_BUCKET_SIZE, GradSyncEngine
    from nemo_nutp.sync.shapes import stage_parameters

    t0 = time.perf_counter()
    plan = _plan(world, pp, layout=layout)
    rank = _rank(plan, kind)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    calls = [0]
    real_new_group = dist.new_group

    def counted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real_new_group(*args, **kw)

    groups_mod.dist.new_group = counted  # type: ignore[attr-defined]
    try:
        groups = groups_mod.build_groups(plan)
    finally:
        groups_mod.dist.new_group = real_new_group  # type: ignore[attr-defined]
    params = stage_parameters(plan, rank)
    kw = {} if staging is None else {"staging_buckets": staging}
    engine = GradSyncEngine(plan, groups, params, bucket_size=DEFAULT_BUCKET_SIZE, **kw)
    engine.warm_up()
    setup_s = time.perf_counter() - t0
    # The norm's reductions are device work (a few launches per bucket on a GPU: one fused
    # foreach sum of squares and one ``index_add_``, ``sync/norm.py``); on ``meta`` they run
    # torch's Python reference kernels and decompositions (~0.1 ms per bucket), which is no
    # part of the control code: counted (``norm_kernels_per_step``: reductions, one per
    # bucket; ``norm_pieces_per_step``: the pieces they cover, each one reduction before the
    # fused kernels), not timed.
    kernels = [0, 0]

    def add_bucket(b: Any, plan: Any, slots: torch.Tensor) -> None:
        if plan[0]:
            kernels[0] += 1
            kernels[1] += len(plan[0])

    def sumsq(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((), dtype=torch.float64, device=t.device)

    def sumsqs(ts: list[torch.Tensor]) -> torch.Tensor:
        kernels[0] += 1
        kernels[1] += len(ts)
        return torch.empty(len(ts), dtype=torch.float64, device=ts[0].device)

    norm_mod.add_bucket = add_bucket  # type: ignore[assignment]
    norm_mod.sumsq = sumsq  # type: ignore[assignment]
    norm_mod.sumsqs = sumsqs  # type: ignore[assignment]
    model = SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]))
    session = SimpleNamespace(plan=plan, groups=groups, model=model)
    times = {"compute_s": 1.0, "sync_s": 0.1, "optimizer_s": 0.05}
    with tempfile.TemporaryDirectory() as tmp:
        hb = Path(tmp)
        cpu, wall = _control_steps(engine, session, times, hb / f"rank{rank}", steps)
        norm_calls, norm_pieces = kernels  # the timed steps' only (not the runs below)
        _heartbeat_files(hb, plan.world_size)
        poll, agg_poll, agg_blame = watchdog_poll(hb, plan.world_size, time.time(), rank)
    fp32 = sum(p.numel() for _, p in params) * 4
    worst = engine.peak_bytes  # fake works never report completion: retired only in finish
    prompt = _peak_if_prompt(engine, engine_mod)
    buckets, messages = len(engine.buckets), len(engine.out_msgs) + len(engine.in_msgs)
    full = _full_stage_memory(world, pp, rank, groups_mod, engine_mod, kw, layout)
    dist.destroy_process_group()
    return {"world": world, "plan_ranks": plan.world_size, "pp": pp, "tp": 8, "rank": rank,
            "sync_layout": layout,
            "rank_kind": kind, "degree": engine.ctx.degree, "setup_s": setup_s,
            "new_group_calls": calls[0],
            "control_s_per_step": min(sum(x) for x in cpu),
            "engine_s_per_step": min(x[0] for x in cpu),
            "metrics_s_per_step": min(x[1] for x in cpu),
            "heartbeat_s_per_step": min(x[2] for x in cpu),
            "control_wall_s_per_step": statistics.median(sum(x) for x in wall),
            "watchdog_poll_s": poll, "aggregator_poll_s": agg_poll,
            "aggregator_blame_s": agg_blame,
            "extra_grad_bytes": worst, "fp32_grad_bytes": fp32,
            "extra_grad_ratio": worst / fp32,
            "extra_grad_bytes_prompt": prompt, "extra_grad_ratio_prompt": prompt / fp32,
            **full,
            "staging_bytes": engine.staging_bytes,
            "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "norm_kernels_per_step": norm_calls // steps,
            "norm_pieces_per_step": norm_pieces // steps,
            "buckets": buckets, "messages": messages}


def _control_steps(engine: Any, session: Any, times: dict[str, float], hb_file: Path,
                   steps: int) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """Per step (engine bookkeeping, metrics reduction, heartbeat write): this thread's CPU
    seconds (``time.thread_time``: the control code's own work, whatever else runs on the
    machine's cores) and wall seconds."""
    from nemo_nutp.train.loop import gather_times, replica_gpus

    gpus = replica_gpus(session.plan)  # once per plan, as a run does
    cpu, wall = [], []
    for step in range(steps):
        c0, w0 = time.thread_time(), time.perf_counter()
        engine.reset()
        for e in engine.order:  # backward order, one readiness call per parameter
            engine.mark_ready([e.param])
        engine.finish(strict=True)
        c1, w1 = time.thread_time(), time.perf_counter()
        gather_times(session, times, 1.2, gpus)
        c2, w2 = time.thread_time(), time.perf_counter()
        hb_file.write_text(f"step {step} {time.time()}\n")
        c3, w3 = time.thread_time(), time.perf_counter()
        cpu.append((c1 - c0, c2 - c1, c3 - c2))
        wall.append((w1 - w0, w2 - w1, w3 - w2))
    return cpu, wall


def _full_stage_memory(world: int, pp: int, rank: int, groups_mod: Any, engine_mod: Any,
                       kw: dict[str, Any], layout: str) -> dict[str, Any]:
    """The same rank's engine over its real stage (llama3_70b's 80 layers / pp, on ``meta``:
    no memory, no arithmetic), one step: peak sync bytes beside its fp32 gradient bytes (the
    one-layer model above makes every bucket a larger fraction of the rank than it is)."""
    from nemo_nutp.sync.engine import DEFAULT_BUCKET_SIZE, GradSyncEngine
    from nemo_nutp.sync.shapes import stage_parameters

    plan = _plan(world, pp, full=True, layout=layout)
    params = stage_parameters(plan, rank)
    groups = groups_mod.build_groups(plan)
    engine = GradSyncEngine(plan, groups, params, bucket_size=DEFAULT_BUCKET_SIZE, **kw)
    engine.reset()
    for e in engine.order:
        engine.mark_ready([e.param])
    engine.finish(strict=True)
    worst = engine.peak_bytes
    prompt = _peak_if_prompt(engine, engine_mod)
    fp32 = sum(p.numel() for _, p in params) * 4
    return {"full_stage_layers": plan.request.model.num_layers // pp,
            "full_stage_extra_grad_bytes": worst, "full_stage_fp32_grad_bytes": fp32,
            "full_stage_extra_grad_ratio": worst / fp32,
            "full_stage_extra_grad_ratio_prompt": prompt / fp32}


class _Completed:
    """A work that reports completion at once (collectives that keep up with backward)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> Any:
        return self.work.wait()

    def is_completed(self) -> bool:
        return True


def _peak_if_prompt(engine: Any, engine_mod: Any) -> int:
    """The engine's peak when every bucket's collective completes before the next hook (the
    other bound: then the hooks retire buckets as they go)."""
    real = engine_mod.dist

    def wrap(fn: Any) -> Any:
        return lambda *a, **k: _Completed(fn(*a, **k))

    engine_mod.dist = SimpleNamespace(
        all_reduce=wrap(real.all_reduce), reduce_scatter_tensor=wrap(real.reduce_scatter_tensor),
        ProcessGroup=real.ProcessGroup, ReduceOp=real.ReduceOp)
    try:
        engine.peak_bytes = 0
        engine.reset()
        for e in engine.order:
            engine.mark_ready([e.param])
        engine.finish(strict=True)
        return int(engine.peak_bytes)
    finally:
        engine_mod.dist = real


def _table(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="one rank of a W-rank job (fake process group; TP8, one TP7 replica stage)")
    for c in ("W", "pp", "rank", "setup s", "new_group", "control ms/step", "watchdog poll ms",
              "aggregator poll s",
              "extra grad / fp32 grad (worst / prompt)", "RSS MiB"):
        t.add_column(c, justify="right")
    for r in runs:
        t.add_row(f"{r['world']:,}", str(r["pp"]), f"{r['rank_kind']} (TP{r['degree']})",
                  f"{r['setup_s']:.1f}", f"{r['new_group_calls']:,}",
                  f"{1e3 * r['control_s_per_step']:.2f}", f"{1e3 * r['watchdog_poll_s']:.2f}",
                  f"{r['aggregator_poll_s']:.3f}",
                  f"{r['extra_grad_ratio']:.2f} / {r['extra_grad_ratio_prompt']:.2f}",
                  f"{r['rss_bytes'] / 2**20:,.0f}")
    Console().print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--pps", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kinds", nargs="+", default=["healthy", "degraded"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--staging-buckets", type=float, default=None,
                    help="the engine's staging window in buckets (default: the engine's)")
    ap.add_argument("--sync-layout", choices=["refine", "base"], default="refine",
                    help="parallel.sync_layout of the planned job (default: refine)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", nargs=3, metavar=("W", "PP", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--aggregator", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.aggregator:
        port, nodes, world, started = a.aggregator
        print("AGG " + json.dumps(_aggregator(int(port), int(nodes), int(world),
                                              float(started))))
        return
    if a.one:
        print("RESULT " + json.dumps(one(int(a.one[0]), int(a.one[1]), a.one[2], a.steps,
                                         a.staging_buckets, a.sync_layout)))
        return
    runs = []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for w in a.worlds:
        for pp in a.pps:
            for kind in a.kinds:
                print(f"W={w:,} pp={pp} {kind} ...", flush=True)
                extra = ([] if a.staging_buckets is None
                         else ["--staging-buckets", str(a.staging_buckets)])
                p = subprocess.run([sys.executable, __file__, "--one", str(w), str(pp), kind,
                                    "--steps", str(a.steps), "--sync-layout", a.sync_layout,
                                    *extra], env=env,
                                   capture_output=True, text=True, check=False)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    raise RuntimeError(f"W={w} pp={pp} {kind} failed:\n{p.stderr[-3000:]}")
                runs.append(json.loads(line[0][7:]))
                r = runs[-1]
                print(f"  setup {r['setup_s']:.1f} s, control {1e3 * r['control_s_per_step']:.2f}"
                      f" ms/step, watchdog poll {1e3 * r['watchdog_poll_s']:.2f} ms, aggregator"
                      f" poll {r['aggregator_poll_s']:.3f} s", flush=True)
    from nemo_nutp.layout.serialize import write_json_atomic

    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic({"runs": runs, "steps": a.steps}, a.out)
    _table(runs)
    png = _plot(runs, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {png}")


def _plot(runs: list[dict[str, Any]], path: Path) -> Path:
    """Control time per step, watchdog poll, setup and extra sync memory vs W, one line per
    (pp, rank kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    keys = sorted({(r["pp"], r["rank_kind"]) for r in runs})
    for pp, kind in keys:
        rs = sorted((r for r in runs if r["pp"] == pp and r["rank_kind"] == kind),
                    key=lambda r: r["world"])
        w = [r["world"] for r in rs]
        label = f"PP{pp} {kind}"
        axes[0].plot(w, [1e3 * r["control_s_per_step"] for r in rs], "o-", label=label)
        axes[1].plot(w, [r["watchdog_poll_s"] for r in rs], "o-", label=f"{label} rank")
        axes[1].plot(w, [r["aggregator_poll_s"] for r in rs], "s--", label=f"{label} aggregator")
        axes[2].plot(w, [r["setup_s"] for r in rs], "o-", label=label)
        axes[3].plot(w, [r["extra_grad_ratio"] for r in rs], "o-", label=f"{label} 1 layer")
        if "full_stage_extra_grad_ratio" in rs[0]:
            axes[3].plot(w, [r["full_stage_extra_grad_ratio"] for r in rs], "s--",
                         label=f"{label} full stage")
    axes[1].axhline(1.0, color="gray", ls=":", lw=1, label="aggregator target")
    for ax, title, target in ((axes[0], "control ms / step", 5.0),
                              (axes[1], "watchdog poll s (rank; aggregator)", 0.01),
                              (axes[2], "setup s", 30.0),
                              (axes[3], "extra sync bytes / fp32 grad bytes (peak)", 0.25)):
        ax.axhline(target, color="gray", ls="--", lw=1, label="target")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size W")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("one rank of a W-rank job (fake process group, Llama-3-70B width, TP8)")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    main()
