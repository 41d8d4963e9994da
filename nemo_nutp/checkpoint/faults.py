"""Fault injection for tests and demos: kill or hang a chosen rank at a chosen step.

Configured by ``recovery.fault`` or the environment (``NUTP_FAULT=kind:rank:step``, which wins),
and fired on the first attempt only (``NUTP_ATTEMPT`` unset or 0), so a restarted world runs
through. Kinds: ``kill`` (SIGKILL at the start of the step), ``hang`` (sleep forever at the start
of the step), ``save_crash`` (SIGKILL inside the first save of a checkpoint with step >= ``step``,
after this rank's shards are written and before the checkpoint is marked complete).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from .events import log_event


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def from_env_or_config(cls, cfg: Any) -> Fault | None:
        if os.environ.get("NUTP_ATTEMPT", "0") not in ("", "0"):
            return None
        spec = os.environ.get("NUTP_FAULT")
        if spec:
            kind, rank, step = spec.split(":")
            if kind not in ("kill", "hang", "save_crash"):
                raise ValueError(f"NUTP_FAULT={spec!r}: kind must be kill, hang or save_crash")
            return cls(kind, int(rank), int(step))
        f = cfg.recovery.fault
        return None if f.kind is None else cls(f.kind, f.rank, f.step)

    def _fire(self, rank: int, step: int) -> None:
        log_event("fault", kind=self.kind, rank=rank, step=step, pid=os.getpid())
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, rank: int, step: int) -> None:
        if self.kind in ("kill", "hang") and rank == self.rank and step == self.step:
            self._fire(rank, step)

    def in_save(self, rank: int, step: int) -> None:
        if self.kind == "save_crash" and rank == self.rank and step >= self.step:
            self._fire(rank, step)
