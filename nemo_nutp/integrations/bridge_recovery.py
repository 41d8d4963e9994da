"""What a ``nutp-bridge`` rank adds to Bridge's ``train()`` for the recovery supervisor.

``nutp-bridge recovery.enabled=true`` runs the ranks under ``nutp-train``'s supervisor
(``recovery/supervisor.py``, started by ``launch/bridge_cli.py``); the supervisor reads each
rank's step heartbeats and the job's events, as it does for ``nutp-train``'s ranks. Under
Bridge's own loop they come from its callback events (``recovery_callbacks``):

* ``on_train_step_start``: heartbeat ``start <step>`` (``$NUTP_HEARTBEAT_DIR/rank<r>``), then the
  injected faults of ``recovery.fault``/``recovery.faults`` or ``NUTP_FAULT``
  (``common/faults.py``: first attempt only) at their step;
* ``on_train_step_end``: heartbeat ``done <step>``;
* ``on_train_start``: rank 0 logs ``resumed`` (step, checkpoint, layout) when the run loaded a
  checkpoint through ``checkpoint.load`` (the supervisor's restart time and resume step).

A relaunched world (``NUTP_ATTEMPT`` > 0) resumes by Bridge's own ``checkpoint.load``:
``resume_at_save`` points it at ``checkpoint.save`` when a checkpoint is there (newest,
``ckpt_step`` cleared), so the weights, optimizer, scheduler and data position are the saved
ones (``bridge_ckpt.NUTPBridgeCheckpointManager.load``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..common.env import HEARTBEAT_DIR
from ..common.faults import Faults


def recovery_callbacks(manager: Any, nutp: Any, plan: Any, checkpoints: Any, *,
                       fault: bool = True) -> None:
    """Register the heartbeat, fault and ``resumed`` hooks (module docstring) on Bridge's
    ``CallbackManager``. Without ``$NUTP_HEARTBEAT_DIR`` / ``$NUTP_EVENTS`` (no supervisor)
    only an injected fault acts. ``fault=False``: no injected fault (a live re-layout's next
    world: the fault was the first world's)."""
    import torch.distributed as dist

    from ..common.events import log_event

    rank = dist.get_rank()
    injected = Faults.from_env_or_config(nutp) if fault else None
    hb = os.environ.get(HEARTBEAT_DIR)
    beat_file = Path(hb) / f"rank{rank}" if hb else None

    def beat(phase: str, step: int) -> None:
        if beat_file is not None:
            beat_file.write_text(f"{phase} {step} {time.time()}\n")

    def step_start(ctx: Any) -> None:
        step = int(ctx.state.train_state.step)
        beat("start", step)
        if injected is not None:
            injected.at_step(rank, step)

    def step_end(ctx: Any) -> None:
        beat("done", int(ctx.state.train_state.step))  # Bridge counts the step after this

    def train_start(ctx: Any) -> None:
        if rank == 0 and checkpoints.loaded is not None:
            log_event("resumed", step=int(ctx.state.train_state.step),
                      checkpoint=checkpoints.loaded, world_size=plan.world_size,
                      replica_tp=[list(r.tp) for r in plan.replicas])

    manager.register("on_train_start", train_start)
    manager.register("on_train_step_start", step_start)
    manager.register("on_train_step_end", step_end)


def resume_at_save(cfg: Any, attempt: int) -> str | None:
    """A relaunched world (``attempt`` > 0): Bridge's ``checkpoint.load`` set to
    ``checkpoint.save`` (``ckpt_step`` cleared: the newest) when a checkpoint is complete there;
    returns that folder. Else nothing changes (the first attempt's own ``checkpoint.load``, e.g.
    pretrained weights, still applies) and None."""
    from ..checkpoint.store import find_latest

    save = cfg.checkpoint.save
    if attempt == 0 or save is None or find_latest(save) is None:
        return None
    cfg.checkpoint.load, cfg.checkpoint.ckpt_step = save, None
    return str(save)
