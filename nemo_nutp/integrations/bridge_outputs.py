"""``nutp-bridge``'s run outputs: the files ``nutp-train`` writes, from Bridge's ``train()``.

Rank 0 writes into ``output.dir`` what ``nutp-train``'s loop writes there, with the loop's own
code (``train/loop.py``): ``metrics.jsonl`` (``MetricsWriter``: one JSON object per step, each in
one ``write``, as ``.partial`` until the run ends, then renamed; a resumed run keeps the rows
before its first step), and at the end ``goodput.json``, the printed goodput table and
``training.png`` (``write_reports``). Goodput has ``nutp-train``'s definition and ledger
(``goodput/accounting.GoodputLedger``).

What each row holds, and where it comes from:
* ``step`` (0-based, as ``nutp-train``'s), ``loss``, ``grad_norm``, ``lr``: ``bridge_run``'s
  per-step record (``recording``: the global-batch loss every replica agrees on, the grad norm
  megatron's step returned, the rate the step applied);
* ``val_loss`` on an evaluation step: Bridge's own reduced validation ``lm loss``
  (``bridge_eval``'s record). Bridge evaluates after its step counter has moved on, so its
  evaluation at iteration ``s`` is on the row of step ``s - 1`` (as ``nutp-train``, whose
  evaluation at ``(step + 1) % eval_interval == 0`` is on that step's row);
* ``step_time_s``, ``goodput``, ``step_goodput``: the ledger's. A step is timed on every rank
  from Bridge's ``on_train_step_start`` to its ``on_train_step_end`` callback; its exposed sync
  is the NUTP gradient finalisation (``model.config.finalize_model_grads_func``), its optimizer
  time the optimizer's ``step``; the slowest rank of each replica is taken with the same one
  all-reduce ``nutp-train`` uses (``gather_times``). Evaluations (``on_eval_start`` to
  ``on_eval_end``) and checkpoint saves (the checkpoint manager's ``save``) are pauses, as in
  ``nutp-train``;
* ``scale_out_mb_s``, ``scale_out_bytes_rank0``: as ``nutp-train``'s, from the same
  ``parallel/comm.py`` counters (``begin_step`` at the step's start, ``take_step`` at its end)
  in the same all-reduce; the slow-link watch (``train/links.py``: detection, probe, the
  mitigation ladder) runs on them as in ``nutp-train``, its request in that all-reduce's slots.

Recovery (``recovery.*``) writes ``recovery/summary.json`` and ``recovery/events.jsonl``
itself; the restarts it records in ``$NUTP_EVENTS`` reach ``goodput.json`` and the table
through ``write_reports`` (the hook: ``finish(restarts=...)`` takes them explicitly).
A resumed run's goodput covers that run only: Bridge's checkpoint does not carry the ledger.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from ..goodput.accounting import GoodputLedger


class BridgeOutputs:
    """The per-step bookkeeping of one ``nutp-bridge`` rank (rank 0 writes).

    ``record``/``evals``: ``bridge_run``'s per-step record and ``bridge_eval``'s evaluations
    (lists that fill while Bridge trains); ``model``: this rank's NUTP DDP model; ``ledger``:
    the goodput ledger to continue (a live re-layout's next world); ``inside()``: per replica
    its slowest rank's speed relative to its peers (the straggler probe's; goodput's
    "straggler inside a replica")."""

    def __init__(self, job: Any, plan: Any, groups: Any, model: Any, out_dir: str | Path, *,
                 record: list[dict[str, float]], evals: list[dict[str, float]],
                 start_step: int = 0, ledger: GoodputLedger | None = None,
                 inside: Any = None, live: bool = False, watch: Any = None) -> None:
        from ..config.schema import OutputConfig
        from ..train.loop import MetricsWriter, replica_gpus

        self.job = dataclasses.replace(job, output=OutputConfig(dir=str(out_dir)))
        self.plan, self.record, self.evals = plan, record, evals
        # what gather_times reads of a nutp-train session: the plan, the groups, the model
        self.session: Any = SimpleNamespace(plan=plan, groups=groups, model=model)
        self.gpus = replica_gpus(plan)
        self.ledger = ledger or GoodputLedger(cluster_gpus=plan.request.cluster.num_gpus,
                                    failed_gpus=len(plan.request.health.failed_gpus),
                                    idle_gpus=plan.idle_healthy_gpus)
        self.out = MetricsWriter(self.job, plan, start_step=start_step) \
            if dist.get_rank() == 0 else None
        self.tokens = job.train.global_batch_size * job.model.seq_length
        self.replica_tp = [list(r.tp) for r in plan.replicas]
        self.pending: dict[str, Any] | None = None
        self.inside = inside  # per replica, its slowest rank's relative speed (or None)
        self.last_reps: list[Any] = []  # the newest step's per-replica times (gather_times)
        self.t0 = self.t_eval = 0.0
        self.sync_s = self.optimizer_s = 0.0
        self.comm = groups.comm
        self.link_probe: Any = None  # the slow-link watch (train/links.py)
        if self.comm is not None:
            from ..train.links import LinkProbe, watched

            if watched(self.comm):
                self.link_probe = LinkProbe(plan, self.comm,
                                            next(model.parameters()).device,
                                            rank0=dist.get_rank() == 0, cfg=self.job, live=live,
                                            carried=watch, start=start_step)

    def link_watch(self) -> Any:
        """Rank 0's slow-link watch, to continue in the next run (None elsewhere)."""
        return self.link_probe.watch if self.link_probe is not None else None

    def relayout_due(self) -> dict[int, float] | None:
        """After a step, on every rank: the slow NICs a live re-layout is due for (rank 0: the
        set; others ``{}``), or None (``train/links.LinkProbe.relayout_due``)."""
        return self.link_probe.relayout_due() if self.link_probe is not None else None

    # ---- wiring -------------------------------------------------------------------------
    def attach(self, callbacks: Any, optimizer: Any, checkpoints: Any, model_config: Any) -> None:
        """Register the step and evaluation callbacks on Bridge's ``CallbackManager`` (after
        ``bridge_eval``'s, so an evaluation's value is recorded when ours runs) and time the
        optimizer step, the gradient finalisation and checkpoint saves."""
        callbacks.register("on_train_step_start", self._step_start)
        callbacks.register("on_train_step_end", self._step_end)
        callbacks.register("on_eval_start", self._eval_start)
        callbacks.register("on_eval_end", self._eval_end)
        optimizer.step = self._timed(optimizer.step, "optimizer_s")
        model_config.finalize_model_grads_func = self._timed(
            model_config.finalize_model_grads_func, "sync_s")
        save = checkpoints.save

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                self.ledger.add_pause("checkpoint", time.perf_counter() - t)

        checkpoints.save = timed_save

    def _timed(self, fn: Any, name: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, name, getattr(self, name) + time.perf_counter() - t)
        return timed

    # ---- callbacks ----------------------------------------------------------------------
    def _step_start(self, ctx: Any) -> None:
        self._flush()
        self.sync_s = self.optimizer_s = 0.0
        if self.comm is not None:
            self.comm.begin_step(int(ctx.state.train_state.step))
        self.t0 = time.perf_counter()

    def _step_end(self, ctx: Any) -> None:
        from ..parallel.comm import scale_out_rate
        from ..train.loop import gather_times

        step_s = time.perf_counter() - self.t0
        compute_s = max(0.0, step_s - self.sync_s - self.optimizer_s)
        times = {"compute_s": compute_s, "sync_s": self.sync_s, "optimizer_s": self.optimizer_s}
        rate, link_bytes = (scale_out_rate(self.comm.take_step()) if self.comm is not None
                            else (None, 0))
        probe = self.link_probe.slots() if self.link_probe is not None else None
        step_s, reps, rates = gather_times(self.session, times, step_s, self.gpus,
                                           rate_mb_s=rate, probe=probe)  # collective
        self.last_reps = reps
        step = int(ctx.state.train_state.step)
        if self.link_probe is not None and probe is not None:  # a probe: every rank at once
            self.link_probe.after_step(step, step_s, rates, probe, link_bytes)
        inside = self.inside() if self.inside is not None else None
        step_goodput = self.ledger.add_step(step_s, reps, inside=inside)
        if self.out is None:
            return
        rec = self.record[-1]  # this step's (bridge_run.recording: the optimizer step)
        skipped = bool(getattr(ctx, "skipped_iter", False))
        norm = rec["grad_norm"]
        self.pending = {
            "step": step, "loss": rec["loss"],
            "grad_norm": None if skipped or math.isnan(norm) else norm, "skipped": skipped,
            "lr": rec["lr"], "tokens": self.tokens, "step_time_s": step_s,
            "tokens_per_s": self.tokens / step_s, "goodput": self.ledger.goodput,
            "step_goodput": step_goodput, "replica_tp": self.replica_tp,
            "scale_out_mb_s": rates, "scale_out_bytes_rank0": link_bytes}

    def _eval_start(self, ctx: Any) -> None:
        self.t_eval = time.perf_counter()

    def _eval_end(self, ctx: Any) -> None:
        self.ledger.add_pause("evaluation", time.perf_counter() - self.t_eval)
        if self.pending is None:
            return
        self.pending["goodput"] = self.ledger.goodput  # as nutp-train: after the evaluation
        e = self.evals[-1] if self.evals else None  # bridge_eval's record of this evaluation
        if e is not None and int(e["step"]) == self.pending["step"] + 1:
            self.pending["val_loss"] = e["val_loss"]

    def _flush(self) -> None:
        if self.pending is not None and self.out is not None:
            self.out.write(self.pending)
        self.pending = None

    def suspend(self) -> None:
        """Rank 0: the pending row written and the file closed, left ``.partial`` (the same
        world re-enters ``train()``: the next run's outputs continue it)."""
        self._flush()
        if self.out is not None:
            self.out.file.close()

    # ---- end of run ---------------------------------------------------------------------
    def finish(self, *, restarts: list[dict[str, Any]] | None = None) -> None:
        """Rank 0: the last row, ``metrics.jsonl`` renamed into place, ``goodput.json``, the
        goodput table and ``training.png``. ``restarts``: the job's restarts so far (None:
        ``$NUTP_EVENTS``'s, as ``nutp-train``)."""
        from ..train.loop import write_reports

        self._flush()
        if self.out is None:
            return
        self.out.close(final_goodput=self.ledger.goodput)
        self.ledger.check()
        write_reports(self.job, self.out.rows, self.ledger, restarts=restarts)
