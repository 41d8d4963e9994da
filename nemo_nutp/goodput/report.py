"""``nutp simulate``: load the scenario, run with a progress bar, print rich tables, write
JSON (``--json PATH``, default ``<output_dir>/<name>.json``) and PNG figures, atomically."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..common.console import make_console, print_error
from ..layout.serialize import write_json_atomic


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}"


def sweep_table(res: dict[str, Any]) -> Table:
    """Mean [p5, p95] loss per policy at each failed fraction, plus nutp loss / fraction."""
    pts = res["sweep"]["points"]
    pols = list(pts[0]["policies"])
    t = Table(title="Throughput loss % vs failed-GPU fraction: mean [p5, p95]")
    for col in ("failed %", "drop closed form", *pols, "nutp / failed"):
        t.add_column(col, justify="right")
    for p in pts:
        cells = [f"{_pct(v['mean'])} [{_pct(v['p5'])}, {_pct(v['p95'])}]"
                 for v in (p["policies"][q] for q in pols)]
        ratio = (f"{p['policies']['nutp']['mean'] / p['fraction']:.2f}"
                 if "nutp" in p["policies"] else "-")
        closed = (_pct(p["drop_closed_form"]) if res["config"]["parallel"]["pp"] == 1
                  else "n/a (pp>1)")
        t.add_row(_pct(p["fraction"], 3), closed, *cells, ratio)
    return t


def timeline_table(res: dict[str, Any]) -> Table:
    tl = res["timeline"]
    c = res["config"]
    t = Table(title=f"{c['days']:g} days, {tl['trials']} trials, {tl['events']:,} failures, "
                    f"mean failed {_pct(tl['mean_failed_fraction'], 3)}% of GPUs; loss = "
                    "throughput loss + transition loss")
    for col in ("policy", "mode", "throughput loss %", "transition loss %", "loss mean %",
                "p5 %", "p95 %", "events / day", "s / event", "rigid paused %",
                "spares for 0 pause (p95)", "boost power %", "GPU-h lost", "$ lost"):
        t.add_column(col, justify="right")
    for pol, r in tl["policies"].items():
        sp = r["spare_domains_zero_pause"]
        t.add_row(pol, r["mode"], _pct(r["throughput_loss"], 3), _pct(r["transition_loss"], 3),
                  _pct(r["mean"], 3), _pct(r["p5"], 3), _pct(r["p95"], 3),
                  f"{r['events_per_day']:.1f}", f"{r['mean_event_s']:.0f}",
                  _pct(r["rigid_paused"], 1), "-" if sp is None else f"{sp:.0f}",
                  _pct(r["boost_power"], 3), f"{r['gpu_hours_lost']:,.0f}",
                  f"{r['usd_lost']:,.0f}")
    return t


def transitions_line(res: dict[str, Any]) -> str:
    """The transition costs the timeline used, one line."""
    c = res["timeline"]["transitions"]
    d = res["timeline"]["daly"]
    daly = (f"; Young/Daly interval {d['interval_h'] * 60:.1f} min (MTTF {d['mttf_h'] * 60:.0f} "
            "min)" if "interval_h" in d else "")
    return (f"transitions ({c['source']}): detect {c['detect_s']:.1f} s, restart "
            f"{c['restart_s']:.0f} s (fit {c['restart_fit']['a']:.3g} x N^"
            f"{c['restart_fit']['k']:.3f}), planned restart {c['planned_restart_s']:.0f} s, "
            f"live {c['live_s']:.1f} s (+ in-flight step {c['live_lost_s']:.1f} s), "
            f"live spare {c.get('live_spare_s', 0.0):.1f} s (modelled), "
            f"checkpoint every {c['checkpoint_interval_s'] / 60:.0f} min, save "
            f"{c['save_s']:.0f} s, recompute {c.get('recompute', 'capped')}{daly}")


def batching_table(res: dict[str, Any]) -> Table:
    b = res["timeline"]["repair_batching"]
    t = Table(title="Repaired GPUs taken back at once (0 h) or in batches: loss mean % "
                    f"(first {b['trials']} trials)")
    for col in ("policy", *[f"every {h:g} h" for h in b["hours"]], "best"):
        t.add_column(col, justify="right")
    for pol, v in b["loss"].items():
        t.add_row(pol, *[_pct(x, 3) for x in v], f"{b['best_hours'][pol]:g} h")
    return t


def blast_table(res: dict[str, Any]) -> Table:
    rows = res["sweep"]["blast"]
    pols = list(rows[0]["policies"])
    t = Table(title=f"Blast radius at {_pct(rows[0]['fraction'], 2)}% failed GPUs: mean loss %")
    for col in ("blast", *pols):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['kind']} ({r['gpus']})", *[_pct(r["policies"][q]["mean"]) for q in pols])
    return t


def straggler_table(res: dict[str, Any]) -> Table:
    """Straggler policies side by side: loss to slow GPUs alone over the timeline."""
    sg, c = res["stragglers"], res["config"]
    s = c["stragglers"]
    t = Table(title=f"Stragglers: {s['rate_per_gpu_day']:g}/GPU-day, speed "
                    f"{s['min_speed']:g}-{s['max_speed']:g}, {s['duration_hours']:g} h "
                    f"({s['duration_distribution']}); {sg['events']:,} episodes, "
                    f"{_pct(sg['mean_slow_fraction'], 3)}% of GPUs slow")
    return _episode_rows(t, "straggler policy", sg["policies"])


def _episode_rows(t: Table, first: str, policies: dict[str, Any]) -> Table:
    """The columns and one row per policy of an episode table (stragglers, slow links)."""
    for col in (first, "throughput loss %", "transition loss %", "loss mean %",
                "p5 %", "p95 %", "events / day", "s / event", "GPU-h lost", "$ lost"):
        t.add_column(col, justify="right")
    for pol, r in policies.items():
        t.add_row(pol, _pct(r["throughput_loss"], 3), _pct(r["transition_loss"], 3),
                  _pct(r["mean"], 3), _pct(r["p5"], 3), _pct(r["p95"], 3),
                  f"{r['events_per_day']:.1f}", f"{r['mean_event_s']:.0f}",
                  f"{r['gpu_hours_lost']:,.0f}", f"{r['usd_lost']:,.0f}")
    return t


def link_table(res: dict[str, Any]) -> Table:
    """Link (slow NIC) policies side by side: loss to slow links alone over the timeline."""
    lk, s = res["links"], res["config"]["links"]
    t = Table(title=f"Slow links: {s['rate_per_gpu_day']:g}/GPU-day, NIC "
                    f"{s['min_slowdown']:g}-{s['max_slowdown']:g}x slower, "
                    f"{s['duration_hours'] * 60:g} min ({s['duration_distribution']}), "
                    f"found in {s['detect_s']:g} s; {lk['events']:,} episodes, "
                    f"{lk['mean_slow_links']:.2f} at a time; DP sync "
                    f"{lk['sync_s']:.2f} s")
    return _episode_rows(t, "link policy", lk["policies"])


def print_result(res: dict[str, Any], console: Console) -> None:
    c, st = res["config"], res["step_time"]
    speeds = ", ".join(f"TP{k}: {v:.3f}" for k, v in res["degraded_speed"].items())
    par = c["parallel"]
    console.print(f"[bold]{c['name']}[/]: {c['cluster']['num_gpus']:,} GPUs "
                  f"({res['hardware']['name']}), model {c['model']}, TP{par['tp_base']} x "
                  f"PP{par['pp']}, {res['replicas']} replicas; step {st['step_s']:.2f} s "
                  f"(compute {st['compute_s']:.2f} s); "
                  f"cost {c['cost']['mode']}/{c['cost']['shard_balance']}")
    console.print(f"replica speed by degree: {speeds}")
    if "sweep" in res:
        console.print(sweep_table(res))
        console.print(blast_table(res))
    if "timeline" in res:
        console.print(timeline_table(res))
        console.print(transitions_line(res))
        console.print(batching_table(res))
    if "stragglers" in res:
        console.print(straggler_table(res))
    if "links" in res:
        console.print(link_table(res))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``nutp simulate`` (exit code 2 on a config error)."""
    from . import figures
    from .config import load_sim_config
    from .simulate import simulate

    console = make_console()
    try:
        cfg = load_sim_config(args.overrides)
        t0 = time.perf_counter()
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def progress(label: str, done: float) -> None:
                if label not in tasks:
                    tasks[label] = bar.add_task(label, total=1.0)
                bar.update(tasks[label], completed=done)

            res = simulate(cfg, progress=progress, sweep=not args.no_sweep,
                           timeline=not args.no_timeline)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print_error(str(e))
        return 2
    res["elapsed_s"] = elapsed
    print_result(res, console)
    console.print(f"simulated in {elapsed:.1f} s")
    out_dir = Path(cfg.output_dir)
    json_path = Path(args.json) if args.json else out_dir / f"{cfg.name}.json"
    write_json_atomic(res, json_path)
    console.print(f"wrote {json_path}")
    if not args.no_figures:
        for p in figures.write_all(res, out_dir):
            console.print(f"wrote {p}")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``simulate`` on the ``nutp`` sub-command parser."""
    p = sub.add_parser("simulate", help="goodput simulator: policies under failures at scale")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sim=paper_32k sim.trials=50")
    p.add_argument("--json", metavar="PATH", help="result JSON (default <output_dir>/<name>.json)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--no-sweep", action="store_true", help="skip the failed-fraction sweep")
    p.add_argument("--no-timeline", action="store_true", help="skip the timeline simulation")
    p.set_defaults(func=run)
