"""PNG figures of a simulation result (paper Fig. 6/7/10 analogues), written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ..layout.serialize import atomic_path

STYLE = {"drop": "C3", "drop-live": "C5", "drop+spares": "C1", "uniform-reduce": "C4",
         "nutp": "C0", "nutp-restart": "C0", "nutp-live": "C9", "nutp+spares": "C6",
         "nutp-live+spares": "C6", "nutp+boost": "C2", "stop-wait": "C7"}


def _save(fig: Figure, path: Path) -> Path:
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _title(res: dict[str, Any]) -> str:
    c = res["config"]
    par = c["parallel"]
    return (f"{c['name']}: {c['cluster']['num_gpus']:,} GPUs, TP{par['tp_base']}xPP{par['pp']}, "
            f"{c['trials']} trials")


def loss_vs_fraction(res: dict[str, Any], path: Path) -> Path:
    """Fig. 6 analogue: throughput loss vs failed-GPU fraction, p5-p95 bands."""
    pts = res["sweep"]["points"]
    x = [p["fraction"] * 100 for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for pol in pts[0]["policies"]:
        m = [p["policies"][pol]["mean"] * 100 for p in pts]
        lo = [p["policies"][pol]["p5"] * 100 for p in pts]
        hi = [p["policies"][pol]["p95"] * 100 for p in pts]
        ax.plot(x, m, marker="o", ms=3, label=pol, color=STYLE.get(pol))
        ax.fill_between(x, lo, hi, alpha=0.15, color=STYLE.get(pol))
    if res["config"]["parallel"]["pp"] == 1:
        ax.plot(x, [p["drop_closed_form"] * 100 for p in pts], "k--", lw=0.8,
                label="1-(1-p)^n")
    ax.plot(x, x, ":", color="grey", lw=0.8, label="= failed fraction")
    ax.set(xlabel="failed GPUs (%)", ylabel="throughput loss vs fault-free (%)",
           title=_title(res))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def spares_vs_fraction(res: dict[str, Any], path: Path) -> Path:
    """Fig. 7 analogue: spare domains a rigid job needs (p95 over trials)."""
    pts = res["sweep"]["points"]
    x = [p["fraction"] * 100 for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for pol in ("drop", "nutp", "nutp+boost"):
        if pol in pts[0]["policies"]:
            ax.plot(x, [p["policies"][pol]["spare_domains_p95"] for p in pts], marker="o",
                    ms=3, label=pol, color=STYLE.get(pol))
    ax.set(xlabel="failed GPUs (%)", ylabel="spare domains for zero pause (p95)",
           title=_title(res))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def blast_sensitivity(res: dict[str, Any], path: Path) -> Path:
    """Fig. 10 analogue: loss at a fixed failed fraction when failures take a GPU/node/domain."""
    rows = res["sweep"]["blast"]
    pols = list(rows[0]["policies"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    w = 0.8 / len(pols)
    for i, pol in enumerate(pols):
        xs = [j + (i - len(pols) / 2 + 0.5) * w for j in range(len(rows))]
        ax.bar(xs, [r["policies"][pol]["mean"] * 100 for r in rows], w, label=pol,
               color=STYLE.get(pol))
    ax.set_xticks(range(len(rows)), [f"{r['kind']} ({r['gpus']} GPUs)" for r in rows])
    ax.set(ylabel="throughput loss (%)", title=f"{_title(res)}\nfailed fraction "
           f"{rows[0]['fraction'] * 100:.2f}% by blast radius")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def straggler_policies(res: dict[str, Any], path: Path, key: str = "stragglers",
                       what: str = "stragglers") -> Path:
    """Mean loss to stragglers (``key='links'``: slow links) per policy, p5-p95 as error
    bars."""
    pols = res[key]["policies"]
    names = list(pols)
    mean = np.array([pols[p]["mean"] for p in names]) * 100
    lo = mean - np.array([pols[p]["p5"] for p in names]) * 100
    hi = np.array([pols[p]["p95"] for p in names]) * 100 - mean
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(names, mean, yerr=np.vstack([lo.clip(0), hi.clip(0)]), capsize=4, color="#4c72b0")
    ax.set_ylabel(f"loss to {what} % (throughput + transitions)")
    ax.set_title(_title(res) + f": {what} policies", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def timeline_losses(res: dict[str, Any], path: Path) -> Path:
    """Per timeline policy: throughput loss and transition loss stacked (their sum = loss)."""
    pols = res["timeline"]["policies"]
    names = list(pols)
    thr = np.array([pols[p]["throughput_loss"] for p in names]) * 100
    tra = np.array([pols[p]["transition_loss"] for p in names]) * 100
    fig, ax = plt.subplots(figsize=(1.0 * len(names) + 2, 4.0))
    ax.bar(names, thr, label="throughput loss (degraded layout)", color="#4c72b0")
    ax.bar(names, tra, bottom=thr, label="transition loss (changing layouts, saves)",
           color="#dd8452")
    ax.set_ylabel("loss vs fault-free %")
    ax.set_title(_title(res) + f", {res['config']['days']:g} days", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def write_all(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every figure the result supports; returns the paths written."""
    name = res["config"]["name"]
    out = []
    if "sweep" in res:
        out += [loss_vs_fraction(res, out_dir / f"{name}_loss_vs_fraction.png"),
                spares_vs_fraction(res, out_dir / f"{name}_spares.png"),
                blast_sensitivity(res, out_dir / f"{name}_blast.png")]
    if "timeline" in res:
        out.append(timeline_losses(res, out_dir / f"{name}_timeline.png"))
    if "stragglers" in res:
        out.append(straggler_policies(res, out_dir / f"{name}_stragglers.png"))
    if "links" in res:
        out.append(straggler_policies(res, out_dir / f"{name}_links.png", "links", "slow links"))
    return out
