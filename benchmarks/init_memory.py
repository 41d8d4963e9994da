"""Per-rank init cost of one Llama-3-70B layer: time and peak extra memory of ``init_param_``.

Each configuration runs in a fresh subprocess: it allocates (and touches) the rank's shard
tensors, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``; a sampling thread where
that is unavailable), initialises, and reports peak RSS minus RSS after allocation. The old
approach (the former ``build.global_weight``: materialise the global tensor, index the slice)
is timed on fc1 only. Target: shard + extra <= 2 x shard. Writes runs/bench/init_memory.json.
Usage: python benchmarks/init_memory.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nemo_nutp.config import load_config
from nemo_nutp.layout.serialize import write_json_atomic
from nemo_nutp.layout.units import PARAM_KINDS, local_shape, space_bounds

NAMES = {"qkv_weight": "decoder.layers.0.self_attention.linear_qkv.weight",
         "proj_weight": "decoder.layers.0.self_attention.linear_proj.weight",
         "fc1_weight": "decoder.layers.0.mlp.linear_fc1.weight",
         "fc2_weight": "decoder.layers.0.mlp.linear_fc2.weight"}
MIB = 1 << 20


def _dims():  # type: ignore[no-untyped-def]
    return load_config(["model=llama3_70b"]).model


def _shards(dims, degree: int, rank: int, kinds: list[str]) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    for kind in kinds:
        b = space_bounds(dims, PARAM_KINDS[kind].space, degree)
        lo, hi = int(b[rank]), int(b[rank + 1])
        out[kind] = ((lo, hi), local_shape(kind, dims, hi - lo))
    return out


def _shard_bytes(shards: dict) -> int:
    total = 0
    for _, shape in shards.values():
        n = 4
        for s in shape:
            n *= s
        total += n
    return total


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


class _Peak:
    """Peak RSS (KiB) from here on: the kernel's reset high-water mark, else a 1 ms sampler."""

    def __enter__(self) -> _Peak:
        import psutil

        self.proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.base, self.thread = _rss_kib("VmRSS"), None
        except OSError:
            self.base = self.proc.memory_info().rss // 1024
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self.proc.memory_info().rss // 1024)

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is None:
            self.peak = _rss_kib("VmHWM")
        else:
            self.thread.join()


def _init(method: str, dims, shards: dict, tensors: dict) -> None:  # type: ignore[no-untyped-def]
    import torch

    from nemo_nutp.layout import local_layout
    from nemo_nutp.layout.units import global_shape
    from nemo_nutp.model.init import init_param_

    for kind, ((lo, hi), _) in shards.items():
        if method == "old-fc1":  # the replaced build.global_weight + load_global_init
            gen = torch.Generator().manual_seed(zlib.crc32(f"1:{NAMES[kind]}".encode()))
            full = torch.randn(global_shape(kind, dims), generator=gen) * dims.init_std
            idx = torch.from_numpy(local_layout(kind, dims, torch.arange(lo, hi).numpy()))
            tensors[kind].copy_(full.reshape(-1)[idx].view_as(tensors[kind]))
        else:
            init_param_(tensors[kind], name=NAMES[kind], kind=kind, units=(lo, hi), dims=dims,
                        seed=1, std=dims.init_std)


def child(degree: int, rank: int, method: str) -> dict:
    """Run one configuration in this process; return its measurements. The new method is
    warmed up on one unit per kind first, so first-touched code pages do not count."""
    import torch

    dims = _dims()
    kinds = list(NAMES) if method == "new-layer" else ["fc1_weight"]
    if method != "old-fc1":
        warm = {k: ((u[0], u[0] + 1), local_shape(k, dims, 1))
                for k, (u, _) in _shards(dims, degree, rank, kinds).items()}
        _init(method, dims, warm, {k: torch.empty(s) for k, (_, s) in warm.items()})
    shards = _shards(dims, degree, rank, kinds)
    tensors = {k: torch.empty(shape).fill_(0.0) for k, (_, shape) in shards.items()}
    with _Peak() as peak:
        t0 = time.perf_counter()
        _init(method, dims, shards, tensors)
        seconds = time.perf_counter() - t0
    return {"degree": degree, "rank": rank, "method": method, "shard_bytes": _shard_bytes(shards),
            "init_s": seconds, "peak_extra_bytes": max(0, peak.peak - peak.base) * 1024,
            "units": {k: list(u) for k, (u, _) in shards.items()}}


def _largest_rank(degree: int) -> int:
    dims = _dims()
    sizes = [_shard_bytes(_shards(dims, degree, r, list(NAMES))) for r in range(degree)]
    return max(range(degree), key=lambda r: sizes[r])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench/init_memory.json")
    ap.add_argument("--child", nargs=3, metavar=("DEGREE", "RANK", "METHOD"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), int(args.child[1]), args.child[2])))
        return
    configs = [(7, _largest_rank(7), "new-layer"), (8, 0, "new-layer"),
               (8, 0, "new-fc1"), (8, 0, "old-fc1")]
    table = Table(title="init of one Llama-3-70B layer's sharded params, one rank (fp32, CPU)")
    for col in ("method", "degree", "rank", "shard MiB", "init s", "peak extra MiB",
                "peak/shard"):
        table.add_column(col, justify="right")
    results = []
    for degree, rank, method in configs:
        proc = subprocess.run([sys.executable, __file__, "--child", str(degree), str(rank),
                               method], capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["peak_over_shard"] = (r["shard_bytes"] + r["peak_extra_bytes"]) / r["shard_bytes"]
        results.append(r)
        table.add_row(method, str(degree), str(rank), f"{r['shard_bytes'] / MIB:.0f}",
                      f"{r['init_s']:.2f}", f"{r['peak_extra_bytes'] / MIB:.1f}",
                      f"{r['peak_over_shard']:.3f}")
    Console().print(table)
    write_json_atomic({"model": "llama3_70b", "target_peak_over_shard": 2.0,
                       "results": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
