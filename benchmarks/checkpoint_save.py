"""Checkpoint save/verify benchmark on CPU/gloo: per-rank parallel hashing vs rank-0 hashing.

One spawned world builds one session and alternates, ``--repeats`` times, saves with
``hashing='parallel'`` (every rank hashes the files it wrote, on a thread pool; rank 0 gathers the
digests) and ``hashing='rank0'`` (the former behaviour: after a barrier rank 0 reads and hashes
every file while the others wait), so both see the same machine noise. It also times the
verification a load does: all ranks each checking their share vs rank 0 checking everything.

Reported per mode (medians): rank 0's busy time in the save (entry to return: every rank returns
together), the part of it rank 0 spent hashing and how many bytes it hashed (replica 0's TP ranks
write the shards, so with per-rank hashing rank 0 reads about 1/TP of them), and the
verification time. On a machine with fewer cores than ranks the seconds show little of the gain;
the bytes are what scales.

Usage: python benchmarks/checkpoint_save.py [--replicas 4] [--hidden 512] [--layers 4]
           [--vocab 8192] [--repeats 3] [--warmup 1] [--out PATH]
Writes runs/bench/checkpoint_save.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("parallel", "rank0")


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


class _Timer:
    """Wraps a function; adds its wall time on this rank to ``seconds``."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0


def _verify(mode: str, path: Path, files: dict[str, str]) -> float:
    import torch.distributed as dist

    from nemo_nutp.checkpoint import integrity

    dist.barrier()
    t0 = time.perf_counter()
    if mode == "parallel":
        assert not integrity.verify_parallel(files, path)
    else:
        if dist.get_rank() == 0:
            assert not integrity.verify_serial(files, path)
        dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.checkpoint import integrity, save_checkpoint
    from nemo_nutp.checkpoint.megatron_format import read_meta
    from nemo_nutp.train.session import build_session

    init_cpu_rank(rank, world, port)
    plan = _plan(args)
    s = build_session(plan, plan.request.model, lr=1e-3, seed=1, micro_batch_size=2)
    s.step(0)  # Adam state exists
    timers = {"parallel": _Timer(integrity.gather_checksums),
              "rank0": _Timer(integrity.checksums_serial)}
    integrity.gather_checksums = timers["parallel"]  # type: ignore[assignment]
    integrity.checksums_serial = timers["rank0"]  # type: ignore[assignment]
    rows: dict[str, dict[str, list[float]]] = {
        m: {"save": [], "hash": [], "verify": [], "rank0_bytes": []} for m in MODES}
    size = 0
    for k in range(args.warmup + args.repeats):
        for mode in MODES:
            dist.barrier()
            before = timers[mode].seconds
            t0 = time.perf_counter()
            path = save_checkpoint(s, Path(out) / mode, step=k + 1, hashing=mode)
            seconds = time.perf_counter() - t0
            meta = read_meta(path)
            assert meta is not None
            size = sum((path / f).stat().st_size for f in meta["files"])
            mine = size if mode == "rank0" else sum(
                (path / f).stat().st_size for f in integrity.own_files(path, 0))
            verify = _verify(mode, path, meta["files"])
            if k >= args.warmup:
                for key, v in (("save", seconds), ("hash", timers[mode].seconds - before),
                               ("verify", verify), ("rank0_bytes", float(mine))):
                    rows[mode][key].append(v)
    if rank == 0:
        Path(out, "raw.json").write_text(json.dumps({"rows": rows, "bytes": size}))


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Checkpoint save, replicas {result['replicas']}, "
                    f"{result['bytes'] / 2**20:.0f} MiB per checkpoint (rank 0, medians)")
    for c in ("hashing", "save s (rank 0 busy)", "rank-0 hashing s", "MiB rank 0 hashes",
              "verify s (load)"):
        t.add_column(c, justify="right")
    for mode, label in (("rank0", "rank 0 reads all (before)"),
                        ("parallel", "each rank its own (now)")):
        m = result["median"][mode]
        t.add_row(label, f"{m['save']:.3f}", f"{m['hash']:.3f}",
                  f"{m['rank0_bytes'] / 2**20:.0f}", f"{m['verify']:.3f}")
    Console().print(t)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="4", help="TP degree per replica")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="saves per mode left out")
    p.add_argument("--out", default="runs/bench/checkpoint_save.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats}: must be >= 1")
    from nemo_nutp.launch.ports import free_port
    from nemo_nutp.layout.serialize import write_json_atomic

    world = sum(int(x) for x in args.replicas.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, free_port(), args, tmp), nprocs=world)
        raw = json.loads(Path(tmp, "raw.json").read_text())
    median = {m: {k: statistics.median(v) for k, v in rows.items()}
              for m, rows in raw["rows"].items()}
    result = {**vars(args), "bytes": raw["bytes"], "median": median, "per_save": raw["rows"],
              "save_ratio_parallel_over_rank0": median["parallel"]["save"]
              / median["rank0"]["save"]}
    write_json_atomic(result, Path(args.out))
    _table(result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
