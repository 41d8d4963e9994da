"""What the training loop calls around each step: resume, heartbeat, fault injection, saves.

* ``resume(ledger)`` follows ``checkpoint.resume``: ``never`` starts fresh; ``auto`` loads the
  newest valid checkpoint under ``checkpoint.load_dir`` (or the save root) if there is one;
  ``required`` insists on one. A newest checkpoint that fails verification is skipped for the
  next older one with a loud warning (``checkpoint.strict``: an error). ``load_optimizer=false``
  loads the weights only. It returns the step to start at; the goodput ledger continues from
  the saved totals and, under the recovery supervisor, the time between that save and now
  (lost steps, detection, restart) is charged to ``restart``. Rank 0 prints one line.
* ``resume_candidates(cfg)`` is the pure-filesystem part (also run by ``nutp-train``'s preflight,
  before any process exists): a given path with nothing loadable is a ``ValueError`` naming the
  path and what it holds.
* ``before_step``/``after_step`` write this rank's heartbeat (``$NUTP_HEARTBEAT_DIR``), fire an
  injected fault, and save every ``checkpoint.interval`` steps (charged to ``checkpoint``; rank 0
  prints one line per save).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .events import log_event
from .faults import Fault
from .megatron_format import describe, restore_asides, sources
from .store import CheckpointError, load_newest_valid, save_checkpoint


def resume_candidates(cfg: Any) -> list[Path]:
    """Checkpoints to try, in the loader's order ([] = start fresh). Pure filesystem."""
    ck = cfg.checkpoint
    if ck.resume == "never":
        return []
    given = ck.load_dir
    source = given or cfg.checkpoint_dir
    if source is None:
        if ck.resume == "required":
            raise ValueError("checkpoint.resume=required: neither checkpoint.load_dir nor "
                             "checkpoint.dir names a checkpoint to resume from")
        return []
    found = sources(Path(source))
    if not found and (given or ck.resume == "required"):
        field = "checkpoint.load_dir" if given else "checkpoint.dir"
        raise ValueError(f"{field}={source}: nothing loadable to resume from "
                         f"({describe(Path(source))}); expected one iter_N/ checkpoint "
                         "directory or a root holding them (megatron-core dist_checkpointing)")
    return found


def layout_of(marker: dict[str, Any] | None) -> str:
    """'TP4+TP3' from NUTP's metadata; stock checkpoints do not record one."""
    if marker is None or "plan" not in marker:
        return "a stock megatron-core checkpoint"
    tps = ["TP" + "/".join(map(str, tp)) for tp in marker["plan"]["replica_tp"]]
    return "+".join(tps)


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

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def _candidates(self) -> list[str]:
        """Rank 0 resolves the candidates (after restoring an interrupted re-save); every rank
        gets them, or the same error."""
        out: list[Any] = [None]
        if self.rank == 0:
            try:
                if self.root is not None and Path(self.root).is_dir():
                    restore_asides(Path(self.root))
                out = [[str(p) for p in resume_candidates(self.cfg)]]
            except (ValueError, OSError) as e:
                out = [f"{type(e).__name__}: {e}"]
        dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], str):
            raise CheckpointError(out[0])
        return list(out[0])

    def resume(self, ledger: Any) -> int:
        ck = self.cfg.checkpoint
        if ck.resume == "never":
            return 0
        paths = self._candidates()
        if not paths:
            return 0
        info = load_newest_valid(self.session, [Path(p) for p in paths], strict=ck.strict,
                                 load_optimizer=ck.load_optimizer, warn=self._say)
        if info is None:
            raise CheckpointError(f"no checkpoint passed verification among {paths}")
        saved = None if info["weights_only"] else info["extra"].get("ledger")
        if saved:
            ledger.restore(saved)  # any cluster size: earlier GPU-seconds are carried
            if os.environ.get("NUTP_ATTEMPT", "0") not in ("", "0"):
                ledger.add_pause("restart", max(0.0, time.time() - saved["saved_at"]))
        what = ("loaded weights only (fresh optimizer) from" if info["weights_only"] else
                "resumed" if info["optimizer"] else "resumed (no optimizer state saved) from")
        self._say(f"checkpoint: {what} {info['path']} (step {info['saved_step']}, saved by "
                  f"{layout_of(info['marker'])}); starting at step {info['step']}")
        if self.rank == 0:
            log_event("resumed", step=info["step"], checkpoint=str(info["path"]),
                      skipped=info["skipped"], weights_only=info["weights_only"],
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
        extra = {"ledger": {**ledger.snapshot(), "saved_at": t0}}
        fault = self.fault
        hook = None if fault is None else (lambda: fault.in_save(self.rank, step + 1))
        path = save_checkpoint(self.session, self.root, step=step + 1, extra=extra, fault=hook)
        seconds = time.time() - t0
        ledger.add_pause("checkpoint", seconds)
        plan = self.session.plan
        self._say(f"checkpoint: saved {path} (step {step + 1}, layout "
                  f"{layout_of({'plan': {'replica_tp': [list(r.tp) for r in plan.replicas]}})}"
                  f", {seconds:.2f} s)")
        if self.rank == 0:
            log_event("checkpoint", step=step + 1, path=str(path), seconds=seconds)
