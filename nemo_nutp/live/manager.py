"""The training loop's side of a live re-layout (``recovery.mode=live``): ``LiveManager``, the
one object the loop calls (torchft's Manager pattern; ``link.py`` has the protocol with the
control process, ``health/commit.py`` its invariants).

The loop calls, in this order:

* ``attach(run)`` once per world: the manager becomes the session's ``StepListener`` (the
  commit vote before every update, the committed step's grad norm) and arms test faults;
* ``begin(step)`` before every step;
* ``boundary_due(slow)`` after every step: GPUs are back or a straggler is to be excluded,
  and the vote agreed to stop after this step; then ``relayout(run, None, slow=...)``;
* ``is_stop(error)`` / ``relayout(run, error)`` when a step fails;
* ``final_check(run)`` at the end (tests).

``relayout`` and ``join`` return the next world's run and the step it starts at. After
``relayout`` returns, every rank of the new world holds exactly the state of the last step
every rank committed (``health/commit.py``); a rank the new layout does not use, or a
fallback to a restart, leaves the process (``os._exit``).

The manager knows nothing of the loop's classes: the loop hands it a ``Trainer`` (how to
build a session and a run), and a run is a ``Run``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from ..common.env import HEARTBEAT_DIR, LIVE_DIGEST
from ..health import watch
from ..health.commit import UNMOVABLE, renumber, replan
from .link import Committed, LiveLink, is_stop, move, reduce_max

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..goodput.accounting import GoodputLedger
    from ..layout import Plan
    from ..train.session import RankSession
    from ..train.step import StepResult


class Outputs(Protocol):
    """Rank 0's metrics file of a run."""

    rows: list[dict[str, Any]]
    file: Any

    def write(self, row: dict[str, Any]) -> None: ...


class Run(Protocol):
    """What a rank trains with in one world (``train.loop.Run``)."""

    session: RankSession | None  # the manager takes it (None) when it moves to a new world

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def out(self) -> Outputs | None: ...

    @property
    def ledger(self) -> GoodputLedger: ...


R = TypeVar("R", bound=Run)
R_co = TypeVar("R_co", bound=Run, covariant=True)


class Trainer(Protocol[R_co]):
    """How the loop builds a world's session and run (``train.loop.Trainer``)."""

    def build(self, job: JobConfig, plan: Plan) -> RankSession: ...

    def make_run(self, job: JobConfig, plan: Plan, session: RankSession, *,
                 start: int | None = None, ledger: GoodputLedger | None = None) -> R_co: ...


EXIT_FALLBACK = 3
"""A rank told to leave because the control process falls back to a restart."""


class LiveManager(Generic[R]):
    """One rank's live re-layout: the loop's only entry into ``live/`` (module docstring)."""

    def __init__(self, cfg: JobConfig, link: LiveLink, trainer: Trainer[R], *,
                 device: torch.device | None) -> None:
        self.cfg, self.link, self.trainer, self.device = cfg, link, trainer, device

    # -- every step ------------------------------------------------------------------------

    def attach(self, run: R) -> None:
        """Make this manager the session's step listener; arm test faults on it."""
        session = run.session
        assert session is not None
        session.listener = self
        inj = self.link.injector
        if inj is not None:
            inj.arm(session, self.link.slot, lambda: (self.link.step, self.link.gen))

    def vote(self, loss: float) -> None:
        """``StepListener.vote``: the commit vote (faults: the ``vote`` phase first)."""
        link = self.link
        if link.injector is not None:
            link.injector.fire("vote", rank=link.slot, step=link.step, gen=link.gen)
        link.vote(loss)

    def stepped(self, result: StepResult) -> None:
        """``StepListener.stepped``: the committed step's grad norm (None: skipped)."""
        self.link.stepped(None if result.skipped else result.grad_norm)

    def phase(self, name: str) -> None:
        """``StepListener.phase``: injected faults of that phase (``common/faults.py``)."""
        link = self.link
        if link.injector is not None:
            link.injector.fire(name, rank=link.slot, step=link.step, gen=link.gen)

    def begin(self, step: int) -> None:
        self.link.begin(step)

    def boundary_due(self, slow: dict[int, float] | None) -> bool:
        """Stop after this step: GPUs are back (the vote agreed) or a straggler is excluded."""
        return self.link.grow_agreed or bool(slow)

    @staticmethod
    def is_stop(error: BaseException) -> bool:
        """Whether a step's error may be a stopped world (``relayout`` then decides)."""
        return is_stop(error)

    # -- a new world -----------------------------------------------------------------------

    def relayout(self, run: R, error: BaseException | None, *,
                 slow: dict[int, float] | None = None,
                 links: dict[int, float] | None = None) -> tuple[R, int]:
        """The world this rank trained in stopped (``error``; None: at the step boundary the
        vote agreed on, GPUs are back, or ``slow``: stragglers to re-plan around): report,
        follow the control process's decision, join the next world with the state moved.
        ``run`` is closed. Returns the new run and the step it starts at (last committed + 1).
        ``links``: rank 0's slow NICs now (its link watch changed them: the sync layout is
        re-planned around them; other ranks pass ``{}``).
        """
        link = self.link
        if (slow or links is not None) and dist.get_rank() == 0:  # the control re-plans
            post: dict[str, Any] = {"slow_gpus": {str(g): v for g, v in (slow or {}).items()}}
            if links is not None:
                post["slow_links"] = {str(g): v for g, v in links.items()}
            link.post("boundary", post)
        if error is None:
            link.boundary()
        else:
            link.stop(error)
        d = link.decision()
        if d["action"] != "live":
            os._exit(EXIT_FALLBACK)  # the control process stops every rank and restarts the job
        if link.injector is not None:  # a death while the new world is built
            link.injector.fire("relayout", rank=link.slot, step=link.step, gen=link.gen)
        old = run.session
        assert old is not None
        if link.slot in d["apply"]:
            self._apply(old, d["step"])
        c = link.committed
        if c.step == d["step"] and c.grad_norm is None and getattr(old.optimizer, "nutp_zero",
                                                                    False):
            # stopped in the parameter all-gather after its update: the step's norm (the sync's)
            c.grad_norm = math.sqrt(old.model.nutp_engine.grad_sumsq)
        if c.step == d["step"]:  # the lr schedule's clock: the committed step's outcome
            old.count_step(c.step, c.grad_norm is None)
        clock = (old.skips, old.counted_through, old.last_skipped)
        job, plan = self._next(old.plan, d)
        gpu = old.plan.rank_to_gpu[dist.get_rank()]
        link.old_replica_tp = old.plan.replicas
        if run.out is not None:
            run.out.file.close()  # rows stay in the .partial file; the new rank 0 reopens it
        rng = torch.get_rng_state()
        if gpu not in plan.rank_to_gpu:  # healthy but unused by the new layout
            os._exit(0)
        rank = list(plan.rank_to_gpu).index(gpu)
        link.rejoin(rank=rank, world=plan.world_size, device=self.device)
        os.environ[HEARTBEAT_DIR] = d["heartbeat_dir"]
        # the new world's hang check reads this rank's stack file there, by its new number
        watch.follow_world(Path(d["heartbeat_dir"]) / f"rank{rank}.stack")
        session = self.trainer.build(job, plan)
        rank_map = _rank_map(old.plan, plan, d)
        # gone: dead, or healthy but left out by the new plan (those exited above)
        gone = frozenset(range(old.plan.world_size)) - set(rank_map)
        from ..relayout.move import MoveImpossible

        try:
            stats = move(old, session, old_plan=old.plan, rank_map=rank_map,
                         joiners=frozenset(d.get("joiners", ())), dead=gone)
        except MoveImpossible as e:  # the same transfer list on every rank: all of them land here
            link.post(UNMOVABLE, {"reason": str(e), "slot": link.slot})
            os._exit(EXIT_FALLBACK)  # the control process restarts the job, naming the reason
        del old
        run.session = None
        ledger, rng, clock = _share(d, rank_map, run.ledger, rng, clock)
        session.skips, session.counted_through, session.last_skipped = clock
        torch.set_rng_state(rng)
        return self._start(job, plan, session, d, ledger, stats)

    def join(self, old_plan: Plan, gpu: int) -> tuple[R, int]:
        """A returning GPU's new process (grow back): join world ``link.gen`` at the rank the
        control process's decision gives this GPU, build the session, receive weights, masters
        and optimizer state from the survivors (no checkpoint read), the ledger and RNG state
        from a survivor. ``old_plan``: the stopped world's; ``gpu``: this process's GPU."""
        link = self.link
        d = json.loads(link.store.get(f"decision{link.gen - 1}"))
        job, plan = self._next(old_plan, d)
        rank = list(plan.rank_to_gpu).index(gpu)
        from . import backend

        if os.environ.get(HEARTBEAT_DIR):  # the world's hang check reads it, by the rank's number
            watch.follow_world(Path(os.environ[HEARTBEAT_DIR]) / f"rank{rank}.stack")
        backend.join(link.store, gen=link.gen, rank=rank, world=plan.world_size,
                     backend="nccl" if self.device is not None and self.device.type == "cuda"
                     else "gloo", timeout_s=link.timeout_s)
        session = self.trainer.build(job, plan)
        rank_map = _rank_map(old_plan, plan, d)
        stats = move(None, session, old_plan=old_plan, rank_map=rank_map,
                     joiners=frozenset(d["joiners"]))
        ledger, rng, clock = _share(d, rank_map, None, torch.get_rng_state(), None)
        session.skips, session.counted_through, session.last_skipped = clock
        torch.set_rng_state(rng)
        return self._start(job, plan, session, d, ledger, stats)

    def final_check(self, run: R) -> None:
        """``NUTP_LIVE_DIGEST=1`` (tests), at the end of the job: the replicas' digests and,
        under the distributed optimizer, the largest difference between an optimizer slice's
        copy and its primary (``live_final``; 0.0: bit for bit). Collective."""
        if os.environ.get(LIVE_DIGEST) != "1":
            return
        from ..common.events import log_event

        session = run.session
        assert session is not None
        check = getattr(session.optimizer, "check_backups", None)
        worst = reduce_max([check() if check is not None else 0.0], None)[0]
        _digest(session, self.link.gen, event="live_final")
        if dist.get_rank() == 0:
            log_event("live_final_slices", gen=self.link.gen, backup_max_diff=worst,
                      redundancy=bool(getattr(session.optimizer, "redundancy", False)))

    # -- internals -------------------------------------------------------------------------

    def _next(self, old_plan: Plan, d: dict[str, Any]) -> tuple[JobConfig, Plan]:
        """The decided world's job and plan, re-planned here (the same code and config as the
        control process's: checked against its ``rank_to_gpu``)."""
        from ..health.decisions import job_for

        links = ({int(g): float(v) for g, v in d["slow_links"].items()}
                 if "slow_links" in d else None)
        job = job_for(self.cfg, frozenset(d["failed_gpus"]), _slow(d), links,
                      d.get("reserved_gpus"))
        plan = replan(old_plan, job)
        if list(plan.rank_to_gpu) != d["rank_to_gpu"]:
            raise RuntimeError(f"re-planned rank_to_gpu={list(plan.rank_to_gpu)} but the "
                               f"control process decided {d['rank_to_gpu']} (same code and "
                               "config?)")
        return job, plan

    def _apply(self, old: RankSession, step: int) -> None:
        """Complete the committed step from the gradients this rank holds (voted, result
        lost)."""
        if getattr(old.optimizer, "nutp_zero", False):  # its slices only: no all-gather in
            old.optimizer.local_only = True  # the stopped world (the move rebuilds the params)
        ok, norm = old.apply_update(step)
        link = self.link
        link.committed = Committed(step, link.loss, norm if ok else None,
                                   step_s=time.perf_counter() - link.began)

    def _start(self, job: JobConfig, plan: Plan, session: RankSession, d: dict[str, Any],
               ledger: GoodputLedger, stats: dict[str, Any]) -> tuple[R, int]:
        """The new world's run from the moved state; rank 0 posts ``started<gen>``."""
        link = self.link
        ledger.failed_gpus = len(plan.request.health.failed_gpus)
        ledger.idle_gpus = plan.idle_healthy_gpus
        ledger.add_pause("relayout", max(0.0, time.time() - d["detected_at"]))
        start = d["step"] + 1
        new = self.trainer.make_run(job, plan, session, start=start, ledger=ledger)
        self._missing_row(new, d["step"])
        self.attach(new)
        if os.environ.get(LIVE_DIGEST) == "1":
            _digest(session, link.gen)
        mx = reduce_max([stats["received_bytes"], stats["lower_bound_bytes"],
                         stats["peak_memory_ratio"], stats["move_s"]], self.device)
        if dist.get_rank() == 0:
            link.post("started", {"t": time.time(), "bytes_received_rank_max": int(mx[0]),
                                  "lower_bound_rank_max": int(mx[1]),
                                  "peak_memory_ratio": mx[2], "move_s": mx[3],
                                  "resume_step": start})
        return new, start

    def _missing_row(self, run: R, step: int) -> None:
        """Rank 0 of the new world: the committed step's row, if the old world stopped before
        its rank 0 wrote it (metrics continue without a gap)."""
        out, link = run.out, self.link
        if out is None or step < 0 or (out.rows and out.rows[-1]["step"] >= step):
            return
        c = link.committed
        assert c.step == step, (c, step)
        tokens = run.cfg.train.global_batch_size * run.cfg.model.seq_length
        step_s = max(c.step_s, 1e-9)  # this rank's own time to the vote: the world is gone
        lr = None if run.session is None else run.session.lr_of(step)
        out.write({"step": step, "loss": c.loss, "grad_norm": c.grad_norm,
                   "skipped": c.grad_norm is None, "lr": lr, "loss_scale": 1.0, "tokens": tokens,
                   "step_time_s": step_s, "tokens_per_s": tokens / step_s,
                   "goodput": run.ledger.goodput, "step_goodput": 0.0,
                   "microbatches": [r.microbatches for r in link.old_replica_tp],
                   "replica_tp": [list(r.tp) for r in link.old_replica_tp],
                   "reshard_bytes_rank0": 0, "recovered_row": True})


def _digest(session: RankSession, gen: int, *, event: str = "live_digest") -> None:
    """``NUTP_LIVE_DIGEST=1`` (tests): rank 0 logs a digest of every replica's assembled global
    parameters (``event``); replicas are bitwise equal iff their digests are."""
    import hashlib

    from ..common.events import log_event
    from ..model.assemble import assemble
    from ..model.init import normalize_name

    ctx = session.groups.ctx
    shards = {getattr(p, "nutp_name", normalize_name(n)) if not getattr(p, "nutp_tied_copy",
                                                                        False)
              else "tied_copy:" + getattr(p, "nutp_name", normalize_name(n)):
              (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None),
               p.detach().float().clone().view(p.shape))
              for n, p in session.model.named_parameters()}
    mine_experts = [getattr(p, "nutp_name", normalize_name(n))
                    for n, p in session.model.named_parameters()
                    if getattr(p, "nutp_expert", None) is not None]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ctx.replica, ctx.stage, shards, mine_experts))
    if dist.get_rank() != 0:
        return
    got = [(r, st, s) for r, st, s, _ in every]
    experts = {k for *_, ks in every for k in ks}
    plan = session.plan
    for i in range(len(plan.replicas)):
        merged: dict[str, torch.Tensor] = {}
        for stage in range(plan.pp):
            mine = [s for r, st, s in got if (r, st) == (i, stage)]
            # MoE: each rank holds whole experts under their global names (``nutp_expert``)
            merged.update(assemble([{k: v for k, v in s.items() if k not in experts}
                                    for s in mine], plan.request.model))
            merged.update({k: v[2] for s in mine for k, v in s.items() if k in experts})
        h = hashlib.sha256()
        for k in sorted(merged):
            h.update(k.encode())
            h.update(merged[k].contiguous().numpy().tobytes())
        log_event(event, gen=gen, replica=i, digest=h.hexdigest())


def _slow(d: dict[str, Any]) -> dict[int, float]:
    """Stragglers the decision re-plans around (GPU -> relative speed)."""
    return {int(g): float(v) for g, v in d.get("slow_gpus", {}).items()}


def _rank_map(old_plan: Plan, plan: Plan, d: dict[str, Any]) -> dict[int, int]:
    """Old rank -> new rank of the survivors (by GPU identity)."""
    return {o: n for o, n in renumber(tuple(old_plan.rank_to_gpu),
                                      tuple(plan.rank_to_gpu)).items()
            if n is not None and o not in d["dead_ranks"]}


def _share(d: dict[str, Any], rank_map: dict[int, int], ledger: GoodputLedger | None,
           rng: torch.Tensor, clock: tuple[int, int, bool | None] | None
           ) -> tuple[GoodputLedger, torch.Tensor, tuple[int, int, bool | None]]:
    """Joiners (grow back) take the goodput ledger, the RNG state and the lr schedule's clock
    (skips, counted through, whether that step was skipped) from the lowest new rank of a
    survivor (one broadcast over the new world, only when the decision has joiners)."""
    if not d.get("joiners"):
        assert ledger is not None and clock is not None
        return ledger, rng, clock
    box: list[Any] = [ledger, rng, clock]
    dist.broadcast_object_list(box, src=min(rank_map.values()))
    if ledger is None:
        return box[0], box[1], box[2]
    assert clock is not None
    return ledger, rng, clock
