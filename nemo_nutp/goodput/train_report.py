"""End-of-run reports for ``nutp-train``: goodput table and the loss/goodput plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..common.console import make_console
from ..layout.serialize import atomic_path
from .accounting import CAUSES, GoodputLedger

_LABELS = {"useful": "useful work", "sync": "exposed sync (reshard + reduce) + optimizer",
           "slack": "slack: waiting for slower replicas",
           "straggler": "straggler inside a replica (peers wait for its slow rank)",
           "failed": "failed GPUs idle",
           "idle": "healthy GPUs unused", "checkpoint": "checkpoint time",
           "restart": "restart time", "relayout": "live re-layout time",
           "evaluation": "evaluation (train.eval_interval)"}


def print_goodput(ledger: GoodputLedger, console: Console | None = None, *,
                  restarts: Sequence[dict[str, Any]] = ()) -> None:
    caption = None
    lives = [r for r in restarts if r.get("mode") == "live"]  # recovery.mode=live
    restarts = [r for r in restarts if r.get("mode") != "live"]
    parts = []
    if restarts:
        lost = sum(r.get("lost_steps", 0) for r in restarts)
        secs = [r["restart_s"] for r in restarts if r.get("restart_s") is not None]
        parts.append(f"{len(restarts)} restart(s): {lost} step(s) recomputed, "
                     f"{sum(secs):.1f} s from failure to resumed training"
                     " (charged to restart time)")
    if lives:
        redo = sum(r.get("recomputed_steps", 0) for r in lives)
        parts.append(f"{len(lives)} live re-layout(s): {redo} in-flight step(s) recomputed, "
                     f"{sum(r['relayout_s'] for r in lives):.1f} s from failure to the new "
                     "layout's first step (charged to live re-layout time)")
    caption = "; ".join(parts) or None
    title = (f"Goodput report: {ledger.cluster_gpus} GPUs x {ledger.wall_s:.1f} s"
             if not ledger.carried_gpu_s else
             f"Goodput report: {ledger.carried_gpu_s:.1f} GPU-s before the resume + "
             f"{ledger.cluster_gpus} GPUs x {ledger.wall_s:.1f} s")
    t = Table(title=title, caption=caption)
    t.add_column("where the GPU-time went")
    t.add_column("GPU-s", justify="right")
    t.add_column("share", justify="right")
    for c in CAUSES:
        v = ledger.totals[c]
        if c == "evaluation" and not v:  # only runs that evaluate
            continue
        t.add_row(_LABELS[c], f"{v:.2f}", f"{v / ledger.total:.1%}" if ledger.total else "-")
        if c == "checkpoint" and "checkpoint_write" in ledger.background:
            t.add_row("  beside it: background checkpoint writes (wall s, not charged)",
                      f"({ledger.background['checkpoint_write']:.2f} s)", "")
    t.add_row("[bold]total", f"{ledger.total:.2f}", "100.0%")
    t.add_row("[bold]goodput[/] (useful share)", "", f"[bold]{ledger.goodput:.1%}")
    (console or make_console()).print(t)


def plot_training(rows: list[dict[str, Any]], path: Path, *,
                  restarts: Sequence[dict[str, Any]] = ()) -> Path:
    """Loss and goodput over steps as a PNG (written to a temp name, then renamed); a dashed
    line marks the step each restart resumed from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r["loss"] for r in rows], marker=".", label="training (global batch)")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        a.plot(*zip(*val, strict=True), marker="o", color="tab:orange", label="validation")
        a.legend(loc="upper right", fontsize=8)
    a.set(xlabel="step", ylabel="loss", title="loss")
    b.plot(steps, [100 * r["goodput"] for r in rows], marker=".", color="tab:green",
           label="run so far (= bar, report, goodput.json)")
    if all("step_goodput" in r for r in rows):
        b.plot(steps, [100 * r["step_goodput"] for r in rows], color="tab:green", alpha=0.35,
               lw=1, label="each step alone (no pauses)")
    b.set(xlabel="step", ylabel="goodput %", title="goodput (useful / allocated GPU-time)",
          ylim=(0, 100))
    b.legend(loc="lower right", fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        for k, r in enumerate(restarts):
            if r.get("resume_step") is not None:
                ax.axvline(r["resume_step"], color="tab:red", ls="--", lw=1,
                           label="restart (resumed step)" if k == 0 else None)
    if restarts:
        a.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path
