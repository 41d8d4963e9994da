"""Change points in a step-time-like series: a one-sided CUSUM on log ratios (issue #36 item 2).

The series is positive and larger is worse: step seconds, or seconds per byte of one GPU's
scale-out traffic (the inverse of its rate). After ``warmup`` samples the baseline ``mu`` is their
median (robust to a slow first step). Each later sample ``x`` adds ``log(x / mu) - allowance`` to a
sum that never goes below 0; the detector fires when the sum exceeds ``threshold``.

Why log ratios with an allowance, not a z-score: a z-score needs a noise estimate, and a quiet
warm-up makes any later jitter look large. With ``allowance = log(tolerance)`` the guarantee is
exact and needs no noise model:

* **no false alarm under bounded noise**: samples within ``[mu / tolerance, mu * tolerance]``
  add at most 0, so they never fire, whatever their order (tests check it with hypothesis);
* **bounded detection delay**: a sustained slowdown by ``s > tolerance`` fires within
  ``ceil(threshold / (log s - log tolerance))`` samples (1.3 and 1.0: 3 samples at 2x, 1 at 4x).

Why not a library: ``ruptures`` (the well-kept change-point library) segments a finished series
offline; this runs online, one sample per step, O(1) time and memory. Pure: no torch, no process
group.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ..layout.specs import bad_value


@dataclass
class Cusum:
    """Online detector of an upward shift (see the module docstring)."""

    warmup: int = 5
    """Samples whose median is the baseline (none is judged)."""
    tolerance: float = 1.3
    """Ratio to the baseline that counts as noise (the allowance is its log)."""
    threshold: float = 1.0
    """Sum of excess log ratios that fires."""
    _warm: list[float] = field(default_factory=list)
    mu: float | None = None
    """The baseline (None during warm-up)."""
    total: float = 0.0
    """The running sum."""

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise bad_value("warmup", self.warmup, "must be >= 1")
        if not self.tolerance > 1.0:
            raise bad_value("tolerance", self.tolerance, "must be > 1")
        if not self.threshold > 0.0:
            raise bad_value("threshold", self.threshold, "must be > 0")

    def add(self, x: float) -> bool:
        """Judge sample ``x`` (> 0). True when it completes a change (the sum then restarts, so
        a persisting shift fires again only after ``threshold`` more)."""
        if not x > 0.0:
            raise bad_value("sample", x, "must be > 0")
        if self.mu is None:
            self._warm.append(x)
            if len(self._warm) == self.warmup:
                self.mu = statistics.median(self._warm)
            return False
        self.total = max(0.0, self.total + math.log(x / self.mu) - math.log(self.tolerance))
        if self.total > self.threshold:
            self.total = 0.0
            return True
        return False

    def ratio(self, x: float) -> float:
        """``x`` over the baseline (1.0 during warm-up)."""
        return 1.0 if self.mu is None else x / self.mu

    def reset(self) -> None:
        """Forget the baseline: the layout changed, so a new normal is learnt."""
        self._warm.clear()
        self.mu, self.total = None, 0.0

    def delay_bound(self, slowdown: float) -> int | None:
        """Samples after warm-up within which a sustained ``slowdown`` fires (None: never)."""
        gain = math.log(slowdown) - math.log(self.tolerance)
        if gain <= 0:
            return None
        return math.floor(self.threshold / gain) + 1
