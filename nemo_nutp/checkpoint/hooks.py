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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..common.env import ATTEMPT, HEARTBEAT_DIR
from ..common.events import log_event
from ..common.faults import Faults
from .bridge_state import check_continuation
from .interval import AutoInterval
from .megatron_format import describe, restore_asides, sources
from .store import CheckpointError, load_newest_valid, save_checkpoint

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..train.session import RankSession

SAVE_ERRORS: tuple[type[BaseException], ...] = (OSError, CheckpointError)
"""What a failed save raises (extended with megatron's and torch DCP's exception types)."""


def save_errors() -> tuple[type[BaseException], ...]:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    return (*SAVE_ERRORS, CheckpointingException, CheckpointException)


def check_writable(field: str, path: str | Path) -> None:
    """``path`` can be created and written (a file written, fsynced and removed): else a
    ``ValueError`` naming ``field`` and the path (a read-only mount, no permission, ``/proc``,
    a file in the way). Pure filesystem, before any process exists; it leaves nothing behind
    (directories it had to create are removed again: a run refused later, e.g. by the output
    lock, must not have written anything)."""
    import secrets

    p = Path(path)
    created = [d for d in (p, *p.parents) if not d.exists()]
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".nutp-write-probe-{os.getpid()}-{secrets.token_hex(3)}"
        with probe.open("w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{field}={path}: cannot be created or written "
                         f"({e.strerror or type(e).__name__})") from None
    finally:
        for d in created:  # innermost first
            try:
                d.rmdir()
            except OSError:
                pass


def check_output_dirs(cfg: JobConfig) -> None:
    """``output.dir`` and, when the job saves, the checkpoint root are writable."""
    check_writable("output.dir", cfg.output.dir)
    if cfg.checkpoint.saves and cfg.checkpoint_dir is not None:
        field = "checkpoint.dir" if cfg.checkpoint.dir else "output.dir"
        check_writable(field, cfg.checkpoint_dir)


def resume_candidates(cfg: JobConfig) -> list[Path]:
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
    def __init__(self, cfg: JobConfig, session: RankSession, *,
                 on_complete: Callable[[int], None] | None = None,
                 lr_at: Callable[[int], float] | None = None) -> None:
        """``on_complete(step)`` runs in this rank's training thread whenever one of its saves
        completes (published, tracker updated): the boundary where a planned restart stops
        without losing a committed step, decided where it happens rather than by a poll that a
        short run can miss. ``lr_at(updates)``: the run's lr schedule (default: constant
        ``train.lr``), which a Bridge checkpoint's schedule must equal from the resumed step
        on."""
        self.cfg, self.session = cfg, session
        self.on_complete = on_complete
        self.lr_at = lr_at
        self.root = cfg.checkpoint_dir
        self.rank = dist.get_rank()
        self.fault = Faults.from_env_or_config(cfg)
        hb = os.environ.get(HEARTBEAT_DIR)
        self.heartbeat = Path(hb) / f"rank{self.rank}" if hb else None
        ck = cfg.checkpoint
        self.saving = self.root is not None and (ck.interval == "auto" or int(ck.interval) > 0)
        self.auto: AutoInterval | None = None
        if self.saving and ck.interval == "auto":
            self.auto = AutoInterval(cfg.recovery.rate_per_gpu_day,
                                     session.plan.request.cluster.num_gpus,
                                     ck.interval_min, ck.interval_max)
            self._say(self.auto.start_line())
        self.saves: Any = None
        if self.saving:
            from ..common.procs import start_results_queue

            start_results_queue()  # the first save's one-time cost, overlapped with the first steps
            if getattr(ck, "async_save", False):
                from .background import BackgroundSaves

                self.saves = BackgroundSaves(on_done=self._completed, on_failed=self._failed)
        self.ledger: Any = None
        self.last_save = 0  # step of the newest save scheduled (or the resume step)
        self.last_end: float | None = None
        self.step_times: list[float] = []

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
        bridge = None if info["weights_only"] else info["extra"].get("bridge")
        if bridge is not None:  # saved by nutp-bridge: its schedule must continue here
            t = self.cfg.train
            check_continuation(bridge, path=info["path"], step=int(info["step"]),
                               steps=t.steps, global_batch=t.global_batch_size,
                               lr=self.lr_at or t.lr, weight_decay=t.weight_decay)
        saved = None if info["weights_only"] else info["extra"].get("ledger")
        if saved:
            ledger.restore(saved)  # any cluster size: earlier GPU-seconds are carried
            if os.environ.get(ATTEMPT, "0") not in ("", "0"):
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

    def interval(self) -> int:
        """Steps between saves now (``checkpoint.interval``, or the auto interval)."""
        return self.auto.steps if self.auto is not None else int(self.cfg.checkpoint.interval)

    def due(self, step: int) -> bool:
        """Save after ``step`` steps? A fixed interval saves at its multiples; ``auto`` counts
        from the previous save (or the step the run started at)."""
        if self.auto is None:
            return step % self.interval() == 0
        return step - self.last_save >= self.auto.steps

    def after_step(self, step: int, ledger: Any) -> None:
        self._beat("done", step)
        now = time.perf_counter()
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
        else:
            self.last_save = step  # the run started at this step (fresh or resumed)
        if not self.saving:
            return
        self.ledger = ledger
        if self.saves is not None and self.saves.pending is not None:
            t0 = time.perf_counter()
            self.saves.poll()  # collective: finalises the save in flight once all writes ended
            ledger.add_pause("checkpoint", time.perf_counter() - t0)
        if self.due(step + 1):
            self._save(step + 1, ledger)
        self.last_end = time.perf_counter()

    def _save(self, step: int, ledger: Any) -> None:
        t0 = time.time()
        extra = {"ledger": {**ledger.snapshot(), "saved_at": t0}}
        fault = self.fault
        hook = None if fault is None else (lambda: fault.in_save(self.rank, step))
        self.last_save = step
        assert self.root is not None  # saving implies a checkpoint directory
        try:
            path = save_checkpoint(self.session, self.root, step=step, extra=extra, fault=hook,
                                   background=self.saves)
        except save_errors() as e:  # e.g. no space left: the save is aborted
            from .background import why_failed

            self._failed(None, f"checkpoint: save of step {step} under {self.root} failed "
                         f"({why_failed(e)}); the previous complete checkpoint stays the one to "
                         "resume from")
            return
        stall = time.time() - t0
        ledger.add_pause("checkpoint", stall)
        self._rederive(stall)
        if self.saves is None:
            from .background import Pending

            self._completed(Pending(step, path, path, t0, stall, 0), stall)
        elif self.saves.pending is not None:
            self.saves.pending.stall_s = stall

    def _rederive(self, stall: float) -> None:
        """``interval=auto``: the same new interval on every rank (the slowest rank's stall and
        step time, one all-reduce per save)."""
        if self.auto is None:
            return
        import torch

        from .integrity import control_group

        recent = self.step_times[-8:]
        mine = torch.tensor([stall, sorted(recent)[len(recent) // 2] if recent else 0.0],
                            dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=control_group())
        self.auto.observe(float(mine[0]), float(mine[1]))
        self._say(self.auto.line())

    def _completed(self, p: Any, seconds: float) -> None:
        """A save is complete (published, tracker updated): the save line and the event."""
        background = self.saves is not None
        write_s = seconds if background else p.stall_s
        if background and self.ledger is not None:
            self.ledger.add_background("checkpoint_write", write_s)
        plan = self.session.plan
        layout = layout_of({"plan": {"replica_tp": [list(r.tp) for r in plan.replicas]}})
        how = (f"stall {p.stall_s:.2f} s, background write {write_s:.2f} s, snapshot "
               f"{p.snapshot_bytes / 2**20:.1f} MiB on rank 0" if background
               else f"{p.stall_s:.2f} s")
        self._say(f"checkpoint: saved {p.final} (step {p.step}, layout {layout}, {how})")
        if self.rank == 0:
            log_event("checkpoint", step=p.step, path=str(p.final), seconds=p.stall_s,
                      stall_s=p.stall_s, write_s=write_s, background=background,
                      snapshot_bytes=p.snapshot_bytes)
        if self.on_complete is not None:
            self.on_complete(p.step)

    def _failed(self, p: Any, line: str) -> None:
        self._say(line)
        if self.rank == 0:
            log_event("checkpoint_failed", step=None if p is None else p.step, message=line)

    def wait_for_save(self) -> None:
        """Block until the save in flight is complete (a planned layout change, the end of the
        run); its wait is charged to ``checkpoint``. Collective."""
        if self.saves is None or self.saves.pending is None:
            return
        t0 = time.perf_counter()
        self.saves.wait()
        if self.ledger is not None:
            self.ledger.add_pause("checkpoint", time.perf_counter() - t0)

    def finish(self) -> None:
        """End of the run (every rank): the save in flight completes."""
        self.wait_for_save()

    def abandon(self) -> None:
        """This world is over (a peer failed; a live re-layout or an exit follows): kill this
        rank's writer of a save still in flight, no collective. Its ``.tmp`` directory is never
        published; the previous complete checkpoint stays the one to resume from."""
        if self.saves is not None:
            self.saves.abandon()
