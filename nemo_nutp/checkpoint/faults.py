"""Fault injection for tests and demos: kill, hang or slow down a chosen rank.

Configured by ``recovery.fault`` or the environment (``NUTP_FAULT=kind:rank:step``, which wins),
and fired on the first attempt only (``NUTP_ATTEMPT`` unset or 0), so a restarted world runs
through. Kinds: ``kill`` (SIGKILL at the start of the step), ``hang`` (sleep forever at the start
of the step), ``save_crash`` (SIGKILL inside the first save of a checkpoint with step >= ``step``,
after this rank's shards are written and before the checkpoint is marked complete), ``slow``
(``NUTP_FAULT=slow:RANK:FACTOR[:STEP]`` or ``recovery.fault.factor``: from step ``step`` on, the
rank sleeps ``FACTOR - 1`` times the measured forward/backward time of each of its micro-batches,
so its compute takes ``FACTOR`` x the wall time — a straggler, see ``train/step.py``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.env import ATTEMPT, FAULT
from ..common.events import log_event

if TYPE_CHECKING:
    from ..config import JobConfig


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    factor: float = 1.0  # kind slow: compute wall-time multiplier (> 1)

    @classmethod
    def from_env_or_config(cls, cfg: JobConfig) -> Fault | None:
        if os.environ.get(ATTEMPT, "0") not in ("", "0"):
            return None
        spec = os.environ.get(FAULT)
        if spec:
            return cls.parse(spec)
        f = cfg.recovery.fault
        return None if f.kind is None else cls(f.kind, f.rank, f.step, f.factor)

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """``kind:rank:step`` or ``slow:rank:factor[:step]``; ValueError naming NUTP_FAULT."""
        parts = spec.split(":")
        kind = parts[0]
        try:
            if kind in ("kill", "hang", "save_crash") and len(parts) == 3:
                return cls(kind, int(parts[1]), int(parts[2]))
            if kind == "slow" and len(parts) in (3, 4):
                factor = float(parts[2])
                if not 1.0 <= factor < 1e6:
                    raise ValueError("factor")
                return cls(kind, int(parts[1]), int(parts[3]) if len(parts) == 4 else 0, factor)
        except ValueError:
            pass
        raise ValueError(f"{FAULT}={spec!r}: must be kill|hang|save_crash:RANK:STEP or "
                         "slow:RANK:FACTOR[:STEP] (FACTOR >= 1)")

    def slow_factor(self, rank: int, step: int) -> float:
        """Compute wall-time multiplier of ``rank`` at ``step`` (1.0: not slowed)."""
        if self.kind == "slow" and rank == self.rank and step >= self.step:
            return self.factor
        return 1.0

    def _fire(self, rank: int, step: int) -> None:
        log_event("fault", kind=self.kind, rank=rank, step=step, pid=os.getpid())
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, rank: int, step: int) -> None:
        if rank != self.rank or step != self.step:
            return
        if self.kind in ("kill", "hang"):
            self._fire(rank, step)
        elif self.kind == "slow":
            # Not a "fault" event: health.watch times failure detection from those; the
            # slowdown itself is applied by the step (slow_factor), nothing dies.
            log_event("slow_fault", rank=rank, step=step, factor=self.factor, pid=os.getpid())

    def in_save(self, rank: int, step: int) -> None:
        if self.kind == "save_crash" and rank == self.rank and step >= self.step:
            self._fire(rank, step)
