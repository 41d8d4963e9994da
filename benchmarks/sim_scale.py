"""Scale benchmark of the goodput simulator: 1000 trials x 32,768 GPUs x 15 days (target < 60 s).

Runs the timeline of the paper scenario (every policy, 1 h steps, layout transitions and the
repair-batching comparison included) and the static failed-fraction sweep at the same trial
count, prints a rich table and writes ``runs/bench/sim_scale.json``.
Usage: ``python benchmarks/sim_scale.py [hydra overrides]``, e.g. ``sim.trials=200``.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from nemo_nutp.goodput import load_sim_config
from nemo_nutp.goodput.simulate import make_context, run_sweep, run_timeline
from nemo_nutp.layout.serialize import write_json_atomic


def main(argv: list[str]) -> int:
    cfg = load_sim_config(["sim=paper_32k", "sim.trials=1000", "sim.days=15", *argv])
    console = Console()
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    ctx = make_context(cfg)
    t1, c1 = time.perf_counter(), time.process_time()
    tl = run_timeline(ctx, np.random.default_rng(cfg.seed))
    t2, c2 = time.perf_counter(), time.process_time()
    sw = run_sweep(ctx, np.random.default_rng(cfg.seed + 1))
    t3, c3 = time.perf_counter(), time.process_time()
    phases = {"setup (cost tables)": t1 - t0, "timeline": t2 - t1, "sweep": t3 - t2}
    cpu = {"setup (cost tables)": c1 - c0, "timeline": c2 - c1, "sweep": c3 - c2}
    table = Table(title=f"nutp simulate at scale: {cfg.trials} trials x "
                        f"{cfg.cluster.num_gpus:,} GPUs x {cfg.days:g} days ({tl['steps']} steps), "
                        f"{len(cfg.policies)} policies")
    table.add_column("phase")
    table.add_column("wall s", justify="right")
    table.add_column("CPU s (this process)", justify="right")
    for k, v in phases.items():
        table.add_row(k, f"{v:.2f}", f"{cpu[k]:.2f}")
    table.add_row("[bold]timeline incl. setup (target < 60 s)", f"[bold]{t2 - t0:.2f}",
                  f"[bold]{c2 - c0:.2f}")
    console.print(table)
    console.print(f"load average (1 min) {load0:.1f} -> {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} CPUs: wall time includes waiting for other work")
    console.print(f"{tl['events']:,} failures simulated; timeline mean loss (throughput + "
                  "transition): " + ", ".join(
                      f"{p} {r['throughput_loss'] * 100:.3f} + {r['transition_loss'] * 100:.3f}"
                      f" = {r['loss'] * 100:.3f}%" for p, r in tl["policies"].items()))
    out = {"schema": "nemo_nutp.bench.sim_scale/1", "trials": cfg.trials,
           "num_gpus": cfg.cluster.num_gpus, "days": cfg.days, "steps": tl["steps"],
           "events": tl["events"], "seconds": phases, "cpu_seconds": cpu,
           "timeline_total_s": t2 - t0,
           "timeline_total_cpu_s": c2 - c0,
           "machine": {"python": platform.python_version(), "cpu": platform.processor(),
                       "numpy": np.__version__},
           "timeline_loss": {p: {k: r[k] for k in ("throughput_loss", "transition_loss", "loss")}
                             for p, r in tl["policies"].items()},
           "load_1min": [load0, os.getloadavg()[0]],
           "sweep_points": len(sw["points"])}
    write_json_atomic(out, "runs/bench/sim_scale.json")
    console.print("wrote runs/bench/sim_scale.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
