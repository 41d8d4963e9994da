"""Detection of a persistent straggler rank (``nutp.straggler_probe_interval`` > 0).

Per-step compute times cannot name the slow rank of a TP group: its peers wait for it inside
the layers' collectives, so every rank of the group measures the same time. Every
``straggler_probe_interval`` steps each rank therefore times a fixed local probe (matrix
products on its own device, no collective; an injected ``slow`` fault stretches it like any
compute of that rank) and the times are all-gathered (one small collective, the same result on
every rank). A rank is *slow at a probe* when its time exceeds ``straggler_threshold`` x the
median of the other ranks of its TP group (of all other ranks when its group has one rank). A
rank slow at ``straggler_window`` consecutive probes is a persistent straggler: reported once as
a ``straggler`` event with its GPU id and estimated relative speed, and written (rank 0) into
``<output.dir>/stragglers.json`` as a health report (``slow_gpus``) that the planner reads via
``health.report`` to keep or exclude it. With ``nutp.exclude_stragglers`` the run stops after
the next checkpoint save (event ``relayout_requested``), so that the relaunch with that report
re-plans at reduced TP and resumes from the checkpoint: under recovery the CPU supervisor's
next world or a launcher's next attempt (``train/elastic.py``), else by hand.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..common.events import log_event

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan


def probe_workload(device: torch.device | None) -> tuple[torch.Tensor, int]:
    """(matrix, chained products) of the probe. On CUDA: bf16 4096 x 4096 products, each
    ~0.14 TFLOP (~0.2-0.3 ms on an H100), 16 of them: compute-bound, so the time scales with
    the GPU's tensor-core speed (a 192 x 192 product is ~us of launch overhead on an H100 and
    cannot tell a slow GPU from a fast one). On CPU: fp32 192 x 192, 6 products (~ms)."""
    gen = torch.Generator().manual_seed(0)
    if device is not None and device.type == "cuda":
        a = torch.randn(4096, 4096, generator=gen) / 64.0
        return a.to(device, torch.bfloat16), 16
    return torch.randn(192, 192, generator=gen).to(device), 6


def _clock(device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StragglerDetector:
    def __init__(self, cfg: JobConfig, plan: Plan, *, rank: int, events: str,
                 device: torch.device | None = None) -> None:
        n = cfg.nutp
        self.interval, self.threshold, self.window = (n.straggler_probe_interval,
                                                      n.straggler_threshold, n.straggler_window)
        self.exclude = n.exclude_stragglers
        self.plan, self.rank, self.events, self.device = plan, rank, events, device
        self.out = Path(cfg.output.dir) / "stragglers.json"
        self.ckpt_interval = cfg.checkpoint.interval
        self.streak = [0] * plan.world_size
        self.found: dict[int, float] = {}  # rank -> estimated relative speed
        self.speed = [1.0] * plan.world_size  # latest probe: speed vs its peers if slow, else 1
        self.peers = {r: [x for x in g if x != r] for g in plan.tp_groups() for r in g}
        self.stop_pending = False
        self.a, self.iters = probe_workload(device)

    def probe(self, slow_factor: float, repeats: int = 5) -> float:
        """Seconds of a fixed local workload on this rank (x the injected slowdown): the
        fastest of ``repeats`` runs, so a preempted run (a shared host) does not count. The
        device is idle at the start (queued work of the step is not timed) and at the end."""
        best = float("inf")
        for _ in range(repeats):
            t0 = _clock(self.device)
            x = self.a
            for _ in range(self.iters):
                x = torch.tanh(x @ self.a)
            dt = _clock(self.device) - t0
            if slow_factor > 1.0:
                time.sleep((slow_factor - 1.0) * dt)
            best = min(best, time.perf_counter() - t0)
        return best

    def after_step(self, step: int, slow_factor: float) -> None:
        """Collective every ``interval`` steps (all ranks call it every step)."""
        if self.interval <= 0 or (step + 1) % self.interval:
            return
        mine = torch.tensor([self.probe(slow_factor)], dtype=torch.float64, device=self.device)
        # One collective into one tensor and one host read (not W tensors and W syncs); W
        # elements, every ``interval`` steps only.
        out = torch.empty(self.plan.world_size, dtype=torch.float64, device=mine.device)
        dist.all_gather_into_tensor(out, mine)
        times = out.tolist()
        for r, t in enumerate(times):
            others = self.peers[r] or [x for x in range(len(times)) if x != r]
            ref = statistics.median(times[x] for x in others) if others else t
            slow = t > self.threshold * ref
            self.streak[r] = self.streak[r] + 1 if slow else 0
            self.speed[r] = min(1.0, ref / t) if slow else 1.0
            if self.streak[r] >= self.window and r not in self.found:
                self.found[r] = min(1.0, ref / t)
                self._report(step, r)

    def _report(self, step: int, r: int) -> None:
        gpu = int(self.plan.rank_to_gpu[r])
        if self.exclude:
            self.stop_pending = True
        if self.rank != 0:
            return
        from ..layout.serialize import write_json_atomic

        log_event("straggler", file=self.events, step=step, rank=r, gpu=gpu,
                  relative_speed=self.found[r], probes=self.window)
        slow = {str(int(self.plan.rank_to_gpu[x])): v for x, v in sorted(self.found.items())}
        write_json_atomic({"slow_gpus": slow}, self.out)
        print(f"straggler: rank {r} (GPU {gpu}) runs at ~{self.found[r]:.2f}x its peers; "
              f"health report {self.out}", flush=True)

    def should_stop(self, step: int) -> bool:
        """With ``nutp.exclude_stragglers``: stop once a checkpoint was saved after a
        detection (the loop saves after ``step`` when ``(step + 1) % interval == 0``)."""
        if not (self.stop_pending and self.ckpt_interval > 0
                and (step + 1) % self.ckpt_interval == 0):
            return False
        if self.rank == 0:
            log_event("relayout_requested", file=self.events, step=step + 1,
                      slow_gpus={str(int(self.plan.rank_to_gpu[r])): v
                                 for r, v in self.found.items()}, report=str(self.out))
            print(f"stopping after the checkpoint of step {step + 1}: relaunch with "
                  f"health.report={self.out} to re-plan without the straggler", flush=True)
        return True
