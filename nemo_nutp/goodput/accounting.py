"""Goodput accounting of a real run: where every GPU-second of the allocation went.

Per step of wall time ``T`` on a cluster of ``N`` GPUs, ``N * T`` GPU-seconds split into:

* ``useful``  — replica ranks computing forward/backward (``degree_r * compute_r``);
* ``sync``    — exposed gradient sync: reshard + cross-replica reduction + reshard back, and the
  optimizer step (``degree_r * (sync_r + optimizer_r)``);
* ``slack``   — replica ranks waiting for slower replicas at the step boundary
  (``degree_r * (T - compute_r - sync_r - optimizer_r)``);
* ``straggler`` — inside a replica, its ranks waiting for its slowest rank: with a measured
  relative speed ``v_r`` of that rank (the straggler probe, ``train/stragglers.py``),
  ``degree_r * compute_r * (1 - v_r)`` of the compute is waiting, not work (``useful`` keeps
  ``degree_r * compute_r * v_r``);
* ``failed``  — failed GPUs idle; ``idle`` — healthy GPUs the plan does not use;
* ``checkpoint`` and ``restart`` — time spent saving or restarting (charged to all GPUs). With
  asynchronous saves ``checkpoint`` is only the stall (snapshot, waits, finalisation); the
  background write time is kept beside the parts (``background``, not part of the total: the
  GPUs trained meanwhile).

By construction the parts add up to the total; ``GoodputLedger.check()`` verifies it (a test
does too). Goodput is ``useful / total``. A resumed run continues the saved ledger
(``snapshot``/``restore``): the earlier runs' GPU-seconds are carried as they were, measured on
their own cluster size, and this run adds its own cluster size x its wall time, so the parts add
up after a resume on any cluster. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("useful", "sync", "slack", "straggler", "failed", "idle", "checkpoint", "restart",
          "relayout", "evaluation")


@dataclass
class GoodputLedger:
    cluster_gpus: int
    failed_gpus: int
    idle_gpus: int
    totals: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    per_step: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0  # this run's accounted wall time
    carried_gpu_s: float = 0.0  # allocated GPU-seconds of earlier runs (restored)
    carried_wall_s: float = 0.0
    background: dict[str, float] = field(default_factory=dict)  # e.g. checkpoint_write: s

    def add_step(self, step_s: float, replicas: list[tuple[int, float, float, float]], *,
                 inside: Sequence[float] | None = None) -> float:
        """Account one step. ``replicas``: (degree, compute_s, sync_s, optimizer_s) each, the
        replica's slowest rank; ``inside``: per replica the relative speed (0, 1] of its
        slowest rank vs its peers (None: no straggler known). Returns the step's goodput
        (useful / total)."""
        parts = {c: 0.0 for c in CAUSES}
        for i, (degree, compute, sync, opt) in enumerate(replicas):
            busy = min(compute + sync + opt, step_s)
            v = 1.0 if inside is None else min(1.0, max(0.0, float(inside[i])))
            parts["useful"] += degree * min(compute, step_s) * v
            parts["straggler"] += degree * min(compute, step_s) * (1.0 - v)
            parts["sync"] += degree * max(0.0, busy - min(compute, step_s))
            parts["slack"] += degree * (step_s - busy)
        used = sum(d for d, *_ in replicas)
        parts["failed"] = self.failed_gpus * step_s
        parts["idle"] = (self.cluster_gpus - self.failed_gpus - used) * step_s
        self._add(parts, step_s)
        return parts["useful"] / (self.cluster_gpus * step_s) if step_s > 0 else 0.0

    def add_pause(self, cause: str, seconds: float) -> None:
        """Whole-cluster pause (checkpoint save, restart, live re-layout, evaluation)."""
        if cause not in ("checkpoint", "restart", "relayout", "evaluation"):
            raise ValueError(f"cause={cause!r}: must be checkpoint, restart, relayout or "
                             "evaluation")
        parts = {c: 0.0 for c in CAUSES}
        parts[cause] = self.cluster_gpus * seconds
        self._add(parts, seconds)

    def add_background(self, name: str, seconds: float) -> None:
        """Wall time of work beside training (an asynchronous checkpoint write): reported,
        never part of the GPU-time total."""
        self.background[name] = self.background.get(name, 0.0) + seconds

    def _add(self, parts: dict[str, float], seconds: float) -> None:
        self.wall_s += seconds
        for c, v in parts.items():
            self.totals[c] += v
        self.per_step.append(parts)

    @property
    def total(self) -> float:
        return self.carried_gpu_s + self.cluster_gpus * self.wall_s

    @property
    def run_wall_s(self) -> float:
        """Wall time accounted over this run and the earlier ones it continues."""
        return self.carried_wall_s + self.wall_s

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues this ledger."""
        return {"totals": dict(self.totals), "total_gpu_s": self.total,
                "wall_s": self.run_wall_s, "background": dict(self.background)}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continue a saved ledger (``snapshot``; older checkpoints lack ``total_gpu_s``: their
        parts add up to it). Steps and pauses of this run are added on top."""
        self.totals = {c: float(saved["totals"].get(c, 0.0)) for c in CAUSES}
        self.carried_gpu_s = float(saved.get("total_gpu_s", sum(self.totals.values())))
        self.carried_wall_s = float(saved["wall_s"])
        self.wall_s = 0.0
        self.background = {k: float(v) for k, v in saved.get("background", {}).items()}

    @property
    def goodput(self) -> float:
        return self.totals["useful"] / self.total if self.total else 0.0

    def check(self, rel: float = 0.01) -> None:
        """Parts must add up to cluster GPUs x wall time (within ``rel``)."""
        s = sum(self.totals.values())
        if self.total and abs(s - self.total) > rel * self.total:
            raise AssertionError(f"goodput parts {s:.3f} != total {self.total:.3f} GPU-s")

    def as_dict(self) -> dict[str, float]:
        out = {f"{c}_gpu_s": v for c, v in self.totals.items()}
        out.update(total_gpu_s=self.total, wall_s=self.run_wall_s, goodput=self.goodput)
        out.update({f"{k}_s": v for k, v in self.background.items()})
        return out
