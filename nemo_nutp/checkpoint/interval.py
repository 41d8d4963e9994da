"""``checkpoint.interval: auto``: the save interval from the measured stall and the failure rate.

Young/Daly: with a save stall ``delta`` (seconds the training ranks stop for one save) and a mean
time between failures of the job ``M`` (``86400 / (rate_per_gpu_day * gpus)`` s: the job stops
when any of its GPUs fails), the expected loss per unit of time, ``delta / tau + tau / (2 M)``
(saves + the half interval recomputed after a failure), is smallest at ``tau = sqrt(2 delta M)``
(Young); Daly's first-order correction subtracts the stall: ``tau = sqrt(2 delta M) - delta``
(for ``delta < M / 2``; otherwise ``tau = M``). In steps: ``round(tau / step_s)``, clamped to
``[checkpoint.interval_min, checkpoint.interval_max]`` so that a tiny job still saves.

Before the first save nothing is measured: the job saves after ``interval_min`` steps, then
re-derives the interval from the median measured stall and step time after every save. Pure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

SECONDS_PER_DAY = 86400.0


def mtbf_s(rate_per_gpu_day: float, gpus: int) -> float:
    """Mean time between failures of a job on ``gpus`` GPUs (inf without failures)."""
    rate = rate_per_gpu_day * gpus
    return SECONDS_PER_DAY / rate if rate > 0 else math.inf


def young_daly_s(stall_s: float, mtbf: float) -> float:
    """Optimal time between saves (seconds), Daly's first-order form."""
    if math.isinf(mtbf):
        return math.inf
    if stall_s >= mtbf / 2:
        return mtbf
    return max(stall_s, math.sqrt(2.0 * stall_s * mtbf) - stall_s)


def interval_steps(stall_s: float, step_s: float, rate_per_gpu_day: float, gpus: int,
                   lo: int, hi: int) -> int:
    """Young/Daly interval in steps, clamped to ``[lo, hi]``."""
    tau = young_daly_s(stall_s, mtbf_s(rate_per_gpu_day, gpus))
    if math.isinf(tau) or step_s <= 0:
        return hi
    return int(min(hi, max(lo, round(tau / step_s))))


@dataclass
class AutoInterval:
    """The interval of a running job: ``interval_min`` until a save is measured, then
    Young/Daly from the medians of the measured stalls and step times."""

    rate_per_gpu_day: float
    gpus: int
    lo: int
    hi: int
    steps: int = 0  # the current interval
    stalls: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = self.lo

    def start_line(self) -> str:
        m = mtbf_s(self.rate_per_gpu_day, self.gpus)
        return (f"checkpoint: interval auto (Young/Daly): {self.steps} steps until a save is "
                f"measured; failure rate {self.rate_per_gpu_day:.3g}/GPU-day x {self.gpus} GPUs "
                f"= MTBF {m / 3600:.3g} h; clamped to [{self.lo}, {self.hi}]")

    def observe(self, stall_s: float, step_s: float) -> bool:
        """Record one save's stall and the typical step time; re-derive. True if changed."""
        self.stalls.append(stall_s)
        self.step_times.append(step_s)
        new = interval_steps(statistics.median(self.stalls), statistics.median(self.step_times),
                             self.rate_per_gpu_day, self.gpus, self.lo, self.hi)
        changed = new != self.steps
        self.steps = new
        return changed

    def line(self) -> str:
        stall = statistics.median(self.stalls)
        step = statistics.median(self.step_times)
        tau = young_daly_s(stall, mtbf_s(self.rate_per_gpu_day, self.gpus))
        return (f"checkpoint: interval auto: {self.steps} steps (stall {stall:.3g} s, step "
                f"{step:.3g} s, MTBF {mtbf_s(self.rate_per_gpu_day, self.gpus) / 3600:.3g} h, "
                f"Young/Daly {tau:.3g} s; clamped to [{self.lo}, {self.hi}])")
