"""What the training loop calls around each step: resume, heartbeat, fault injection, saves.

* ``resume(ledger)`` loads the newest complete checkpoint (if ``checkpoint.resume``) and returns
  the step to start at; the goodput ledger continues from the saved totals and, under the
  recovery supervisor, the time between that save and now (lost steps, detection, restart) is
  charged to ``restart``.
* ``before_step``/``after_step`` write this rank's heartbeat (``$NUTP_HEARTBEAT_DIR``), fire an
  injected fault, and save every ``checkpoint.interval`` steps (charged to ``checkpoint``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .events import log_event
from .faults import Fault
from .store import find_latest, load_checkpoint, save_checkpoint


class CheckpointHooks:
    def __init__(self, cfg: Any, session: Any) -> None:
        self.cfg, self.session = cfg, session
        self.root = cfg.checkpoint_dir
        self.rank = dist.get_rank()
        self.fault = Fault.from_env_or_config(cfg)
        hb = os.environ.get("NUTP_HEARTBEAT_DIR")
        self.heartbeat = Path(hb) / f"rank{self.rank}" if hb else None

    def _beat(self, phase: str, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.write_text(f"{phase} {step} {time.time()}\n")

    def resume(self, ledger: Any) -> int:
        if self.root is None or not self.cfg.checkpoint.resume:
            return 0
        path = find_latest(self.root) if self.rank == 0 else None
        box = [None if path is None else str(path)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return 0
        info = load_checkpoint(self.session, box[0])
        saved = info["extra"].get("ledger")
        if saved:
            ledger.totals.update(saved["totals"])
            ledger.wall_s = saved["wall_s"]
            if os.environ.get("NUTP_ATTEMPT", "0") not in ("", "0"):
                ledger.add_pause("restart", max(0.0, time.time() - saved["saved_at"]))
        if self.rank == 0:
            log_event("resumed", step=info["step"], checkpoint=box[0],
                      world_size=self.session.plan.world_size,
                      replica_tp=[list(r.tp) for r in self.session.plan.replicas])
        return int(info["step"])

    def before_step(self, step: int) -> None:
        self._beat("start", step)
        if self.fault is not None:
            self.fault.at_step(self.rank, step)

    def after_step(self, step: int, ledger: Any) -> None:
        self._beat("done", step)
        interval = self.cfg.checkpoint.interval
        if self.root is None or interval <= 0 or (step + 1) % interval:
            return
        t0 = time.time()
        extra = {"ledger": {"totals": dict(ledger.totals), "wall_s": ledger.wall_s,
                            "saved_at": t0}}
        fault = self.fault
        hook = None if fault is None else (lambda: fault.in_save(self.rank, step + 1))
        path = save_checkpoint(self.session, self.root, step=step + 1, extra=extra, fault=hook)
        seconds = time.time() - t0
        ledger.add_pause("checkpoint", seconds)
        if self.rank == 0:
            log_event("checkpoint", step=step + 1, path=str(path), seconds=seconds)
