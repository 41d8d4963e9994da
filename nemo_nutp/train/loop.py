"""The per-rank training loop of ``nutp-train``: steps, metrics, progress, goodput, outputs.

Rank 0 writes ``metrics.jsonl`` (one JSON object per step, each in one ``write``; written as
``.partial`` and renamed when the run ends), ``goodput.json`` and ``training.png`` into
``output.dir``, shows a rich progress bar (step, loss, tokens/s, goodput) and prints the goodput
report at the end.

Goodput has one definition everywhere: useful GPU-seconds / allocated GPU-seconds (cluster GPUs x
wall time, checkpoint saves and restarts included) of the run so far. The bar, each row's
``goodput``, the report's "useful work" share, the plot and ``goodput.json`` show that number
(a row's value counts the saves before it; the last row is updated at the end, so it equals
the JSON's); ``step_goodput`` is the one step alone, without pauses.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..common.env import EVENTS
from ..goodput.accounting import GoodputLedger
from ..parallel.comm import LinkFault, scale_out_rate

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan
    from ..live.link import LiveLink
    from ..live.manager import LiveManager
    from .links import LinkProbe
    from .session import RankSession


def gather_times(session: RankSession, times: dict[str, float], step_s: float,
                  gpus: list[int], *, rate_mb_s: float | None = None,
                  probe: list[float] | None = None
                  ) -> tuple[float, list[tuple[int, float, float, float]],
                             list[dict[str, Any] | None]]:
    """Step wall time (slowest rank), per replica (GPUs of all its stages, compute, sync,
    optimizer: maxima over its ranks) and per replica its scale-out rates, the same on every
    rank.

    One fixed-size all-reduce (MAX) of ``5 x replicas + 1`` elements (+ ``probe``) and one
    host sync per step: O(replicas) whatever the world size (each rank fills its replica's
    row; times are >= 0, so the zeros elsewhere never win; rate slots start at -inf).
    ``gpus``: GPUs per replica (``replica_gpus``). ``rate_mb_s``: this rank's cross-domain rate
    this step (``parallel.comm.scale_out_rate``; None: no such traffic). Per replica the rates give
    ``{"gpu": its slowest GPU, "min": that GPU's MB/s, "max": its fastest GPU's}`` (None: no
    rank of it had cross-domain traffic). ``probe``: extra slots reduced (MAX) in the same
    all-reduce and written back in place (the slow-link watch's request, ``train/links.py``);
    every rank passes the same number of slots."""
    plan, ctx = session.plan, session.groups.ctx
    assert len(gpus) == len(plan.replicas)
    # On the parameters' device: NCCL groups only move device tensors.
    device = next(session.model.parameters()).device
    n = len(plan.replicas)
    extra = len(probe) if probe is not None else 0
    buf = torch.zeros(5 * n + 1 + extra, dtype=torch.float64)
    buf[3 * ctx.replica:3 * ctx.replica + 3] = torch.tensor(
        [times["compute_s"], times["sync_s"], times["optimizer_s"]], dtype=torch.float64)
    buf[3 * n:5 * n] = -math.inf
    if rate_mb_s is not None:
        gpu = plan.rank_to_gpu[ctx.rank]
        buf[3 * n + 2 * ctx.replica] = -_rate_code(rate_mb_s, gpu)  # MAX: the slowest GPU
        buf[3 * n + 2 * ctx.replica + 1] = rate_mb_s
    buf[5 * n] = step_s
    if probe is not None:
        buf[5 * n + 1:] = torch.tensor(probe, dtype=torch.float64)
    buf = buf.to(device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    vals = buf.tolist()
    if probe is not None:
        probe[:] = vals[5 * n + 1:]
    rates: list[dict[str, Any] | None] = []
    for r in range(n):
        low, high = vals[3 * n + 2 * r], vals[3 * n + 2 * r + 1]
        if low == -math.inf:
            rates.append(None)
        else:
            q, gpu = divmod(int(-low), _GPU_CODES)
            rates.append({"gpu": gpu, "min": q / _RATE_STEPS, "max": high})
    return vals[5 * n], list(zip(gpus, vals[0:3 * n:3], vals[1:3 * n:3], vals[2:3 * n:3])), rates


_GPU_CODES = 1 << 18  # GPU ids below 262,144
_RATE_STEPS = 1000  # rates in steps of 0.001 MB/s; with the GPU id exact in a float64 (< 2^53)


def _rate_code(rate_mb_s: float, gpu: int) -> float:
    """One number ordering (rate, GPU) pairs, so a MAX of its negation finds a replica's
    slowest GPU and its rate in the same all-reduce as the step times."""
    q = min(int(rate_mb_s * _RATE_STEPS), (1 << 53) // _GPU_CODES - 1)  # floor: min <= max
    return float(q * _GPU_CODES + gpu)


def link_faults(faults: Any, plan: Plan) -> tuple[LinkFault, ...]:
    """The slow_link faults of ``faults`` (a ``common.faults.Faults`` or None) keyed by the GPU
    their rank has in ``plan`` (the first world's); ValueError for a rank outside it."""
    out = []
    for f in faults.links() if faults is not None else []:
        if f.rank >= plan.world_size:
            raise ValueError(f"recovery.fault.rank={f.rank}: a slow_link fault names a rank of "
                             f"the first world (world_size={plan.world_size})")
        out.append(LinkFault(plan.rank_to_gpu[f.rank], f.step, f.factor, f.until))
    return tuple(out)


def replica_gpus(plan: Plan) -> list[int]:
    """GPUs per replica (all its stages). A run computes it once for its plan (a live
    re-layout brings a new run): at 4,096 replicas the per-step Python loop over
    ``plan.replicas`` was ~2 ms of a 5 ms control budget."""
    return [sum(rep.tp) for rep in plan.replicas]


class MetricsWriter:
    """Rank 0's ``metrics.jsonl`` (as ``.partial`` until ``close``) and TensorBoard (if
    installed); ``nutp-bridge`` writes its rows with it too (``integrations/bridge_outputs``)."""

    def __init__(self, cfg: JobConfig, plan: Plan, *, start_step: int = 0) -> None:
        self.dir = Path(cfg.output.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.partial = self.dir / "metrics.jsonl.partial"
        # Resumed run: keep the steps before the resume point, from the previous attempt's file
        # (still partial, or already renamed if it was stopped after writing it).
        final = self.dir / "metrics.jsonl"
        kept = _earlier_rows(self.partial if self.partial.exists() else final, start_step)
        self.file = self.partial.open("w")
        self.fd = self.file.fileno()
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        except Exception:  # tensorboard not installed: optional
            self.tb = None
        self.rows: list[dict[str, Any]] = []
        for row in kept:
            self.write_line(row)

    def write_line(self, row: dict[str, Any]) -> None:
        """One step's row in one ``write`` (a reader or a crash never sees half a row)."""
        self.rows.append(row)
        data = (json.dumps(row) + "\n").encode()
        if os.write(self.fd, data) != len(data):
            raise OSError(f"short write to {self.partial}")

    def write(self, row: dict[str, Any]) -> None:
        self.write_line(row)
        if self.tb is not None:
            for k in ("loss", "grad_norm", "goodput", "tokens_per_s"):
                if row[k] is not None:
                    self.tb.add_scalar(f"train/{k}", row[k], row["step"])

    def amend_last(self, update: dict[str, Any]) -> None:
        """Add ``update`` to the newest row already written (a live re-layout's next world ran
        the evaluation the stopped one owed that step): the file rewritten atomically, then
        appended to as before."""
        from ..layout.serialize import atomic_path

        self.rows[-1].update(update)
        lines = [json.dumps(r) + "\n" for r in self.rows]
        self.file.close()
        with atomic_path(self.partial) as tmp:
            tmp.write_text("".join(lines))
        self.file = self.partial.open("a")
        self.fd = self.file.fileno()

    def close(self, *, final_goodput: float | None = None) -> None:
        """Rename the rows into place. ``final_goodput``: the run's goodput at its end (a save
        after the last step included) replaces the last row's, so the last row, the report and
        ``goodput.json`` show one number."""
        self.file.close()
        if final_goodput is not None and self.rows and self.rows[-1]["goodput"] != final_goodput:
            self.rows[-1]["goodput"] = final_goodput
            lines = self.partial.read_text().splitlines(keepends=True)
            lines[-1] = json.dumps(self.rows[-1]) + "\n"
            from ..layout.serialize import atomic_path

            with atomic_path(self.partial) as tmp:
                tmp.write_text("".join(lines))
        os.replace(self.partial, self.dir / "metrics.jsonl")
        if self.tb is not None:
            self.tb.close()


def _earlier_rows(path: Path, start_step: int) -> list[dict[str, Any]]:
    if start_step == 0 or not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] < start_step]


class Trainer:
    """How this rank builds a world's session and run (the same at start-up and after a live
    re-layout: ``live.manager.Trainer``)."""

    def __init__(self, device: torch.device | None, *, live: bool = False,
                 on_checkpoint: Callable[[int], None] | None = None) -> None:
        self.device, self.live, self.on_checkpoint = device, live, on_checkpoint
        # slow_link faults keyed by GPU: taken from the first world's plan, kept by every
        # later world of this process (None: no world yet)
        self.links: tuple[LinkFault, ...] | None = None
        self.link_watch: Any = None  # rank 0's LinkWatch, carried into the next world

    def build(self, job: JobConfig, plan: Plan) -> RankSession:
        from .schedule import schedule_of
        from .session import build_session, precision_of
        from .step import step_options

        t = job.train
        return build_session(plan, job.model, lr=t.lr, seed=t.seed,
                             micro_batch_size=t.micro_batch_size, optimizer=t.optimizer,
                             weight_decay=t.weight_decay, opts=step_options(t),
                             precision=precision_of(t), device=self.device,
                             data_path=t.data_path, bucket_size=job.sync.bucket_size,
                             distributed_optimizer=t.distributed_optimizer,
                             live_redundancy=job.recovery.live_redundancy,
                             schedule=schedule_of(t), valid_data_path=t.valid_data_path)

    def make_run(self, job: JobConfig, plan: Plan, session: RankSession, *,
                 start: int | None = None, ledger: GoodputLedger | None = None) -> Run:
        run = Run(job, plan, session, start=start, ledger=ledger, live_mode=self.live,
                  on_checkpoint=self.on_checkpoint, links=self.links, watch=self.link_watch)
        self.links = run.links
        if run.link_watch is not None and run.link_watch.watch is not None:
            self.link_watch = run.link_watch.watch
        return run


class Run:
    """What a rank trains with in one world (a live re-layout replaces it)."""

    def __init__(self, cfg: JobConfig, plan: Plan, session: RankSession, *,
                 start: int | None = None, ledger: GoodputLedger | None = None,
                 live_mode: bool = False,
                 on_checkpoint: Callable[[int], None] | None = None,
                 links: tuple[LinkFault, ...] | None = None, watch: Any = None) -> None:
        from ..checkpoint.hooks import CheckpointHooks
        from ..train.rebalance import LiveBalance
        from .schedule import schedule_of

        self.cfg, self.plan = cfg, plan
        self.session: RankSession | None = session  # None once moved to the next world
        self.gpus = replica_gpus(plan)
        self.last: Any = None  # the newest step's StepResult
        self.live_mode = live_mode  # recovery.mode=live: no stop for a straggler, the live
        # path re-lays out around it instead
        self.rank0 = dist.get_rank() == 0
        self.ledger = ledger or GoodputLedger(cluster_gpus=plan.request.cluster.num_gpus,
                                              failed_gpus=len(plan.request.health.failed_gpus),
                                              idle_gpus=plan.idle_healthy_gpus)
        self.hooks = CheckpointHooks(cfg, session, on_complete=on_checkpoint,
                                     lr_at=schedule_of(cfg.train).lr_at)
        # nutp.rebalance; an injected slow fault is world 0's (after a live re-layout the
        # slowed GPU has left, or its rank number names another GPU)
        self.balance = LiveBalance(cfg, session, fault=self.hooks.fault if start is None else None,
                                rank=dist.get_rank())
        # slow links (keyed by GPU) apply in every world; the first world's plan names the GPU
        self.links = links if links is not None else link_faults(self.hooks.fault, plan)
        self.comm = session.groups.comm
        self.link_watch: LinkProbe | None = None  # slow-link detection (train/links.py)
        if self.comm is not None:
            from .links import LinkProbe, watched

            self.comm.faults = self.links
            if watched(self.comm):
                self.link_watch = LinkProbe(plan, self.comm,
                                            next(session.model.parameters()).device,
                                            rank0=self.rank0, cfg=cfg, live=live_mode,
                                            carried=watch, start=start or 0)
        if start is None:
            start = self.hooks.resume(self.ledger)
        else:  # live re-layout: start-of-step faults are the first world's only
            self.hooks.fault = None
        self.start = start
        self.out = MetricsWriter(cfg, plan, start_step=start) if self.rank0 else None
        self.progress = _progress() if self.rank0 else None
        self.task = (self.progress.add_task("train", total=cfg.train.steps, completed=start,
                                            info="") if self.progress else None)
        if self.progress:
            self.progress.start()

    def step(self, step: int) -> bool:
        """One step and its bookkeeping; False: stop here (``nutp.exclude_stragglers``)."""
        t, session, ledger, out = self.cfg.train, self.session, self.ledger, self.out
        assert session is not None
        tokens = t.global_batch_size * self.cfg.model.seq_length
        self.hooks.before_step(step)
        self.balance.before_step(step)
        if self.comm is not None:
            self.comm.begin_step(step)
        t0 = time.perf_counter()
        res = self.last = session.step(step)
        rate, link_bytes = (scale_out_rate(self.comm.take_step()) if self.comm is not None
                            else (None, 0))
        probe = self.link_watch.slots() if self.link_watch is not None else None
        step_s, reps, rates = gather_times(session, res.times, time.perf_counter() - t0,
                                           self.gpus, rate_mb_s=rate, probe=probe)
        shares = self.balance.after_step(step, reps)  # this step's shares; may change the next's
        step_goodput = ledger.add_step(step_s, reps, inside=self.balance.inside_speeds())
        val_loss = None
        if t.eval_interval and (step + 1) % t.eval_interval == 0:  # megatron's: after the
            t_eval = time.perf_counter()  # update, every eval_interval-th step
            k = (step + 1) // t.eval_interval - 1  # evaluations so far: the set continues
            val_loss = session.evaluate(k * t.eval_iters, t.eval_iters)
            ledger.add_pause("evaluation", time.perf_counter() - t_eval)
        if out is not None and self.progress is not None:
            goodput = ledger.goodput  # the run's so far (this step's save: the next row's)
            row = {"step": step, "loss": res.loss,
                   "grad_norm": None if res.skipped else res.grad_norm,
                   "skipped": res.skipped, "lr": session.lr,
                   "loss_scale": float(session.optimizer.get_loss_scale()),
                   "tokens": tokens, "step_time_s": step_s, "tokens_per_s": tokens / step_s,
                   "goodput": goodput, "step_goodput": step_goodput,
                   "microbatches": shares,
                   "replica_tp": [list(r.tp) for r in self.plan.replicas],
                   "reshard_bytes_rank0": session.model.nutp_engine.sent_bytes,
                   "scale_out_mb_s": rates, "scale_out_bytes_rank0": link_bytes}
            if val_loss is not None:
                row["val_loss"] = val_loss
            out.write(row)
            self.progress.update(self.task, advance=1, info=f"loss {res.loss:.4f}  "
                                 f"{tokens / step_s:,.0f} tok/s  goodput {goodput:.1%}")
        if self.link_watch is not None and probe is not None:  # a probe: every rank at once
            self.link_watch.after_step(step, step_s, rates, probe, link_bytes)
        # The row is on disk before the save: a world stopped right after a checkpoint
        # completes (planned restart) has every row up to it.
        self.hooks.after_step(step, ledger)
        # nutp.exclude_stragglers: saved; relaunch (live: re-laid out around it, train_rank)
        return self.live_mode or not self.balance.should_stop(step)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        if self.comm is not None:
            self.comm.close()
        self.hooks.abandon()  # a save still in flight (a failed world) can never complete


def train_rank(cfg: JobConfig, plan: Plan, *, device: torch.device | None = None,
               link: LiveLink | None = None, joining: int | None = None,
               on_checkpoint: Callable[[int], None] | None = None,
               on_stop: Callable[[int, dict[int, float]], None] | None = None
               ) -> list[dict[str, Any]] | None:
    """Run the whole job on this rank (process group already initialised). ``link``: the
    rank's connection to the live control process (``recovery.mode=live``): a
    ``live.manager.LiveManager`` then turns a failure of a peer into a live re-layout instead
    of an error, and GPUs reported back into a grow-back re-layout at the step boundary the
    vote agreed on. ``joining``: this process is a returning GPU's (its id; ``plan`` is the
    stopped world's, no group yet). ``on_checkpoint(step)``: called at every completed save
    (a launcher worker's planned restart, ``train/elastic.py``). ``on_stop(step, slow)``:
    called on every rank when the run stopped before ``train.steps`` for
    ``nutp.exclude_stragglers`` (restart mode), after the checkpoint it resumes from (``step``)
    is complete; ``slow``: the stragglers, GPU -> relative speed."""
    trainer = Trainer(device, live=link is not None, on_checkpoint=on_checkpoint)
    manager: LiveManager[Run] | None = None
    if link is not None:
        from ..live.manager import LiveManager

        manager = LiveManager(cfg, link, trainer, device=device)
    if joining is not None:
        assert manager is not None, "a joiner is started by the live control process"
        run, step = manager.join(plan, joining)
    else:
        run = trainer.make_run(cfg, plan, trainer.build(cfg, plan))
        if manager is not None:
            manager.attach(run)
        step = run.start
    try:
        while step < cfg.train.steps:
            try:
                if manager is not None:
                    manager.begin(step)
                if not run.step(step):
                    break
                if manager is not None:
                    slow = run.balance.exclusion()
                    links = (run.link_watch.relayout_due() if run.link_watch is not None
                             else None)  # the same on every rank (train/links.py)
                    if ((manager.boundary_due(slow) or links is not None)
                            and step + 1 < cfg.train.steps):
                        run.close()
                        run, step = manager.relayout(run, None, slow=slow, links=links)
                        continue
            except Exception as e:
                if manager is None or not manager.is_stop(e):
                    raise
                run.close()
                run, step = manager.relayout(run, e)
                continue
            step += 1
        run.hooks.finish()  # a background save in flight completes before the run ends
        if step + 1 < cfg.train.steps and manager is None and on_stop is not None:
            on_stop(step + 1, run.balance.exclusion() or {})  # stopped for a straggler
        if manager is not None:
            manager.final_check(run)  # tests only (NUTP_LIVE_DIGEST)
    finally:
        run.close()
    if run.out is None:
        return None
    run.out.close(final_goodput=run.ledger.goodput)
    run.ledger.check()
    return write_reports(cfg, run.out.rows, run.ledger)


def _progress() -> Any:
    from rich import progress as rp

    return rp.Progress(rp.TextColumn("[bold]step"), rp.MofNCompleteColumn(), rp.BarColumn(),
                       rp.TextColumn("{task.fields[info]}"), rp.TimeElapsedColumn())


def write_reports(cfg: JobConfig, rows: list[dict[str, Any]], ledger: GoodputLedger, *,
                  restarts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Rank 0 at the end of a run: ``goodput.json``, the printed goodput table and
    ``training.png`` in ``output.dir`` (``nutp-train`` and ``nutp-bridge``). ``restarts``: the
    job's restarts so far (None: those of ``$NUTP_EVENTS``)."""
    from ..goodput.train_report import plot_training, print_goodput
    from ..layout.serialize import write_json_atomic

    d = Path(cfg.output.dir)
    restarts = _restarts() if restarts is None else restarts
    write_json_atomic({**ledger.as_dict(), "restarts": restarts,
                       "lost_steps": sum(r.get("lost_steps", 0) for r in restarts)},
                      d / "goodput.json")
    print_goodput(ledger, restarts=restarts)
    png = plot_training(rows, d / "training.png", restarts=restarts)
    print(f"metrics: {d / 'metrics.jsonl'}\nplot: {png}")
    return rows


def _restarts() -> list[dict[str, Any]]:
    """Restarts of this job so far (under recovery: from ``$NUTP_EVENTS``), one dict each with
    ``gpus``, ``reason``, ``lost_steps``, ``restart_s``, ``resume_step``."""
    import os

    from ..common.events import read_events
    from ..health.watch import summary

    path = os.environ.get(EVENTS)
    return summary(read_events(path)) if path else []
