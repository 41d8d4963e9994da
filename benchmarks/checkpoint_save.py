"""Checkpoint save benchmark on CPU/gloo: synchronous vs asynchronous stall, first vs later saves.

Each of ``--worlds`` fresh spawned worlds (a wide model with few layers, so that the state is
>= 1 GiB across ranks by default and writing dominates) trains a step, then times

* its *first* save (synchronous; the one that used to pay a one-time ~10 s penalty);
* ``--repeats`` rounds of, side by side: ``--steps`` plain steps (step time without a write), a
  synchronous save (its stall = the whole save), an asynchronous save (``checkpoint.async_save``:
  its stall = the time the ranks spend in ``save_checkpoint``, i.e. the snapshot and scheduling,
  plus the finalisation and any wait) followed by steps while the background write runs (step
  time with a write, polled after every step as the training loop does).

Reported (medians): ``sync_stall_s`` / ``async_stall_s`` per save, ``first_save_s`` (median over
the fresh worlds) and ``later_save_s`` (the later synchronous saves), ``overlap_step_ratio``
(median step time while a write runs / without), ``async_write_s`` (the background write), and
``async_effective_stall_s`` = stall + the extra time of the overlapped steps (on 2 CPU cores the
write competes with compute: this shows whether the stall merely moved into the steps).
``state_bytes``: the checkpoint's bytes on disk; ``snapshot_bytes_max_rank``: the largest rank's
host snapshot.

Usage: python benchmarks/checkpoint_save.py [--replicas 2] [--hidden 1024] [--layers 2]
           [--vocab 40960] [--worlds 3] [--repeats 2] [--steps 3] [--out PATH]
Writes runs/bench/checkpoint_save.json (+ .png) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _plan(args: argparse.Namespace) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    replicas = tuple(int(x) for x in args.replicas.split(","))
    tb = max(replicas)
    model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=8, num_query_groups=4,
                        ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab, seq_length=16)
    return build_plan(PlanRequest(
        cluster=ClusterSpec(tb * len(replicas), tb, tb), model=model,
        parallel=ParallelSpec(tp_base=tb), replicas=replicas, global_batch=2 * len(replicas)))


def _timed_step(s: Any, k: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    s.step(k)
    dist.barrier()
    return time.perf_counter() - t0


def _drop(root: Path, keep: Path | None = None) -> None:
    """Rank 0 removes old checkpoints (disk space); every rank waits."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p != keep:
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str,
            index: int) -> None:
    import torch.distributed as dist

    from nemo_nutp.checkpoint import save_checkpoint
    from nemo_nutp.checkpoint.background import BackgroundSaves, host_snapshot_bytes_all
    from nemo_nutp.checkpoint.megatron_format import read_meta
    from nemo_nutp.train.session import build_session

    init_cpu_rank(rank, world, port)
    plan = _plan(args)
    s = build_session(plan, plan.request.model, lr=1e-3, seed=1, micro_batch_size=2)
    k = 0
    _timed_step(s, k)  # Adam state exists
    k += 1
    roots = {m: Path(out) / f"w{index}" / m for m in ("sync", "async")}
    rows: dict[str, list[float]] = {"first": [], "sync": [], "async": [], "write": [],
                                    "base_step": [], "overlap_step": [], "extra_in_steps": []}
    dist.barrier()
    t0 = time.perf_counter()
    path = save_checkpoint(s, roots["sync"], step=k)
    rows["first"].append(time.perf_counter() - t0)
    meta = read_meta(path)
    assert meta is not None
    state = sum(meta["sizes"].values())
    done: list[float] = []
    saves = BackgroundSaves(on_done=lambda p, sec: done.append(sec))
    snap = 0
    for _ in range(args.repeats):
        base = [_timed_step(s, k + j) for j in range(args.steps)]
        k += args.steps
        rows["base_step"] += base
        _drop(roots["sync"])
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(s, roots["sync"], step=k)
        rows["sync"].append(time.perf_counter() - t0)
        _drop(roots["async"])
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(s, roots["async"], step=k, background=saves)
        stall = time.perf_counter() - t0
        snap = max(snap, saves.last_snapshot_bytes)
        overlapped = []
        while saves.pending is not None and len(overlapped) < 50:
            t_step = _timed_step(s, k)
            k += 1
            t1 = time.perf_counter()
            saves.poll()
            stall += time.perf_counter() - t1
            if saves.pending is not None or not overlapped:
                overlapped.append(t_step)
        t1 = time.perf_counter()
        saves.wait()
        stall += time.perf_counter() - t1
        rows["async"].append(stall)
        rows["write"].append(done[-1])
        rows["overlap_step"] += overlapped
        med = statistics.median(base)
        rows["extra_in_steps"].append(sum(max(0.0, t - med) for t in overlapped))
    snap_max = host_snapshot_bytes_all(snap)
    if rank == 0:
        Path(out, f"raw{index}.json").write_text(json.dumps(
            {"rows": rows, "state_bytes": state, "snapshot_bytes_max_rank": snap_max}))
    dist.barrier()


def _summary(raws: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def all_of(key: str) -> list[float]:
        return [v for r in raws for v in r["rows"][key]]

    med = statistics.median
    sync, asyn = med(all_of("sync")), med(all_of("async"))
    first, later = med(all_of("first")), med(all_of("sync"))
    ratio = med(all_of("overlap_step")) / med(all_of("base_step"))
    return {**vars(args), "state_bytes": raws[0]["state_bytes"],
            "snapshot_bytes_max_rank": max(r["snapshot_bytes_max_rank"] for r in raws),
            "sync_stall_s": sync, "async_stall_s": asyn, "stall_ratio_async_over_sync": asyn / sync,
            "first_save_s": first, "later_save_s": later, "first_over_later": first / later,
            "overlap_step_ratio": ratio, "async_write_s": med(all_of("write")),
            "async_effective_stall_s": asyn + med(all_of("extra_in_steps")),
            "base_step_s": med(all_of("base_step")), "overlap_step_s": med(all_of("overlap_step")),
            "per_world": [r["rows"] for r in raws]}


def _table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Checkpoint saves: {r['state_bytes'] / 2**30:.2f} GiB of state, "
                    f"replicas {r['replicas']}, {r['worlds']} fresh worlds (medians)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [("sync stall per save (s)", f"{r['sync_stall_s']:.3f}"),
            ("async stall per save (s)", f"{r['async_stall_s']:.3f}"),
            ("async / sync stall (target <= 0.2)", f"{r['stall_ratio_async_over_sync']:.3f}"),
            ("async background write (s)", f"{r['async_write_s']:.3f}"),
            ("async stall + extra time of overlapped steps (s)",
             f"{r['async_effective_stall_s']:.3f}"),
            ("step without / with a write running (s)",
             f"{r['base_step_s']:.3f} / {r['overlap_step_s']:.3f}"),
            ("overlap_step_ratio (target <= 1.5)", f"{r['overlap_step_ratio']:.3f}"),
            ("first save (s, median over fresh worlds)", f"{r['first_save_s']:.3f}"),
            ("later sync saves (s)", f"{r['later_save_s']:.3f}"),
            ("first / later (target <= 2)", f"{r['first_over_later']:.3f}"),
            ("host snapshot, largest rank (MiB)", f"{r['snapshot_bytes_max_rank'] / 2**20:.0f}")]
    for a, b in rows:
        t.add_row(a, b)
    Console().print(t)


def _plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nemo_nutp.layout.serialize import atomic_path

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["sync stall", "async stall", "async stall\n+ step slowdown", "first save",
             "later saves"]
    vals = [r["sync_stall_s"], r["async_stall_s"], r["async_effective_stall_s"],
            r["first_save_s"], r["later_save_s"]]
    a.bar(names, vals, color=["tab:red", "tab:green", "tab:olive", "tab:blue", "tab:cyan"])
    a.set(ylabel="seconds (median)", title=f"{r['state_bytes'] / 2**30:.2f} GiB checkpoint")
    a.tick_params(axis="x", labelsize=7)
    b.bar(["step, no write", "step, write running"], [r["base_step_s"], r["overlap_step_s"]])
    b.set(ylabel="seconds (median)", title=f"overlap_step_ratio {r['overlap_step_ratio']:.2f}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="2", help="TP degree per replica")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=40960)
    p.add_argument("--worlds", type=int, default=3, help="fresh worlds (first save in each)")
    p.add_argument("--repeats", type=int, default=2, help="sync+async save pairs per world")
    p.add_argument("--steps", type=int, default=3, help="plain steps before each pair")
    p.add_argument("--out", default="runs/bench/checkpoint_save.json")
    args = p.parse_args(argv)
    for name in ("worlds", "repeats", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}={getattr(args, name)}: must be >= 1")
    from rich.progress import Progress

    from nemo_nutp.common.ports import free_port
    from nemo_nutp.layout.serialize import write_json_atomic

    world = sum(int(x) for x in args.replicas.split(","))
    raws = []
    with tempfile.TemporaryDirectory(dir=Path(args.out).parent if Path(args.out).parent.is_dir()
                                     else None) as tmp, Progress() as bar:
        task = bar.add_task("fresh worlds", total=args.worlds)
        for i in range(args.worlds):
            mp.spawn(_worker, args=(world, free_port(), args, tmp, i), nprocs=world)
            raws.append(json.loads(Path(tmp, f"raw{i}.json").read_text()))
            shutil.rmtree(Path(tmp) / f"w{i}", ignore_errors=True)
            bar.advance(task)
    result = _summary(raws, args)
    out = Path(args.out)
    write_json_atomic(result, out)
    png = _plot(result, out.with_suffix(".png"))
    _table(result)
    print(f"wrote {out} and {png}")
    return result


if __name__ == "__main__":
    main()
